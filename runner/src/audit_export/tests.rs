use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// A sink that stores batches in memory as the S3 layout would, and fails while told to.
#[derive(Default)]
struct Fake {
    objects: Mutex<BTreeMap<String, Vec<u8>>>,
    failing: AtomicBool,
    target: String,
    puts: std::sync::atomic::AtomicU64,
}

use std::collections::BTreeMap;

impl Fake {
    fn store(&self, stream: byoc_audit::export::Stream, from: u64, lines: &[String]) {
        if lines.is_empty() {
            return;
        }
        let body: Vec<u8> = lines.iter().flat_map(|l| format!("{l}\n").into_bytes()).collect();
        let name = byoc_audit::export::object_name(stream, from, from + lines.len() as u64);
        self.objects.lock().unwrap().insert(name, body);
    }
}

impl Sink for Arc<Fake> {
    fn kind(&self) -> &'static str {
        "s3"
    }
    fn target(&self) -> String {
        self.target.clone()
    }
    fn put_keys<'a>(&'a self, keys: &'a PublishedKeys) -> SinkFuture<'a> {
        Box::pin(async move {
            if self.failing.load(Ordering::SeqCst) {
                return Err(SinkError("connection refused".into()));
            }
            let mut o = self.objects.lock().unwrap();
            o.insert(byoc_audit::log::RUNNER_PUB.into(), keys.runner_pub.clone().into_bytes());
            o.insert(byoc_audit::log::CONTROL_PLANE_PUB.into(), keys.control_plane_pub.clone().into_bytes());
            Ok(())
        })
    }
    fn put<'a>(&'a self, batch: &'a Batch) -> SinkFuture<'a> {
        Box::pin(async move {
            if self.failing.load(Ordering::SeqCst) {
                return Err(SinkError("connection refused".into()));
            }
            use byoc_audit::export::Stream;
            self.store(Stream::Records, batch.records_from, &batch.records);
            self.store(Stream::Checkpoints, batch.checkpoints_from, &batch.checkpoints);
            self.store(Stream::Cosigned, batch.cosigned_from, &batch.cosigned);
            self.puts.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

struct Setup {
    dir: tempfile::TempDir,
    audit: Arc<crate::audit::Audit>,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let key = byoc_protocol::generate_signing_key();
    let (audit, _) = crate::audit::Audit::open(dir.path(), key, "rn-1", "inst-1", &[]).unwrap();
    Setup { dir, audit: Arc::new(audit) }
}

fn exporter(s: &Setup, sink: &Arc<Fake>, batch_records: usize) -> Exporter {
    Exporter {
        sink: Box::new(sink.clone()),
        state_dir: s.dir.path().to_path_buf(),
        audit: s.audit.clone(),
        batch_records,
        retry_max: Duration::from_millis(20),
    }
}

fn records(s: &Setup, n: usize) {
    for i in 0..n {
        s.audit.record(Record { event: format!("e{i}"), ..Default::default() }).unwrap();
    }
}

/// Run the exporter until every sink's cursor reaches the log's size, then stop it.
async fn deliver(s: &Setup, sink: &Arc<Fake>, batch_records: usize) {
    let stop = CancellationToken::new();
    let task = tokio::spawn(exporter(s, sink, batch_records).run(stop.clone()));
    let dir = s.dir.path().to_path_buf();
    let ok = tokio::time::timeout(Duration::from_secs(20), async {
        while !(caught_up(&dir, s.audit.size())
            && load_state(&dir, "s3").is_some_and(|st| st.failing_since_ms.is_none()))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    assert!(ok.is_ok(), "the export never caught up: {:?}", load_state(&dir, "s3"));
}

fn verify_copy(objects: &BTreeMap<String, Vec<u8>>) -> Result<byoc_audit::verify::Report, copy::CopyError> {
    let work = tempfile::tempdir().unwrap();
    copy::verify(&copy::Source::Dir("/copy".into()), objects, work.path(), None).map(|(r, _, _)| r)
}

#[test]
fn batches_hold_records_only_up_to_a_checkpoint_and_cosignatures_of_what_they_hold() {
    let s = setup();
    records(&s, 5);
    let audit_dir = s.audit.dir().to_path_buf();
    // A record written but not yet checkpointed (the writer does both under one lock;
    // here: appended by hand) is not part of a batch.
    let (batch, next) = next_batch(&audit_dir, &SinkState::default(), 1000).unwrap().unwrap();
    let total = s.audit.size();
    assert_eq!((batch.records_from, batch.records.len() as u64), (0, total));
    assert_eq!(next.records, total);
    assert!(!batch.checkpoints.is_empty());
    assert_eq!(next.checkpoints, batch.checkpoints.len() as u64);
    assert!(next_batch(&audit_dir, &next, 1000).unwrap().is_none());
    std::fs::OpenOptions::new()
        .append(true)
        .open(audit_dir.join(LOG))
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"seq\":99"))
        .unwrap();
    assert!(next_batch(&audit_dir, &next, 1000).unwrap().is_none(), "a torn line is not sent");

    // Small batches: one checkpoint at a time when each covers more than the limit.
    let (small, _) = next_batch(&audit_dir, &SinkState::default(), 1).unwrap().unwrap();
    assert_eq!(small.checkpoints.len(), 1);
    assert!(small.records.len() <= 2);
}

#[tokio::test]
async fn a_copy_survives_an_outage_and_a_restart_with_no_gap_and_verifies() {
    let s = setup();
    let sink = Arc::new(Fake { target: "s3://b/p/rn-1".into(), ..Default::default() });
    records(&s, 3);
    deliver(&s, &sink, 2).await;
    let first = load_state(s.dir.path(), "s3").unwrap();
    assert_eq!(first.records, s.audit.size());

    // An outage: records keep coming (jobs are not held up), the sink refuses.
    sink.failing.store(true, Ordering::SeqCst);
    let stop = CancellationToken::new();
    let task = tokio::spawn(exporter(&s, &sink, 2).run(stop.clone()));
    records(&s, 4);
    let dir = s.dir.path().to_path_buf();
    tokio::time::timeout(Duration::from_secs(20), async {
        while load_state(&dir, "s3").is_none_or(|st| st.errors_total < 2) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    stop.cancel();
    task.await.unwrap();
    let failing = load_state(&dir, "s3").unwrap();
    assert!(
        failing.failing_since_ms.is_some() && failing.last_error.as_deref() == Some("connection refused")
    );
    assert_eq!(failing.records, first.records, "nothing counted as delivered while failing");
    // One record for the outage, however many failures.
    let lines = byoc_audit::log::read_lines(s.audit.dir(), 0, u64::MAX).unwrap();
    assert_eq!(lines.iter().filter(|l| l.contains("\"audit_export_failed\"")).count(), 1);

    // Back, after a restart: resumes from the cursor and records the recovery.
    sink.failing.store(false, Ordering::SeqCst);
    records(&s, 2);
    deliver(&s, &sink, 2).await;
    let lines = byoc_audit::log::read_lines(s.audit.dir(), 0, u64::MAX).unwrap();
    assert!(lines.iter().any(|l| l.contains("\"audit_export_resumed\"")));
    // The resumed record itself reaches the copy.
    deliver(&s, &sink, 2).await;
    let objects = sink.objects.lock().unwrap().clone();
    let report = verify_copy(&objects).unwrap();
    assert_eq!(report.records, s.audit.size());
}

#[tokio::test]
async fn a_batch_sent_again_after_a_crash_is_read_once_and_a_removed_object_is_a_gap() {
    let s = setup();
    let sink = Arc::new(Fake { target: "s3://b/p/rn-1".into(), ..Default::default() });
    records(&s, 4);
    deliver(&s, &sink, 3).await;
    // A crash after the sink stored a batch but before the cursor moved: the cursor
    // file is from before.
    let before = load_state(s.dir.path(), "s3").unwrap();
    records(&s, 3);
    deliver(&s, &sink, 1000).await;
    save_state(s.dir.path(), &before).unwrap();
    records(&s, 1);
    deliver(&s, &sink, 1000).await;
    let objects = sink.objects.lock().unwrap().clone();
    assert_eq!(verify_copy(&objects).unwrap().records, s.audit.size());

    let mut damaged = objects.clone();
    let victim = damaged.keys().find(|k| k.starts_with("records/")).cloned().unwrap();
    damaged.remove(&victim);
    let err = verify_copy(&damaged).err().unwrap();
    assert!(err.to_string().contains("missing"), "{err}");

    // A record altered in place: named with its object.
    let mut altered = objects.clone();
    let (name, body) =
        altered.iter().find(|(k, _)| k.starts_with("records/")).map(|(k, v)| (k.clone(), v.clone())).unwrap();
    let text = String::from_utf8(body).unwrap().replacen("\"e1\"", "\"e9\"", 1);
    altered.insert(name.clone(), text.into_bytes());
    let only = altered.keys().filter(|k| k.starts_with("records/")).cloned().collect::<Vec<_>>();
    // Keep one object per range so the alteration is not a conflict with a repeat.
    for k in only.iter().filter(|k| **k != name) {
        if byoc_audit::export::parse_object_name(k).map(|(_, f, _)| f)
            == byoc_audit::export::parse_object_name(&name).map(|(_, f, _)| f)
        {
            altered.remove(k);
        }
    }
    let err = verify_copy(&altered).err().unwrap().to_string();
    assert!(err.contains(&name) || err.contains("disagree"), "{err}");
}

#[tokio::test]
async fn a_new_target_starts_a_new_copy_and_a_removed_sink_stops_with_a_record() {
    let s = setup();
    let sink = Arc::new(Fake { target: "s3://b/p/rn-1".into(), ..Default::default() });
    records(&s, 2);
    deliver(&s, &sink, 1000).await;
    let other = Arc::new(Fake { target: "s3://other/p/rn-1".into(), ..Default::default() });
    deliver(&s, &other, 1000).await;
    assert!(
        other.objects.lock().unwrap().contains_key(&byoc_audit::export::object_name(
            byoc_audit::export::Stream::Records,
            0,
            1
        )) || other.objects.lock().unwrap().keys().any(|k| k.starts_with("records/00000000000000000000-"))
    );
    let lines = byoc_audit::log::read_lines(s.audit.dir(), 0, u64::MAX).unwrap();
    assert!(lines.iter().any(|l| l.contains("audit_export_started") && l.contains("was s3://b/p/rn-1")));

    forget_removed(s.dir.path(), &AuditExportConfig::default(), &s.audit);
    assert!(load_state(s.dir.path(), "s3").is_none());
    let lines = byoc_audit::log::read_lines(s.audit.dir(), 0, u64::MAX).unwrap();
    assert!(lines.iter().any(|l| l.contains("\"audit_export_stopped\"") && l.contains("s3://other/p/rn-1")));
}

#[tokio::test]
async fn a_sink_that_names_its_own_region_needs_no_aws_region() {
    let key = byoc_protocol::b64(byoc_protocol::generate_signing_key().verifying_key().as_bytes());
    let text = format!(
        "[control_plane]\nurl = \"https://cp.example.com\"\npublic_keys = [\"{key}\"]\n[runner]\ninstall_id = \"inst-1\"\n\
         [audit.export.s3]\nbucket = \"acme-audit\"\nregion = \"eu-west-1\"\n"
    );
    let config = Config::parse(&text, "test", Vec::new()).unwrap();
    let sinks = sinks(&config, "rn-1").await.unwrap();
    assert_eq!(sinks.iter().map(|s| s.target()).collect::<Vec<_>>(), ["s3://acme-audit/byoc-audit/rn-1"]);
    // Without any region the configuration is refused before anything starts.
    let text = text.replace("region = \"eu-west-1\"\n", "");
    let err = Config::parse(&text, "test", Vec::new()).err().unwrap();
    assert!(err.problems.iter().any(|p| p.contains("audit.export.s3.region")), "{:?}", err.problems);
}
