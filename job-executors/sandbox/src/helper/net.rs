//! The job's network boundary, from both sides: the helper starts the user-mode stack
//! (slirp4netns) for init's namespace; init, inside it, sets the routes and the
//! `prohibit` rules the job cannot change and hands the runner its sockets.

use std::io::Read as _;
use std::os::fd::{AsRawFd as _, OwnedFd};

use nix::unistd::Pid;

use super::error::{SetupError, StepExt as _};
use crate::net::{Cidr, PROHIBIT_PRIORITY};
use crate::netlink::Netlink;
use crate::spec::{UserModeNet, handover};

/// This job's blocked ranges: the fixed list, the customer's, the host's own addresses
/// and bridged subnets (the runner adds those that appear later, while the job runs).
pub(super) fn blocked_ranges(net: &UserModeNet) -> Result<Vec<Cidr>, SetupError> {
    let mut all = crate::net::always_blocked();
    all.extend(net.blocked.iter().copied());
    all.extend(
        crate::net::host_blocked()
            .map_err(|e| SetupError::Network(Box::new(SetupError::Refused(e.to_string()))))?,
    );
    all.sort();
    all.dedup();
    Ok(all)
}

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// The running user-mode stack; dropping it closes its exit descriptor, and it exits.
pub(super) struct UserModeStack {
    _exit: OwnedFd,
}

/// Start slirp4netns for `child`'s namespaces and wait until its interface is up.
pub(super) fn start_user_mode_stack(
    child: Pid,
    net: &UserModeNet,
    born_in: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<UserModeStack, SetupError> {
    use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
    use std::os::fd::AsFd as _;
    let (ready_r, ready_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).step("pipe")?;
    let (exit_r, exit_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).step("pipe")?;
    // Only these two ends are the stack's to inherit.
    for fd in [&ready_w, &exit_r] {
        fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty())).step("fcntl")?;
    }
    // Its messages go to memory, shown only if it fails: never into the job's log.
    let log = nix::sys::memfd::memfd_create(c"slirp4netns", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .step("memfd_create")?;
    let log_for_child = log.try_clone().step("dup")?;
    let mut args: Vec<String> =
        ["--configure", "--disable-host-loopback", "--disable-dns", "--enable-sandbox", "--enable-seccomp"]
            .map(String::from)
            .into();
    args.push(format!("--mtu={}", net.mtu));
    args.push(format!("--ready-fd={}", ready_w.as_raw_fd()));
    args.push(format!("--exit-fd={}", exit_r.as_raw_fd()));
    if net.ipv6 {
        args.push("--enable-ipv6".into());
    }
    args.push(child.as_raw().to_string());
    args.push(crate::net::TAP_NAME.into());
    // The child is reaped by the helper's waitpid loop; its handle is not needed.
    let spawned = match born_in {
        Some(cgroup) => spawn_into_cgroup(&net.slirp4netns, &args, log_for_child, cgroup),
        None => std::process::Command::new(&net.slirp4netns)
            .env_clear()
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::from(log_for_child))
            .spawn()
            .map(drop),
    }
    .step(format!("starting {}", net.slirp4netns.display()));
    drop(ready_w);
    drop(exit_r);
    spawned?;
    let mut fds = [nix::poll::PollFd::new(ready_r.as_fd(), nix::poll::PollFlags::POLLIN)];
    let timeout = nix::poll::PollTimeout::try_from(net.ready_timeout_ms.min(60_000) as i32)
        .unwrap_or(nix::poll::PollTimeout::MAX);
    let failed = |why: String| {
        let said = stack_messages(&log);
        SetupError::Refused(if said.is_empty() { why } else { format!("{why}: {said}") })
    };
    match nix::poll::poll(&mut fds, timeout) {
        Ok(0) => {
            return Err(failed(format!(
                "{} did not bring the job's network up within {} ms",
                net.slirp4netns.display(),
                net.ready_timeout_ms
            )));
        }
        Ok(_) => {}
        Err(e) => return Err(e).step(format!("waiting for {}", net.slirp4netns.display())),
    }
    let mut b = [0u8; 1];
    match nix::unistd::read(&ready_r, &mut b) {
        Ok(1) if b[0] == b'1' => Ok(UserModeStack { _exit: exit_w }),
        _ => Err(failed(format!("{} exited before the job's network was up", net.slirp4netns.display()))),
    }
}

