//! The job sandbox, end to end through the real daemon: a probe reports what a job
//! can see and do, limits are enforced with a reason that names them, nothing of a job
//! survives a timeout or a cancel, and network can be switched off.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_protocol::JobStatus;
use common::*;

#[tokio::test]
async fn probe_inside_the_sandbox_finds_every_escape_closed() {
    let e = env().await;
    let runner_pid = e.runner.pid().unwrap();
    // The probe is this binary; place it where jobs may read (the test dir is bound
    // read-only; the build dir may sit under a path the sandbox uses, such as /work).
    let probe = e.dir.path().join("probe");
    if std::fs::hard_link(BIN, &probe).is_err() {
        std::fs::copy(BIN, &probe).unwrap();
    }
    let id =
        e.cp.enqueue(EnqueueRequest::new(
            "action.script",
            serde_json::json!({
                "script": format!(
                    "exec {} sandbox-probe --runner-pid {runner_pid} --state-dir {} --config-dir {}",
                    probe.display(),
                    e.runner.state_dir.display(),
                    e.runner.config_path.parent().unwrap().display()
                ),
                "env": {"DECLARED": "yes"},
            }),
        ))
        .unwrap();
    let v = e.finished(&id).await;
    let out = e.output(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
    let report = common::probe_report_all_held(&out);
    // Only the declared environment.
    let mut env: Vec<&str> =
        report["env_names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    env.sort();
    // PWD is the shell's own; nothing of the runner's environment is there.
    assert_eq!(env, ["BYOC_JOB_ID", "BYOC_OUTPUT", "DECLARED", "HOME", "PATH", "PWD"]);
    assert_eq!(report["hostname"], "byoc-job");
    // Running as root, the runner gives jobs a distinct unprivileged uid.
    assert_eq!(report["uid"], 1000);
    // The identity key itself is untouched by all this.
    assert!(e.runner.state_dir.join("identity.key").exists());
}

#[tokio::test]
async fn memory_limit_kills_the_job_and_says_so() {
    let e = env_with(RunnerOptions { sandbox_extra: "memory_mib = 64".into(), ..Default::default() }).await;
    // `tail` keeps a whole newline-free "line" in memory.
    let id =
        e.cp.enqueue(script("set -e; head -c 400000000 /dev/zero | tail > /dev/null; echo survived"))
            .unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{:?}", e.output(&id));
    assert!(r.error.as_deref().unwrap_or("").contains("memory limit of 64 MiB"), "{:?}", r.error);
    assert!(
        String::from_utf8_lossy(&e.cp.log(&id).unwrap())
            .contains("[sandbox] cgroup V1 limits: memory 64 MiB")
    );
}

#[tokio::test]
async fn every_process_of_a_job_sits_in_the_jobs_cgroup_in_every_hierarchy() {
    // The helper joins by moving its only thread (v1 `tasks`): the job, its children
    // and a background process must all be inside, in memory, pids and cpu alike.
    let e = env().await;
    let id =
        e.cp.enqueue(script(
            "sleep 30 & cat /proc/$!/cgroup | sed 's/^/bg /'; sed 's/^/job /' /proc/self/cgroup; kill $!",
        ))
        .unwrap();
    let v = e.finished(&id).await;
    let out = e.output(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
    for who in ["job", "bg"] {
        for controller in ["memory", "pids", "cpu"] {
            let line = out
                .lines()
                .find(|l| {
                    l.strip_prefix(&format!("{who} "))
                        .and_then(|l| l.split(':').nth(1))
                        .is_some_and(|c| c.split(',').any(|c| c == controller))
                })
                .unwrap_or_else(|| panic!("no {controller} line for {who}:\n{out}"));
            // One cgroup per sandbox: `byoc-job-<id>-<runner pid>-s<n>`.
            let cgroup = line.rsplit('/').next().unwrap();
            let runner_pid = e.runner.pid().unwrap();
            assert!(
                cgroup
                    .strip_prefix(&format!("byoc-job-{id}-{runner_pid}-s"))
                    .is_some_and(|n| n.parse::<u64>().is_ok()),
                "{who} not in the job's {controller} cgroup: {line}"
            );
        }
    }
    // Removed after the job (off its path): none of its cgroups stays behind.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let found = std::process::Command::new("find")
            .args(["/sys/fs/cgroup", "-maxdepth", "8", "-type", "d", "-name", &format!("byoc-job-{id}-s*")])
            .output()
            .unwrap();
        let left = String::from_utf8_lossy(&found.stdout).trim().to_string();
        if left.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "cgroups left behind: {left}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The sandbox helper run directly on `spec`, to its end.
fn run_helper(spec: &byoc_sandbox::SandboxSpec) -> std::process::Output {
    use std::io::Write as _;
    let mut child = std::process::Command::new(BIN)
        .arg("sandbox-exec")
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&serde_json::to_vec(spec).unwrap()).unwrap();
    child.wait_with_output().unwrap()
}

/// A sandbox for `sh -c script` in a fresh directory of `dir`, offline, no limits: for
/// the tests that start the helper directly.
fn bare_spec(dir: &std::path::Path, script: &str) -> byoc_sandbox::SandboxSpec {
    use std::os::unix::fs::PermissionsExt as _;
    let (work, root) = (dir.join("work"), dir.join("root"));
    std::fs::create_dir_all(&work).unwrap();
    std::fs::create_dir_all(&root).unwrap();
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).unwrap();
    byoc_sandbox::SandboxSpec {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        work_dir: work,
        new_root: root,
        ro_paths: vec![],
        hidden_paths: vec![],
        network: byoc_sandbox::spec::NetworkSpec::Off,
        tmp_size_mib: 16,
        nofile: 1024,
        host_uid: 65534,
        host_gid: 65534,
        cgroup_procs: vec![],
        cgroup_born_in: None,
        hostname: "byoc-job".into(),
        then: vec![],
        sealed_dir: None,
        lease: None,
        binds: vec![],
        proc: true,
    }
}

/// On a cgroup v2 hierarchy the job's init is born in its cgroup (`clone3` with
/// `CLONE_INTO_CGROUP`): given the directory and no `cgroup.procs` to write, the job
/// still runs inside it, so nothing moved it there. The helper runs directly, on this
/// machine's v2 hierarchy (`/sys/fs/cgroup/unified` beside v1, or `/sys/fs/cgroup`).
#[test]
fn on_cgroup_v2_the_job_is_born_in_its_cgroup() {
    let v2 = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(std::path::Path::new)
        .find(|p| p.join("cgroup.procs").exists() && !p.join("tasks").exists())
        .expect("a cgroup v2 hierarchy (these machines mount one at /sys/fs/cgroup/unified)");
    let name = format!("byoc-test-born-{}", std::process::id());
    let cgroup = v2.join(&name);
    std::fs::create_dir(&cgroup).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let spec = byoc_sandbox::SandboxSpec {
        cgroup_born_in: Some(cgroup.clone()),
        ..bare_spec(dir.path(), "grep '^0::' /proc/self/cgroup")
    };
    let out = run_helper(&spec);
    let _ = std::fs::remove_dir(&cgroup);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.trim(), format!("0::/{name}"), "the job ran outside its cgroup");
    // The test process itself was never moved.
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    assert!(!own.contains(&name), "{own}");
}

/// The runner's binds: a read-only one stays unwritable (its host files unchanged), a
/// writable one takes writes until a later stage freezes it, and then none, not even
/// from the stage that froze it; without /proc no process reaches another's
/// descriptors. As root the job runs as an unprivileged uid, so the host files are
/// handed to it (as the runner hands a job its data directory).
#[test]
fn binds_are_read_only_or_frozen_for_good_and_no_proc_means_no_other_descriptors() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let (ro, rw) = (dir.path().join("ro"), dir.path().join("rw"));
    for d in [&ro, &rw] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    std::fs::write(ro.join("provider"), "verified").unwrap();
    std::fs::set_permissions(ro.join("provider"), std::fs::Permissions::from_mode(0o666)).unwrap();
    let try_write = |path: &str, what: &str| {
        format!(
            "if (echo changed >> {path}) 2>/dev/null; then echo '{what}: written'; else echo '{what}: refused'; fi; "
        )
    };
    let first =
        format!("{}{}", try_write("/r/provider", "stage 1 ro"), try_write("/d/installed", "stage 1 rw"));
    let mut spec = byoc_sandbox::SandboxSpec {
        binds: vec![
            byoc_sandbox::spec::Bind { host: ro.clone(), inside: "/r".into(), writable: false },
            byoc_sandbox::spec::Bind { host: rw.clone(), inside: "/d".into(), writable: true },
        ],
        proc: false,
        ..bare_spec(dir.path(), &first)
    };
    let second = format!(
        "{}{}ls -A /proc | wc -l | sed 's/^/proc entries: /'; [ -e /proc/1/fd/1 ] && echo 'init stdout: reachable'; true",
        try_write("/d/installed", "stage 2 rw"),
        try_write("/r/provider", "stage 2 ro")
    );
    spec.then = vec![byoc_sandbox::spec::Stage {
        argv: vec!["/bin/sh".into(), "-c".into(), second],
        seal: vec![],
        gate: false,
        freeze: vec!["/d".into()],
    }];
    let out = run_helper(&spec);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "stage 1 ro: refused",
        "stage 1 rw: written",
        "stage 2 rw: refused",
        "stage 2 ro: refused",
        "proc entries: 0",
    ] {
        assert!(stdout.lines().any(|l| l == line), "no {line:?} in:\n{stdout}");
    }
    assert!(!stdout.contains("init stdout: reachable"), "{stdout}");
    assert_eq!(std::fs::read_to_string(ro.join("provider")).unwrap(), "verified");
    assert_eq!(std::fs::read_to_string(rw.join("installed")).unwrap(), "changed\n");

    // A bind over the sandbox's own places, or a frozen path that is no writable bind,
    // is refused before anything is built.
    for (binds, freeze) in [
        (
            vec![byoc_sandbox::spec::Bind { host: rw.clone(), inside: "/work/x".into(), writable: true }],
            vec![],
        ),
        (
            vec![byoc_sandbox::spec::Bind { host: ro.clone(), inside: "/r".into(), writable: false }],
            vec!["/r".into()],
        ),
    ] {
        let mut bad = bare_spec(dir.path(), "echo ran");
        bad.binds = binds;
        bad.then = vec![byoc_sandbox::spec::Stage {
            argv: vec!["/bin/true".into()],
            seal: vec![],
            gate: false,
            freeze,
        }];
        let out = run_helper(&bad);
        assert_eq!(out.status.code(), Some(byoc_sandbox::helper::EXIT_SANDBOX_FAILED));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("ran"));
    }
}

