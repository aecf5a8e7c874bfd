//! The job's network, seen from the runner: the customer's egress settings, the
//! one-line description each job's log and `started` record carry, the check that the
//! boundary can be built at all, and the services the runner provides inside a job's
//! namespace once the sandbox's init hands over their sockets: the DNS forwarder (and
//! the allow-list's routes for names), the role's credential endpoint, and the rules
//! that keep host addresses appearing while the job runs out of its reach.

use std::net::SocketAddr;
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use byoc_sandbox::net::Cidr;
use byoc_sandbox::spec::{NetworkSpec, UserModeNet, handover};

/// The customer's `[sandbox.egress]`: what networked jobs may reach beyond the ranges
/// that are always blocked. Never taken from a job.
#[derive(Debug, Clone)]
pub struct NetworkSettings {
    /// The user-mode network stack.
    pub slirp4netns: PathBuf,
    pub ipv6: bool,
    pub mtu: u32,
    /// More ranges no job may reach.
    pub deny: Vec<Cidr>,
    /// `None`: any destination that is not blocked.
    pub allow: Option<EgressAllow>,
    /// Resolvers the job's DNS forwarder asks; empty: the host's `/etc/resolv.conf`.
    pub nameservers: Vec<SocketAddr>,
    pub ready_timeout: Duration,
}

impl Default for NetworkSettings {
    fn default() -> Self {
        NetworkSettings {
            slirp4netns: PathBuf::from("/usr/bin/slirp4netns"),
            ipv6: true,
            mtu: 65520,
            deny: Vec::new(),
            allow: None,
            nameservers: Vec::new(),
            ready_timeout: Duration::from_secs(10),
        }
    }
}

/// An egress allow-list: address ranges, and host names (exact, or `*.suffix`).
#[derive(Debug, Clone, Default)]
pub struct EgressAllow {
    pub ranges: Vec<Cidr>,
    pub hosts: Vec<String>,
}

impl EgressAllow {
    pub fn len(&self) -> usize {
        self.ranges.len() + self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a job's code reaches the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkUse {
    /// No job code runs on the host (the runner itself does the work: noop, artifact
    /// sync, kubernetes API calls).
    InRunner,
    /// Its own namespace with no way out.
    Offline,
    /// Its own namespace, egress through the user-mode stack.
    UserMode,
}

/// One line for the job's log and its `started` audit record.
pub fn describe(use_: NetworkUse, settings: &NetworkSettings) -> String {
    match use_ {
        NetworkUse::InRunner => "network: the runner's own (no job code runs on the host)".into(),
        NetworkUse::Offline => "network: none (own namespace, loopback only)".into(),
        NetworkUse::UserMode => {
            let egress = match &settings.allow {
                None => "egress to any address not blocked".to_string(),
                Some(a) => {
                    format!("egress allow-list {} entr{}", a.len(), if a.len() == 1 { "y" } else { "ies" })
                }
            };
            let deny = if settings.deny.is_empty() {
                String::new()
            } else {
                format!(", {} more range(s) denied", settings.deny.len())
            };
            format!(
                "network: user-mode ({}), {egress}{deny}, metadata and host blocked{}",
                settings.slirp4netns.file_name().and_then(|n| n.to_str()).unwrap_or("slirp4netns"),
                if settings.ipv6 { ", IPv4+IPv6" } else { ", IPv4 only" }
            )
        }
    }
}

/// Why a job's network boundary cannot be built (or widened): what is missing and what
/// to do. A job that needs it is refused (`sandbox_network_unavailable`), never run
/// with less isolation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NetworkUnavailable(pub String);

impl From<String> for NetworkUnavailable {
    fn from(s: String) -> Self {
        NetworkUnavailable(s)
    }
}

/// Whether the boundary can be built here; the reason and what to install if not.
/// Cheap (run before each networked job): the stack's program and the TUN device.
pub fn check_available(settings: &NetworkSettings) -> Result<(), NetworkUnavailable> {
    use std::os::unix::fs::PermissionsExt as _;
    let stack = &settings.slirp4netns;
    match std::fs::metadata(stack) {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
        Ok(_) => {
            return Err(NetworkUnavailable::from(format!("{} is not an executable file", stack.display())));
        }
        Err(e) => {
            return Err(NetworkUnavailable::from(format!(
                "the user-mode network stack {} is missing ({e}); install it: apt-get install slirp4netns",
                stack.display()
            )));
        }
    }
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun") {
        return Err(NetworkUnavailable::from(format!(
            "/dev/net/tun cannot be opened ({e}); the runner's unit needs DeviceAllow=/dev/net/tun rw \
             (the packaged unit has it) and the tun module loaded"
        )));
    }
    Ok(())
}

