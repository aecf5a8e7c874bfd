//! The runner's DNS forwarder for one job: it answers on the job's own loopback
//! (127.0.0.53, UDP and TCP, sockets made inside the job's namespace) and forwards to
//! the runner's upstream resolvers from the runner's namespace, so a job resolves names
//! whatever the host's resolver is (a link-local one included) without reaching it.
//!
//! With an egress allow-list, only allowed names are resolved (others are refused:
//! no exfiltration through lookups), and the addresses an allowed name resolves to are
//! routed into the job's namespace before the answer reaches the job. The blocked
//! ranges stay refused whatever an answer says: their rules come before any route.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use byoc_sandbox::net::Cidr;
use byoc_sandbox::netlink::Netlink;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Largest message over UDP we accept from a job or an upstream.
const MAX_UDP: usize = 4096;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// A TCP client that says nothing for this long is dropped.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// A TCP client is served this long at most, however busy.
const TCP_LIFETIME: Duration = Duration::from_secs(60);
/// Queries handled at once per job; more are dropped (the client retries).
const MAX_IN_FLIGHT: usize = 64;

const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;
const RCODE_SERVFAIL: u8 = 2;
const RCODE_REFUSED: u8 = 5;

/// One question: the name (lower case, no trailing dot) and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub name: String,
    pub qtype: u16,
}

/// Read a possibly compressed name at `pos`; returns it and the position after it.
fn read_name(msg: &[u8], mut pos: usize) -> Option<(String, usize)> {
    let mut labels: Vec<String> = Vec::new();
    let mut end = None;
    let mut jumps = 0;
    let mut total = 0;
    loop {
        let len = *msg.get(pos)? as usize;
        match len & 0xc0 {
            0x00 => {
                if len == 0 {
                    return Some((labels.join("."), end.unwrap_or(pos + 1)));
                }
                let label = msg.get(pos + 1..pos + 1 + len)?;
                total += len + 1;
                if total > 255 {
                    return None;
                }
                labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
                pos += 1 + len;
            }
            0xc0 => {
                let target = ((len & 0x3f) << 8) | *msg.get(pos + 1)? as usize;
                end.get_or_insert(pos + 2);
                jumps += 1;
                // Pointers must go backwards, and not forever.
                if jumps > 32 || target >= pos {
                    return None;
                }
                pos = target;
            }
            _ => return None,
        }
    }
}

fn u16_at(msg: &[u8], pos: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*msg.get(pos)?, *msg.get(pos + 1)?]))
}

/// The single question of a query (we forward only those with exactly one).
pub fn question(msg: &[u8]) -> Option<Question> {
    if msg.len() < 12 || u16_at(msg, 4)? != 1 {
        return None;
    }
    let (name, pos) = read_name(msg, 12)?;
    Some(Question { name, qtype: u16_at(msg, pos)? })
}

/// Every A and AAAA address in an answer's answer section.
pub fn answer_addresses(msg: &[u8]) -> Option<Vec<IpAddr>> {
    if msg.len() < 12 {
        return None;
    }
    let qd = u16_at(msg, 4)?;
    let an = u16_at(msg, 6)?;
    let mut pos = 12;
    for _ in 0..qd {
        let (_, p) = read_name(msg, pos)?;
        pos = p + 4;
    }
    let mut out = Vec::new();
    for _ in 0..an {
        let (_, p) = read_name(msg, pos)?;
        let rtype = u16_at(msg, p)?;
        let rdlen = u16_at(msg, p + 8)? as usize;
        let rdata = msg.get(p + 10..p + 10 + rdlen)?;
        match (rtype, rdlen) {
            (TYPE_A, 4) => out.push(IpAddr::from(<[u8; 4]>::try_from(rdata).ok()?)),
            (TYPE_AAAA, 16) => out.push(IpAddr::from(<[u8; 16]>::try_from(rdata).ok()?)),
            _ => {}
        }
        pos = p + 10 + rdlen;
    }
    Some(out)
}

