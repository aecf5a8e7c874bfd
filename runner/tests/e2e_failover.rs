//! Two runners of one install against the reference control plane: a runner frozen
//! mid-job (SIGSTOP) loses its lease; the job is leased anew, under a higher fencing
//! epoch, to the other runner, which runs it once; when the first resumes, its
//! heartbeat, log and result are refused as fenced, it stops the job and journals
//! `fenced`, and the control plane keeps the second runner's result. A job that changes
//! infrastructure is not leased anew until the vendor says the first runner stopped
//! (the reference control plane's rule, tested in `byoc_control_plane::state`).
//! A Spot interruption or an Auto Scaling termination, announced by the metadata
//! service, makes a runner drain: it hands over what cannot finish in time and
//! completes the lifecycle action once drained.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::time::Duration;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::imds::FakeImds;
use byoc_control_plane::moto::MotoServer;
use byoc_control_plane::server::{ControlPlane, ControlPlaneConfig};
use byoc_protocol::JobStatus;
use common::*;
use nix::sys::signal::Signal;

/// Leases of 3 s (heartbeats every second): a frozen runner loses its job quickly.
const LEASE_SECS: u64 = 3;

struct Pair {
    cp: ControlPlane,
    /// The install's bootstrap token: it enrolls two serving runners.
    token: String,
    /// The install's bucket both runners copy their audit logs into.
    moto: MotoServer,
    a: RunnerProcess,
    b: RunnerProcess,
    a_id: String,
    b_id: String,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

async fn pair() -> Pair {
    pair_with(|_| RunnerOptions::default()).await
}

/// Two runners; A gets `a_opts` besides the suite's own.
async fn pair_with(a_opts: impl Fn(&Path) -> RunnerOptions) -> Pair {
    let cp = ControlPlane::start(ControlPlaneConfig {
        lease_secs: LEASE_SECS,
        offer_timeout: Duration::from_secs(3),
        ..Default::default()
    })
    .await
    .unwrap();
    let moto = MotoServer::start().await;
    moto.create_bucket("acme-audit").await;
    let export = format!(
        "\n[aws]\nregion = \"us-east-1\"\nendpoint_url = \"{}\"\n\n[audit.export.s3]\nbucket = \"acme-audit\"\n",
        moto.url()
    );
    let aws_env: Vec<(String, String)> = vec![
        ("AWS_ACCESS_KEY_ID".into(), "runner-instance-identity".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "runner-instance-secret".into()),
        ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
    ];
    let opts = |dir: &Path| RunnerOptions {
        poll_wait_secs: 2,
        extra: export.clone(),
        env: aws_env.clone(),
        ..test_options(dir)
    };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // A's own settings come after the shared ones (its [aws] replaces theirs).
    let own = a_opts(da.path());
    let base = opts(da.path());
    let a_opts = if own.extra.contains("[aws]") {
        RunnerOptions { extra: own.extra, env: own.env, ..base }
    } else {
        let mut env = base.env.clone();
        env.retain(|(k, _)| !own.env.iter().any(|(o, _)| o == k));
        env.extend(own.env);
        RunnerOptions { extra: base.extra.clone() + &own.extra, env, ..base }
    };
    // Both enroll with the install's token (as the instances of its Auto Scaling group do).
    let token = cp.install_token(2);
    let start = |dir: &Path, opts: &RunnerOptions| {
        let mut r = RunnerProcess::prepare(Path::new(BIN), dir, &cp, opts).unwrap();
        r.spawn(Some(token.clone())).unwrap();
        r
    };
    let a = start(da.path(), &a_opts);
    assert!(wait_polling(&cp, WAIT).await, "{}", a.log());
    let a_id = cp.runners()[0].runner_id.clone();
    let b = start(db.path(), &opts(db.path()));
    assert!(
        cp.wait_until(WAIT, |cp| cp.runners().iter().filter(|r| r.polls > 0).count() == 2).await,
        "{}",
        b.log()
    );
    let b_id = cp.runners().into_iter().find(|r| r.runner_id != a_id).unwrap().runner_id;
    Pair { cp, token, moto, a, b, a_id, b_id, _dirs: (da, db) }
}

/// Live (not zombie) processes descended from `pid`, with their command lines.
fn descendants(pid: u32) -> Vec<(i32, String)> {
    let parent_of = |p: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        stat.rsplit(')').next()?.split_whitespace().nth(1)?.parse().ok()
    };
    processes_matching("")
        .into_iter()
        .filter(|&p| {
            let mut at = p;
            while let Some(up) = parent_of(at).filter(|&up| up > 1) {
                if up == pid as i32 {
                    return true;
                }
                at = up;
            }
            false
        })
        .map(|p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            (p, String::from_utf8_lossy(&cmd).replace('\0', " "))
        })
        .collect()
}

