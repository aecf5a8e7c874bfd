//! `byoc-runner sandbox-probe`: run inside a sandbox, it reports what a job can see and
//! do. Every check is phrased so that `held: true` means the sandbox held.

use std::path::Path;

use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub held: bool,
    pub detail: String,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
    pub uid: u32,
    pub hostname: String,
    pub env_names: Vec<String>,
    pub pid: u32,
}

pub struct ProbeArgs<'a> {
    pub runner_pid: i32,
    pub state_dir: &'a Path,
    pub identity_key: &'a Path,
    pub config_dir: &'a Path,
    /// More `host:port` addresses the job must not reach (the runner's control plane,
    /// a service on the host's loopback), besides [`UNREACHABLE`].
    pub unreachable: &'a [String],
}

/// Addresses no job may reach: IMDS over IPv4 and IPv6, the ECS and EKS Pod Identity
/// credential addresses.
pub const UNREACHABLE: &[&str] =
    &["169.254.169.254:80", "[fd00:ec2::254]:80", "169.254.170.2:80", "169.254.170.23:80"];

/// Try to connect; `held` when the connection could not be made.
fn unreachable(target: &str) -> (bool, String) {
    use std::net::ToSocketAddrs as _;
    let addrs: Vec<std::net::SocketAddr> = match target.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(e) => return (true, format!("does not resolve: {e}")),
    };
    for addr in &addrs {
        if std::net::TcpStream::connect_timeout(addr, std::time::Duration::from_secs(3)).is_ok() {
            return (false, format!("connected to {addr}"));
        }
    }
    let errs: Vec<String> = addrs
        .iter()
        .map(|a| match std::net::TcpStream::connect_timeout(a, std::time::Duration::from_secs(3)) {
            Ok(_) => format!("{a}: connected"),
            Err(e) => format!("{a}: {e}"),
        })
        .collect();
    (true, errs.join("; "))
}

fn refused<T, E: std::fmt::Display>(r: Result<T, E>) -> (bool, String) {
    match r {
        Ok(_) => (false, "allowed".into()),
        Err(e) => (true, format!("refused: {e}")),
    }
}

