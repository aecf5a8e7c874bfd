//! `byoc-bench`: the spine's figures, printed (not asserted).
//!
//! - pickup latency, enqueue → the job's child process running, p50/p99 over N jobs
//!   run one after another (also enqueue → runner journaled `started`);
//! - the runner's resident memory after an idle minute;
//! - requests the runner sends per minute while idle;
//! - masking throughput: job output through the masker with 20 secrets, one core.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::{ControlPlane, ControlPlaneConfig, EnqueueRequest};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "byoc-bench",
    about = "Measure byoc-runner pickup latency, idle memory and idle request rate"
)]
struct Args {
    #[arg(long, default_value_t = 200)]
    jobs: usize,
    /// Idle window for memory and request-rate figures, seconds.
    #[arg(long, default_value_t = 60)]
    idle_secs: u64,
    #[arg(long)]
    runner_bin: Option<PathBuf>,
    /// Runs for the sandbox start-overhead figure.
    #[arg(long, default_value_t = 200)]
    sandbox_runs: usize,
    /// A pause between sandbox starts, as between jobs that arrive apart (0: back to back).
    #[arg(long, default_value_t = 0)]
    spacing_ms: u64,
    /// Records for the audit-log figures (0 skips them).
    #[arg(long, default_value_t = 200_000)]
    audit_records: usize,
    /// MiB of job output for the masking throughput figure (0 skips it).
    #[arg(long, default_value_t = 512)]
    mask_mib: usize,
    /// MiB a job prints for the output-path figure, through the runner (0 skips it);
    /// the default passes the 256 MiB log cap, so the ring's path is measured too.
    #[arg(long, default_value_t = 1024)]
    output_mib: usize,
    /// Soak: this many `runner.noop` jobs one after another; RSS, open files and threads
    /// after the first 1,000 and after the last (0 skips it; `scripts/bench soak` runs 20,000).
    #[arg(long, default_value_t = 0)]
    soak_jobs: usize,
    /// MiB a container prints for the container output figure, through the runner (0
    /// skips it; needs Docker and busybox).
    #[arg(long, default_value_t = 1024)]
    container_output_mib: usize,
    /// Warm runs for the container start figure (0 skips it; needs Docker and busybox).
    #[arg(long, default_value_t = 20)]
    container_runs: usize,
}

/// Import a busybox image offline under `tag` (never pulled).
fn import_busybox(tag: &str) -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let bin = root.path().join("bin");
    std::fs::create_dir_all(&bin)?;
    std::fs::copy("/bin/busybox", bin.join("busybox")).context("busybox-static is required")?;
    for applet in ["sh", "echo", "true", "yes", "head"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet))?;
    }
    std::fs::create_dir_all(root.path().join("tmp"))?;
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("tar -C {} -cf - . | docker import - {tag} >/dev/null", root.path().display()))
        .status()?;
    anyhow::ensure!(status.success(), "docker import failed");
    Ok(())
}

struct FirstWrite(Option<std::time::Instant>);

impl byoc_job_executors::OutputSink for FirstWrite {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        // The runner's own `[sandbox] …` lines come before the container's output.
        if !chunk.starts_with(b"[sandbox]") {
            self.0.get_or_insert_with(std::time::Instant::now);
        }
        Ok(())
    }
}

/// Time from asking the executor to run a container to its first output byte.
async fn container_start_ms(image: &str, dir: &std::path::Path) -> anyhow::Result<f64> {
    let exec = byoc_job_executors::build(
        "action.container",
        &serde_json::json!({"image": image, "command": ["echo", "up"]}),
    )?;
    let work = tempfile::tempdir_in(dir)?;
    let mut sink = FirstWrite(None);
    let t0 = std::time::Instant::now();
    let containers = byoc_job_executors::ContainerSettings {
        docker_socket: "/var/run/docker.sock".into(),
        memory_bytes: 256 << 20,
        pids: 64,
        uid: 65534,
        gid: 65534,
        busybox: "/bin/busybox".into(),
        network: Default::default(),
        owner: "local".into(),
        prepare_networks: true,
    };
    let ctx = byoc_job_executors::ExecContext::builder(
        format!("bench-{}", byoc_protocol::random_hex(4)),
        work.path(),
    )
    .timeout(Duration::from_secs(60), Duration::from_secs(2))
    .isolation(None, Some(containers))
    .build(&mut sink);
    let outcome = exec.run(ctx).await;
    anyhow::ensure!(
        outcome.status == byoc_protocol::JobStatus::Succeeded,
        "container failed: {:?}",
        outcome.error
    );
    let first = sink.0.context("no output")?;
    // As on a runner between jobs: the next job's network is made while none waits.
    byoc_job_executors::container::prepared_settled().await;
    Ok(first.duration_since(t0).as_secs_f64() * 1000.0)
}