/// An answer to `query` carrying only `rcode` (and the question, as sent).
pub fn error_reply(query: &[u8], rcode: u8) -> Option<Vec<u8>> {
    let (_, end) = read_name(query, 12)?;
    let qend = end + 4;
    let mut r = query.get(..qend)?.to_vec();
    // QR, the query's opcode and RD; RA; the rcode. One question, nothing else.
    r[2] = 0x80 | (query[2] & 0x79);
    r[3] = 0x80 | (rcode & 0x0f);
    r[4..6].copy_from_slice(&1u16.to_be_bytes());
    r[6..12].fill(0);
    Some(r)
}

/// Whether `name` is on the allow-list: an exact name, or `*.suffix` for any name
/// below `suffix`.
pub fn name_allowed(patterns: &[String], name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    patterns.iter().any(|p| {
        let p = p.trim_end_matches('.').to_ascii_lowercase();
        match p.strip_prefix("*.") {
            Some(suffix) => name.len() > suffix.len() + 1 && name.ends_with(&format!(".{suffix}")),
            None => name == p,
        }
    })
}

/// Routes for allowed names' addresses, added to the job's namespace through the
/// netlink socket its init made there.
pub struct Router {
    netlink: Arc<Mutex<Netlink>>,
    /// The job's interface to the user-mode stack (its index in the job's namespace).
    tap: u32,
    ipv6: bool,
    routed: Mutex<std::collections::HashSet<IpAddr>>,
}

impl Router {
    pub fn new(netlink: Arc<Mutex<Netlink>>, tap: u32, ipv6: bool) -> Router {
        Router { netlink, tap, ipv6, routed: Mutex::default() }
    }

    fn route(&self, ip: IpAddr) -> Result<(), byoc_sandbox::netlink::NetlinkError> {
        use byoc_sandbox::net::{GATEWAY_IPV4, GATEWAY_IPV6};
        if ip.is_ipv6() && !self.ipv6 {
            return Ok(());
        }
        if !self.routed.lock().unwrap_or_else(|e| e.into_inner()).insert(ip) {
            return Ok(());
        }
        let gateway = if ip.is_ipv4() { IpAddr::V4(GATEWAY_IPV4) } else { IpAddr::V6(GATEWAY_IPV6) };
        let mut nl = self.netlink.lock().unwrap_or_else(|e| e.into_inner());
        match nl.add_route_via(Cidr::host(ip), gateway, self.tap) {
            Err(e) if e.errno() != Some(nix::Error::EEXIST) => {
                self.routed.lock().unwrap_or_else(|e| e.into_inner()).remove(&ip);
                Err(e)
            }
            _ => Ok(()),
        }
    }
}

/// How one job's names are resolved.
pub struct Forwarder {
    pub upstreams: Vec<SocketAddr>,
    /// `None`: any name. `Some`: only these names (exact or `*.suffix`), their
    /// addresses routed through `router`.
    pub allowed_names: Option<Vec<String>>,
    pub router: Option<Router>,
}

impl Forwarder {
    /// The answer the job gets for `query` (`None`: drop it).
    async fn answer(&self, query: &[u8], tcp: bool) -> Option<Vec<u8>> {
        let q = question(query)?;
        if let Some(allowed) = &self.allowed_names
            && !name_allowed(allowed, &q.name)
        {
            tracing::debug!(name = %q.name, "Job's DNS query refused: not on the egress allow-list.");
            return error_reply(query, RCODE_REFUSED);
        }
        let reply = match self.ask_upstreams(query, tcp).await {
            Some(r) => r,
            None => return error_reply(query, RCODE_SERVFAIL),
        };
        if self.allowed_names.is_some() {
            let Some(router) = &self.router else { return error_reply(query, RCODE_REFUSED) };
            // Routed before the job sees the address, so its first connection works.
            for ip in answer_addresses(&reply).unwrap_or_default() {
                if let Err(e) = router.route(ip) {
                    tracing::warn!(name = %q.name, %ip, error = %e, "Routing an allowed name's address failed: {e}.");
                    return error_reply(query, RCODE_SERVFAIL);
                }
            }
        }
        Some(reply)
    }

    async fn ask_upstreams(&self, query: &[u8], tcp: bool) -> Option<Vec<u8>> {
        ask_upstreams(&self.upstreams, query, tcp).await
    }

