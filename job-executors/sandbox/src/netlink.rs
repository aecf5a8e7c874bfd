//! The few rtnetlink requests the network boundary needs: bring a link up, add an
//! address, add or delete a route, add a `prohibit` rule. Each request waits for the
//! kernel's acknowledgement, so a failure is reported, never assumed away.
//!
//! A netlink socket acts on the network namespace it was created in; the sandbox's
//! init opens one inside the job's namespace (and hands a copy to the runner, which
//! adds routes for allowed host names as the job resolves them, and `prohibit` rules
//! for host addresses that appear while the job runs). [`AddressWatch`] is the
//! runner's subscription to those appearances in its own namespace.

use std::net::IpAddr;
use std::os::fd::{AsRawFd as _, OwnedFd};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto, socket,
};

use crate::net::Cidr;

const NLMSG_ERROR: u16 = 2;
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_NEWRULE: u16 = 32;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

const RT_TABLE_MAIN: u8 = 254;
const RTPROT_STATIC: u8 = 4;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_NOWHERE: u8 = 255;
const RTN_UNICAST: u8 = 1;
const FR_ACT_PROHIBIT: u8 = 8;

const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const FRA_DST: u16 = 1;
const FRA_PRIORITY: u16 = 6;
const FRA_IP_PROTO: u16 = 22;
const FRA_DPORT_RANGE: u16 = 24;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_F_NODAD: u8 = 0x02;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
/// Attribute type bits that are flags (`NLA_F_NESTED`, `NLA_F_NET_BYTEORDER`).
const NLA_TYPE_MASK: u16 = 0x3fff;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const IFF_UP: u32 = 0x1;
const RTNH_F_ONLINK: u32 = 0x4;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("opening a netlink socket: {0}")]
    Open(nix::Error),
    #[error("{what}: {source}")]
    Io { what: String, source: nix::Error },
    #[error("{what}: the kernel answered {errno}")]
    Refused { what: String, errno: nix::Error },
    #[error("{what}: no acknowledgement from the kernel")]
    NoAck { what: String },
    /// The kernel dropped notifications (the socket's buffer overflowed): whatever
    /// was announced meanwhile must be read again from scratch.
    #[error("address notifications were lost (receive buffer overrun)")]
    Overrun,
}

impl NetlinkError {
    /// The kernel's error number, when it refused the request.
    pub fn errno(&self) -> Option<nix::Error> {
        match self {
            NetlinkError::Refused { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

/// A NETLINK_ROUTE socket in the namespace it was opened in.
pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
}

fn family(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { AF_INET } else { AF_INET6 }
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn attr(buf: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(data);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// The `(type, payload)` attributes in `buf` (each `rtattr` header, then its data,
/// aligned to 4); a truncated one ends the list.
fn attributes(mut buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((kind, &buf[4..len]));
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    out
}

/// The netlink messages in one datagram: `(type, seq, payload after the header)`.
fn messages(buf: &[u8]) -> Vec<(u16, u32, &[u8])> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        let typ = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        let seq = u32::from_ne_bytes([buf[off + 8], buf[off + 9], buf[off + 10], buf[off + 11]]);
        if len < 16 || off + len > buf.len() {
            break;
        }
        out.push((typ, seq, &buf[off + 16..off + len]));
        off += len.next_multiple_of(4);
    }
    out
}

fn ip_from(family: u8, bytes: &[u8]) -> Option<IpAddr> {
    match family {
        AF_INET => <[u8; 4]>::try_from(bytes).ok().map(IpAddr::from),
        AF_INET6 => <[u8; 16]>::try_from(bytes).ok().map(IpAddr::from),
        _ => None,
    }
}

/// An address the kernel announced on one of this namespace's links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnnouncedAddress {
    pub ifindex: u32,
    pub addr: IpAddr,
    pub prefix_len: u8,
}

/// One `RTM_NEWADDR` payload (`struct ifaddrmsg`, then attributes).
fn parse_new_address(payload: &[u8]) -> Option<AnnouncedAddress> {
    if payload.len() < 8 {
        return None;
    }
    let (family, prefix_len) = (payload[0], payload[1]);
    let ifindex = u32::from_ne_bytes([payload[4], payload[5], payload[6], payload[7]]);
    let attrs = attributes(&payload[8..]);
    // IFA_LOCAL is the interface's own address on point-to-point links; IPv6 sends
    // only IFA_ADDRESS.
    let pick = |kind| attrs.iter().find(|(k, _)| *k == kind).and_then(|(_, d)| ip_from(family, d));
    let addr = pick(IFA_LOCAL).or_else(|| pick(IFA_ADDRESS))?;
    Some(AnnouncedAddress { ifindex, addr, prefix_len })
}

/// The runner's subscription to addresses added in its own namespace (a Docker
/// network created, an interface brought up), read without blocking.
pub struct AddressWatch {
    fd: OwnedFd,
}

impl AddressWatch {
    pub fn open() -> Result<AddressWatch, NetlinkError> {
        use nix::sys::socket::bind;
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            SockProtocol::NetlinkRoute,
        )
        .map_err(NetlinkError::Open)?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR))
            .map_err(|source| NetlinkError::Io { what: "subscribing to address changes".into(), source })?;
        Ok(AddressWatch { fd })
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// The addresses announced since the last call (removals are ignored: a rule for
    /// an address that is gone refuses nothing anyone needs). Never blocks.
    pub fn take_announced(&self) -> Result<Vec<AnnouncedAddress>, NetlinkError> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 16384];
        loop {
            match recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                Ok(0) => return Ok(out),
                Ok(n) => out.extend(
                    messages(&buf[..n])
                        .into_iter()
                        .filter(|(typ, _, _)| *typ == RTM_NEWADDR)
                        .filter_map(|(_, _, payload)| parse_new_address(payload)),
                ),
                Err(nix::Error::EAGAIN) => return Ok(out),
                Err(nix::Error::ENOBUFS) => return Err(NetlinkError::Overrun),
                Err(nix::Error::EINTR) => continue,
                Err(source) => {
                    return Err(NetlinkError::Io { what: "reading address changes".into(), source });
                }
            }
        }
    }
}

