//! RFC 6962 (§2.1) Merkle tree hashing and proofs over SHA-256.
//!
//! `MTH({}) = SHA-256()`, leaves `SHA-256(0x00 || d)`, nodes `SHA-256(0x01 || l || r)`,
//! split at the largest power of two below the size. Proof verification follows
//! RFC 9162 §2.1.3.2 and §2.1.4.2.

use sha2::{Digest as _, Sha256};

pub type Hash = [u8; 32];

pub fn leaf_hash(data: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(data);
    h.finalize().into()
}

pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

pub fn empty_root() -> Hash {
    Sha256::digest(b"").into()
}

/// Largest power of two strictly smaller than `n` (n ≥ 2).
fn split(n: usize) -> usize {
    let mut k = 1;
    while k << 1 < n {
        k <<= 1;
    }
    k
}

/// MTH over leaf hashes.
pub fn root(leaves: &[Hash]) -> Hash {
    match leaves.len() {
        0 => empty_root(),
        1 => leaves[0],
        n => {
            let k = split(n);
            node_hash(&root(&leaves[..k]), &root(&leaves[k..]))
        }
    }
}

/// Incremental root: a stack of perfect subtree roots (a compact range from 0).
#[derive(Debug, Clone, Default)]
pub struct Frontier {
    /// (height, hash), heights strictly decreasing.
    stack: Vec<(u32, Hash)>,
    size: u64,
}

impl Frontier {
    pub fn push(&mut self, leaf: Hash) {
        let mut node = (0u32, leaf);
        while let Some(&(h, top)) = self.stack.last() {
            if h != node.0 {
                break;
            }
            self.stack.pop();
            node = (h + 1, node_hash(&top, &node.1));
        }
        self.stack.push(node);
        self.size += 1;
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn root(&self) -> Hash {
        let mut iter = self.stack.iter().rev();
        let Some(&(_, mut acc)) = iter.next() else { return empty_root() };
        for (_, h) in iter {
            acc = node_hash(h, &acc);
        }
        acc
    }
}

impl Frontier {
    /// The perfect subtree covering exactly leaves `[lo, hi)`, if it is one of this
    /// frontier's.
    fn node(&self, lo: u64, hi: u64) -> Option<Hash> {
        let mut at = 0u64;
        for &(height, hash) in &self.stack {
            let end = at + (1u64 << height);
            if at == lo && end == hi {
                return Some(hash);
            }
            at = end;
        }
        None
    }
}

/// The tree as the audit writer keeps it, in memory that does not grow with the log:
/// the perfect subtrees of the first `base` leaves (those the control plane has
/// acknowledged) and the leaf hashes after them. Every root and consistency proof the
/// writer needs starts at or after `base` (proofs go from the acknowledged size), and
/// RFC 6962's proofs only ever ask for subtrees of the old size's frontier on its left.
#[derive(Debug, Clone, Default)]
pub struct CompactTree {
    base: Frontier,
    tail: Vec<Hash>,
}

impl CompactTree {
    pub fn push(&mut self, leaf: Hash) {
        self.tail.push(leaf);
    }

    pub fn size(&self) -> u64 {
        self.base.size + self.tail.len() as u64
    }

    /// Leaves before this are kept only as subtree hashes.
    pub fn base_size(&self) -> u64 {
        self.base.size
    }

    /// Keep only subtree hashes of the first `size` leaves (clamped to the tree).
    pub fn forget_before(&mut self, size: u64) {
        let n = size.min(self.size()).saturating_sub(self.base.size) as usize;
        for leaf in self.tail.drain(..n) {
            self.base.push(leaf);
        }
        // After an outage's backlog is acknowledged, give its memory back.
        if self.tail.capacity() > 4 * self.tail.len().max(1024) {
            self.tail.shrink_to_fit();
        }
    }

    /// The root of the first `size` leaves; `None` below `base_size()`.
    pub fn root_at(&self, size: u64) -> Option<Hash> {
        if size < self.base.size || size > self.size() {
            return None;
        }
        let mut f = self.base.clone();
        for leaf in &self.tail[..(size - self.base.size) as usize] {
            f.push(*leaf);
        }
        Some(f.root())
    }

    /// The root of leaves `[lo, hi)` (hi > lo) from what is kept.
    fn range_root(&self, lo: u64, hi: u64) -> Option<Hash> {
        let b = self.base.size;
        if lo >= b {
            return Some(root(&self.tail[(lo - b) as usize..(hi - b) as usize]));
        }
        if let Some(h) = self.base.node(lo, hi) {
            return Some(h);
        }
        if hi <= b || hi - lo < 2 {
            return None;
        }
        let k = split((hi - lo) as usize) as u64;
        Some(node_hash(&self.range_root(lo, lo + k)?, &self.range_root(lo + k, hi)?))
    }

