//! Loopback ports for the servers the harness starts as other processes (moto,
//! docker-registry), which must be told a port before they bind it.
//!
//! Picking a free port and releasing it races with every other test doing the same: CI
//! once saw moto lose its port to a docker-registry started by a parallel test, and the
//! suite then talked to the registry. So a port is never handed out twice in one
//! process, a server counts as started only once its own process holds the listening
//! socket, and one whose child exits (it lost the port) starts again on another.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Child;
use std::sync::Mutex;
use std::time::Duration;

static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// How many times a server that lost its port is started again on another.
pub const START_ATTEMPTS: u32 = 4;

/// A loopback port that is free now and that this process has not handed out before.
pub fn free_port() -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        if claim(port) {
            return port;
        }
    }
}

/// Start a server process on a port from `next_port` and wait until it is ready:
/// `spawn` starts it on the port given (its output going to `log`), `answers` asks it
/// over that port. A child that exits (it lost the port) is started again on another
/// port, up to [`START_ATTEMPTS`] times; one that is not ready within `patience` fails
/// the test.
pub async fn start_child(
    what: &str,
    log: &Path,
    patience: Duration,
    mut next_port: impl FnMut() -> u16,
    mut spawn: impl FnMut(u16) -> Child,
    answers: impl AsyncFn(u16) -> bool,
) -> (u16, Child) {
    for attempt in 1..=START_ATTEMPTS {
        let port = next_port();
        let mut child = spawn(port);
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            if let Some(status) = child.try_wait().expect("child status") {
                let said = std::fs::read_to_string(log).unwrap_or_default();
                assert!(attempt < START_ATTEMPTS, "{what} exited ({status}) on port {port}:\n{said}");
                break;
            }
            // Only our own child's answer counts: another server may hold the port.
            if listens_on(child.id(), port) && answers(port).await {
                return (port, child);
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what} did not start on port {port}");
            }
            // Readiness of another process: nothing to wait on but its port.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// Keep `port` (bound by this process, and to be bound again) out of [`free_port`]'s hands.
pub fn reserve(port: u16) {
    claim(port);
}

/// Whether `port` was not handed out or reserved before (it is now).
fn claim(port: u16) -> bool {
    HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner()).insert(port)
}

/// Whether process `pid` holds the listening IPv4 socket on 127.0.0.1:`port` — that the
/// server answering on the port is the child started for it, not whoever took it first.
pub fn listens_on(pid: u32, port: u16) -> bool {
    // The child's own view: a test may run it in another network namespace.
    let Ok(table) = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")) else { return false };
    // Columns: sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode.
    let listening: BTreeSet<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = cols.get(1)?.rsplit(':').next()?;
            let ours = u16::from_str_radix(local_port, 16).ok()? == port && *cols.get(3)? == "0A";
            let inode = cols.get(9)?;
            ours.then(|| format!("socket:[{inode}]"))
        })
        .collect();
    if listening.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .any(|target| listening.contains(&target.to_string_lossy().into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_handed_out_once() {
        let ports: BTreeSet<u16> = (0..200).map(|_| free_port()).collect();
        assert_eq!(ports.len(), 200);
        assert!(ports.iter().all(|p| !claim(*p)));
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        reserve(port);
        assert!(!claim(port), "a reserved port is never handed out");
    }

    #[test]
    fn the_listener_is_found_in_its_own_process_only() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens_on(std::process::id(), port));
        let mut other = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        assert!(!listens_on(other.id(), port));
        other.kill().unwrap();
        other.wait().unwrap();
        drop(listener);
        assert!(!listens_on(std::process::id(), port));
    }
}
