//! Shared set-up for the end-to-end suites: a reference control plane on a free
//! loopback port and the real `byoc-runner` binary in a temp dir.
#![allow(dead_code, clippy::unwrap_used)]

pub mod roles;

use std::path::Path;
use std::time::Duration;

use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::state::JobState;
use byoc_control_plane::{ControlPlane, ControlPlaneConfig, EnqueueRequest, JobView};

pub const BIN: &str = env!("CARGO_BIN_EXE_byoc-runner");
pub const WAIT: Duration = Duration::from_secs(60);

pub struct Env {
    pub cp: ControlPlane,
    pub runner: RunnerProcess,
    pub dir: tempfile::TempDir,
}

pub async fn start_cp() -> ControlPlane {
    ControlPlane::start(ControlPlaneConfig { offer_timeout: Duration::from_secs(3), ..Default::default() })
        .await
        .expect("control plane starts")
}

/// Options every suite uses: jobs may read the test's directory (files the test
/// writes to steer a job, the sandbox probe).
pub fn test_options(dir: &Path) -> RunnerOptions {
    use std::os::unix::fs::PermissionsExt as _;
    // The sandboxed job runs as an unprivileged uid: let it traverse the test dir.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    RunnerOptions { sandbox_ro_paths: vec![dir.to_path_buf()], ..Default::default() }
}

/// A job log without the lines the sandbox adds (which limits were applied).
/// The job's own output: its log without the runner's `[sandbox]` lines and without
/// the runner's last line saying how the job ended.
pub fn job_output(log: &[u8]) -> String {
    let text = String::from_utf8_lossy(log);
    let mut lines: Vec<&str> = text.lines().filter(|l| !l.starts_with("[sandbox] ")).collect();
    if lines.last().is_some_and(|l| l.starts_with("[runner] job ")) {
        lines.pop();
    }
    lines.into_iter().map(|l| format!("{l}\n")).collect()
}

/// How many times the runner journaled `started` for a job: 1 means it ran once.
pub fn started_count(state_dir: &Path, job_id: &str) -> usize {
    std::fs::read_to_string(state_dir.join("journal.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "started" && v["job_id"] == job_id)
        .count()
}

/// Processes on the host whose command line contains `needle`.
pub fn processes_matching(needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).replace('\0', " ").contains(needle) && alive(*pid)
        })
        .collect()
}

/// Wait (bounded) until no host process matches `needle`; returns the survivors.
pub async fn gone(needle: &str) -> Vec<i32> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = processes_matching(needle);
        if left.is_empty() || tokio::time::Instant::now() > deadline {
            return left;
        }
        // The kernel finishes killing a pid namespace asynchronously; re-check shortly.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Poll until `done` (for what another process writes without telling the test), or
