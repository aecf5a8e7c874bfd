//! The job's network boundary: what a job may never reach, the address plan of its
//! namespace, and what the helper needs to know about the host to enforce it.
//!
//! A networked job gets its own network namespace whose only way out is a user-mode
//! network stack (`slirp4netns`): a process in the runner's namespace that terminates
//! the job's TCP/UDP flows and opens ordinary sockets for them, so it needs no
//! privilege in the host's namespace. Inside the namespace, before the job starts,
//! `prohibit` rules placed ahead of every routing table refuse the ranges below and
//! the host's own addresses; the job holds no capability, so it cannot change them.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An address range, `addr/len` (a bare address is a single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    len: u8,
}

impl Cidr {
    /// `addr/len` with the host bits cleared; `None` when `len` is too long.
    pub fn new(addr: IpAddr, len: u8) -> Option<Cidr> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (len <= max).then(|| Cidr { addr: mask(addr, len), len })
    }

    pub fn host(addr: IpAddr) -> Cidr {
        Cidr { addr, len: if addr.is_ipv4() { 32 } else { 128 } }
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.addr.is_ipv4() && mask(ip, self.len) == self.addr
    }

    /// Whether every address of `other` is in this range.
    pub fn covers(&self, other: &Cidr) -> bool {
        self.len <= other.len && self.contains(other.addr)
    }

    /// Whether the two ranges share any address.
    pub fn overlaps(&self, other: &Cidr) -> bool {
        self.contains(other.addr) || other.contains(self.addr)
    }
}

fn mask(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let m = if len == 0 { 0 } else { u32::MAX << (32 - u32::from(len)) };
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & m))
        }
        IpAddr::V6(a) => {
            let m = if len == 0 { 0 } else { u128::MAX << (128 - u32::from(len)) };
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & m))
        }
    }
}

/// An address or range that does not parse: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidCidr(pub String);

impl FromStr for Cidr {
    type Err = InvalidCidr;
    fn from_str(s: &str) -> Result<Cidr, InvalidCidr> {
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr =
            addr.parse().map_err(|_| InvalidCidr(format!("{s:?} is not an IP address or CIDR range")))?;
        let Some(len) = len else { return Ok(Cidr::host(addr)) };
        let len: u8 =
            len.parse().map_err(|_| InvalidCidr(format!("{s:?}: prefix length is not a number")))?;
        let cidr =
            Cidr::new(addr, len).ok_or_else(|| InvalidCidr(format!("{s:?}: prefix length too long")))?;
        if cidr.addr != addr {
            return Err(InvalidCidr(format!("{s:?} has host bits set (did you mean {cidr}?)")));
        }
        Ok(cidr)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Cidr, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What a job can never reach, whatever it or its configuration says:
/// link-local (IMDS 169.254.169.254, the ECS/EKS credential addresses 169.254.170.2 and
/// .23, the Amazon DNS and Time Sync addresses are the runner's), IMDS over IPv6, the
/// user-mode stack's own gateway and resolver aliases (the gateway would lead to the
/// host's loopback), and addresses that are never a destination.
pub const ALWAYS_BLOCKED: &[&str] = &[
    "169.254.0.0/16",
    "fe80::/10",
    "fd00:ec2::/32",
    // The user-mode stack's network: its gateway and DNS aliases.
    "10.0.2.0/24",
    "fd00::/64",
    "0.0.0.0/8",
    "127.0.0.0/8",
    "::1/128",
    "::/128",
];

/// [`ALWAYS_BLOCKED`] parsed.
pub fn always_blocked() -> Vec<Cidr> {
    ALWAYS_BLOCKED.iter().filter_map(|s| s.parse().ok()).collect()
}

/// The address plan slirp4netns gives a namespace (its defaults with `--configure`).
pub const JOB_IPV4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 100);
pub const GATEWAY_IPV4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
pub const JOB_IPV6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x100);
pub const GATEWAY_IPV6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2);
/// The job's interface to the user-mode stack.
pub const TAP_NAME: &str = "tap0";
/// The runner's DNS forwarder inside each job's namespace (on the job's own loopback,
/// like systemd-resolved's stub): the job's `/etc/resolv.conf` names it.
pub const JOB_DNS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)), 53);
/// The job's role credential endpoint inside its namespace (the AWS container
/// credentials protocol accepts loopback addresses).
pub const JOB_CREDENTIALS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 80);

/// The priority of the rules that refuse blocked ranges: ahead of every routing table
/// (main's is 32766), behind only the local table's (0).
pub const PROHIBIT_PRIORITY: u32 = 100;

#[derive(Debug, thiserror::Error)]
#[error("listing the host's addresses: {0}")]
pub struct HostAddressesError(String);