    /// Answer on the job's UDP socket until the task is dropped.
    pub async fn serve_udp(self: Arc<Self>, socket: tokio::net::UdpSocket) {
        let socket = Arc::new(socket);
        let mut tasks = tokio::task::JoinSet::new();
        let mut buf = vec![0u8; MAX_UDP];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                // Not a spin on a socket that keeps failing.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            while tasks.try_join_next().is_some() {}
            if tasks.len() >= MAX_IN_FLIGHT {
                continue;
            }
            let query = buf[..n].to_vec();
            let (me, socket) = (self.clone(), socket.clone());
            tasks.spawn(async move {
                if let Some(reply) = me.answer(&query, false).await {
                    let _ = socket.send_to(&reply, from).await;
                }
            });
        }
    }

    /// Answer on the job's TCP listener until the task is dropped: at most
    /// `MAX_IN_FLIGHT` connections at once, each dropped after `TCP_IDLE` of silence or
    /// `TCP_LIFETIME` in all (`jobnet::serve_bounded`).
    pub async fn serve_tcp(self: Arc<Self>, listener: tokio::net::TcpListener) {
        crate::jobnet::serve_bounded(listener, MAX_IN_FLIGHT, TCP_LIFETIME, |mut stream| {
            let me = self.clone();
            async move {
                while let Ok(Ok(query)) = tokio::time::timeout(TCP_IDLE, read_framed(&mut stream)).await {
                    let Some(reply) = me.answer(&query, true).await else { break };
                    let mut framed = (reply.len() as u16).to_be_bytes().to_vec();
                    framed.extend_from_slice(&reply);
                    if stream.write_all(&framed).await.is_err() {
                        break;
                    }
                }
            }
        })
        .await
    }
}

async fn read_framed(stream: &mut tokio::net::TcpStream) -> std::io::Result<Vec<u8>> {
    let len = stream.read_u16().await? as usize;
    let mut msg = vec![0u8; len];
    stream.read_exact(&mut msg).await?;
    Ok(msg)
}

/// The first matching answer from `upstreams`, asked in order.
async fn ask_upstreams(upstreams: &[SocketAddr], query: &[u8], tcp: bool) -> Option<Vec<u8>> {
    for upstream in upstreams {
        let r = if tcp { ask_tcp(*upstream, query).await } else { ask_udp(*upstream, query).await };
        match r {
            Ok(reply) if reply.len() >= 12 && reply[..2] == query[..2] => return Some(reply),
            Ok(_) => tracing::debug!(%upstream, "upstream DNS answer did not match the query"),
            Err(e) => tracing::debug!(%upstream, error = %e, "upstream DNS failed"),
        }
    }
    None
}

/// A query for `name` of `qtype` (1: A, 28: AAAA), as a stub resolver sends it.
pub fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len().min(63) as u8);
        q.extend_from_slice(&label.as_bytes()[..label.len().min(63)]);
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes());
    q
}

/// The IPv4 addresses of `name`, asked of `upstreams` as a job's forwarder asks them
/// (for containers, whose names the runner resolves when they start).
pub async fn resolve_v4(upstreams: &[SocketAddr], name: &str) -> Vec<IpAddr> {
    // A random id, as any stub resolver's (an off-path answer must guess it).
    let id = u16::from_str_radix(&byoc_protocol::random_hex(2), 16).unwrap_or(0x4242);
    let q = query(id, name, TYPE_A);
    match ask_upstreams(upstreams, &q, false).await {
        Some(reply) => {
            answer_addresses(&reply).unwrap_or_default().into_iter().filter(IpAddr::is_ipv4).collect()
        }
        None => Vec::new(),
    }
}

async fn ask_udp(upstream: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let bind: SocketAddr = if upstream.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("literal");
    let sock = tokio::net::UdpSocket::bind(bind).await?;
    sock.connect(upstream).await?;
    sock.send(query).await?;
    let mut buf = vec![0u8; MAX_UDP];
    let n = tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    buf.truncate(n);
    Ok(buf)
}