/// fail naming `what` after `WAIT`.
pub async fn eventually(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub async fn env_with(opts: RunnerOptions) -> Env {
    env_in(tempfile::tempdir().expect("tempdir"), opts).await
}

/// A runner whose directory the test prepared (its state dir is `dir/state`).
pub async fn env_in(dir: tempfile::TempDir, opts: RunnerOptions) -> Env {
    let cp = start_cp().await;
    let base = test_options(dir.path());
    let opts = RunnerOptions {
        sandbox_ro_paths: [base.sandbox_ro_paths, opts.sandbox_ro_paths.clone()].concat(),
        ..opts
    };
    let runner = RunnerProcess::start(Path::new(BIN), dir.path(), &cp, &opts).expect("runner starts");
    assert!(wait_polling(&cp, WAIT).await, "runner never polled; log:\n{}", runner.log());
    Env { cp, runner, dir }
}

pub async fn env() -> Env {
    env_with(RunnerOptions::default()).await
}

pub fn script(s: &str) -> EnqueueRequest {
    EnqueueRequest::new("action.script", serde_json::json!({ "script": s }))
}

impl Env {
    pub async fn finished(&self, job_id: &str) -> JobView {
        // A refusal is final: no point waiting out the deadline for a result.
        match self.cp.wait_for(job_id, WAIT, |v| v.result.is_some() || v.state == JobState::Rejected).await {
            Some(v) if v.result.is_some() => v,
            _ => panic!(
                "job {job_id} did not finish: {:?}\nrunner log:\n{}",
                self.cp.job(job_id),
                self.runner.log()
            ),
        }
    }

    pub async fn rejected(&self, job_id: &str) -> JobView {
        match self.cp.wait_for(job_id, WAIT, |v| !v.rejections.is_empty()).await {
            Some(v) => v,
            None => panic!(
                "job {job_id} was not rejected: {:?}\nrunner log:\n{}",
                self.cp.job(job_id),
                self.runner.log()
            ),
        }
    }

    pub async fn state(&self, job_id: &str, state: JobState) -> JobView {
        match self.cp.wait_for(job_id, WAIT, |v| v.state == state).await {
            Some(v) => v,
            None => panic!(
                "job {job_id} never reached {state:?}: {:?}\nrunner log:\n{}",
                self.cp.job(job_id),
                self.runner.log()
            ),
        }
    }

    /// The job's own output as uploaded: its log without the runner's `[sandbox]` lines.
    pub fn output(&self, job_id: &str) -> String {
        job_output(&self.cp.log(job_id).unwrap_or_default())
    }

    /// Wait until the job's uploaded log contains `needle` (woken by each upload).
    pub async fn log_contains(&self, job_id: &str, needle: &str) {
        let found = self
            .cp
            .wait_until(WAIT, |cp| {
                cp.log(job_id).is_some_and(|l| String::from_utf8_lossy(&l).contains(needle))
            })
            .await;
        assert!(found, "job {job_id} never logged {needle:?}; runner log:\n{}", self.runner.log());
    }

    /// Until the job awaits a local approval; its entry in `byoc-runner approvals`.
    pub async fn awaiting_approval(&self, job_id: &str) -> serde_json::Value {
        let v = self
            .cp
            .wait_for(job_id, WAIT, |v| v.waiting.is_some() || v.result.is_some())
            .await
            .unwrap_or_else(|| panic!("job {job_id} never settled; runner log:\n{}", self.runner.log()));
        assert_eq!(
            v.waiting.as_ref().map(|w| w.state.as_str()),
            Some("awaiting_approval"),
            "{v:?}\nrunner log:\n{}",
            self.runner.log()
        );
        let list = self.cli_json(&["approvals"]);
        list.as_array()
            .unwrap()
            .iter()
            .find(|r| r["job_id"] == job_id)
            .cloned()
            .expect("listed by `approvals`")
    }

    pub fn cli_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--output", "json"]);
        let out = self.runner.cli(&all);
        assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("CLI prints JSON")
    }
}

/// A runner started with a systemd notification socket, so tests can wait for its
/// state changes (READY=1, STOPPING=1) as systemd would.
pub async fn env_with_notify() -> (Env, tokio::net::UnixDatagram) {
    let sock_dir = tempfile::tempdir().unwrap();
    let path = sock_dir.path().join("notify.sock");
    let sock = tokio::net::UnixDatagram::bind(&path).unwrap();
    let opts = RunnerOptions {
        env: vec![("NOTIFY_SOCKET".into(), path.display().to_string())],
        ..Default::default()
    };
    let e = env_with(opts).await;
    // Keep the socket's directory alive as long as the runner's temp dir.
    std::mem::forget(sock_dir);
    (e, sock)
}

