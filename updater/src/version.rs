//! Package versions as dpkg orders them (`[epoch:]upstream[-revision]`, `~` before
//! anything, letters before other characters, digits numerically), and the customer's
//! pin: one version, or a range of comparisons (`>= 0.2.0, < 0.3.0`).

use std::cmp::Ordering;

/// Whether `v` is a version dpkg would accept (and a file name can carry).
pub fn valid(v: &str) -> bool {
    let (epoch, rest) = match v.split_once(':') {
        Some((e, r)) => (Some(e), r),
        None => (None, v),
    };
    epoch.is_none_or(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()))
        && rest.starts_with(|c: char| c.is_ascii_digit())
        && rest.len() <= 128
        && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b".+~-".contains(&b))
        && !rest.ends_with('-')
}

/// dpkg's order (`dpkg --compare-versions`).
pub fn compare(a: &str, b: &str) -> Ordering {
    let split = |v: &str| -> (u64, String, String) {
        let (epoch, rest) = match v.split_once(':') {
            Some((e, r)) => (e.parse().unwrap_or(0), r),
            None => (0, v),
        };
        match rest.rsplit_once('-') {
            Some((up, rev)) => (epoch, up.to_string(), rev.to_string()),
            None => (epoch, rest.to_string(), String::new()),
        }
    };
    let (ea, ua, ra) = split(a);
    let (eb, ub, rb) = split(b);
    ea.cmp(&eb).then_with(|| verrevcmp(&ua, &ub)).then_with(|| verrevcmp(&ra, &rb))
}

/// `~` sorts before everything (even the end), letters before non-letters.
fn order(c: Option<u8>) -> i32 {
    match c {
        None => 0,
        Some(b'~') => -1,
        Some(c) if c.is_ascii_digit() => 0,
        Some(c) if c.is_ascii_alphabetic() => c as i32,
        Some(c) => c as i32 + 256,
    }
}

fn verrevcmp(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        // The non-digit prefix, character by character.
        while (i < a.len() && !a[i].is_ascii_digit()) || (j < b.len() && !b[j].is_ascii_digit()) {
            let ac = order(a.get(i).copied().filter(|c| !c.is_ascii_digit()));
            let bc = order(b.get(j).copied().filter(|c| !c.is_ascii_digit()));
            if ac != bc {
                return ac.cmp(&bc);
            }
            i += 1;
            j += 1;
        }
        // Then the number, numerically (leading zeros ignored).
        while a.get(i) == Some(&b'0') {
            i += 1;
        }
        while b.get(j) == Some(&b'0') {
            j += 1;
        }
        let mut first_diff = Ordering::Equal;
        while i < a.len() && a[i].is_ascii_digit() && j < b.len() && b[j].is_ascii_digit() {
            if first_diff == Ordering::Equal {
                first_diff = a[i].cmp(&b[j]);
            }
            i += 1;
            j += 1;
        }
        if i < a.len() && a[i].is_ascii_digit() {
            return Ordering::Greater;
        }
        if j < b.len() && b[j].is_ascii_digit() {
            return Ordering::Less;
        }
        if first_diff != Ordering::Equal {
            return first_diff;
        }
    }
    Ordering::Equal
}

/// The versions the customer lets in: `0.2.1` (that one), or comparisons joined by
/// commas, all of which must hold (`>= 0.2.0, < 0.3.0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    text: String,
    bounds: Vec<(Op, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Pin {
    pub fn parse(text: &str) -> Result<Pin, String> {
        let mut bounds = Vec::new();
        for part in text.split(',').map(str::trim) {
            let (op, v) = [(">=", Op::Ge), ("<=", Op::Le), ("=", Op::Eq), (">", Op::Gt), ("<", Op::Lt)]
                .iter()
                .find_map(|(s, op)| part.strip_prefix(s).map(|v| (*op, v.trim())))
                .unwrap_or((Op::Eq, part));
            if !valid(v) {
                return Err(format!(
                    "{part:?} is not a version or a comparison (`0.2.1`, `>= 0.2.0, < 0.3.0`)"
                ));
            }
            bounds.push((op, v.to_string()));
        }
        Ok(Pin { text: text.trim().to_string(), bounds })
    }

    pub fn allows(&self, version: &str) -> bool {
        self.bounds.iter().all(|(op, bound)| {
            let o = compare(version, bound);
            match op {
                Op::Eq => o == Ordering::Equal,
                Op::Lt => o == Ordering::Less,
                Op::Le => o != Ordering::Greater,
                Op::Gt => o == Ordering::Greater,
                Op::Ge => o != Ordering::Less,
            }
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_as_dpkg_orders_them() {
        use Ordering::*;
        for (a, b, want) in [
            ("0.1.0", "0.1.0", Equal),
            ("0.1.0", "0.2.0", Less),
            ("0.10.0", "0.9.0", Greater),
            ("0.1.0-vm2", "0.1.0-vm1", Greater),
            ("0.1.0~rc1", "0.1.0", Less),
            ("0.1.0", "0.1.0+fix1", Less),
            ("1:0.1.0", "0.9.0", Greater),
            ("0.1.0-1", "0.1.0", Greater),
            ("0.1.0a", "0.1.0.", Less),
            ("1.002", "1.2", Equal),
            ("0.1.0-10", "0.1.0-9", Greater),
        ] {
            assert_eq!(compare(a, b), want, "{a} vs {b}");
            assert_eq!(compare(b, a), want.reverse(), "{b} vs {a}");
        }
    }

    #[test]
    fn only_versions_a_file_name_can_carry_are_valid() {
        for good in ["0.1.0", "1:2.3-4", "0.1.0~rc1+b2", "0.1.0-vm1"] {
            assert!(valid(good), "{good}");
        }
        for bad in ["", "a1", "0.1/../x", "0.1 0", "1:", ":1", "0.1-", "0.1_2"] {
            assert!(!valid(bad), "{bad}");
        }
    }

    #[test]
    fn a_pin_is_one_version_or_a_range() {
        let exact = Pin::parse("0.2.1").unwrap();
        assert!(exact.allows("0.2.1") && !exact.allows("0.2.2"));
        let range = Pin::parse(">= 0.2.0, < 0.3.0").unwrap();
        assert!(range.allows("0.2.0") && range.allows("0.2.9-1") && !range.allows("0.3.0"));
        assert!(!range.allows("0.1.9"));
        assert!(Pin::parse(">= x").is_err());
        assert!(Pin::parse("").is_err());
    }
}
