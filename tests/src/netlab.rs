//! A private network for the network-boundary suites (root only; nothing leaves the
//! machine). Two namespaces joined by a veth pair:
//!
//! ```text
//!  "runner" namespace                                   "outside" namespace
//!  lo: 127.0.0.1, 169.254.169.254, 169.254.170.2,        198.51.100.1, 2001:db8::1
//!      169.254.170.23, fd00:ec2::254 (fake IMDS and       an HTTP server, a DNS server
//!      credential services answer there)                  (outside.test → both addresses)
//!  198.51.100.2, 2001:db8::2 ─────── veth ─────────────────
//! ```
//!
//! The runner, the reference control plane and moto run in the first: a test's
//! async body runs on a runtime whose threads were created inside it
//! ([`NetLab::run`]), so every socket it makes and every process it starts is there.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

pub const OUTSIDE_V4: &str = "198.51.100.1";
pub const OUTSIDE_V6: &str = "2001:db8::1";
pub const RUNNER_V4: &str = "198.51.100.2";
pub const OUTSIDE_NAME: &str = "outside.test";
pub const OUTSIDE_HTTP_PORT: u16 = 8080;
/// Addresses on the runner namespace's loopback where fake metadata services answer.
pub const METADATA_ADDRS: &[&str] = &["169.254.169.254", "169.254.170.2", "169.254.170.23", "fd00:ec2::254"];

pub struct NetLab {
    pub runner_ns: Netns,
    pub outside_ns: Netns,
    outside_stop: Option<tokio::sync::oneshot::Sender<()>>,
    outside_thread: Option<std::thread::JoinHandle<()>>,
    /// Requests the outside HTTP server answered.
    pub outside_hits: Arc<AtomicUsize>,
}

fn ip(args: &[&str]) {
    run_ip(Command::new("ip").args(args), args);
}

/// `ip ARGS` inside `ns`'s network namespace (nsenter, by the holder's /proc path).
fn ip_in(ns: &Netns, args: &[&str]) {
    run_ip(Command::new("nsenter").arg(format!("--net={}", ns.path())).arg("ip").args(args), args);
}

fn run_ip(cmd: &mut Command, args: &[&str]) {
    let out = cmd.output().expect("ip (iproute2) and nsenter (util-linux) are required");
    if !out.status.success() {
        panic!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
}

/// A network namespace held by a `sleep` of its own (`unshare --net`), reached through
/// /proc/PID/ns/net. Named namespaces (`ip netns add`) were abandoned: under load their
/// bind mounts in /run/netns vanished now and then (every `ip -n NS` then failed with
/// EINVAL, in two CI runs), whatever locking was tried; a holder process has no mount
/// to lose, and its namespace goes when it is killed.
pub struct Netns {
    holder: std::process::Child,
}

impl Netns {
    fn new() -> Netns {
        let own = std::fs::read_link("/proc/self/ns/net").expect("our network namespace");
        let holder = Command::new("unshare")
            .args(["--net", "--", "sleep", "1000000"])
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("unshare (util-linux) is required");
        let ns = Netns { holder };
        // unshare enters the new namespace before it execs sleep: wait for that.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::read_link(ns.path()).map_or(true, |l| l == own) {
            assert!(std::time::Instant::now() < deadline, "unshare --net never entered its namespace");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        ns
    }

    /// The namespace, for setns and nsenter.
    pub fn path(&self) -> String {
        format!("/proc/{}/ns/net", self.holder.id())
    }

    /// For `ip link … netns PID`.
    fn pid(&self) -> String {
        self.holder.id().to_string()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// A host of its own beside this process's network namespace, joined by a veth pair
/// (`host_cidr` on our side, `peer_cidr` in its namespace): what a job reaches through
/// its own network, as it reaches a cloud's endpoints (never this host's addresses or
/// loopback). The demo's AWS for real providers. Root only.
pub struct NeighbourHost {
    pub ns: Netns,
    link: String,
}

impl NeighbourHost {
    pub fn create(host_cidr: &str, peer_cidr: &str) -> NeighbourHost {
        assert!(nix::unistd::geteuid().is_root(), "a neighbour host needs root (unshare --net, veth)");
        let ns = Netns::new();
        let link = format!("byocnb{}", std::process::id() % 100_000);
        ip(&["link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &ns.pid()]);
        ip(&["addr", "add", host_cidr, "dev", &link]);
        ip(&["link", "set", &link, "up"]);
        ip_in(&ns, &["link", "set", "lo", "up"]);
        ip_in(&ns, &["addr", "add", peer_cidr, "dev", "eth0"]);
        ip_in(&ns, &["link", "set", "eth0", "up"]);
        NeighbourHost { ns, link }
    }
}

impl Drop for NeighbourHost {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.link]).output();
    }
}

/// Run `f` on a new thread that has joined the network namespace at `path`.
pub fn in_netns<T: Send + 'static>(path: String, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns (the suites need root)");
        f()
    })
    .join()
    .expect("thread in the namespace panicked")
}