/// What the stack printed (its last lines), for an error message.
fn stack_messages(log: &OwnedFd) -> String {
    let mut text = String::new();
    let _ = nix::unistd::lseek(log, 0, nix::unistd::Whence::SeekSet);
    let mut file = std::fs::File::from(match log.try_clone() {
        Ok(fd) => fd,
        Err(_) => return text,
    });
    let _ = (&mut file).take(4096).read_to_string(&mut text);
    text.lines()
        .filter(|l| !l.starts_with("WARNING: Support for") && !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// In init, inside the job's namespaces: IPv6, the blocked ranges, the allow-list.
pub(super) fn configure_user_mode(net: &UserModeNet, blocked: &[Cidr]) -> Result<(), SetupError> {
    use crate::net::{GATEWAY_IPV4, GATEWAY_IPV6, JOB_IPV6};
    use std::net::IpAddr;
    let mut nl = Netlink::open().step("netlink")?;
    let tap = nix::net::if_::if_nametoindex(crate::net::TAP_NAME)
        .step(format!("the job's interface {}", crate::net::TAP_NAME))?;
    nl.link_up(1).step("netlink")?;
    if net.ipv6 {
        nl.add_address(tap, IpAddr::V6(JOB_IPV6), 64).step("netlink")?;
        // With an allow-list only the allowed ranges are routed, below.
        if net.allow.is_none() {
            let default = Cidr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 0)
                .ok_or_else(|| SetupError::Refused("the IPv6 default range".into()))?;
            nl.add_route_via(default, IpAddr::V6(GATEWAY_IPV6), tap).step("netlink")?;
        }
    }
    if let Some(allow) = &net.allow {
        // The stack's --configure added the IPv4 default route: it must go.
        nl.delete_default_route(false).step("netlink")?;
        for range in allow {
            if !range.is_ipv4() && !net.ipv6 {
                continue;
            }
            let gateway = if range.is_ipv4() { IpAddr::V4(GATEWAY_IPV4) } else { IpAddr::V6(GATEWAY_IPV6) };
            match nl.add_route_via(*range, gateway, tap) {
                Err(e) if e.errno() != Some(nix::Error::EEXIST) => {
                    return Err(SetupError::Step { step: "netlink".into(), source: Box::new(e) });
                }
                _ => {}
            }
        }
    }
    // With an allow-list, DNS goes through the runner's forwarder only (on the job's
    // loopback): a resolver inside an allowed range would answer any name, and every
    // name asked of it leaves the host.
    if net.allow.is_some() {
        for v6 in [false, true] {
            for proto in [IPPROTO_TCP, IPPROTO_UDP] {
                match nl.prohibit_port(v6, proto, 53, PROHIBIT_PRIORITY) {
                    Err(e) if e.errno() != Some(nix::Error::EEXIST) => {
                        return Err(SetupError::Step { step: "netlink".into(), source: Box::new(e) });
                    }
                    _ => {}
                }
            }
        }
    }
    // Last, so that no route above is looked up against them; they come first in
    // every lookup from now on.
    for range in blocked {
        match nl.prohibit(*range, PROHIBIT_PRIORITY) {
            Err(e) if e.errno() != Some(nix::Error::EEXIST) => {
                return Err(SetupError::Step { step: "netlink".into(), source: Box::new(e) });
            }
            _ => {}
        }
    }
    Ok(())
}

/// In init: make the sockets the runner serves inside the job's namespace and send
/// them over the hand-over channel; the job never holds any of them.
pub(super) fn hand_over(net: &UserModeNet, channel: OwnedFd) -> Result<(), SetupError> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::os::fd::AsRawFd as _;
    let dns = crate::net::JOB_DNS;
    let udp = std::net::UdpSocket::bind(dns).step(format!("binding the DNS forwarder's {dns}/udp"))?;
    let tcp = std::net::TcpListener::bind(dns).step(format!("binding the DNS forwarder's {dns}/tcp"))?;
    let nl = Netlink::open().step("netlink")?;
    let mut names = vec![handover::DNS_UDP, handover::DNS_TCP, handover::NETLINK];
    let mut fds = vec![udp.as_raw_fd(), tcp.as_raw_fd(), nl.fd().as_raw_fd()];
    let creds = if net.credentials {
        let addr = crate::net::JOB_CREDENTIALS;
        let l = std::net::TcpListener::bind(addr).step(format!("binding the credential endpoint {addr}"))?;
        names.push(handover::CREDENTIALS);
        fds.push(l.as_raw_fd());
        Some(l)
    } else {
        None
    };
    // The job's interface travels too: routes for allowed names go through it.
    let tap = nix::net::if_::if_nametoindex(crate::net::TAP_NAME)
        .step(format!("the job's interface {}", crate::net::TAP_NAME))?;
    let text = format!("{};tap={tap}", names.join(","));
    let iov = [std::io::IoSlice::new(text.as_bytes())];
    sendmsg::<()>(
        channel.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .step("handing the job's sockets to the runner")?;
    drop((udp, tcp, nl, creds, channel));
    Ok(())
}

/// Start `program` (no environment, stdin and stdout /dev/null, stderr `stderr`) born in
/// the job's cgroup v2 directory, as `Command::spawn` would outside it. An exec that
/// fails exits 127 before the stack is ready, which its caller reports.
fn spawn_into_cgroup(
    program: &std::path::Path,
    args: &[String],
    stderr: OwnedFd,
    cgroup: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let cstr = |b: &[u8]| {
        std::ffi::CString::new(b).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let path = cstr(program.as_os_str().as_bytes())?;
    let mut argv = vec![path.clone()];
    for a in args {
        argv.push(cstr(a.as_bytes())?);
    }
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null")?;
    match crate::sys::clone_into_cgroup(nix::sched::CloneFlags::empty(), cgroup)? {
        crate::sys::Forked::Parent(_) => Ok(()),
        crate::sys::Forked::Child => {
            // A copy of the single-threaded helper: only descriptor moves, the signal
            // mask the helper blocked (as `Command` resets it) and the exec.
            use nix::sys::signal::{SigSet, SigmaskHow, sigprocmask};
            let moved = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)
                .and_then(|()| nix::unistd::dup2_stdin(&null))
                .and_then(|()| nix::unistd::dup2_stdout(&null))
                .and_then(|()| nix::unistd::dup2_stderr(&stderr));
            if moved.is_ok() {
                let _ = nix::unistd::execve::<_, &std::ffi::CStr>(&path, &argv, &[]);
            }
            crate::sys::exit_now(127)
        }
    }
}