fn audit_record(i: usize) -> byoc_audit::log::Record {
    let mut r = byoc_audit::log::Record {
        event: "job_finished".into(),
        job: Some(format!("job-{i:016x}")),
        kind: Some("action.script".into()),
        status: Some("succeeded".into()),
        exit_code: Some(0),
        ..Default::default()
    };
    r.digests.insert("log_sha256".into(), "ab".repeat(32));
    r
}

/// Audit log: append latency (one record per fsync) and group-commit throughput, then
/// offline verification throughput.
fn audit_bench(n: usize) -> anyhow::Result<()> {
    use byoc_audit::log::AuditWriter;
    let dir = tempfile::tempdir()?;
    let key = byoc_protocol::generate_signing_key();
    let cp = byoc_protocol::generate_signing_key();
    let (mut w, _) = AuditWriter::open(
        dir.path(),
        key.clone(),
        "rn-bench",
        "inst-bench",
        &[byoc_protocol::b64(cp.verifying_key().as_bytes())],
    )?;
    let single = 2_000.min(n);
    let mut lat = Vec::with_capacity(single);
    for i in 0..single {
        let t = std::time::Instant::now();
        w.append(audit_record(i))?;
        lat.push(t.elapsed().as_micros() as u64);
    }
    lat.sort_unstable();
    println!(
        "audit append, one record per commit (record fsync + signed checkpoint fsync): p50 {:.2} ms, p99 {:.2} ms, {:.0} records/s",
        percentile(&lat, 0.5) as f64 / 1000.0,
        percentile(&lat, 0.99) as f64 / 1000.0,
        single as f64 / (lat.iter().sum::<u64>() as f64 / 1e6)
    );
    let batch = 256;
    let rest = n - single;
    let t = std::time::Instant::now();
    let mut blat = Vec::new();
    let mut i = single;
    while i < n {
        let k = batch.min(n - i);
        let tb = std::time::Instant::now();
        w.append_batch((i..i + k).map(audit_record).collect())?;
        blat.push(tb.elapsed().as_micros() as u64);
        i += k;
    }
    blat.sort_unstable();
    println!(
        "audit append, group commit of {batch}: {:.0} records/s sustained over {rest} records, commit p99 {:.2} ms",
        rest as f64 / t.elapsed().as_secs_f64(),
        percentile(&blat, 0.99) as f64 / 1000.0
    );
    let note = byoc_audit::note::cosign(
        &w.sign_at(w.size()).context("signing")?,
        byoc_audit::log::CONTROL_PLANE_KEY_NAME,
        &cp,
    )?;
    w.store_cosigned(w.size(), &note)?;
    let trust =
        byoc_audit::verify::Trust { runner: key.verifying_key(), control_plane: vec![cp.verifying_key()] };
    let t = std::time::Instant::now();
    let report = byoc_audit::verify::verify_dir(dir.path(), &trust).map_err(|e| anyhow::anyhow!("{e}"))?;
    let secs = t.elapsed().as_secs_f64();
    let lines = byoc_audit::log::read_lines(dir.path(), 0, u64::MAX)?;
    let th = std::time::Instant::now();
    for l in &lines {
        std::hint::black_box(byoc_audit::merkle::leaf_hash(l.as_bytes()));
    }
    let hash_rate = lines.len() as f64 / th.elapsed().as_secs_f64();
    println!(
        "audit verify: {} records, {} checkpoints in {:.2} s = {:.0} records/s (parse + hash + tree + {} signatures); leaf hashing alone {:.0} records/s on one core; 10 million records extrapolate to {:.1} s",
        report.records,
        report.checkpoints,
        secs,
        report.records as f64 / secs,
        report.checkpoints + report.cosigned,
        hash_rate,
        10_000_000.0 / (report.records as f64 / secs)
    );
    Ok(())
}

