//! A real VM for the suites that must run where customers run the runner: Debian 12 with
//! systemd as PID 1, cgroup v2 and cloud-init, under qemu's software emulation (KVM is not
//! usable on the build machines).
//!
//! - The base image comes from `tests/vm/build-image` (debootstrap, cached outside the
//!   clone by a hash of its recipe); each VM writes to its own qcow2 overlay.
//! - cloud-init reads a NoCloud seed: the test's user-data unchanged, and vendor-data for
//!   what stands in for the cloud (trusted CA, endpoints).
//! - Networking is qemu's user mode with `restrict=on`: the guest reaches nothing but the
//!   forwards the test declares, each relayed to a server on the host's loopback by the
//!   suite's own binary (`relay_if_asked`). The guest's network is 169.254.0.0/16 so
//!   that 169.254.169.254 (the instance metadata address) can be one of those forwards.
//! - The suite reaches into the guest only through the qemu guest agent (a virtio serial
//!   port): `exec` runs a command and returns its exit code and output.
//! - The serial console is captured to a file; a failing suite prints its tail.
//!
//! Nothing here skips: a missing qemu, image or firmware is an error naming the fix.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;

/// The guest's user-mode network (so the metadata address can be forwarded).
pub const GUEST_NET: &str = "169.254.0.0/16";
/// The metadata service's address, as on EC2.
pub const IMDS_ADDR: &str = "169.254.169.254";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where `scripts/setup` unpacks qemu (see there for why it is not installed).
/// qemu's accelerator: `BYOC_VM_ACCEL` (`kvm`, `tcg,thread=multi`), or software
/// emulation.
fn accel() -> String {
    std::env::var("BYOC_VM_ACCEL").unwrap_or_else(|_| "tcg,thread=multi".into())
}

pub fn qemu_dir() -> PathBuf {
    std::env::var_os("BYOC_QEMU_DIR")
        .map_or_else(|| PathBuf::from("/opt/byoc-runner-test/qemu"), PathBuf::from)
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{0}")]
    Setup(String),
    #[error("guest agent: {0}")]
    Agent(String),
    #[error("timed out after {0:?}: {1}")]
    Timeout(Duration, String),
}

/// The base image's files.
#[derive(Debug, Clone)]
pub struct VmImage {
    pub dir: PathBuf,
}

impl VmImage {
    /// Build (or find in the cache) the base image.
    pub fn get() -> Result<VmImage, VmError> {
        let out = Command::new(repo().join("tests/vm/build-image"))
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| VmError::Setup(format!("tests/vm/build-image: {e}")))?;
        if !out.status.success() {
            return Err(VmError::Setup(format!("tests/vm/build-image failed ({})", out.status)));
        }
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        for f in ["base.raw", "vmlinuz", "initrd.img"] {
            if !dir.join(f).is_file() {
                return Err(VmError::Setup(format!("{} has no {f}", dir.display())));
            }
        }
        Ok(VmImage { dir })
    }
}

/// One forward from the guest to a host loopback server.
#[derive(Debug, Clone)]
pub struct Forward {
    /// An address inside [`GUEST_NET`] (not .2 or .3: qemu's gateway and DNS).
    pub guest_addr: String,
    pub guest_port: u16,
    pub host_port: u16,
}

#[derive(Debug, Clone, Default)]
pub struct VmOptions {
    pub user_data: String,
    pub vendor_data: Option<String>,
    pub forwards: Vec<Forward>,
    pub memory_mib: Option<u32>,
}

/// What a command printed and how it ended.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    pub code: i64,
    pub stdout: String,
    pub stderr: String,
}

impl ExecOutput {
    pub fn ok(&self) -> bool {
        self.code == 0
    }
}

pub struct Vm {
    dir: tempfile::TempDir,
    child: Option<Child>,
    sync_id: u64,
}