fn journal_events(state_dir: &Path, job_id: &str) -> Vec<String> {
    std::fs::read_to_string(state_dir.join("journal.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["job_id"] == job_id)
        .map(|v| v["event"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test]
async fn a_frozen_runner_loses_its_lease_and_is_fenced_when_it_wakes() {
    let p = pair().await;
    let job =
        p.cp.enqueue(EnqueueRequest {
            runner_id: Some(p.a_id.clone()),
            ..EnqueueRequest::new(
                "action.script",
                serde_json::json!({"script": "echo begun; sleep 6; echo ended"}),
            )
        })
        .unwrap();
    // Running on A: then A freezes (a hung VM, a stalled disk).
    let a_pid = p.a.pid().unwrap();
    eventually("A's job is running and its first line uploaded", async || {
        descendants(a_pid).iter().any(|(_, cmd)| cmd.starts_with("sleep 6"))
            && p.cp.log(&job).is_some_and(|l| String::from_utf8_lossy(&l).contains("begun"))
    })
    .await;
    p.a.signal(Signal::SIGSTOP);

    // The lease runs out; B gets the job under epoch 2. A's job was held to its lease
    // (two runners, a sandboxed job): it stopped by itself before B could have it, with
    // A still frozen. Nothing of it runs beside B's.
    let handed = p.cp.wait_for(&job, WAIT, |v| v.leases.len() == 2).await.unwrap();
    let left = descendants(a_pid);
    assert!(left.is_empty(), "A's job outlived its lease: {left:?}");
    assert!(handed.lease_bound, "B holds it to its lease too");
    let view = p.cp.wait_for(&job, WAIT, |v| v.result.is_some()).await.unwrap();
    assert_eq!(view.result.as_ref().unwrap().status, JobStatus::Succeeded, "{}", p.b.log());
    assert_eq!(view.leases, [(p.a_id.clone(), 1), (p.b_id.clone(), 2)]);
    assert_eq!((view.claimed_by.as_deref(), view.epoch), (Some(p.b_id.as_str()), 2));
    assert_eq!(started_count(&p.b.state_dir, &job), 1, "the job ran once on B");
    let b_log = p.cp.log(&job).unwrap();
    let text = String::from_utf8_lossy(&b_log);
    // The log of the new lease is B's run alone; A's part stays with its epoch.
    assert!(text.contains("ended") && text.matches("begun").count() == 1, "{text}");
    let earlier = p.cp.earlier_logs(&job);
    assert_eq!(earlier.len(), 1);
    assert!(earlier[0].0 == 1 && String::from_utf8_lossy(&earlier[0].1).contains("begun"), "{earlier:?}");

    // A wakes: its next heartbeat or result is fenced; it stops and journals it.
    p.a.signal(Signal::SIGCONT);
    eventually("A journaled the job as fenced", async || {
        journal_events(&p.a.state_dir, &job).last().map(String::as_str) == Some("fenced")
    })
    .await;
    let after = p.cp.job(&job).unwrap();
    assert!(after.fenced.iter().all(|(r, e, _)| *r == p.a_id && *e == 1), "{:?}", after.fenced);
    assert!(!after.fenced.is_empty());
    // A's own log of its attempt: begun, stopped by the lease, never ended.
    let a_log = std::fs::read_to_string(p.a.state_dir.join(format!("spool/{job}.log"))).unwrap();
    assert!(a_log.contains("begun") && a_log.contains("lease ran out"), "{a_log}");
    assert!(!a_log.contains("ended"), "{a_log}");
    // B's result and log stand; A reported nothing.
    assert_eq!(after.result, view.result);
    assert_eq!(p.cp.log(&job).unwrap(), b_log);
    let events = journal_events(&p.a.state_dir, &job);
    assert!(!events.contains(&"reported".to_string()), "{events:?}");
    let fenced = audit_events(&p.a.state_dir, "job_fenced");
    assert_eq!(fenced.len(), 1, "{fenced:?}");
    assert!(fenced[0]["detail"].as_str().unwrap().contains("epoch"), "{fenced:?}");
    // The customer sees it on A.
    let shown = p.a.cli(&["jobs", "show", &job, "-o", "json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["phase"], "fenced", "{shown}");
    // `status` counts it as fenced on A and as succeeded on B: which runner ran it.
    let status = |r: &RunnerProcess| -> serde_json::Value {
        serde_json::from_slice(&r.cli(&["status", "-o", "json"]).stdout).unwrap()
    };
    assert_eq!(status(&p.a)["jobs_by_status"]["fenced"], 1);
    assert_eq!(status(&p.b)["jobs_by_status"]["succeeded"], 1);
    // A's job process is gone (stopped when fenced, or ended on its own).
    assert!(gone(&job).await.is_empty());

    // The install's whole trail, both runners' copies in the customer's bucket, checks
    // from the copy alone: A's says it was fenced, B's that it ran the job.
    eventually("both runners' copies hold their whole logs", async || {
        [&p.a.state_dir, &p.b.state_dir].iter().all(|d| {
            let st = byoc_runner::audit_export::status(d);
            let signed = byoc_runner::audit_export::latest_checkpoint_size(&d.join("audit"));
            st.len() == 1 && Some(st[0].delivered_records) == signed
        })
    })
    .await;
    let out = p.a.cli(&[
        "audit",
        "verify",
        "--from",
        "s3://acme-audit/byoc-audit",
        "--region",
        "us-east-1",
        "--endpoint-url",
        &p.moto.url(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    for id in [&p.a_id, &p.b_id] {
        assert!(stdout.contains(&format!("ok: s3://acme-audit/byoc-audit/{id}: ")), "{stdout}");
    }
    let keys = p.moto.s3_keys("acme-audit").await;
    let mut a_copy = String::new();
    for k in keys.iter().filter(|k| k.starts_with(&format!("byoc-audit/{}/records/", p.a_id))) {
        a_copy += &String::from_utf8(p.moto.s3_object("acme-audit", k).await.unwrap()).unwrap();
    }
    assert!(a_copy.contains("\"job_fenced\""), "{a_copy}");
}

#[tokio::test]
async fn a_runner_killed_while_frozen_comes_back_fenced_under_its_journaled_epoch() {
    let mut p = pair().await;
    let job =
        p.cp.enqueue(EnqueueRequest {
            runner_id: Some(p.a_id.clone()),
            ..EnqueueRequest::new(
                "action.script",
                serde_json::json!({"script": "echo begun; sleep 3; echo ended"}),
            )
        })
        .unwrap();
    eventually("A started the job", async || started_count(&p.a.state_dir, &job) == 1).await;
    p.a.signal(Signal::SIGSTOP);
    let view = p.cp.wait_for(&job, WAIT, |v| v.result.is_some()).await.unwrap();
    assert_eq!(view.epoch, 2);
    // A dies frozen (a reset VM); at its next start it settles the interrupted job and
    // reports it under the epoch its journal holds: fenced, journaled, not reported.
    p.a.kill9().await;
    p.a.spawn(None).unwrap();
    eventually("A journaled the job as fenced after its restart", async || {
        journal_events(&p.a.state_dir, &job).last().map(String::as_str) == Some("fenced")
    })
    .await;
    let after = p.cp.job(&job).unwrap();
    assert_eq!(after.result, view.result, "B's result stands");
    // Its log upload (before the result) is the first thing refused.
    assert!(after.fenced.iter().all(|(r, e, _)| *r == p.a_id && *e == 1), "{:?}", after.fenced);
    assert!(!after.fenced.is_empty());
}

/// A runner that watches the fake metadata service (and names its Auto Scaling group).
fn watching(imds: &FakeImds, aws: Option<&str>) -> impl Fn(&Path) -> RunnerOptions {
    let imds = imds.url.clone();
    let aws = aws.map(str::to_string);
    move |_| {
        let mut extra = "\n[lifecycle]\nwatch = true\npoll_secs = 1\nmargin_secs = 2\n".to_string();
        if let Some(url) = &aws {
            extra += &format!(
                "autoscaling_group = \"byoc-runners\"\nlifecycle_hook = \"drain\"\n\n[aws]\nregion = \"us-east-1\"\nendpoint_url = \"{url}\"\n"
            );
        }
        RunnerOptions {
            extra,
            env: vec![
                ("AWS_EC2_METADATA_SERVICE_ENDPOINT".into(), imds.clone()),
                ("AWS_ACCESS_KEY_ID".into(), "runner-instance-identity".into()),
                ("AWS_SECRET_ACCESS_KEY".into(), "runner-instance-secret".into()),
            ],
            ..Default::default()
        }
    }
}

#[tokio::test]
async fn a_spot_interruption_hands_the_running_job_over_to_the_other_runner() {
    let imds = FakeImds::start().await.unwrap();
    let mut p = pair_with(watching(&imds, None)).await;
    let job =
        p.cp.enqueue(EnqueueRequest {
            runner_id: Some(p.a_id.clone()),
            ..EnqueueRequest::new(
                "action.script",
                serde_json::json!({"script": "echo begun; sleep 8; echo ended"}),
            )
        })
        .unwrap();
    eventually("A started the job", async || started_count(&p.a.state_dir, &job) == 1).await;
    // Two minutes in real life; here 5 s, of which A keeps 2 s for the stop.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    imds.spot_notice("terminate", now + 5);

    // A takes nothing new, stops the job it cannot finish, reports nothing for it and
    // exits cleanly, retiring from the install on the way, which hands B the job at
    // once; B runs it to the end.
    let status = p.a.wait_exit(WAIT).await.expect("A stops");
    assert!(status.success(), "{}", p.a.log());
    let view = p.cp.wait_for(&job, WAIT, |v| v.result.is_some()).await.unwrap();
    assert_eq!(
        view.result.as_ref().unwrap().status,
        JobStatus::Succeeded,
        "{view:?}\n{}",
        String::from_utf8_lossy(&p.cp.log(&job).unwrap())
    );
    assert_eq!(view.leases, [(p.a_id.clone(), 1), (p.b_id.clone(), 2)]);
    assert!(String::from_utf8_lossy(&p.cp.log(&job).unwrap()).contains("ended"));
    let notice = audit_events(&p.a.state_dir, "lifecycle_notice");
    assert_eq!(notice.len(), 1);
    // A left the install: its place is free for the instance that replaces it.
    assert_eq!(audit_events(&p.a.state_dir, "runner_retired").len(), 1);
    assert!(p.cp.runners().iter().any(|r| r.runner_id == p.a_id && r.retired));
    assert!(notice[0]["detail"].as_str().unwrap().starts_with("spot terminate at "), "{notice:?}");
    assert!(!journal_events(&p.a.state_dir, &job).contains(&"reported".to_string()));
    assert!(gone(&job).await.is_empty());
}

/// What Auto Scaling was told: each call's form and whether it was signed.
#[derive(Clone, Default)]
struct Calls(std::sync::Arc<std::sync::Mutex<Vec<(String, bool)>>>);

async fn autoscaling(
    axum::extract::State(calls): axum::extract::State<Calls>,
    headers: axum::http::HeaderMap,
    body: String,
) -> &'static str {
    let signed = headers.get("authorization").and_then(|v| v.to_str().ok()).is_some_and(|a| {
        a.starts_with("AWS4-HMAC-SHA256") && a.contains("/us-east-1/autoscaling/aws4_request")
    });
    calls.0.lock().unwrap().push((body, signed));
    "<CompleteLifecycleActionResponse><ResponseMetadata><RequestId>1</RequestId></ResponseMetadata></CompleteLifecycleActionResponse>"
}

#[tokio::test]
async fn an_autoscaling_termination_drains_then_completes_the_lifecycle_action() {
    let calls = Calls::default();
    let app = axum::Router::new().route("/", axum::routing::post(autoscaling)).with_state(calls.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let aws = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let imds = FakeImds::start().await.unwrap();
    let mut p = pair_with(watching(&imds, Some(&aws))).await;
    let job =
        p.cp.enqueue(EnqueueRequest {
            runner_id: Some(p.a_id.clone()),
            ..EnqueueRequest::new(
                "action.script",
                serde_json::json!({"script": "sleep 2; echo finished here"}),
            )
        })
        .unwrap();
    eventually("A started the job", async || started_count(&p.a.state_dir, &job) == 1).await;
    // Both of the install's places are taken: a third instance's runner is refused.
    let dx = tempfile::tempdir().unwrap();
    let mut x = RunnerProcess::prepare(Path::new(BIN), dx.path(), &p.cp, &test_options(dx.path())).unwrap();
    x.spawn(Some(p.token.clone())).unwrap();
    let refused = x.wait_exit(WAIT).await.expect("a third runner stops");
    assert!(!refused.success());
    assert!(x.log().contains("runners are serving"), "{}", x.log());
    imds.target_lifecycle_state("Terminated");
    // The job fits in the hook's time: A finishes and reports it, then lets the
    // instance go, and exits.
    let status = p.a.wait_exit(WAIT).await.expect("A stops");
    assert!(status.success(), "{}", p.a.log());
    let view = p.cp.job(&job).unwrap();
    assert_eq!(view.result.as_ref().map(|r| r.status), Some(JobStatus::Succeeded));
    assert_eq!(view.leases, [(p.a_id.clone(), 1)], "A finished it itself");
    let calls = calls.0.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let (form, signed) = &calls[0];
    assert!(signed, "signed under the runner's identity");
    let form: std::collections::BTreeMap<String, String> =
        url::form_urlencoded::parse(form.as_bytes()).into_owned().collect();
    assert_eq!(form["Action"], "CompleteLifecycleAction");
    assert_eq!(form["AutoScalingGroupName"], "byoc-runners");
    assert_eq!(form["LifecycleHookName"], "drain");
    assert_eq!(form["InstanceId"], byoc_control_plane::imds::INSTANCE_ID);
    assert_eq!(form["LifecycleActionResult"], "CONTINUE");
    assert_eq!(audit_events(&p.a.state_dir, "lifecycle_action_completed").len(), 1);
    // A retired before letting the instance go: the instance that replaces it enrolls
    // with the same token.
    assert_eq!(audit_events(&p.a.state_dir, "runner_retired").len(), 1);
    let dc = tempfile::tempdir().unwrap();
    let mut c = RunnerProcess::prepare(Path::new(BIN), dc.path(), &p.cp, &test_options(dc.path())).unwrap();
    c.spawn(Some(p.token.clone())).unwrap();
    assert!(
        p.cp.wait_until(WAIT, |cp| cp.runners().iter().filter(|r| !r.retired && r.polls > 0).count() == 2)
            .await,
        "{}",
        c.log()
    );
    server.abort();
}