impl NetLab {
    /// Build both namespaces, their link and addresses, and start the outside servers.
    pub fn create() -> NetLab {
        assert!(nix::unistd::geteuid().is_root(), "the network suites need root (unshare --net, veth)");
        let mut lab = NetLab {
            runner_ns: Netns::new(),
            outside_ns: Netns::new(),
            outside_stop: None,
            outside_thread: None,
            outside_hits: Arc::default(),
        };
        let (r, o) = (&lab.runner_ns, &lab.outside_ns);
        // Created straight into the two namespaces: link names are per namespace.
        let (rp, op) = (r.pid(), o.pid());
        ip(&["link", "add", "v0", "netns", &rp, "type", "veth", "peer", "name", "v1", "netns", &op]);
        for (ns, dev, v4, v6) in
            [(r, "v0", "198.51.100.2/24", "2001:db8::2/64"), (o, "v1", "198.51.100.1/24", "2001:db8::1/64")]
        {
            ip_in(ns, &["link", "set", "lo", "up"]);
            ip_in(ns, &["addr", "add", v4, "dev", dev]);
            ip_in(ns, &["-6", "addr", "add", v6, "dev", dev, "nodad"]);
            ip_in(ns, &["link", "set", dev, "up"]);
        }
        ip_in(r, &["route", "add", "default", "via", OUTSIDE_V4]);
        ip_in(r, &["-6", "route", "add", "default", "via", OUTSIDE_V6]);
        for a in METADATA_ADDRS {
            // An IPv6 address stays "tentative" (unbindable: EADDRNOTAVAIL) until the
            // kernel's DAD work runs, even on lo; under load that is after the test binds.
            if a.contains(':') {
                ip_in(r, &["-6", "addr", "add", &format!("{a}/128"), "dev", "lo", "nodad"]);
            } else {
                ip_in(r, &["addr", "add", &format!("{a}/32"), "dev", "lo"]);
            }
        }
        // The outside servers: a runtime on a thread inside the outside namespace.
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let hits = lab.outside_hits.clone();
        let path = lab.outside_ns.path();
        lab.outside_thread = Some(std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("outside namespace");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                let mut tasks = Vec::new();
                for a in [OUTSIDE_V4, OUTSIDE_V6] {
                    let addr = SocketAddr::new(a.parse().expect("literal"), OUTSIDE_HTTP_PORT);
                    let listener = tokio::net::TcpListener::bind(addr).await.expect("outside http");
                    tasks.push(tokio::spawn(counting_http(listener, hits.clone(), "outside")));
                }
                let dns = tokio::net::UdpSocket::bind((OUTSIDE_V4, 53)).await.expect("outside dns");
                tasks.push(tokio::spawn(dns_server(dns)));
                let _ = ready_tx.send(());
                let _ = stopped.await;
                for t in tasks {
                    t.abort();
                }
            });
        }));
        ready_rx.recv().expect("outside servers started");
        lab.outside_stop = Some(stop);
        lab
    }

    /// Run a test's body on a multi-threaded runtime inside the runner namespace.
    pub fn run<F, Fut>(&self, body: F) -> Fut::Output
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future + 'static,
        Fut::Output: Send + 'static,
    {
        in_netns(self.runner_ns.path(), move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(body())
        })
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        if let Some(stop) = self.outside_stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.outside_thread.take() {
            let _ = t.join();
        }
        // The namespaces (and the veth pair between them) go with their holders.
    }
}

/// Count connections and answer each with a small HTTP 200 naming `who`.
pub async fn counting_http(listener: tokio::net::TcpListener, hits: Arc<AtomicUsize>, who: &'static str) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    loop {
        let Ok((mut s, _)) = listener.accept().await else { continue };
        hits.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let _ = s.read(&mut buf).await;
            let body = format!("hello from {who}\n");
            let _ = s
                .write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
        });
    }
}