    /// RFC 6962 consistency proof from the first `m` leaves to the first `n`; `None`
    /// if `m` is below `base_size()` or `n` beyond the tree.
    pub fn consistency_proof(&self, m: u64, n: u64) -> Option<Vec<Hash>> {
        fn subproof(
            t: &CompactTree,
            m: u64,
            lo: u64,
            hi: u64,
            complete: bool,
            out: &mut Vec<Hash>,
        ) -> Option<()> {
            let n = hi - lo;
            if m == n {
                if !complete {
                    out.push(t.range_root(lo, hi)?);
                }
                return Some(());
            }
            let k = split(n as usize) as u64;
            if m <= k {
                subproof(t, m, lo, lo + k, complete, out)?;
                out.push(t.range_root(lo + k, hi)?);
            } else {
                subproof(t, m - k, lo + k, hi, false, out)?;
                out.push(t.range_root(lo, lo + k)?);
            }
            Some(())
        }
        if m < self.base.size || m > n || n > self.size() {
            return None;
        }
        let mut out = Vec::new();
        if m > 0 && m < n {
            subproof(self, m, 0, n, true, &mut out)?;
        }
        Some(out)
    }
}

/// Inclusion proof (audit path) for leaf `index` in the tree of `leaves`.
pub fn inclusion_proof(leaves: &[Hash], index: usize) -> Vec<Hash> {
    fn path(leaves: &[Hash], m: usize, out: &mut Vec<Hash>) {
        let n = leaves.len();
        if n <= 1 {
            return;
        }
        let k = split(n);
        if m < k {
            path(&leaves[..k], m, out);
            out.push(root(&leaves[k..]));
        } else {
            path(&leaves[k..], m - k, out);
            out.push(root(&leaves[..k]));
        }
    }
    let mut out = Vec::new();
    path(leaves, index, &mut out);
    out
}

/// Consistency proof between the first `m` leaves and all of `leaves` (RFC 6962 SUBPROOF).
pub fn consistency_proof(leaves: &[Hash], m: usize) -> Vec<Hash> {
    fn subproof(m: usize, leaves: &[Hash], complete: bool, out: &mut Vec<Hash>) {
        let n = leaves.len();
        if m == n {
            if !complete {
                out.push(root(leaves));
            }
            return;
        }
        let k = split(n);
        if m <= k {
            subproof(m, &leaves[..k], complete, out);
            out.push(root(&leaves[k..]));
        } else {
            subproof(m - k, &leaves[k..], false, out);
            out.push(root(&leaves[..k]));
        }
    }
    let mut out = Vec::new();
    if m > 0 && m < leaves.len() {
        subproof(m, leaves, true, &mut out);
    }
    out
}

/// RFC 9162 §2.1.3.2.
pub fn verify_inclusion(index: u64, size: u64, leaf: &Hash, proof: &[Hash], root: &Hash) -> bool {
    if index >= size {
        return false;
    }
    let (mut fn_, mut sn) = (index, size - 1);
    let mut r = *leaf;
    for p in proof {
        if sn == 0 {
            return false;
        }
        if fn_ & 1 == 1 || fn_ == sn {
            r = node_hash(p, &r);
            if fn_ & 1 == 0 {
                while fn_ & 1 == 0 && fn_ != 0 {
                    fn_ >>= 1;
                    sn >>= 1;
                }
            }
        } else {
            r = node_hash(&r, p);
        }
        fn_ >>= 1;
        sn >>= 1;
    }
    sn == 0 && r == *root
}

/// RFC 9162 §2.1.4.2.
pub fn verify_consistency(m: u64, n: u64, root_m: &Hash, root_n: &Hash, proof: &[Hash]) -> bool {
    if m == n {
        return proof.is_empty() && root_m == root_n;
    }
    if m == 0 || m > n {
        return m == 0 && proof.is_empty();
    }
    let mut proof: Vec<Hash> = proof.to_vec();
    if m.is_power_of_two() {
        proof.insert(0, *root_m);
    }
    let Some((first, rest)) = proof.split_first() else { return false };
    let (mut fn_, mut sn) = (m - 1, n - 1);
    while fn_ & 1 == 1 {
        fn_ >>= 1;
        sn >>= 1;
    }
    let (mut fr, mut sr) = (*first, *first);
    for c in rest {
        if sn == 0 {
            return false;
        }
        if fn_ & 1 == 1 || fn_ == sn {
            fr = node_hash(c, &fr);
            sr = node_hash(c, &sr);
            if fn_ & 1 == 0 {
                while fn_ & 1 == 0 && fn_ != 0 {
                    fn_ >>= 1;
                    sn >>= 1;
                }
            }
        } else {
            sr = node_hash(&sr, c);
        }
        fn_ >>= 1;
        sn >>= 1;
    }
    sn == 0 && fr == *root_m && sr == *root_n
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng as _;
    use sigstore_types::Sha256Hash;

    fn leaves(n: usize) -> Vec<Hash> {
        (0..n).map(|i| leaf_hash(format!("record {i}").as_bytes())).collect()
    }

    /// The compact tree gives the same roots and proofs as the full leaf list, for every
    /// base (acknowledged size) ≤ m ≤ n up to 70 leaves, and refuses below its base.
    #[test]
    fn the_compact_tree_matches_the_full_tree_above_its_base() {
        let all = leaves(70);
        for base in 0..=70u64 {
            let mut t = CompactTree::default();
            for l in &all {
                t.push(*l);
            }
            t.forget_before(base);
            assert_eq!((t.base_size(), t.size()), (base, 70));
            for n in base..=70 {
                assert_eq!(t.root_at(n), Some(root(&all[..n as usize])), "root at {n}, base {base}");
                for m in base..=n {
                    let want = consistency_proof(&all[..n as usize], m as usize);
                    assert_eq!(t.consistency_proof(m, n), Some(want), "proof {m} -> {n}, base {base}");
                }
            }
            if base > 0 {
                assert_eq!(t.root_at(base - 1), None);
                assert_eq!(t.consistency_proof(base - 1, 70), None);
            }
        }
    }

    #[test]
    fn rfc6962_reference_roots() {
        // The RFC 6962 reference inputs used by the certificate-transparency test suites.
        let inputs: [&[u8]; 8] = [
            b"",
            &[0x00],
            &[0x10],
            &[0x20, 0x21],
            &[0x30, 0x31],
            &[0x40, 0x41, 0x42, 0x43],
            &[0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56, 0x57],
            &[0x60, 0x61, 0x62, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, 0x69, 0x6a, 0x6b, 0x6c, 0x6d, 0x6e, 0x6f],
        ];
        let l: Vec<Hash> = inputs.iter().map(|d| leaf_hash(d)).collect();
        assert_eq!(
            hex::encode(empty_root()),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex::encode(root(&l[..1])),
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
        );
        assert_eq!(hex::encode(root(&l)), "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328");
    }

    #[test]
    fn frontier_matches_recursive_root() {
        let l = leaves(300);
        let mut f = Frontier::default();
        for (i, h) in l.iter().enumerate() {
            f.push(*h);
            assert_eq!(f.root(), root(&l[..=i]), "size {}", i + 1);
        }
    }

    #[test]
    fn proofs_verify_here_and_in_an_independent_implementation() {
        let mut rng = rand::rng();
        for n in 1..70usize {
            let l = leaves(n);
            let r = root(&l);
            for i in 0..n {
                let p = inclusion_proof(&l, i);
                assert!(verify_inclusion(i as u64, n as u64, &l[i], &p, &r), "inclusion {i}/{n}");
                let sp: Vec<Sha256Hash> = p.iter().map(|h| Sha256Hash::new(*h)).collect();
                assert!(
                    sigstore_merkle::verify_inclusion_proof(
                        &Sha256Hash::new(l[i]),
                        i as u64,
                        n as u64,
                        &sp,
                        &Sha256Hash::new(r)
                    )
                    .is_ok(),
                    "independent inclusion {i}/{n}"
                );
                let mut bad = p.clone();
                if !bad.is_empty() {
                    let at = rng.random_range(0..bad.len());
                    bad[at][0] ^= 1;
                    assert!(!verify_inclusion(i as u64, n as u64, &l[i], &bad, &r));
                }
            }
            for m in 1..=n {
                let p = consistency_proof(&l, m);
                let rm = root(&l[..m]);
                assert!(verify_consistency(m as u64, n as u64, &rm, &r, &p), "consistency {m}->{n}");
                let sp: Vec<Sha256Hash> = p.iter().map(|h| Sha256Hash::new(*h)).collect();
                assert!(
                    sigstore_merkle::verify_consistency_proof(
                        m as u64,
                        n as u64,
                        &sp,
                        &Sha256Hash::new(rm),
                        &Sha256Hash::new(r)
                    )
                    .is_ok(),
                    "independent consistency {m}->{n}"
                );
                if m < n {
                    let mut wrong = rm;
                    wrong[5] ^= 1;
                    assert!(!verify_consistency(m as u64, n as u64, &wrong, &r, &p));
                }
            }
        }
    }
}