/// Anonymous RSS (KiB: heap, stacks, relocated data) of a process: what a leak grows;
/// file-backed pages (code) only come and go with the paths it runs.
fn anon_rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("RssAnon")
}

/// RSS (KiB), open descriptors and threads of a process.
fn process_figures(pid: u32) -> anyhow::Result<(u64, usize, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    Ok((field("VmRSS:").context("VmRSS")?, fds, field("Threads:").context("Threads")?))
}

/// `n` noop jobs through the runner, one after another: does anything grow per job?
async fn soak(cp: &ControlPlane, pid: u32, n: usize) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let mut after_first = None;
    // The anonymous part along the way: growth that keeps climbing is a leak, growth
    // that levels off is the allocator settling.
    let step = (n / 10).max(1000);
    let mut anon = Vec::new();
    for i in 0..n {
        // Short-lived envelopes, so settled jobs can leave the journal (their nonces
        // expire) as they would on a VM running for months.
        let req =
            EnqueueRequest { ttl_secs: 5, ..EnqueueRequest::new("runner.noop", serde_json::Value::Null) };
        let id = cp.enqueue(req).map_err(|e| anyhow::anyhow!("{e}"))?;
        cp.wait_for(&id, Duration::from_secs(30), |v| v.result.is_some())
            .await
            .context("soak job did not finish")?;
        if i + 1 == n.min(1000) {
            after_first = Some(process_figures(pid)?);
        }
        if (i + 1) % step == 0 {
            anon.push(format!("{}: {}", i + 1, anon_rss(pid)?));
        }
    }
    let (rss0, fds0, threads0) = after_first.context("no figures after the first jobs")?;
    let (rss1, fds1, threads1) = process_figures(pid)?;
    println!(
        "soak, {n} noop jobs in {:.0} s: RSS after the first {} {:.1} MiB, after the last {:.1} MiB (growth {:+.2} MiB; target within 2 MiB; journal_keep 500); open files {fds0} -> {fds1}; threads {threads0} -> {threads1}",
        started.elapsed().as_secs_f64(),
        n.min(1000),
        rss0 as f64 / 1024.0,
        rss1 as f64 / 1024.0,
        (rss1 as f64 - rss0 as f64) / 1024.0
    );
    println!("soak: anonymous RSS (KiB) after jobs {}", anon.join(", "));
    Ok(())
}

/// A sandboxed job with 20 secrets prints `mib` MiB of 100-byte lines: the job's own
/// clock around the printing is the output path (pipe → read → mask → spool), since the
/// pipe blocks the job whenever the runner falls behind; the same printing into
/// /dev/null in the same job is what the job could do alone.
/// A container's output through the runner (its pipes, masking, the spool and the
/// log cap), from the job's start to its end: the start (about half a second) included.
async fn container_output_bench(cp: &ControlPlane, mib: usize) -> anyhow::Result<()> {
    let tag = format!("byoc-bench/busybox:output-{}", byoc_protocol::random_hex(3));
    import_busybox(&tag)?;
    let bytes = mib << 20;
    let line = "module.network.aws_subnet.private[0]: Still creating... [10s elapsed] id=subnet-0a1b2c3d4e5f6a7b8 ok";
    let mut req = EnqueueRequest::new(
        "action.container",
        serde_json::json!({
            "image": tag, "network": false,
            "command": ["sh", "-c", format!("yes '{line}' | head -c {bytes}")],
            "secret_env": {"SECRET_0": format!("s3cr3t-{}", byoc_protocol::random_hex(12))}
        }),
    );
    req.timeout_secs = 3600;
    let id = cp.enqueue(req).map_err(|e| anyhow::anyhow!("{e}"))?;
    let v = cp
        .wait_for(&id, Duration::from_secs(3600), |v| v.result.is_some() || !v.rejections.is_empty())
        .await
        .context("container output job did not finish")?;
    let _ = std::process::Command::new("docker").args(["rmi", "-f", &tag]).output();
    anyhow::ensure!(v.rejections.is_empty(), "container output job refused: {:?}", v.rejections);
    let result = v.result.context("no result")?;
    anyhow::ensure!(
        result.status == byoc_protocol::JobStatus::Succeeded,
        "container output job failed: {:?}",
        result.error
    );
    let secs = v.duration_ms.context("no duration")? as f64 / 1000.0;
    println!(
        "container output: {mib} MiB from the container's stdout through masking and the spool in {secs:.2} s \
         (start included): {:.0} MB/s (target >= 200 MB/s); log kept {} bytes, {} omitted",
        bytes as f64 / secs / 1e6,
        result.log_size,
        result.log_omitted_bytes
    );
    Ok(())
}