/// A job held to its lease runs while the lease is renewed and stops by itself, with
/// every process of it, once a deadline passes unrenewed, even when the runner that
/// held it does nothing more (here: the test stops renewing) and the job ignores SIGTERM.
#[test]
fn a_job_held_to_its_lease_stops_by_itself_when_the_lease_runs_out() {
    use byoc_sandbox::lease::{LeaseBinding, monotonic_now_ns};
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let ms = |n: u64| n * 1_000_000;
    let binding = LeaseBinding::new(monotonic_now_ns() + ms(800), std::time::Duration::from_millis(300));
    let spec = byoc_sandbox::SandboxSpec {
        lease: Some(byoc_sandbox::spec::LeaseSpec { grace_ms: 300 }),
        ..bare_spec(dir.path(), "trap '' TERM; echo started; sleep 3501; echo ended")
    };
    let mut cmd = std::process::Command::new(BIN);
    cmd.arg("sandbox-exec")
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    byoc_sandbox::pass_channels(&mut cmd, None, None, Some(binding.attach().unwrap()));
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(&serde_json::to_vec(&spec).unwrap()).unwrap();
    // Renewed past its first deadline twice over, it keeps running.
    let first = binding.deadline_ns();
    while monotonic_now_ns() < first + ms(1600) {
        binding.renew(monotonic_now_ns() + ms(800));
        assert!(child.try_wait().unwrap().is_none(), "stopped while its lease was renewed");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(!processes_matching("sleep 3501").is_empty());
    // No renewal from now on: it stops by itself, SIGTERM ignored, killed after the grace.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(byoc_sandbox::helper::EXIT_LEASE_EXPIRED), "{stderr}");
    assert!(stderr.contains("lease ran out"), "{stderr}");
    assert!(monotonic_now_ns() >= binding.deadline_ns() + ms(300), "killed before the grace");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("started") && !stdout.contains("ended"), "{stdout}");
    assert!(processes_matching("sleep 3501").is_empty(), "the job outlived its lease");
}