/// What a job must never reach on this host: every address of the host's interfaces
/// (in the caller's namespace: the runner's), and every subnet behind a local bridge
/// (Docker's networks: other jobs' containers and whatever else runs there).
pub fn host_blocked() -> Result<Vec<Cidr>, HostAddressesError> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| HostAddressesError(e.to_string()))?;
    let mut kinds = HostLinks::open().map_err(|e| HostAddressesError(e.to_string()))?;
    let mut out = Vec::new();
    for ifa in addrs {
        let Some(a) = ifa.address else { continue };
        let (ip, prefix_len) = if let Some(v4) = a.as_sockaddr_in() {
            let len = ifa.netmask.and_then(|m| m.as_sockaddr_in().map(|m| u32::from(m.ip()).count_ones()));
            (IpAddr::V4(v4.ip()), len.unwrap_or(32) as u8)
        } else if let Some(v6) = a.as_sockaddr_in6() {
            let len = ifa.netmask.and_then(|m| m.as_sockaddr_in6().map(|m| u128::from(m.ip()).count_ones()));
            (IpAddr::V6(v6.ip()), len.unwrap_or(128) as u8)
        } else {
            continue;
        };
        // An interface gone since the listing took its addresses with it.
        let Ok(ifindex) = nix::net::if_::if_nametoindex(ifa.interface_name.as_str()) else { continue };
        let announced = crate::netlink::AnnouncedAddress { ifindex, addr: ip, prefix_len };
        out.extend(kinds.blocked_for(&announced).map_err(|e| HostAddressesError(e.to_string()))?);
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Which of the host's links are bridges, asked of the kernel in the caller's
/// namespace (sysfs would answer for whichever namespace mounted it).
pub struct HostLinks {
    netlink: crate::netlink::Netlink,
    bridges: std::collections::HashMap<u32, bool>,
}

impl HostLinks {
    pub fn open() -> Result<HostLinks, crate::netlink::NetlinkError> {
        Ok(HostLinks { netlink: crate::netlink::Netlink::open()?, bridges: Default::default() })
    }

    /// What an address on the host closes to jobs: the address itself, and its whole
    /// subnet when it sits on a bridge. A link that went away meanwhile counts as a
    /// bridge: closing a subnet nobody routes to costs nothing.
    pub fn blocked_for(
        &mut self,
        a: &crate::netlink::AnnouncedAddress,
    ) -> Result<Vec<Cidr>, crate::netlink::NetlinkError> {
        let is_bridge = match self.bridges.get(&a.ifindex) {
            Some(b) => *b,
            None => {
                let b = match self.netlink.link_kind(a.ifindex) {
                    Ok(kind) => kind.as_deref() == Some("bridge"),
                    Err(e) if e.errno() == Some(nix::Error::ENODEV) => true,
                    Err(e) => return Err(e),
                };
                self.bridges.insert(a.ifindex, b);
                b
            }
        };
        let mut out = vec![Cidr::host(a.addr)];
        if is_bridge && let Some(subnet) = Cidr::new(a.addr, a.prefix_len) {
            out.push(subnet);
        }
        Ok(out)
    }
}

/// The `resolv.conf` a networked job sees: the runner's forwarder only.
pub fn job_resolv_conf() -> String {
    format!(
        "# written by byoc-runner: the job's DNS goes through the runner\nnameserver {}\noptions edns0\n",
        JOB_DNS.ip()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_print_and_match() {
        let c: Cidr = "169.254.0.0/16".parse().unwrap();
        assert_eq!(c.to_string(), "169.254.0.0/16");
        assert!(c.contains("169.254.169.254".parse().unwrap()));
        assert!(!c.contains("169.255.0.1".parse().unwrap()));
        assert!(!c.contains("::1".parse().unwrap()));
        let v6: Cidr = "fd00:ec2::/32".parse().unwrap();
        assert!(v6.contains("fd00:ec2::254".parse().unwrap()));
        assert!(!v6.contains("fd00::254".parse().unwrap()));
        assert_eq!("10.1.2.3".parse::<Cidr>().unwrap().to_string(), "10.1.2.3/32");
        assert!("10.1.2.3/8".parse::<Cidr>().unwrap_err().0.contains("10.0.0.0/8"));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("example.com".parse::<Cidr>().is_err());
        assert!("0.0.0.0/0".parse::<Cidr>().unwrap().overlaps(&c));
        assert!(c.overlaps(&"169.254.169.254/32".parse().unwrap()));
        assert!(!c.overlaps(&"10.0.0.0/8".parse().unwrap()));
        assert!(c.covers(&"169.254.169.254/32".parse().unwrap()) && c.covers(&c));
        assert!(!"169.254.169.254/32".parse::<Cidr>().unwrap().covers(&c));
        assert!(!c.covers(&"::/0".parse().unwrap()));
    }

    #[test]
    fn the_fixed_block_list_parses_and_covers_the_metadata_addresses() {
        let blocked = always_blocked();
        assert_eq!(blocked.len(), ALWAYS_BLOCKED.len());
        for ip in
            ["169.254.169.254", "169.254.170.2", "169.254.170.23", "fd00:ec2::254", "fe80::1", "10.0.2.2"]
        {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(blocked.iter().any(|c| c.contains(ip)), "{ip} not blocked");
        }
        for ip in ["198.51.100.1", "2001:db8::1", "52.94.1.1"] {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(!blocked.iter().any(|c| c.contains(ip)), "{ip} blocked");
        }
    }
}