async fn output_path_bench(cp: &ControlPlane, mib: usize) -> anyhow::Result<()> {
    let secret_env: serde_json::Map<String, serde_json::Value> = (0..20)
        .map(|i| {
            (
                format!("SECRET_{i}"),
                serde_json::Value::String(format!("s3cr3t-{i}-{}", byoc_protocol::random_hex(12))),
            )
        })
        .collect();
    let bytes = mib << 20;
    let script = format!(
        "line='module.network.aws_subnet.private[0]: Still creating... [10s elapsed] id=subnet-0a1b2c3d4e5f6a7b8 ok'\n\
         t0=$EPOCHREALTIME; yes \"$line\" | head -c {bytes} >/dev/null; t1=$EPOCHREALTIME\n\
         yes \"$line\" | head -c {bytes}; t2=$EPOCHREALTIME\n\
         echo \"alone=$t0,$t1\" >> \"$BYOC_OUTPUT\"; echo \"through=$t1,$t2\" >> \"$BYOC_OUTPUT\""
    );
    let mut req = EnqueueRequest::new(
        "action.script",
        serde_json::json!({"script": script, "interpreter": "/bin/bash", "secret_env": secret_env}),
    );
    req.timeout_secs = 3600;
    let enqueued = std::time::Instant::now();
    let id = cp.enqueue(req).map_err(|e| anyhow::anyhow!("{e}"))?;
    let v = cp
        .wait_for(&id, Duration::from_secs(3600), |v| v.result.is_some() || !v.rejections.is_empty())
        .await
        .context("job did not finish")?;
    anyhow::ensure!(v.rejections.is_empty(), "output job refused: {:?}", v.rejections);
    let total = enqueued.elapsed().as_secs_f64();
    let result = v.result.context("no result")?;
    anyhow::ensure!(
        result.status == byoc_protocol::JobStatus::Succeeded,
        "output job failed: {:?}",
        result.error
    );
    let span = |key: &str| -> anyhow::Result<f64> {
        let s = result.outputs[key].as_str().with_context(|| format!("no {key} output"))?;
        let (a, b) = s.split_once(',').context("bad span")?;
        Ok(b.parse::<f64>()? - a.parse::<f64>()?)
    };
    let (alone, through) = (span("alone")?, span("through")?);
    println!(
        "job output path, {mib} MiB printed by a sandboxed job with 20 secrets (pipe -> mask -> spool{}): {:.0} MB/s ({through:.2} s); the same printing into /dev/null {:.0} MB/s; to the result acknowledged {total:.1} s; log kept {} MiB, {} MiB omitted (target >= 200 MB/s)",
        if mib > 256 { ", past the 256 MiB cap" } else { "" },
        bytes as f64 / through / 1e6,
        bytes as f64 / alone / 1e6,
        result.log_size >> 20,
        result.log_omitted_bytes >> 20,
    );
    Ok(())
}