/// `struct rtmsg` (route requests).
fn rtmsg(family: u8, dst_len: u8, kind: u8) -> Vec<u8> {
    let mut m = vec![family, dst_len, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, RT_SCOPE_UNIVERSE, kind];
    m.extend_from_slice(&0u32.to_ne_bytes());
    m
}

impl Netlink {
    pub fn open() -> Result<Netlink, NetlinkError> {
        let fd =
            socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::NetlinkRoute)
                .map_err(NetlinkError::Open)?;
        Ok(Netlink { fd, seq: 0 })
    }

    /// A socket opened elsewhere (in a job's namespace, received from its init).
    pub fn from_fd(fd: OwnedFd) -> Netlink {
        Netlink { fd, seq: 1 << 16 }
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Send one message (a header with the next sequence number, then `body`); returns
    /// that number.
    fn send(&mut self, what: &str, kind: u16, flags: u16, body: &[u8]) -> Result<u32, NetlinkError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut msg = Vec::with_capacity(16 + body.len());
        msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        msg.extend_from_slice(&seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(body);
        sendto(self.fd.as_raw_fd(), &msg, &NetlinkAddr::new(0, 0), MsgFlags::empty())
            .map_err(|source| NetlinkError::Io { what: what.to_string(), source })?;
        Ok(seq)
    }

    /// Send one request and wait for the kernel's acknowledgement.
    fn request(&mut self, what: &str, kind: u16, flags: u16, body: &[u8]) -> Result<(), NetlinkError> {
        let seq = self.send(what, kind, flags | NLM_F_ACK, body)?;
        let io = |source| NetlinkError::Io { what: what.to_string(), source };
        let mut buf = vec![0u8; 8192];
        // Answers to earlier requests cannot be pending (each waited for its own), but
        // skip anything that is not ours rather than misread it.
        for _ in 0..16 {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(io)?;
            for (typ, rseq, payload) in messages(&buf[..n]) {
                if typ == NLMSG_ERROR && rseq == seq && payload.len() >= 4 {
                    let code = i32::from_ne_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    return if code == 0 {
                        Ok(())
                    } else {
                        Err(NetlinkError::Refused {
                            what: what.to_string(),
                            errno: nix::Error::from_raw(-code),
                        })
                    };
                }
            }
        }
        Err(NetlinkError::NoAck { what: what.to_string() })
    }

    /// The kind of link `ifindex` (`bridge`, `veth`, `dummy`...); `None` for a
    /// physical device, which has no kind.
    pub fn link_kind(&mut self, ifindex: u32) -> Result<Option<String>, NetlinkError> {
        let what = format!("reading link {ifindex}");
        let mut body = vec![0u8, 0];
        body.extend_from_slice(&0u16.to_ne_bytes());
        body.extend_from_slice(&(ifindex as i32).to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        let seq = self.send(&what, RTM_GETLINK, 0, &body)?;
        let io = |source| NetlinkError::Io { what: what.clone(), source };
        let mut buf = vec![0u8; 32768];
        for _ in 0..16 {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(io)?;
            for (typ, rseq, payload) in messages(&buf[..n]) {
                if rseq != seq {
                    continue;
                }
                if typ == NLMSG_ERROR && payload.len() >= 4 {
                    let code = i32::from_ne_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    return Err(NetlinkError::Refused { what, errno: nix::Error::from_raw(-code) });
                }
                if typ == RTM_NEWLINK && payload.len() >= 16 {
                    let kind = attributes(&payload[16..])
                        .into_iter()
                        .find(|(k, _)| *k == IFLA_LINKINFO)
                        .and_then(|(_, info)| {
                            attributes(info).into_iter().find(|(k, _)| *k == IFLA_INFO_KIND)
                        })
                        .map(|(_, name)| String::from_utf8_lossy(name).trim_end_matches('\0').to_string());
                    return Ok(kind);
                }
            }
        }
        Err(NetlinkError::NoAck { what })
    }

    pub fn link_up(&mut self, ifindex: u32) -> Result<(), NetlinkError> {
        let mut body = vec![0u8, 0];
        body.extend_from_slice(&0u16.to_ne_bytes());
        body.extend_from_slice(&(ifindex as i32).to_ne_bytes());
        body.extend_from_slice(&IFF_UP.to_ne_bytes());
        body.extend_from_slice(&IFF_UP.to_ne_bytes());
        self.request(&format!("bringing link {ifindex} up"), RTM_NEWLINK, 0, &body)
    }

    /// An address on a link, without duplicate address detection (nobody else is on
    /// the link but the user-mode stack, and DAD would delay IPv6 by a second).
    pub fn add_address(&mut self, ifindex: u32, addr: IpAddr, prefix: u8) -> Result<(), NetlinkError> {
        let mut body = vec![family(addr), prefix, IFA_F_NODAD, RT_SCOPE_UNIVERSE];
        body.extend_from_slice(&ifindex.to_ne_bytes());
        attr(&mut body, IFA_LOCAL, &ip_bytes(addr));
        attr(&mut body, IFA_ADDRESS, &ip_bytes(addr));
        self.request(
            &format!("adding address {addr}/{prefix}"),
            RTM_NEWADDR,
            NLM_F_CREATE | NLM_F_EXCL,
            &body,
        )
    }

    /// A route to `dst` through `gateway` on link `ifindex`, in the main table. The
    /// gateway is declared on the link (`onlink`): the kernel would otherwise look it
    /// up, and the rules that refuse the stack's own network refuse that lookup too.
    pub fn add_route_via(&mut self, dst: Cidr, gateway: IpAddr, ifindex: u32) -> Result<(), NetlinkError> {
        let mut body = rtmsg(family(dst.addr()), dst.prefix_len(), RTN_UNICAST);
        body[8..12].copy_from_slice(&RTNH_F_ONLINK.to_ne_bytes());
        if dst.prefix_len() > 0 {
            attr(&mut body, RTA_DST, &ip_bytes(dst.addr()));
        }
        attr(&mut body, RTA_GATEWAY, &ip_bytes(gateway));
        attr(&mut body, RTA_OIF, &ifindex.to_ne_bytes());
        self.request(
            &format!("adding a route to {dst} via {gateway}"),
            RTM_NEWROUTE,
            NLM_F_CREATE | NLM_F_EXCL,
            &body,
        )
    }

    /// Remove the default route of one family (`v6`) from the main table, whoever
    /// added it (any protocol, any scope). Its absence is an error: the caller relies
    /// on it being gone.
    pub fn delete_default_route(&mut self, v6: bool) -> Result<(), NetlinkError> {
        let mut body = rtmsg(if v6 { AF_INET6 } else { AF_INET }, 0, RTN_UNICAST);
        body[5] = 0; // protocol: any
        body[6] = RT_SCOPE_NOWHERE; // scope: any
        self.request("deleting the default route", RTM_DELROUTE, 0, &body)
    }

    /// A rule ahead of every routing table that refuses every destination's `port`
    /// over `ip_proto` (6: TCP, 17: UDP) in one family (`v6`). Addresses on the
    /// namespace's own loopback are found in the local table first, so they stay.
    pub fn prohibit_port(
        &mut self,
        v6: bool,
        ip_proto: u8,
        port: u16,
        priority: u32,
    ) -> Result<(), NetlinkError> {
        let family = if v6 { AF_INET6 } else { AF_INET };
        let mut body = vec![family, 0, 0, 0, 0, 0, 0, FR_ACT_PROHIBIT];
        body.extend_from_slice(&0u32.to_ne_bytes());
        attr(&mut body, FRA_IP_PROTO, &[ip_proto]);
        let mut range = port.to_ne_bytes().to_vec();
        range.extend_from_slice(&port.to_ne_bytes());
        attr(&mut body, FRA_DPORT_RANGE, &range);
        attr(&mut body, FRA_PRIORITY, &priority.to_ne_bytes());
        self.request(
            &format!("adding a rule that prohibits port {port}/{ip_proto}"),
            RTM_NEWRULE,
            NLM_F_CREATE | NLM_F_EXCL,
            &body,
        )
    }

    /// A rule ahead of every routing table (`priority` lower than main's 32766) that
    /// refuses `dst` with EACCES: no route, however specific, can lead there.
    pub fn prohibit(&mut self, dst: Cidr, priority: u32) -> Result<(), NetlinkError> {
        let mut body = vec![family(dst.addr()), dst.prefix_len(), 0, 0, 0, 0, 0, FR_ACT_PROHIBIT];
        body.extend_from_slice(&0u32.to_ne_bytes());
        if dst.prefix_len() > 0 {
            attr(&mut body, FRA_DST, &ip_bytes(dst.addr()));
        }
        attr(&mut body, FRA_PRIORITY, &priority.to_ne_bytes());
        self.request(
            &format!("adding a rule that prohibits {dst}"),
            RTM_NEWRULE,
            NLM_F_CREATE | NLM_F_EXCL,
            &body,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `RTM_NEWADDR` message as the kernel sends it: header, `ifaddrmsg`, attributes.
    fn new_address(family: u8, prefix: u8, ifindex: u32, attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![family, prefix, 0, 0];
        body.extend_from_slice(&ifindex.to_ne_bytes());
        for (kind, data) in attrs {
            attr(&mut body, *kind, data);
        }
        let mut msg = ((16 + body.len()) as u32).to_ne_bytes().to_vec();
        msg.extend_from_slice(&RTM_NEWADDR.to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&body);
        msg
    }

    #[test]
    fn announced_addresses_parse_and_hostile_bytes_do_not_panic() {
        let mut datagram = new_address(
            AF_INET,
            16,
            7,
            &[(IFA_ADDRESS, vec![172, 30, 0, 9]), (IFA_LOCAL, vec![172, 30, 0, 1])],
        );
        datagram.extend(new_address(
            AF_INET6,
            64,
            8,
            &[(IFA_ADDRESS, "2001:db8::1".parse::<std::net::Ipv6Addr>().unwrap().octets().to_vec())],
        ));
        let parsed: Vec<AnnouncedAddress> =
            messages(&datagram).into_iter().filter_map(|(_, _, p)| parse_new_address(p)).collect();
        assert_eq!(
            parsed,
            [
                // IFA_LOCAL is the interface's own address where both are sent.
                AnnouncedAddress { ifindex: 7, addr: "172.30.0.1".parse().unwrap(), prefix_len: 16 },
                AnnouncedAddress { ifindex: 8, addr: "2001:db8::1".parse().unwrap(), prefix_len: 64 },
            ]
        );
        // Truncated, oversized lengths, wrong address sizes: nothing, and no panic.
        for cut in 0..datagram.len() {
            let _ =
                messages(&datagram[..cut]).into_iter().filter_map(|(_, _, p)| parse_new_address(p)).count();
        }
        let wrong_size = new_address(AF_INET, 24, 1, &[(IFA_ADDRESS, vec![1, 2, 3])]);
        assert!(messages(&wrong_size).into_iter().all(|(_, _, p)| parse_new_address(p).is_none()));
        let mut lying = new_address(AF_INET, 24, 1, &[(IFA_ADDRESS, vec![10, 0, 0, 1])]);
        lying[24] = 0xff; // the attribute claims more bytes than there are
        assert!(messages(&lying).into_iter().all(|(_, _, p)| parse_new_address(p).is_none()));
        assert!(attributes(&[4, 0]).is_empty());
    }
}