#[tokio::test]
async fn pids_limit_stops_a_fork_bomb_and_says_so() {
    let e = env_with(RunnerOptions { sandbox_extra: "pids = 16".into(), ..Default::default() }).await;
    let mut req = script("for i in $(seq 1 40); do sleep 3301 & done; wait");
    req.timeout_secs = 60;
    let id = e.cp.enqueue(req).unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{:?}", e.output(&id));
    assert!(r.error.as_deref().unwrap_or("").contains("limit of 16 processes"), "{:?}", r.error);
    assert_eq!(gone("sleep 3301").await, Vec::<i32>::new(), "the fork bomb outlived its job");
}

#[tokio::test]
async fn a_timeout_leaves_no_process_behind_even_one_that_left_the_group() {
    let e = env().await;
    let mut req = script("setsid sleep 3401 & (trap '' TERM INT; exec sleep 3402) & echo ready; wait");
    req.timeout_secs = 2;
    let id = e.cp.enqueue(req).unwrap();
    e.log_contains(&id, "ready").await;
    assert_eq!(processes_matching("sleep 340").len(), 2);
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::TimedOut);
    assert_eq!(gone("sleep 340").await, Vec::<i32>::new(), "processes outlived the job");
}

#[tokio::test]
async fn no_job_reaches_the_runners_loopback_with_or_without_a_network() {
    let e = env().await;
    // The control plane listens on the runner's 127.0.0.1: the job's loopback is its own.
    let port = e.cp.runner_url().rsplit(':').next().unwrap().to_string();
    let probe = format!(
        "if (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; then echo connected; else echo refused; fi"
    );
    let on =
        e.cp.enqueue(EnqueueRequest::new(
            "action.script",
            serde_json::json!({"script": probe, "interpreter": "/bin/bash"}),
        ))
        .unwrap();
    let off =
        e.cp.enqueue(EnqueueRequest::new(
            "action.script",
            serde_json::json!({"script": probe, "interpreter": "/bin/bash", "network": false}),
        ))
        .unwrap();
    e.finished(&on).await;
    e.finished(&off).await;
    assert_eq!(e.output(&on), "refused\n");
    assert_eq!(e.output(&off), "refused\n");
    // Each job's log says which network it got.
    let log = |id: &str| String::from_utf8_lossy(&e.cp.log(id).unwrap()).into_owned();
    assert!(log(&on).contains("[sandbox] network: user-mode (slirp4netns)"), "{}", log(&on));
    assert!(log(&off).contains("[sandbox] network: none"), "{}", log(&off));
}