/// Job output through the masking sink: 20 secrets (one a 1,100-character session
/// token), log lines of words, hex and base64 that keep the automaton busy, 64 KiB reads.
fn mask_bench(mib: usize) -> anyhow::Result<()> {
    use byoc_job_executors::OutputSink;
    use byoc_job_executors::mask::{Masker, MaskingSink};
    struct Count(usize);
    impl OutputSink for Count {
        fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
            self.0 += chunk.len();
            Ok(())
        }
    }
    let mut n: u64 = 0x9e3779b97f4a7c15;
    let mut next = move || {
        n ^= n << 13;
        n ^= n >> 7;
        n ^= n << 17;
        n
    };
    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let token: String = (0..1100).map(|_| B64[(next() % 64) as usize] as char).collect();
    let mut secrets = vec![token];
    secrets
        .push("AKIA".to_string() + &(0..16).map(|_| B64[(next() % 26) as usize] as char).collect::<String>());
    secrets.push((0..40).map(|_| B64[(next() % 64) as usize] as char).collect());
    secrets.extend((0..17).map(|i| format!("vendor-secret-{i}-{:x}", next())));
    let masker = Masker::new(&secrets).map_err(anyhow::Error::msg)?;
    let words = [
        "module.network",
        "aws_subnet.private[0]",
        "Creating...",
        "Still creating...",
        "id=",
        "10.0.1.0/24",
        "tags.%",
        "Refreshing state",
        "null_resource",
        "TF_LOG",
        "DEBUG",
        "provider",
        "2026-11-24T09:00:00Z",
    ];
    let mut text = Vec::with_capacity(8 << 20);
    while text.len() < 8 << 20 {
        for _ in 0..8 {
            match next() % 4 {
                0 => text.extend_from_slice(format!("{:016x}", next()).as_bytes()),
                1 => text.extend((0..24).map(|_| B64[(next() % 64) as usize])),
                _ => text.extend_from_slice(words[(next() % words.len() as u64) as usize].as_bytes()),
            }
            text.push(b' ');
        }
        text.push(b'\n');
    }
    let mut count = Count(0);
    let started = std::time::Instant::now();
    {
        let mut sink = MaskingSink::new(masker, &mut count);
        let mut written = 0;
        while written < mib << 20 {
            for chunk in text.chunks(64 << 10) {
                sink.write(chunk)?;
            }
            written += text.len();
        }
        sink.flush_end()?;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "masking, 20 secrets (one of 1,100 characters) in every form, 64 KiB reads: {:.0} MiB in {secs:.2} s = {:.0} MB/s on one core (target >= 200 MB/s for the whole output path)",
        count.0 as f64 / (1 << 20) as f64,
        count.0 as f64 / secs / 1e6
    );
    Ok(())
}

/// Wall clock in microseconds.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The child's first act: print the wall clock in µs (a bash builtin, no extra process).
const FIRST_INSTRUCTION: &str = "echo ${EPOCHREALTIME/./}";

async fn plain_spawn_us() -> anyhow::Result<u64> {
    let t0 = now_us();
    let out = tokio::process::Command::new("/bin/bash")
        .args(["-c", FIRST_INSTRUCTION])
        .env_clear()
        .output()
        .await?;
    let t1: u64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    Ok(t1.saturating_sub(t0))
}

/// The job network a sandbox start is measured with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Net {
    /// The runner's own namespace: the product before the network boundary.
    Shared,
    /// `network = false`: an empty namespace.
    Off,
    /// The default: own namespace, slirp4netns, rules, the hand-over of the DNS and
    /// credential sockets to the runner.
    UserMode,
}