impl Vm {
    /// Start a VM on a fresh overlay of `image`. Returns once qemu runs; the guest boots
    /// on (wait with [`Vm::wait_agent`]).
    pub fn boot(image: &VmImage, opts: &VmOptions) -> Result<Vm, VmError> {
        let dir = tempfile::Builder::new()
            .prefix("byoc-vm.")
            .tempdir()
            .map_err(|e| VmError::Setup(format!("temp dir: {e}")))?;
        let d = dir.path();
        let setup = |what: &str, cmd: &mut Command| -> Result<(), VmError> {
            let out = cmd.output().map_err(|e| VmError::Setup(format!("{what}: {e}")))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(VmError::Setup(format!("{what}: {}", String::from_utf8_lossy(&out.stderr).trim())))
            }
        };
        setup(
            "qemu-img create (qemu-utils)",
            Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
                .arg(image.dir.join("base.raw"))
                .arg(d.join("disk.qcow2")),
        )?;
        std::fs::write(d.join("user-data"), &opts.user_data).map_err(|e| VmError::Setup(e.to_string()))?;
        let instance = format!("instance-id: i-{:016x}\nlocal-hostname: byoc-vm\n", rand::random::<u64>());
        std::fs::write(d.join("meta-data"), instance).map_err(|e| VmError::Setup(e.to_string()))?;
        let mut seed = Command::new("cloud-localds");
        if let Some(v) = &opts.vendor_data {
            std::fs::write(d.join("vendor-data"), v).map_err(|e| VmError::Setup(e.to_string()))?;
            seed.arg("-V").arg(d.join("vendor-data"));
        }
        setup(
            "cloud-localds (cloud-image-utils)",
            seed.arg(d.join("seed.img")).arg(d.join("user-data")).arg(d.join("meta-data")),
        )?;