/// A service that must never be reached: it counts connections.
pub struct Tripwire {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Tripwire {
    pub async fn start(addr: SocketAddr) -> Tripwire {
        let listener =
            tokio::net::TcpListener::bind(addr).await.unwrap_or_else(|e| panic!("binding {addr}: {e}"));
        let addr = listener.local_addr().expect("local addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(counting_http(listener, hits.clone(), "tripwire"));
        Tripwire { addr, hits, task }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Tripwire {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A DNS server that knows one name: `outside.test` (A and AAAA); everything else is
/// NXDOMAIN.
async fn dns_server(sock: tokio::net::UdpSocket) {
    let names = vec![(
        OUTSIDE_NAME.to_string(),
        vec![OUTSIDE_V4.parse().expect("literal"), OUTSIDE_V6.parse().expect("literal")],
    )];
    serve_names(sock, names, Arc::default()).await
}

/// Answer A and AAAA queries for `names` (anything else: NXDOMAIN), noting each name
/// asked in `asked`.
async fn serve_names(
    sock: tokio::net::UdpSocket,
    names: Vec<(String, Vec<IpAddr>)>,
    asked: Arc<std::sync::Mutex<Vec<String>>>,
) {
    let mut buf = [0u8; 1500];
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf).await else { continue };
        if let Some(reply) = dns_answer(&buf[..n], &names, &asked) {
            let _ = sock.send_to(&reply, from).await;
        }
    }
}

/// A DNS server on a loopback port of the caller's namespace that knows the names it
/// is given and remembers every name it was asked (to show what left by lookup).
pub struct NameServer {
    pub addr: SocketAddr,
    pub asked: Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl NameServer {
    pub async fn start(names: &[(&str, IpAddr)]) -> NameServer {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.expect("binding a DNS port");
        let addr = sock.local_addr().expect("local addr");
        let names = names.iter().map(|(n, ip)| (n.to_string(), vec![*ip])).collect();
        let asked = Arc::<std::sync::Mutex<Vec<String>>>::default();
        let task = tokio::spawn(serve_names(sock, names, asked.clone()));
        NameServer { addr, asked, task }
    }

    pub fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for NameServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn dns_answer(
    q: &[u8],
    names: &[(String, Vec<IpAddr>)],
    asked: &std::sync::Mutex<Vec<String>>,
) -> Option<Vec<u8>> {
    if q.len() < 12 {
        return None;
    }
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = *q.get(pos)? as usize;
        if len == 0 {
            pos += 1;
            break;
        }
        labels.push(String::from_utf8_lossy(q.get(pos + 1..pos + 1 + len)?).to_ascii_lowercase());
        pos += 1 + len;
    }
    let qtype = u16::from_be_bytes([*q.get(pos)?, *q.get(pos + 1)?]);
    let qend = pos + 4;
    let mut r = q.get(..qend)?.to_vec();
    r[2] = 0x84 | (q[2] & 0x01);
    r[6..12].fill(0);
    let name = labels.join(".");
    asked.lock().unwrap_or_else(|e| e.into_inner()).push(name.clone());
    let Some((_, addrs)) = names.iter().find(|(n, _)| *n == name) else {
        r[3] = 0x83; // NXDOMAIN
        return Some(r);
    };
    let addr = addrs.iter().find(|a| (qtype == 1 && a.is_ipv4()) || (qtype == 28 && a.is_ipv6())).copied();
    r[3] = 0x80;
    if let Some(a) = addr {
        r[7] = 1;
        r.extend_from_slice(&[0xc0, 12]);
        r.extend_from_slice(&qtype.to_be_bytes());
        r.extend_from_slice(&[0, 1, 0, 0, 0, 30]);
        let bytes = match a {
            IpAddr::V4(v) => v.octets().to_vec(),
            IpAddr::V6(v) => v.octets().to_vec(),
        };
        r.extend_from_slice(&(bytes.len() as u16).to_be_bytes());
        r.extend_from_slice(&bytes);
    }
    Some(r)
}

/// A host beside the machine's own namespace (for containers, whose traffic leaves
/// through it): a namespace joined to the root namespace by a veth pair in the
/// TEST-NET-3 range, with an HTTP server at 203.0.113.1:8080. The root namespace gets
/// 203.0.113.2/24 on its end; all of it goes away when the peer is dropped.
pub struct Peer {
    pub ns: Netns,
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub const PEER_V4: &str = "203.0.113.1";
pub const PEER_HOST_SIDE_V4: &str = "203.0.113.2";

impl Peer {
    pub fn create() -> Peer {
        assert!(nix::unistd::geteuid().is_root(), "the network suites need root (unshare --net, veth)");
        let tag = byoc_protocol::random_hex(4);
        let ns = Netns::new();
        let host_if = format!("byocp{tag}");
        ip(&["link", "add", &host_if, "type", "veth", "peer", "name", "v1", "netns", &ns.pid()]);
        ip(&["addr", "add", &format!("{PEER_HOST_SIDE_V4}/24"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip_in(&ns, &["link", "set", "lo", "up"]);
        ip_in(&ns, &["addr", "add", &format!("{PEER_V4}/24"), "dev", "v1"]);
        ip_in(&ns, &["link", "set", "v1", "up"]);
        let addr: SocketAddr = format!("{PEER_V4}:{OUTSIDE_HTTP_PORT}").parse().expect("literal");
        let hits: Arc<AtomicUsize> = Arc::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (path, h) = (ns.path(), hits.clone());
        let thread = std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("peer namespace");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(addr).await.expect("peer http");
                let task = tokio::spawn(counting_http(listener, h, "peer"));
                let _ = ready_tx.send(());
                let _ = stopped.await;
                task.abort();
            });
        });
        ready_rx.recv().expect("peer server started");
        Peer { ns, addr, hits, stop: Some(stop), thread: Some(thread) }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The namespace goes with its holder (Netns's drop, after this), and with it
        // its end of the veth pair and so ours.
    }
}