/// The resolvers the runner asks for jobs: the customer's, or the host's.
pub fn upstreams(settings: &NetworkSettings) -> Vec<SocketAddr> {
    if settings.nameservers.is_empty() {
        crate::dns::nameservers_from_resolv_conf(
            &std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
        )
    } else {
        settings.nameservers.clone()
    }
}

/// The helper's network spec for a job.
pub fn spec(use_: NetworkUse, settings: &NetworkSettings, credentials: bool) -> NetworkSpec {
    match use_ {
        NetworkUse::InRunner | NetworkUse::Offline => NetworkSpec::Off,
        NetworkUse::UserMode => NetworkSpec::UserMode(UserModeNet {
            slirp4netns: settings.slirp4netns.clone(),
            ipv6: settings.ipv6,
            mtu: settings.mtu,
            blocked: settings.deny.clone(),
            allow: settings.allow.as_ref().map(|a| a.ranges.clone()),
            handover: true,
            credentials,
            ready_timeout_ms: settings.ready_timeout.as_millis() as u64,
        }),
    }
}

/// Connections to one job's credential endpoint served at once: an SDK needs one or two;
/// more are closed as they arrive, so a job cannot spend the runner's descriptors.
pub const MAX_CREDENTIAL_CONNECTIONS: usize = 32;
/// A credential connection lives at most this long (an idle or slow client is dropped;
/// SDKs reconnect when they next need credentials).
const CREDENTIAL_CONNECTION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(30);

