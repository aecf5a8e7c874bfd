//! `oci.sync` jobs end to end: the real runner binary and the reference control plane;
//! the vendor's registry (docker-registry with basic auth, reached with the job's
//! one-time token); the install's ECR as moto (CreateRepository, GetAuthorizationToken
//! under the job's assumed role) with its registry host mapped to a second local
//! docker-registry.
#![allow(clippy::unwrap_used)]

mod common;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::moto::MotoServer;
use byoc_control_plane::registry::{COSIGN_SIG, LocalRegistry, Pushed};
use byoc_protocol::JobStatus;
use common::roles::*;
use common::*;

const USER: &str = "vendor-sync";
const TOKEN: &str = "otk-5e2b9c1d7a8f403e9b6c";
/// moto's ECR registry for the example account.
const ECR_HOST: &str = "123456789012.dkr.ecr.us-east-1.amazonaws.com";

struct SyncEnv {
    env: Env,
    moto: MotoServer,
    src: LocalRegistry,
    ecr: LocalRegistry,
}

async fn sync_env() -> SyncEnv {
    let params = base_params();
    let (moto, src, ecr) = tokio::join!(
        moto_with_stack(&params),
        LocalRegistry::start(Some((USER, TOKEN))),
        LocalRegistry::start(None)
    );
    let mut opts = role_options(&moto, "");
    // The vendor's registry stands on this machine's loopback: reached only because the
    // runner's configuration names it, as the install's ECR is mapped.
    opts.extra.push_str(&format!(
        "\n[oci]\nchunk_mib = 5\nregistry_endpoints = {{ \"{ECR_HOST}\" = \"{}\", \"{}\" = \"{}\" }}\n",
        ecr.url(),
        src.host(),
        src.url()
    ));
    let env = env_with(opts).await;
    SyncEnv { env, moto, src, ecr }
}

fn sync_job(
    src: &LocalRegistry,
    repo: &str,
    artifact: &Pushed,
    token: &str,
    expires_at: Option<i64>,
) -> EnqueueRequest {
    EnqueueRequest {
        entity: "artifact".into(),
        operation: "sync".into(),
        requested_role: Some("inst-demo-maintenance".into()),
        app_config: Some(app_config()),
        role_request: Some(named("api-image")),
        ..EnqueueRequest::new(
            "oci.sync",
            serde_json::json!({
                "source": format!("{}/{repo}:1.4.0@{}", src.host(), artifact.digest),
                "source_credential": {"username": USER, "token": token, "expires_at": expires_at},
                "destination": {"repository": "inst-demo/api", "tags": ["1.4.0"]},
                "repository": {"immutable": true, "scan_on_push": true, "encryption": "AES256"},
            }),
        )
    }
}

fn audit(e: &SyncEnv) -> Vec<serde_json::Value> {
    audit_records(&e.env.runner.state_dir)
}

/// The one-time token appears nowhere: job log, result, audit log, runner log, state.
fn assert_token_absent(e: &SyncEnv, job: &str) {
    let v = e.env.cp.job(job).unwrap();
    let result = serde_json::to_string(&v.result).unwrap();
    assert!(!result.contains(TOKEN), "result: {result}");
    assert!(!e.env.output(job).contains(TOKEN));
    for (path, bytes) in every_file_under(&e.env.runner.dir) {
        assert!(!String::from_utf8_lossy(&bytes).contains(TOKEN), "the token is in {path}");
    }
}