/// Wait for a notification containing `needle` (e.g. "STOPPING=1").
pub async fn wait_notify(sock: &tokio::net::UnixDatagram, needle: &str) {
    let mut buf = vec![0u8; 4096];
    loop {
        let n = tokio::time::timeout(WAIT, sock.recv(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no {needle} notification"))
            .unwrap();
        if String::from_utf8_lossy(&buf[..n]).contains(needle) {
            return;
        }
    }
}

/// Wait until the runner's log contains `needle` (its own progress report).
pub async fn wait_log(runner: &RunnerProcess, needle: &str, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if runner.log().contains(needle) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// True when the process exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

/// Build a local Docker image offline (`docker import` of a rootfs): static busybox
/// with its applets, plus `extra` (host file, path in the image) copies.
pub fn import_image(tag: &str, extra: &[(&Path, &Path)]) -> String {
    import_image_with(tag, extra, &[])
}

/// [`import_image`] with Dockerfile instructions for its configuration (`docker import
/// --change`: ENTRYPOINT, CMD, ENV, …).
pub fn import_image_with(tag: &str, extra: &[(&Path, &Path)], changes: &[&str]) -> String {
    let busybox = Path::new("/bin/busybox");
    assert!(busybox.exists(), "busybox-static is required (apt-get install busybox-static)");
    let root = tempfile::tempdir().unwrap();
    let bin = root.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(busybox, bin.join("busybox")).unwrap();
    let list = std::process::Command::new(busybox).arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let _ = std::os::unix::fs::symlink("busybox", bin.join(applet));
    }
    for dir in ["tmp", "work", "etc", "proc", "sys", "dev"] {
        std::fs::create_dir_all(root.path().join(dir)).unwrap();
    }
    // As in any real image; Docker copies the image's /tmp mode onto its tmpfs.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(root.path().join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
    for (file, at) in extra {
        let dest = root.path().join(at.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(file, &dest).unwrap();
    }
    let mut tar = std::process::Command::new("tar")
        .arg("-C")
        .arg(root.path())
        .args(["-cf", "-", "."])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::process::Command::new("docker")
        .arg("import")
        .args(changes.iter().flat_map(|c| ["--change", c]))
        .args(["-", tag])
        .stdin(tar.stdout.take().unwrap())
        .output()
        .expect("docker is required");
    assert!(tar.wait().unwrap().success(), "tar of the image rootfs failed");
    assert!(out.status.success(), "docker import failed: {}", String::from_utf8_lossy(&out.stderr));
    tag.to_string()
}

/// What the engine did to this job's containers since `since` (unix seconds), as
/// `docker events` lists it (create, start, die, destroy, …).
pub fn engine_events(job_id: &str, since: u64) -> Vec<String> {
    let until = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 1;
    let out = std::process::Command::new("docker")
        .args(["events", "--since", &since.to_string(), "--until", &until.to_string()])
        .args(["--filter", &format!("label=byoc-runner.job={job_id}"), "--format", "{{.Action}}"])
        .output()
        .expect("docker is required");
    assert!(out.status.success(), "docker events: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect()
}

/// Containers (running or not) labelled as this job's.
pub fn job_containers(job_id: &str) -> Vec<String> {
    let out = std::process::Command::new("docker")
        .args(["ps", "-a", "--format", "{{.Names}}", "--filter", &format!("label=byoc-runner.job={job_id}")])
        .output()
        .expect("docker is required");
    String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_string).collect()
}

/// Every record of the runner's audit log, parsed (a torn last line is skipped).
pub fn audit_records(state_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(state_dir.join("audit/log.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The audit records of one event.
pub fn audit_events(state_dir: &Path, event: &str) -> Vec<serde_json::Value> {
    audit_records(state_dir).into_iter().filter(|r| r["event"] == event).collect()
}

/// A stand-in tool (`tests/fixtures/<name>/<name>`) copied into a directory of its own
/// that the sandbox may read: inside the sandbox the job's directory is mounted at
/// /work, which would hide a checkout under /work. Returns the directory and the tool.
pub fn stand_in(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // The tool and what it calls beside it (the terraform stand-in's plan files).
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name);
    for entry in std::fs::read_dir(&fixtures).expect("fixtures").flatten() {
        if entry.file_type().is_ok_and(|t| t.is_file()) {
            let src = entry.path();
            std::fs::copy(&src, dir.path().join(entry.file_name()))
                .unwrap_or_else(|e| panic!("copying {}: {e}", src.display()));
        }
    }
    let tool = dir.path().join(name);
    (dir, tool)
}

/// Docker networks labelled as this job's.
pub fn job_networks(job_id: &str) -> Vec<String> {
    let out = std::process::Command::new("docker")
        .args(["network", "ls", "-q", "--filter", &format!("label=byoc-runner.job={job_id}")])
        .output()
        .expect("docker is required");
    String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_string).collect()
}

/// The sandbox probe's JSON report from a job's output, with every escape check held.
pub fn probe_report_all_held(out: &str) -> serde_json::Value {
    let report: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("probe printed {out}"));
    let checks = report["checks"].as_array().unwrap();
    assert!(checks.len() >= 20, "{report}");
    let failed: Vec<&serde_json::Value> = checks.iter().filter(|c| c["held"] != true).collect();
    assert!(failed.is_empty(), "escapes possible: {failed:#?}");
    report
}

/// The repository's root.
pub fn repo() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Run a command that must succeed; its output.
pub fn run(cmd: &mut std::process::Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The updater binary (`byoc-runner-updater`, its own crate), built with the profile
/// under test once per test process: the package ships it beside the runner.
pub fn updater_bin() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let bin = Path::new(BIN).with_file_name("byoc-runner-updater");
            let mut cargo = std::process::Command::new(env!("CARGO"));
            cargo.args(["build", "--quiet", "-p", "byoc-runner-updater"]);
            if Path::new(BIN).parent().is_some_and(|d| d.ends_with("release")) {
                cargo.arg("--release");
            }
            run(cargo.current_dir(repo()));
            assert!(bin.is_file(), "{} was not built", bin.display());
            bin
        })
        .clone()
}