async fn ask_tcp(upstream: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let timeout = |_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer");
    let mut stream = tokio::time::timeout(UPSTREAM_TIMEOUT, tokio::net::TcpStream::connect(upstream))
        .await
        .map_err(timeout)??;
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(query);
    stream.write_all(&framed).await?;
    tokio::time::timeout(UPSTREAM_TIMEOUT, read_framed(&mut stream)).await.map_err(timeout)?
}

/// The host's resolvers from a `resolv.conf` text (port 53).
pub fn nameservers_from_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().split('%').next()?.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer_with(query: &[u8], records: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut r = query.to_vec();
        r[2] = 0x81;
        r[3] = 0x80;
        r[6..8].copy_from_slice(&(records.len() as u16).to_be_bytes());
        for (t, data) in records {
            r.extend_from_slice(&[0xc0, 12]);
            r.extend_from_slice(&t.to_be_bytes());
            r.extend_from_slice(&[0, 1, 0, 0, 0, 60]);
            r.extend_from_slice(&(data.len() as u16).to_be_bytes());
            r.extend_from_slice(data);
        }
        r
    }

    #[test]
    fn questions_and_answers_parse() {
        let q = query(7, "Outside.Test", TYPE_A);
        assert_eq!(question(&q), Some(Question { name: "outside.test".into(), qtype: TYPE_A }));
        let a = answer_with(
            &q,
            &[
                (5, vec![3, b'f', b'o', b'o', 0]),
                (TYPE_A, vec![198, 51, 100, 1]),
                (TYPE_AAAA, [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1].to_vec()),
            ],
        );
        assert_eq!(
            answer_addresses(&a).unwrap(),
            vec!["198.51.100.1".parse::<IpAddr>().unwrap(), "2001:db8::1".parse().unwrap()]
        );
        let refused = error_reply(&q, RCODE_REFUSED).unwrap();
        assert_eq!(refused[..2], q[..2]);
        assert_eq!(refused[3] & 0x0f, RCODE_REFUSED);
        assert_eq!(question(&refused).unwrap().name, "outside.test");
    }

    #[test]
    fn hostile_messages_do_not_panic_or_loop() {
        // A pointer to itself, a pointer forward, truncated labels, a huge count.
        let mut looped = query(1, "a", TYPE_A);
        looped.truncate(12);
        looped.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
        assert_eq!(question(&looped), None);
        let mut forward = query(1, "a", TYPE_A);
        forward.truncate(12);
        forward.extend_from_slice(&[0xc0, 40]);
        assert_eq!(question(&forward), None);
        let mut short = query(1, "abc", TYPE_A);
        short.truncate(14);
        assert_eq!(question(&short), None);
        let mut many = query(1, "a", TYPE_A);
        many[6] = 0xff;
        assert_eq!(answer_addresses(&many), None);
        for len in 0..40 {
            let mut bytes: Vec<u8> = (0..len).map(|i| (i * 37 % 256) as u8).collect();
            if bytes.len() > 5 {
                bytes[5] = 1;
            }
            let _ = question(&bytes);
            let _ = answer_addresses(&bytes);
            let _ = error_reply(&bytes, RCODE_REFUSED);
        }
    }

    #[test]
    fn allow_list_names_match_exactly_or_below_a_wildcard() {
        let allowed = vec!["sts.us-east-1.amazonaws.com".to_string(), "*.ecr.example".to_string()];
        assert!(name_allowed(&allowed, "STS.us-east-1.amazonaws.com."));
        assert!(name_allowed(&allowed, "123.dkr.ecr.example"));
        assert!(!name_allowed(&allowed, "ecr.example"));
        assert!(!name_allowed(&allowed, "evil-ecr.example"));
        assert!(!name_allowed(&allowed, "sts.us-east-1.amazonaws.com.evil.test"));
    }

    #[test]
    fn resolv_conf_nameservers() {
        let text = "# x\nsearch example\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\nnameserver  169.254.169.253 \n";
        let got = nameservers_from_resolv_conf(text);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], "10.0.0.2:53".parse().unwrap());
        assert_eq!(got[2], "169.254.169.253:53".parse().unwrap());
    }
}