        let q = qemu_dir();
        let qemu = q.join("usr/bin/qemu-system-x86_64");
        if !qemu.is_file() {
            return Err(VmError::Setup(format!("{} not found: run scripts/setup", qemu.display())));
        }
        let relay =
            std::env::current_exe().map_err(|e| VmError::Setup(format!("the suite's own binary: {e}")))?;
        let mut netdev = format!("user,id=n0,net={GUEST_NET},restrict=on");
        for f in &opts.forwards {
            netdev.push_str(&format!(
                ",guestfwd=tcp:{}:{}-cmd:{} {RELAY_ARG} 127.0.0.1 {}",
                f.guest_addr,
                f.guest_port,
                relay.display(),
                f.host_port
            ));
        }
        // qemu is killed when the thread that started it ends, however the suite ends
        // (util-linux's setpriv sets the parent-death signal, then execs qemu).
        let mut cmd = Command::new("setpriv");
        cmd.args(["--pdeathsig", "KILL", "--"]).arg(&qemu);
        for fw in ["usr/share/qemu", "usr/share/seabios", "usr/lib/ipxe/qemu"] {
            cmd.arg("-L").arg(q.join(fw));
        }
        let accel = accel();
        let cpu = if accel.starts_with("kvm") { "host" } else { "max" };
        cmd.args(["-accel", &accel, "-cpu", cpu, "-smp", "2", "-m"])
            .arg(opts.memory_mib.unwrap_or(1536).to_string())
            .args(["-display", "none", "-no-user-config", "-nodefaults"])
            .arg("-serial")
            .arg(format!("file:{}", d.join("serial.log").display()))
            .arg("-monitor")
            .arg(format!("unix:{},server=on,wait=off", d.join("monitor.sock").display()))
            .arg("-kernel")
            .arg(image.dir.join("vmlinuz"))
            .arg("-initrd")
            .arg(image.dir.join("initrd.img"))
            .args(["-append", "root=/dev/vda rw console=ttyS0 quiet systemd.show_status=false"])
            .arg("-drive")
            .arg(format!("file={},if=virtio,format=qcow2", d.join("disk.qcow2").display()))
            .arg("-drive")
            .arg(format!("file={},if=virtio,format=raw,readonly=on", d.join("seed.img").display()))
            .arg("-netdev")
            .arg(netdev)
            .args(["-device", "virtio-net-pci,netdev=n0,romfile="])
            .args(["-device", "virtio-serial"])
            .arg("-chardev")
            .arg(format!("socket,path={},server=on,wait=off,id=qga0", d.join("qga.sock").display()))
            .args(["-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(
                std::fs::File::create(d.join("qemu.log")).map_err(|e| VmError::Setup(e.to_string()))?,
            ))
            .stderr(Stdio::from(
                std::fs::File::create(d.join("qemu.err")).map_err(|e| VmError::Setup(e.to_string()))?,
            ));
        let child = cmd.spawn().map_err(|e| VmError::Setup(format!("{}: {e}", qemu.display())))?;
        let mut vm = Vm { dir, child: Some(child), sync_id: 0 };
        // The sockets exist once qemu has parsed its options.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !vm.dir.path().join("qga.sock").exists() {
            if let Some(status) = vm.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                return Err(VmError::Setup(format!("qemu exited ({status}): {}", vm.qemu_stderr())));
            }
            if Instant::now() > deadline {
                return Err(VmError::Setup(format!("qemu did not start: {}", vm.qemu_stderr())));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(vm)
    }

    fn qemu_stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("qemu.err")).unwrap_or_default()
    }

    /// The serial console so far.
    pub fn serial(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(self.dir.path().join("serial.log")).unwrap_or_default())
            .into_owned()
    }

    /// The last `lines` lines of the serial console, for failure messages.
    pub fn serial_tail(&self, lines: usize) -> String {
        let s = self.serial();
        let all: Vec<&str> = s.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn running(&mut self) -> Result<(), VmError> {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(None)) => Ok(()),
            Some(Ok(Some(status))) => {
                Err(VmError::Setup(format!("qemu exited ({status}): {}", self.qemu_stderr())))
            }
            Some(Err(e)) => Err(VmError::Setup(format!("qemu: {e}"))),
            None => Err(VmError::Setup("qemu is not running".into())),
        }
    }

    /// One guest agent request and its `return` value. A fresh connection each time,
    /// synchronised with `guest-sync` so that answers to abandoned requests (an agent
    /// that was not up yet, a rebooting guest) are skipped.
    fn agent(&mut self, request: serde_json::Value, timeout: Duration) -> Result<serde_json::Value, VmError> {
        self.running()?;
        self.sync_id += 1;
        let id = u64::from(std::process::id()) * 1_000_000 + self.sync_id;
        let mut s = UnixStream::connect(self.dir.path().join("qga.sock"))
            .map_err(|e| VmError::Agent(format!("connecting: {e}")))?;
        s.set_read_timeout(Some(timeout)).map_err(|e| VmError::Agent(e.to_string()))?;
        let sync = serde_json::json!({"execute": "guest-sync", "arguments": {"id": id}});
        writeln!(s, "{sync}").map_err(|e| VmError::Agent(format!("writing: {e}")))?;
        let mut r = BufReader::new(s.try_clone().map_err(|e| VmError::Agent(e.to_string()))?);
        let read_line = |r: &mut BufReader<UnixStream>| -> Result<serde_json::Value, VmError> {
            let mut line = String::new();
            match r.read_line(&mut line) {
                Ok(0) => Err(VmError::Agent("connection closed".into())),
                Ok(_) => Ok(serde_json::from_str(line.trim_start_matches('\u{ff}'))
                    .unwrap_or(serde_json::Value::Null)),
                Err(e) => Err(VmError::Agent(format!("reading: {e}"))),
            }
        };
        loop {
            if read_line(&mut r)?["return"].as_u64() == Some(id) {
                break;
            }
        }
        writeln!(s, "{request}").map_err(|e| VmError::Agent(format!("writing: {e}")))?;
        let answer = read_line(&mut r)?;
        if let Some(e) = answer.get("error") {
            return Err(VmError::Agent(format!("{request}: {e}")));
        }
        Ok(answer["return"].clone())
    }

    /// Wait until the guest agent answers (the guest has booted far enough).
    pub fn wait_agent(&mut self, timeout: Duration) -> Result<(), VmError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.agent(serde_json::json!({"execute": "guest-ping"}), Duration::from_secs(5)) {
                Ok(_) => return Ok(()),
                Err(VmError::Setup(e)) => return Err(VmError::Setup(e)),
                Err(e) if Instant::now() > deadline => {
                    return Err(VmError::Timeout(timeout, format!("the guest agent never answered ({e})")));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(500)),
            }
        }
    }

    /// Run `script` with /bin/sh in the guest, as root; its exit code and output.
    pub fn exec(&mut self, script: &str, timeout: Duration) -> Result<ExecOutput, VmError> {
        let started = self.agent(
            serde_json::json!({"execute": "guest-exec", "arguments": {
                "path": "/bin/sh", "arg": ["-c", script], "capture-output": true}}),
            Duration::from_secs(30),
        )?;
        let pid = started["pid"]
            .as_i64()
            .ok_or_else(|| VmError::Agent(format!("guest-exec answered {started}")))?;
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.agent(
                serde_json::json!({"execute": "guest-exec-status", "arguments": {"pid": pid}}),
                Duration::from_secs(30),
            )?;
            if st["exited"].as_bool() == Some(true) {
                let text = |k: &str| {
                    st[k]
                        .as_str()
                        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default()
                };
                let code =
                    st["exitcode"].as_i64().or_else(|| st["signal"].as_i64().map(|s| 128 + s)).unwrap_or(-1);
                return Ok(ExecOutput { code, stdout: text("out-data"), stderr: text("err-data") });
            }
            if Instant::now() > deadline {
                return Err(VmError::Timeout(timeout, format!("`{script}` in the guest")));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Run `script` and insist on success; its stdout.
    pub fn sh(&mut self, script: &str) -> String {
        match self.exec(script, Duration::from_secs(300)) {
            Ok(o) if o.ok() => o.stdout,
            Ok(o) => panic!("`{script}` in the guest exited {}:\n{}\n{}", o.code, o.stdout, o.stderr),
            Err(e) => panic!("`{script}` in the guest: {e}\nserial console:\n{}", self.serial_tail(60)),
        }
    }

    /// Poll `script` until it succeeds; its last output either way.
    pub fn wait_for(&mut self, script: &str, timeout: Duration) -> Result<ExecOutput, VmError> {
        let deadline = Instant::now() + timeout;
        loop {
            let o = self.exec(script, timeout)?;
            if o.ok() {
                return Ok(o);
            }
            if Instant::now() > deadline {
                return Err(VmError::Timeout(timeout, format!("`{script}`: {}{}", o.stdout, o.stderr)));
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Ask the guest to reboot and wait until its agent is back.
    pub fn reboot(&mut self, timeout: Duration) -> Result<(), VmError> {
        let boot_id = self.sh("cat /proc/sys/kernel/random/boot_id");
        // The agent may die before it answers: the command's own status is not awaited.
        let _ = self.agent(
            serde_json::json!({"execute": "guest-exec", "arguments": {"path": "/bin/systemctl", "arg": ["reboot"]}}),
            Duration::from_secs(30),
        );
        self.wait_new_boot(&boot_id, timeout, "reboot")
    }

    /// A hard reset, as a power loss: qemu's `system_reset` (nothing is shut down or
    /// flushed by the guest), then wait until its agent is back.
    pub fn reset(&mut self, timeout: Duration) -> Result<(), VmError> {
        let boot_id = self.sh("cat /proc/sys/kernel/random/boot_id");
        let mut monitor = UnixStream::connect(self.dir.path().join("monitor.sock"))
            .map_err(|e| VmError::Setup(format!("the qemu monitor: {e}")))?;
        let _ = writeln!(monitor, "system_reset");
        self.wait_new_boot(&boot_id, timeout, "reset")
    }

    /// Until the guest's agent answers from a boot other than `boot_id`.
    fn wait_new_boot(&mut self, boot_id: &str, timeout: Duration, what: &str) -> Result<(), VmError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(o) = self.exec("cat /proc/sys/kernel/random/boot_id", Duration::from_secs(10))
                && o.ok()
                && o.stdout != boot_id
            {
                return Ok(());
            }
            self.running()?;
            if Instant::now() > deadline {
                return Err(VmError::Timeout(timeout, format!("the guest did not come back from a {what}")));
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Pull the plug: qemu is killed, nothing in the guest gets to stop or report.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A clean power-off (the guest agent asks systemd; ACPI through the monitor if the
    /// agent does not answer); qemu is killed if the guest has not stopped by `timeout`.
    pub fn power_off(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        // guest-shutdown never answers on success: a short wait, then ACPI as well.
        let _ = self.agent(
            serde_json::json!({"execute": "guest-shutdown", "arguments": {"mode": "powerdown"}}),
            Duration::from_secs(3),
        );
        if let Ok(mut m) = UnixStream::connect(self.dir.path().join("monitor.sock")) {
            let _ = writeln!(m, "system_powerdown");
        }
        let mut child = self.child.take()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The argument with which qemu starts the suite's own binary as the relay for one
/// forwarded connection (see [`relay_if_asked`]).
pub const RELAY_ARG: &str = "--byoc-vm-relay";

/// Call first in a VM suite's `main`: when qemu started this binary for a forwarded
/// connection (`RELAY_ARG HOST PORT`), relay it and exit. The suite's own binary is the
/// relay so that nothing else has to be built (cargo builds no other crate's binaries
/// for a test).
pub fn relay_if_asked() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some(RELAY_ARG) {
        return;
    }
    let [_, _, host, port] = args.as_slice() else {
        eprintln!("usage: {RELAY_ARG} HOST PORT");
        std::process::exit(64);
    };
    std::process::exit(match relay(host, port) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("vm relay to {host}:{port}: {e}");
            1
        }
    });
}

/// The connection is this process's stdin and stdout; relay it to HOST:PORT, half-closes
/// included.
fn relay(host: &str, port: &str) -> std::io::Result<()> {
    use std::io::Read as _;
    use std::net::{Shutdown, TcpStream};
    let up = TcpStream::connect(format!("{host}:{port}"))?;
    let mut up_read = up.try_clone()?;
    let to_guest = std::thread::spawn(move || {
        let mut out = std::io::stdout().lock();
        let mut buf = [0u8; 64 * 1024];
        while let Ok(n) = up_read.read(&mut buf) {
            if n == 0 || out.write_all(&buf[..n]).is_err() || out.flush().is_err() {
                break;
            }
        }
    });
    let mut up_write = up;
    let mut input = std::io::stdin().lock();
    let mut buf = [0u8; 64 * 1024];
    while let Ok(n) = input.read(&mut buf) {
        if n == 0 || up_write.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = up_write.shutdown(Shutdown::Write);
    let _ = to_guest.join();
    Ok(())
}

/// Serve the files of `dir` and of its direct subdirectories over HTTPS on a loopback
/// port, until the task is aborted: the release URLs a stack's user-data downloads from.
pub async fn serve_files_tls(
    dir: PathBuf,
    tls: std::sync::Arc<rustls::ServerConfig>,
) -> (u16, tokio::task::JoinHandle<()>) {
    use axum::extract::Path as UrlPath;
    use axum::http::StatusCode;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binding a loopback port");
    let port = listener.local_addr().expect("local addr").port();
    let safe = |part: &str| !part.is_empty() && !part.contains('/') && !part.starts_with('.');
    let top = dir.clone();
    let app = axum::Router::new()
        .route(
            "/{file}",
            axum::routing::get(move |UrlPath(file): UrlPath<String>| {
                let dir = top.clone();
                async move {
                    if !safe(&file) {
                        return Err(StatusCode::NOT_FOUND);
                    }
                    std::fs::read(dir.join(file)).map_err(|_| StatusCode::NOT_FOUND)
                }
            }),
        )
        .route(
            "/{sub}/{file}",
            axum::routing::get(move |UrlPath((sub, file)): UrlPath<(String, String)>| {
                let dir = dir.clone();
                async move {
                    if !safe(&sub) || !safe(&file) {
                        return Err(StatusCode::NOT_FOUND);
                    }
                    std::fs::read(dir.join(sub).join(file)).map_err(|_| StatusCode::NOT_FOUND)
                }
            }),
        );
    let task = tokio::spawn(crate::server::serve(listener, app, Some(tokio_rustls::TlsAcceptor::from(tls))));
    (port, task)
}