#[tokio::test]
async fn an_image_with_its_signature_is_synced_into_ecr_and_resynced_for_free() {
    let e = sync_env().await;
    let img = e.src.push_random_image("acme/api", Some("1.4.0"), 3, 6_000_000, 21).await;
    let sig = e.src.push_referrer("acme/api", &img, COSIGN_SIG, b"cosign-signature").await;

    let id = e.env.cp.enqueue(sync_job(&e.src, "acme/api", &img, TOKEN, Some(i64::MAX / 2))).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{}", r.error, e.env.output(&id));
    let out = &r.outputs;
    assert_eq!(out["digest"], img.digest.as_str());
    assert_eq!(out["source"], format!("{}/acme/api@{}", e.src.host(), img.digest));
    assert_eq!(out["destination"], format!("{ECR_HOST}/inst-demo/api@{}", img.digest));
    assert_eq!(out["referrers"], 1);
    assert_eq!(out["repository_created"], true);
    assert!(out["bytes_moved"].as_u64().unwrap() > 18_000_000, "{out}");
    assert_eq!(out["bytes_skipped"], 0);
    // In the install's registry, tagged, with the signature findable.
    let (d, _) = e.ecr.manifest("inst-demo/api", "1.4.0").await.unwrap();
    assert_eq!(d, img.digest);
    assert!(e.ecr.manifest("inst-demo/api", &sig.digest).await.is_some());

    // ECR as AWS received it: the repository created with the install's settings,
    // both calls under the job's assumed role (not the runner's own identity).
    let created = e.moto.calls_of("CreateRepository").await;
    assert_eq!(created.len(), 1);
    assert_eq!(created[0].params["repositoryName"], "\"inst-demo/api\"");
    assert_eq!(created[0].params["imageTagMutability"], "\"IMMUTABLE\"");
    assert!(created[0].params["imageScanningConfiguration"].contains("true"));
    assert!(created[0].params["encryptionConfiguration"].contains("AES256"));
    assert_eq!(e.moto.calls_of("GetAuthorizationToken").await.len(), 1);
    let repos = e
        .moto
        .json_call("ecr", "AmazonEC2ContainerRegistry_V20150921.DescribeRepositories", serde_json::json!({}))
        .await;
    assert_eq!(repos["repositories"][0]["repositoryName"], "inst-demo/api");

    // One audit record for the artifact: references, digest, bytes.
    let records = audit(&e);
    let synced: Vec<_> = records.iter().filter(|r| r["event"] == "artifact_synced").collect();
    assert_eq!(synced.len(), 1);
    assert_eq!(synced[0]["job"], id.as_str());
    assert_eq!(synced[0]["role"], "inst-demo-maintenance");
    assert_eq!(synced[0]["digests"]["artifact"], img.digest.as_str());
    let detail = synced[0]["detail"].as_str().unwrap();
    assert!(detail.contains(&format!("{}/acme/api", e.src.host())) && detail.contains(ECR_HOST), "{detail}");
    assert!(detail.contains(&format!("{} bytes moved", out["bytes_moved"])), "{detail}");
    assert_token_absent(&e, &id);

    // Again: the repository exists, every blob is present, zero bytes move.
    let again = e.env.cp.enqueue(sync_job(&e.src, "acme/api", &img, TOKEN, None)).unwrap();
    let r2 = e.env.finished(&again).await.result.unwrap();
    assert_eq!(r2.status, JobStatus::Succeeded, "{:?}", r2.error);
    assert_eq!((r2.outputs["bytes_moved"].as_u64(), r2.outputs["bytes_read"].as_u64()), (Some(0), Some(0)));
    assert_eq!(r2.outputs["bytes_skipped"], out["bytes_moved"]);
    assert_eq!(r2.outputs["repository_created"], false);
    assert_eq!(e.moto.calls_of("CreateRepository").await.len(), 1);
}

#[tokio::test]
async fn wrong_and_expired_tokens_fail_with_errors_naming_the_source() {
    let e = sync_env().await;
    let img = e.src.push_random_image("acme/api", Some("1.4.0"), 1, 1000, 22).await;
    let wrong = "otk-wrong-0000000000000";
    let id = e.env.cp.enqueue(sync_job(&e.src, "acme/api", &img, wrong, None)).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    let err = r.error.unwrap();
    assert!(
        err.contains("source registry") && err.contains("401") && err.contains("source_unauthorized"),
        "{err}"
    );
    assert_eq!(r.outputs["reason"], "source_unauthorized");
    assert!(!err.contains(wrong) && !e.env.output(&id).contains(wrong));

    let expired = e.env.cp.enqueue(sync_job(&e.src, "acme/api", &img, TOKEN, Some(1_000_000))).unwrap();
    let r = e.env.finished(&expired).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "source_credential_expired", "{:?}", r.error);
    assert!(r.error.unwrap().contains("source credential expired"));
    // Nothing was tagged by either.
    assert!(e.ecr.tags("inst-demo/api").await.is_empty());
    let failed: Vec<_> = audit(&e).into_iter().filter(|r| r["event"] == "artifact_sync_failed").collect();
    assert_eq!(failed.len(), 2);
    assert!(failed[0]["detail"].as_str().unwrap().contains("source_unauthorized"));
    assert!(failed[1]["detail"].as_str().unwrap().contains("source_credential_expired"));
    assert_token_absent(&e, &expired);
    for (path, bytes) in every_file_under(&e.env.runner.dir) {
        assert!(!String::from_utf8_lossy(&bytes).contains(wrong), "the wrong token is in {path}");
    }
}

#[tokio::test]
async fn a_sync_without_a_role_or_with_a_bad_spec_is_refused() {
    let e = sync_env().await;
    let img = e.src.push_random_image("acme/api", Some("1"), 1, 1000, 23).await;
    let no_role = EnqueueRequest {
        requested_role: None,
        app_config: None,
        role_request: None,
        ..sync_job(&e.src, "acme/api", &img, TOKEN, None)
    };
    let id = e.env.cp.enqueue(no_role).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert!(r.error.unwrap().contains("assumed role"));
    assert!(e.moto.calls_of("GetAuthorizationToken").await.is_empty());
    // No digest: rejected before the claim, with the reason.
    let mut bad = sync_job(&e.src, "acme/api", &img, TOKEN, None);
    bad.spec["source"] = format!("{}/acme/api:1", e.src.host()).into();
    let id = e.env.cp.enqueue(bad).unwrap();
    let v = e.env.rejected(&id).await;
    assert!(v.rejections[0].1.contains("digest"), "{:?}", v.rejections);
}