/// Accept on a listener inside a job's namespace and serve each connection with
/// `serve`, at most `max` at once (more are closed at once: refused) and each for at
/// most `lifetime`. An accept error (the runner out of descriptors, say) waits before
/// the next try, doubling up to a second, instead of spinning.
pub async fn serve_bounded<F, Fut>(
    listener: tokio::net::TcpListener,
    max: usize,
    lifetime: std::time::Duration,
    serve: F,
) where
    F: Fn(tokio::net::TcpStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut conns = tokio::task::JoinSet::new();
    let mut backoff = std::time::Duration::ZERO;
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        match stream {
            Ok((stream, _)) => {
                backoff = std::time::Duration::ZERO;
                while conns.try_join_next().is_some() {}
                if conns.len() >= max {
                    // Closed unread: the client sees its connection refused.
                    drop(stream);
                    continue;
                }
                let fut = serve(stream);
                conns.spawn(async move {
                    let _ = tokio::time::timeout(lifetime, fut).await;
                });
            }
            Err(e) => {
                backoff = (backoff * 2)
                    .clamp(std::time::Duration::from_millis(10), std::time::Duration::from_secs(1));
                tracing::warn!(error = %e, wait_ms = backoff.as_millis() as u64, "Accepting a connection from a job's namespace failed: {e}.");
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

/// Serves the AWS container credentials protocol for one job on connections from
/// inside its namespace (the runner implements it over the job's role session).
pub trait CredentialEndpoint: Send + Sync {
    fn serve(&self, stream: tokio::net::TcpStream) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// The sockets init made inside the job's namespace.
struct Handover {
    /// The job's interface index in its namespace.
    tap: u32,
    dns_udp: tokio::net::UdpSocket,
    dns_tcp: tokio::net::TcpListener,
    netlink: OwnedFd,
    credentials: Option<tokio::net::TcpListener>,
}

/// Wait for init's message on the channel; `None` when the channel closed without one
/// (the sandbox failed before its network was up).
async fn receive(channel: OwnedFd) -> std::io::Result<Option<Handover>> {
    // A seqpacket socket, registered with the runtime through UnixStream only for its
    // readiness: the message (and its descriptors) is read with recvmsg.
    let channel = std::os::unix::net::UnixStream::from(channel);
    channel.set_nonblocking(true)?;
    let channel = tokio::net::UnixStream::from_std(channel)?;
    let mut buf = [0u8; 256];
    let (n, fds) = loop {
        channel.readable().await?;
        match channel.try_io(tokio::io::Interest::READABLE, || {
            byoc_sandbox::receive_with_fds(channel.as_fd(), &mut buf)
        }) {
            Ok(r) => break r,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    let text = std::str::from_utf8(&buf[..n]).unwrap_or("");
    let (names, tap) = text.split_once(";tap=").unwrap_or((text, ""));
    let tap: u32 =
        tap.parse().map_err(|_| std::io::Error::other(format!("no interface index in {text:?}")))?;
    let names: Vec<&str> = names.split(',').collect();
    if names.len() != fds.len() {
        return Err(std::io::Error::other(format!("{} names for {} descriptors", names.len(), fds.len())));
    }
    let mut by_name: std::collections::HashMap<&str, OwnedFd> = names.into_iter().zip(fds).collect();
    let mut take = |name: &str| {
        by_name.remove(name).ok_or_else(|| std::io::Error::other(format!("the sandbox did not send {name}")))
    };
    let tcp = |fd: OwnedFd| -> std::io::Result<tokio::net::TcpListener> {
        let l = std::net::TcpListener::from(fd);
        l.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(l)
    };
    let udp = std::net::UdpSocket::from(take(handover::DNS_UDP)?);
    udp.set_nonblocking(true)?;
    Ok(Some(Handover {
        tap,
        dns_udp: tokio::net::UdpSocket::from_std(udp)?,
        dns_tcp: tcp(take(handover::DNS_TCP)?)?,
        netlink: take(handover::NETLINK)?,
        credentials: take(handover::CREDENTIALS).ok().map(tcp).transpose()?,
    }))
}

/// The runner's subscription to host addresses, opened before a job's namespace is
/// built so that nothing announced in between is missed: each new address (and the
/// subnet behind a new bridge, a Docker network created after the job started) is
/// prohibited in the job's namespace as it appears.
pub struct HostFollower {
    watch: byoc_sandbox::netlink::AddressWatch,
    /// The watch's socket registered with the runtime, for its readiness only (the
    /// messages are read through `watch`).
    readiness: tokio::net::UnixDatagram,
    links: byoc_sandbox::net::HostLinks,
    caught_up: bool,
}

impl HostFollower {
    pub fn open() -> Result<HostFollower, NetworkUnavailable> {
        let unavailable = |e: &dyn std::fmt::Display| {
            NetworkUnavailable(format!("following the host's addresses for the job's boundary: {e}"))
        };
        let watch = byoc_sandbox::netlink::AddressWatch::open().map_err(|e| unavailable(&e))?;
        let fd = watch.fd().try_clone().map_err(|e| unavailable(&e))?;
        let readiness = tokio::net::UnixDatagram::from_std(std::os::unix::net::UnixDatagram::from(fd))
            .map_err(|e| unavailable(&e))?;
        let links = byoc_sandbox::net::HostLinks::open().map_err(|e| unavailable(&e))?;
        Ok(HostFollower { watch, readiness, links, caught_up: false })
    }

    /// The ranges to close next: what appeared on the host since the last call (and,
    /// on the first call, everything there is: whatever appeared between the
    /// sandbox's listing and this subscription). Waits until there is something.
    pub async fn next_ranges(&mut self) -> Result<Vec<Cidr>, String> {
        let everything = || byoc_sandbox::net::host_blocked().map_err(|e| e.to_string());
        if !std::mem::replace(&mut self.caught_up, true) {
            return everything();
        }
        loop {
            if let Err(e) = self.readiness.readable().await {
                return Err(format!("waiting for address changes: {e}"));
            }
            // Nothing left to read clears the readiness (WouldBlock).
            let announced =
                self.readiness.try_io(tokio::io::Interest::READABLE, || match self.watch.take_announced() {
                    Ok(v) if v.is_empty() => Err(std::io::ErrorKind::WouldBlock.into()),
                    other => Ok(other),
                });
            return match announced {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => Err(e.to_string()),
                Ok(Ok(announced)) => {
                    let mut ranges = Vec::new();
                    // Link-local addresses of new links are closed to every job already.
                    let always = byoc_sandbox::net::always_blocked();
                    for a in announced.iter().filter(|a| !always.iter().any(|c| c.contains(a.addr))) {
                        let closed = self.links.blocked_for(a).map_err(|e| e.to_string())?;
                        tracing::info!(
                            address = %a.addr,
                            closed = %closed.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(" "),
                            "A host address appeared: closed to a running job."
                        );
                        ranges.extend(closed);
                    }
                    Ok(ranges)
                }
                // Announcements were lost: close everything there is now.
                Ok(Err(byoc_sandbox::netlink::NetlinkError::Overrun)) => everything(),
                Ok(Err(e)) => Err(e.to_string()),
            };
        }
    }

    /// Keep the job's namespace closed to the host; returns only when that fails.
    async fn follow(mut self, job_ns: Arc<std::sync::Mutex<byoc_sandbox::netlink::Netlink>>) -> String {
        loop {
            let ranges = match self.next_ranges().await {
                Ok(r) => r,
                Err(e) => return e,
            };
            let mut nl = job_ns.lock().unwrap_or_else(|e| e.into_inner());
            for range in ranges {
                match nl.prohibit(range, byoc_sandbox::net::PROHIBIT_PRIORITY) {
                    Err(e) if e.errno() != Some(nix::Error::EEXIST) => return e.to_string(),
                    _ => {}
                }
            }
        }
    }
}

/// The runner's services inside one job's namespace, running until dropped.
pub struct Services {
    task: tokio::task::JoinHandle<()>,
    arrived: tokio::sync::watch::Receiver<Option<Result<(), NetworkUnavailable>>>,
    lost: Arc<std::sync::Mutex<Option<String>>>,
}

impl Drop for Services {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Services {
    /// Start serving as soon as the sandbox hands over its sockets on `channel`. If
    /// the boundary cannot be kept (a new host address could not be closed), `stop`
    /// is cancelled and [`Services::lost`] says why.
    pub fn start(
        channel: OwnedFd,
        settings: &NetworkSettings,
        credentials: Option<Arc<dyn CredentialEndpoint>>,
        follower: HostFollower,
        stop: tokio_util::sync::CancellationToken,
    ) -> Services {
        let (tx, arrived) = tokio::sync::watch::channel(None);
        let settings = settings.clone();
        let lost = Arc::new(std::sync::Mutex::new(None));
        let lost_by_task = lost.clone();
        let task = tokio::spawn(async move {
            let handover = match receive(channel).await {
                Ok(Some(h)) => h,
                Ok(None) => {
                    let _ = tx.send(Some(Err(NetworkUnavailable(
                        "the sandbox ended before its network was up".into(),
                    ))));
                    return;
                }
                Err(e) => {
                    let _ =
                        tx.send(Some(Err(NetworkUnavailable(format!("receiving the job's sockets: {e}")))));
                    return;
                }
            };
            let upstreams = upstreams(&settings);
            let allowed_names = settings.allow.as_ref().map(|a| a.hosts.clone());
            let job_ns =
                Arc::new(std::sync::Mutex::new(byoc_sandbox::netlink::Netlink::from_fd(handover.netlink)));
            let router = allowed_names
                .is_some()
                .then(|| crate::dns::Router::new(job_ns.clone(), handover.tap, settings.ipv6));
            let forwarder = Arc::new(crate::dns::Forwarder { upstreams, allowed_names, router });
            let _ = tx.send(Some(Ok(())));
            let creds = async {
                let (Some(listener), Some(endpoint)) = (handover.credentials, credentials) else {
                    return std::future::pending().await;
                };
                serve_bounded(
                    listener,
                    MAX_CREDENTIAL_CONNECTIONS,
                    CREDENTIAL_CONNECTION_LIFETIME,
                    |stream| endpoint.serve(stream),
                )
                .await
            };
            let boundary = async {
                let why = follower.follow(job_ns).await;
                tracing::error!(error = %why, "The job's network boundary could not follow the host; stopping the job: {why}.");
                *lost_by_task.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                stop.cancel();
            };
            tokio::join!(
                forwarder.clone().serve_udp(handover.dns_udp),
                forwarder.serve_tcp(handover.dns_tcp),
                creds,
                boundary
            );
        });
        Services { task, arrived, lost }
    }

    /// Why the job's boundary stopped following the host (the job was stopped).
    pub fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the sandbox handed over its sockets (`None`: not yet, or never).
    pub fn outcome(&self) -> Option<Result<(), NetworkUnavailable>> {
        self.arrived.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncReadExt as _;

    use super::serve_bounded;

    /// Whether the server closed `stream` (EOF or reset) within a few seconds.
    async fn closed(stream: &mut tokio::net::TcpStream) -> bool {
        let mut b = [0u8; 1];
        matches!(tokio::time::timeout(Duration::from_secs(5), stream.read(&mut b)).await, Ok(Ok(0) | Err(_)))
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_refused_and_none_outlives_its_lifetime() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (held_tx, mut held_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let server = tokio::spawn(serve_bounded(listener, 2, Duration::from_millis(300), move |stream| {
            let held = held_tx.clone();
            async move {
                let _stream = stream;
                let _ = held.send(());
                // A client that never finishes: only the lifetime ends it.
                std::future::pending::<()>().await;
            }
        }));
        let mut first = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut second = tokio::net::TcpStream::connect(addr).await.expect("connect");
        held_rx.recv().await.expect("first served");
        held_rx.recv().await.expect("second served");
        // Past the cap: closed at once, never served.
        let mut third = tokio::net::TcpStream::connect(addr).await.expect("connect");
        assert!(closed(&mut third).await, "the third connection was refused");
        assert!(held_rx.try_recv().is_err(), "and never served");
        // The held ones end with their lifetime; then new ones are served again.
        assert!(closed(&mut first).await && closed(&mut second).await);
        let _fourth = tokio::net::TcpStream::connect(addr).await.expect("connect");
        held_rx.recv().await.expect("served once the others ended");
        server.abort();
    }
}