fn status_field(name: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")).map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

struct Checks(Vec<Check>);

impl Checks {
    fn add(&mut self, name: &str, (held, detail): (bool, String)) {
        self.0.push(Check { name: name.into(), held, detail });
    }
}

/// The runner's state, key, config and process are out of the job's reach.
fn runner_out_of_reach(c: &mut Checks, args: &ProbeArgs<'_>) {
    use nix::unistd::Pid;
    // Hidden: absent, or masked (an empty, inaccessible directory).
    let hidden = |dir: &Path| match std::fs::read_dir(dir) {
        Ok(mut d) => match d.next() {
            None => (true, "masked (empty)".into()),
            Some(_) => (false, "listable with entries".into()),
        },
        Err(e) => (true, format!("not listable: {e}")),
    };
    c.add("state_dir_hidden", hidden(args.state_dir));
    c.add("identity_key_unreadable", refused(std::fs::read(args.identity_key)));
    c.add("config_dir_hidden", hidden(args.config_dir));
    let runner = Pid::from_raw(args.runner_pid);
    c.add(
        "runner_process_invisible",
        if Path::new(&format!("/proc/{}", args.runner_pid)).exists() {
            (false, "visible in /proc".into())
        } else {
            (true, "not in /proc".into())
        },
    );
    c.add("runner_unsignalable", refused(nix::sys::signal::kill(runner, None)));
    c.add("ptrace_attach_refused", refused(nix::sys::ptrace::attach(runner)));
    c.add("ptrace_traceme_refused", refused(nix::sys::ptrace::traceme()));
}

/// Nothing to write outside the job's directories, no capability, no way to gain one.
fn no_privilege(c: &mut Checks) {
    for p in ["/probe", "/usr/probe", "/etc/probe", "/bin/probe", "/var/probe", "/opt/probe"] {
        c.add(&format!("write_refused:{p}"), refused(std::fs::write(p, b"x")));
    }
    for p in ["/work/probe", "/tmp/probe"] {
        let r = std::fs::write(p, b"x");
        c.add(&format!("write_allowed:{p}"), (r.is_ok(), format!("{r:?}")));
    }
    c.add(
        "mount_refused",
        refused(nix::mount::mount(
            None::<&str>,
            "/tmp",
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )),
    );
    c.add("unshare_refused", refused(nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER)));
    c.add("setuid_refused", refused(nix::unistd::setuid(nix::unistd::Uid::from_raw(12345))));
    c.add("module_load_refused", refused(nix::kmod::init_module(&[], c"")));
    c.add("chroot_refused", refused(nix::unistd::chroot("/tmp")));
    let cap_eff = status_field("CapEff");
    c.add(
        "no_effective_capabilities",
        (cap_eff.trim_start_matches('0').is_empty(), format!("CapEff {cap_eff}")),
    );
    let cap_bnd = status_field("CapBnd");
    c.add("empty_bounding_set", (cap_bnd.trim_start_matches('0').is_empty(), format!("CapBnd {cap_bnd}")));
    let nnp = status_field("NoNewPrivs");
    c.add("no_new_privs", (nnp == "1", format!("NoNewPrivs {nnp}")));
    let seccomp = status_field("Seccomp");
    c.add("seccomp_filter", (seccomp == "2", format!("Seccomp {seccomp}")));
    // EPERM (the job sandbox's filter) or a kill (Docker's profile) is a filter's
    // refusal; ENOSYS would be a kernel without x32 that no filter stopped, which the
    // check must not take for one.
    let x32 = crate::sys::x32_getpid();
    let x32_held = match x32 {
        Ok(crate::sys::X32Answer::Errno(libc::EPERM) | crate::sys::X32Answer::Killed(_)) => true,
        Ok(crate::sys::X32Answer::Errno(libc::ENOSYS)) => !cfg!(target_arch = "x86_64"),
        _ => false,
    };
    c.add("x32_abi_refused", (x32_held, format!("{x32:?}")));
    // Taking a descriptor of another process (here its own, which the kernel would
    // allow to anyone of the same uid): refused by the filter.
    let getfd = crate::sys::pidfd_getfd_own_stdout();
    // A kernel without the call (ENOSYS) cannot be asked it either.
    c.add("pidfd_getfd_refused", (getfd == libc::EPERM || getfd == libc::ENOSYS, format!("errno {getfd}")));
}

/// The blocked addresses are unreachable and the job cannot change its routes or
/// craft packets.
fn network_closed(c: &mut Checks, args: &ProbeArgs<'_>) {
    for target in UNREACHABLE.iter().map(|s| s.to_string()).chain(args.unreachable.iter().cloned()) {
        c.add(&format!("unreachable:{target}"), unreachable(&target));
    }
    c.add(
        "routes_unchangeable",
        refused(crate::netlink::Netlink::open().map_err(|e| e.to_string()).and_then(|mut nl| {
            nl.prohibit(
                "192.0.2.0/24"
                    .parse()
                    .unwrap_or(crate::net::Cidr::host(std::net::Ipv4Addr::UNSPECIFIED.into())),
                99,
            )
            .map_err(|e| e.to_string())
        })),
    );
    c.add(
        "raw_socket_refused",
        refused(nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Raw,
            nix::sys::socket::SockFlag::empty(),
            nix::sys::socket::SockProtocol::Icmp,
        )),
    );
}

pub fn run(args: &ProbeArgs<'_>) -> Report {
    let mut c = Checks(Vec::new());
    runner_out_of_reach(&mut c, args);
    no_privilege(&mut c);
    network_closed(&mut c, args);
    let checks = c.0;
    let mut env_names: Vec<String> =
        std::env::vars_os().map(|(k, _)| k.to_string_lossy().into_owned()).collect();
    env_names.sort();
    Report {
        checks,
        uid: nix::unistd::getuid().as_raw(),
        hostname: nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default(),
        env_names,
        pid: std::process::id(),
    }
}