/// Spawn to first instruction through the sandbox, including the per-job cgroup.
async fn sandboxed_spawn_us(
    runner_bin: &std::path::Path,
    dir: &std::path::Path,
    n: usize,
    net: Net,
) -> anyhow::Result<u64> {
    use tokio::io::AsyncWriteExt as _;
    let work = dir.join(format!("work-{n}"));
    let root = dir.join(format!("root-{n}"));
    std::fs::create_dir_all(&work)?;
    std::fs::create_dir_all(&root)?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777))?;
    let t0 = now_us();
    let limits = byoc_sandbox::cgroup::Limits { memory_bytes: 512 << 20, pids: 256, cpu_millis: 1000 };
    let cgroup = byoc_sandbox::cgroup::JobCgroup::create(&format!("bench-{n}"), limits).ok();
    let spec = byoc_sandbox::SandboxSpec {
        argv: vec!["/bin/bash".into(), "-c".into(), FIRST_INSTRUCTION.into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        work_dir: work.clone(),
        new_root: root.clone(),
        ro_paths: vec![],
        hidden_paths: vec![],
        network: match net {
            Net::Shared => byoc_sandbox::spec::NetworkSpec::SharedWithHost,
            Net::Off => byoc_sandbox::spec::NetworkSpec::Off,
            Net::UserMode => byoc_job_executors::jobnet::spec(
                byoc_job_executors::jobnet::NetworkUse::UserMode,
                &Default::default(),
                true,
            ),
        },
        tmp_size_mib: 64,
        nofile: 1024,
        host_uid: 65534,
        host_gid: 65534,
        cgroup_procs: cgroup.as_ref().map(|c| c.procs.clone()).unwrap_or_default(),
        cgroup_born_in: cgroup.as_ref().and_then(|c| c.v2_dir()).map(|d| d.to_path_buf()),
        hostname: "byoc-job".into(),
        then: vec![],
        sealed_dir: None,
        lease: None,
        binds: vec![],
        proc: true,
    };
    let mut cmd = tokio::process::Command::new(runner_bin);
    cmd.arg("sandbox-exec")
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    // As the runner does: the hand-over channel, and its services started on it.
    let services = if net == Net::UserMode {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
        byoc_sandbox::pass_channels(cmd.as_std_mut(), Some(theirs), None, None);
        let follower = byoc_job_executors::jobnet::HostFollower::open().map_err(|e| anyhow::anyhow!(e.0))?;
        let stop = tokio_util::sync::CancellationToken::new();
        Some(byoc_job_executors::jobnet::Services::start(ours, &Default::default(), None, follower, stop))
    } else {
        None
    };
    let mut child = cmd.spawn()?;
    drop(cmd);
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(&serde_json::to_vec(&spec)?).await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    drop(services);
    if let Some(cg) = cgroup {
        cg.kill_all_and_remove();
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let t1: u64 = text.trim().parse().with_context(|| {
        format!("sandboxed child printed {text:?}, stderr {:?}", String::from_utf8_lossy(&out.stderr))
    })?;
    Ok(t1.saturating_sub(t0))
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Resident KiB of `binary`'s code (its executable mappings in `pid`).
fn resident_code_kib(pid: u32, binary: &std::path::Path) -> u64 {
    let binary = std::fs::canonicalize(binary).unwrap_or_else(|_| binary.to_path_buf());
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut in_code = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.first().is_some_and(|f| f.contains('-') && !f.ends_with(':')) {
            in_code = fields.get(1).is_some_and(|perms| perms.contains('x'))
                && fields.get(5).is_some_and(|path| std::path::Path::new(path) == binary);
        } else if in_code && fields.first() == Some(&"Rss:") {
            kib += fields.get(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    kib
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runner_bin = match args.runner_bin {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("byoc-runner"),
    };
    if !runner_bin.exists() {
        bail!("runner binary {} not found", runner_bin.display());
    }
    // Sandbox start overhead: spawn → the child's first instruction, plain vs sandboxed
    // with each network. Each network in a run of its own: the kernel tears a network
    // namespace down after its last process exits, and that work belongs to the runs
    // that create namespaces, not to whichever run comes next.
    let sdir = tempfile::tempdir()?;
    let mut plain = Vec::with_capacity(args.sandbox_runs);
    for _ in 0..args.sandbox_runs {
        plain.push(plain_spawn_us().await?);
    }
    let modes = [Net::Shared, Net::Off, Net::UserMode];
    let mut sandboxed: Vec<Vec<u64>> = vec![Vec::with_capacity(args.sandbox_runs); modes.len()];
    for (i, net) in modes.iter().enumerate() {
        for n in 0..args.sandbox_runs {
            if args.spacing_ms > 0 {
                tokio::time::sleep(Duration::from_millis(args.spacing_ms)).await;
            }
            sandboxed[i].push(sandboxed_spawn_us(&runner_bin, sdir.path(), n * modes.len() + i, *net).await?);
        }
    }
    plain.sort_unstable();
    let p50p = percentile(&plain, 0.5);
    println!(
        "sandbox start, spawn -> first instruction (n={}, {} ms apart; cgroup + namespaces + mounts + seccomp + Landlock): plain process p50 {:.2} ms p99 {:.2} ms",
        args.sandbox_runs,
        args.spacing_ms,
        p50p as f64 / 1000.0,
        percentile(&plain, 0.99) as f64 / 1000.0,
    );
    for (i, net) in modes.iter().enumerate() {
        sandboxed[i].sort_unstable();
        let p50 = percentile(&sandboxed[i], 0.5);
        let what = match net {
            Net::Shared => "shared host network (before the boundary)",
            Net::Off => "network = false (empty namespace)",
            Net::UserMode => "own namespace + slirp4netns + rules + hand-over (the default)",
        };
        println!(
            "  {what}: p50 {:.2} ms p99 {:.2} ms; overhead over plain p50 {:.2} ms",
            p50 as f64 / 1000.0,
            percentile(&sandboxed[i], 0.99) as f64 / 1000.0,
            p50.saturating_sub(p50p) as f64 / 1000.0
        );
    }
    let (shared, user_mode) = (percentile(&sandboxed[0], 0.5), percentile(&sandboxed[2], 0.5));
    println!(
        "  added by the network boundary (user-mode vs shared) p50 {:.2} ms (target <= 10 ms)",
        user_mode.saturating_sub(shared) as f64 / 1000.0
    );

    if args.mask_mib > 0 {
        mask_bench(args.mask_mib)?;
    }
    if args.audit_records > 0 {
        audit_bench(args.audit_records)?;
    }

    if args.container_runs > 0 {
        let mut cold = Vec::new();
        let mut warm = Vec::new();
        for i in 0..3 {
            let tag = format!("byoc-bench/busybox:cold-{}-{i}", byoc_protocol::random_hex(3));
            import_busybox(&tag)?;
            cold.push(container_start_ms(&tag, sdir.path()).await?);
            if i == 0 {
                for _ in 0..args.container_runs {
                    warm.push(container_start_ms(&tag, sdir.path()).await?);
                }
            }
            let _ = std::process::Command::new("docker").args(["rmi", "-f", &tag]).output();
        }
        byoc_job_executors::container::release_prepared().await;
        println!(
            "networked container action start, first of the process (its network made then): {:.0} ms",
            cold[0]
        );
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        println!(
            "networked container action start, run -> first output byte: cold (first run of a freshly imported image) median {:.0} ms (n={}); warm median {:.0} ms (n={}, target <= 300 ms)",
            med(&mut cold),
            cold.len(),
            med(&mut warm),
            warm.len()
        );
    }

    let cp = ControlPlane::start(ControlPlaneConfig::default()).await?;
    let dir = tempfile::tempdir()?;
    // journal_keep 500: the soak (thousands of jobs) crosses it many times.
    let opts = RunnerOptions {
        heartbeat_secs: 15,
        jobs_extra: "journal_keep = 500\nmax_clock_skew_secs = 0".into(),
        ..Default::default()
    };
    let mut runner = RunnerProcess::start(&runner_bin, dir.path(), &cp, &opts)?;
    if !wait_polling(&cp, Duration::from_secs(30)).await {
        bail!("runner did not start:\n{}", runner.log());
    }
    println!(
        "byoc-runner benchmark: binary {}, {} jobs, idle window {} s",
        runner_bin.display(),
        args.jobs,
        args.idle_secs
    );

    let mut to_child = Vec::with_capacity(args.jobs);
    let mut to_started = Vec::with_capacity(args.jobs);
    let mut started_to_child = Vec::with_capacity(args.jobs);
    let mut last_job = String::new();
    for _ in 0..args.jobs {
        // The child's first act is to print the wall clock in ms (a bash builtin: no
        // extra process in between).
        let req = EnqueueRequest::new(
            "action.script",
            serde_json::json!({"script": "echo $(( ${EPOCHREALTIME/./} / 1000 ))", "interpreter": "/bin/bash"}),
        );
        let enqueued = byoc_control_plane::state::unix_ms();
        let id = cp.enqueue(req).map_err(|e| anyhow::anyhow!("{e}"))?;
        last_job = id.clone();
        let v = cp
            .wait_for(&id, Duration::from_secs(30), |v| v.result.is_some())
            .await
            .context("job did not finish")?;
        // The last line is the job's; a `[sandbox]` line about its limits comes first.
        let log = String::from_utf8_lossy(&cp.log(&id).unwrap_or_default())
            .trim()
            .lines()
            .last()
            .unwrap_or("")
            .to_string();
        let child_ms: u64 = log.parse().with_context(|| format!("job printed {log:?}"))?;
        to_child.push(child_ms.saturating_sub(enqueued));
        if let Some(started) = v.result.as_ref().and_then(|r| r.started_at_ms) {
            started_to_child.push(child_ms.saturating_sub(started));
        }
        if let Some(p) = v.pickup_ms {
            to_started.push(p);
        }
    }
    to_child.sort_unstable();
    to_started.sort_unstable();
    started_to_child.sort_unstable();
    println!(
        "pickup latency, enqueue -> child process running: p50 {} ms, p99 {} ms, max {} ms (n={})",
        percentile(&to_child, 0.5),
        percentile(&to_child, 0.99),
        to_child.last().unwrap_or(&0),
        to_child.len()
    );
    println!(
        "pickup latency, enqueue -> runner journaled 'started': p50 {} ms, p99 {} ms",
        percentile(&to_started, 0.5),
        percentile(&to_started, 0.99)
    );
    // The same figure the VM suite prints for its guest (cgroup v2), both on one clock.
    println!(
        "pickup, runner started -> child running: p50 {} ms, p99 {} ms (the VM suite prints the guest's)",
        percentile(&started_to_child, 0.5),
        percentile(&started_to_child, 0.99)
    );

    if args.output_mib > 0 {
        output_path_bench(&cp, args.output_mib).await?;
    }
    if args.container_output_mib > 0 {
        container_output_bench(&cp, args.container_output_mib).await?;
    }
    if args.soak_jobs > 0 {
        soak(&cp, runner.pid().context("runner exited")?, args.soak_jobs).await?;
        let state = dir.path().join("state");
        let lines =
            std::fs::read_to_string(state.join("journal.jsonl")).map(|t| t.lines().count()).unwrap_or(0);
        let archives = std::fs::read_dir(state.join("journal-archive")).map(|d| d.count()).unwrap_or(0);
        println!("soak: the journal holds {lines} lines; {archives} archive files");
    }

    // The last job's closing record (its result acknowledged) is written and uploaded
    // after the result: let that finish, so the idle window counts idle traffic only.
    let runner_id = cp.runners().first().map(|r| r.runner_id.clone()).unwrap_or_default();
    let audit_log = dir.path().join("state").join("audit").join(byoc_audit::log::LOG);
    let closing = format!("\"event\":\"job_reported\",\"job\":\"{last_job}\"");
    let settled = |cp: &ControlPlane| {
        let log = std::fs::read_to_string(&audit_log).unwrap_or_default();
        (last_job.is_empty() || log.contains(&closing))
            && cp.audit_size(&runner_id) >= log.lines().count() as u64
    };
    if !cp.wait_until(Duration::from_secs(30), settled).await {
        bail!("the runner's audit records were not acknowledged within 30 s");
    }
    let counts_before = cp.request_counts();
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let counts_after = cp.request_counts();
    let before: u64 = counts_before.values().sum();
    let after: u64 = counts_after.values().sum();
    let by_kind: Vec<String> = counts_after
        .iter()
        .map(|(k, n)| (k, n - counts_before.get(k).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let pid = runner.pid().context("runner exited")?;
    let rss = rss_kib(pid).context("reading runner RSS")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    println!(
        "idle RSS after {} s: {:.1} MiB ({} KiB: heap, stacks and relocated data {} KiB, the binary's and libraries' pages {} KiB, of which the binary's code {} KiB)",
        args.idle_secs,
        rss as f64 / 1024.0,
        rss,
        kib("RssAnon:"),
        kib("RssFile:") + kib("RssShmem:"),
        resident_code_kib(pid, &runner_bin)
    );
    println!(
        "idle requests: {} in {} s = {:.2} per minute ({})",
        after - before,
        args.idle_secs,
        (after - before) as f64 * 60.0 / args.idle_secs as f64,
        by_kind.join(", ")
    );
    println!("targets: pickup p50 <= 20 ms, idle RSS <= 12 MiB, <= 2 requests/minute idle");
    println!(
        "reference: the best existing runner of this kind short-polls every 5 s (12 requests/minute idle, pickup up to 5 s); it is not available offline to run here"
    );
    runner.kill9().await;
    Ok(())
}