#[tokio::test]
async fn a_missing_program_fails_with_a_clear_reason() {
    let e = env().await;
    let id =
        e.cp.enqueue(EnqueueRequest::new(
            "action.script",
            serde_json::json!({"script": "true", "interpreter": "/nonexistent/shell"}),
        ))
        .unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert!(r.error.unwrap().contains("could not be executed"), "{}", e.output(&id));
    assert!(e.output(&id).contains("exec /nonexistent/shell"));
}

/// The runner started in a mount namespace where no cgroup hierarchy is mounted.
fn without_cgroups(sandbox_extra: &str) -> RunnerOptions {
    RunnerOptions {
        sandbox_extra: sandbox_extra.into(),
        wrap: [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs none /sys/fs/cgroup && exec \"$0\" \"$@\"",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_job_whose_limits_cannot_be_applied_is_refused_unless_the_customer_opts_out() {
    let e = env_with(without_cgroups("")).await;
    let job = serde_json::json!({"script": "echo ran", "network": false});
    let id = e.cp.enqueue(EnqueueRequest::new("action.script", job.clone())).unwrap();
    let v = e.rejected(&id).await;
    assert_eq!(v.rejections[0].0, byoc_protocol::RejectReason::SandboxLimitsUnavailable);
    assert!(v.rejections[0].1.contains("sandbox.require_limits = false"), "{:?}", v.rejections);
    assert_eq!(started_count(&e.runner.state_dir, &id), 0, "nothing ran");
    assert!(e.cp.log(&id).is_none_or(|l| l.is_empty()));
    drop(e);

    let e = env_with(without_cgroups("require_limits = false")).await;
    let id = e.cp.enqueue(EnqueueRequest::new("action.script", job)).unwrap();
    let r = e.finished(&id).await.result.unwrap();
    let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}\n{log}");
    assert!(log.contains("cgroup limits not applied (sandbox.require_limits = false)"), "{log}");
    assert_eq!(e.output(&id), "ran\n");
}
