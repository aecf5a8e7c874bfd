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
    sync_request(serde_json::json!({
        "source": format!("{}/{repo}:1.4.0@{}", src.host(), artifact.digest),
        "source_credential": {"username": USER, "token": token, "expires_at": expires_at},
        "destination": {"repository": "inst-demo/api", "tags": ["1.4.0"]},
        "repository": {"immutable": true, "scan_on_push": true, "encryption": "AES256"},
    }))
}

/// An `oci.sync` job with `spec`, under the maintenance role.
fn sync_request(spec: serde_json::Value) -> EnqueueRequest {
    EnqueueRequest {
        entity: "artifact".into(),
        operation: "sync".into(),
        requested_role: Some("inst-demo-maintenance".into()),
        app_config: Some(app_config()),
        role_request: Some(named("api-image")),
        ..EnqueueRequest::new("oci.sync", spec)
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

/// The vendor's registry in token mode (docker-registry verifying the control plane's
/// signed tokens), the control plane's token service honouring one-time grants.
struct GrantEnv {
    env: Env,
    _moto: MotoServer,
    tokens: std::sync::Arc<byoc_control_plane::grants::RegistryTokens>,
    src: LocalRegistry,
    ecr: LocalRegistry,
}

async fn grant_env() -> GrantEnv {
    let params = base_params();
    let (moto, ecr) = tokio::join!(moto_with_stack(&params), LocalRegistry::start(None));
    let tokens = byoc_control_plane::grants::RegistryTokens::start("vendor-registry").await;
    let src = LocalRegistry::start_token(&tokens).await;
    let mut opts = role_options(&moto, "");
    // The vendor's registry and its token realm stand on loopback: reached only because
    // the runner's configuration names them.
    let realm = tokens.addr.to_string();
    opts.extra.push_str(&format!(
        "\n[oci]\nregistry_endpoints = {{ \"{ECR_HOST}\" = \"{}\", \"{}\" = \"{}\", \"{realm}\" = \"http://{realm}\" }}\n",
        ecr.url(),
        src.host(),
        src.url()
    ));
    let env = env_with(opts).await;
    // The control plane mints grants with the jobs that ask for one.
    env.cp.use_registry_tokens(tokens.clone());
    GrantEnv { env, _moto: moto, tokens, src, ecr }
}

/// A sync job whose source credential is `credential` (a grant's value), or, with
/// `None`, one the control plane mints for it.
fn grant_job(src: &LocalRegistry, repo: &str, artifact: &Pushed, credential: Option<&str>) -> EnqueueRequest {
    let mut spec = serde_json::json!({
        "source": format!("{}/{repo}:1.4.0@{}", src.host(), artifact.digest),
        "destination": {"repository": "inst-demo/api", "tags": ["1.4.0"]},
    });
    match credential {
        Some(grant) => {
            spec["source_credential"] =
                serde_json::json!({"username": byoc_control_plane::grants::GRANT_USER, "token": grant});
        }
        None => spec["source_grant"] = serde_json::json!({"ttl_secs": 300}),
    }
    sync_request(spec)
}

/// Neither a grant nor a registry token (a JWT: `eyJ…`) in any file the runner wrote,
/// its log, the job's output or result.
fn assert_no_grant_or_token(e: &GrantEnv, job: &str, grant: &str) {
    let v = e.env.cp.job(job).unwrap();
    let result = serde_json::to_string(&v.result).unwrap();
    let output = e.env.output(job);
    for secret in [grant, "eyJ"] {
        assert!(!result.contains(secret), "{secret} in the result: {result}");
        assert!(!output.contains(secret), "{secret} in the job's output");
        for (path, bytes) in every_file_under(&e.env.runner.dir) {
            assert!(!String::from_utf8_lossy(&bytes).contains(secret), "{secret} is in {path}");
        }
    }
}

/// Pull once, with a grant minted for the job; the grant is spent by that exchange, and
/// a copy of it (a replayed job, or one copied out of a captured request) is refused at
/// the token service: the sync fails `source_grant_refused` and nothing is tagged.
#[tokio::test]
async fn a_one_time_grant_pulls_once_and_is_refused_after() {
    let e = grant_env().await;
    let img = e.src.push_random_image("acme/api", Some("1.4.0"), 2, 200_000, 31).await;

    // The control plane mints this job's grant with the job.
    let id = e.env.cp.enqueue(grant_job(&e.src, "acme/api", &img, None)).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    let grant = e.tokens.grant_of_job(&id).expect("a grant minted for the job");
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{}", r.error, e.env.output(&id));
    let (d, _) = e.ecr.manifest("inst-demo/api", "1.4.0").await.unwrap();
    assert_eq!(d, img.digest);
    // The audit record names the grant by digest, with the repository and the artifact.
    let grant_digest = format!("sha256:{}", byoc_protocol::sha256_hex(grant.as_bytes()));
    let synced: Vec<_> = audit_records(&e.env.runner.state_dir)
        .into_iter()
        .filter(|r| r["event"] == "artifact_synced" && r["job"] == id.as_str())
        .collect();
    assert_eq!(synced[0]["digests"]["source_credential"], grant_digest.as_str());
    assert_eq!(synced[0]["digests"]["artifact"], img.digest.as_str());
    assert!(synced[0]["detail"].as_str().unwrap().contains("/acme/api"));
    // The token service's evidence: which grant, when, from where; one exchange.
    let used: Vec<_> = e.tokens.exchanges().into_iter().filter(|x| x.refused.is_none()).collect();
    assert_eq!(used.len(), 1);
    assert_eq!(format!("sha256:{}", used[0].grant_sha256), grant_digest);
    assert_eq!(used[0].scopes, ["repository:acme/api:pull"]);
    assert_no_grant_or_token(&e, &id, &grant);
    // The control plane shows which grant was used by which runner, and when.
    let report: serde_json::Value = reqwest::Client::new()
        .get(format!("{}/admin/grants", e.env.cp.admin_url()))
        .bearer_auth(e.env.cp.admin_token())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let minted = &report["grants"][0];
    assert_eq!(format!("sha256:{}", minted["grant_sha256"].as_str().unwrap()), grant_digest);
    assert_eq!(minted["grant"]["job_id"], id.as_str());
    assert_eq!(minted["grant"]["repository"], "acme/api");
    assert_eq!(minted["grant"]["digest"], img.digest.as_str());
    assert!(minted["runner"].as_str().is_some_and(|r| !r.is_empty()), "{report}");
    assert!(minted["grant"]["spent"]["at"].as_i64().is_some(), "{report}");
    assert!(!report.to_string().contains(&grant), "the report names grants by digest only");

    // The same grant again: refused at the token service, before any byte moves.
    let again = e.env.cp.enqueue(grant_job(&e.src, "acme/api", &img, Some(&grant))).unwrap();
    let r = e.env.finished(&again).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "source_grant_refused", "{:?}", r.error);
    assert!(r.error.unwrap().contains("grant already used"));
    let refused: Vec<_> = e.tokens.exchanges().into_iter().filter(|x| x.refused.is_some()).collect();
    assert_eq!(refused.len(), 1);
    let failed: Vec<_> = audit_records(&e.env.runner.state_dir)
        .into_iter()
        .filter(|r| r["event"] == "artifact_sync_failed" && r["job"] == again.as_str())
        .collect();
    assert!(failed[0]["detail"].as_str().unwrap().contains("source_grant_refused"));
    assert_no_grant_or_token(&e, &again, &grant);
}

/// A grant opens one artifact for pull, within its time: another repository, another
/// digest of the same repository, an expired grant and a push scope are refused.
#[tokio::test]
async fn a_grant_opens_one_repository_for_pull_within_its_time() {
    let e = grant_env().await;
    let api = e.src.push_random_image("acme/api", Some("1.4.0"), 1, 1000, 32).await;
    let billing = e.src.push_random_image("acme/billing", Some("1.4.0"), 1, 1000, 33).await;

    // A grant for acme/api used for acme/billing.
    let for_api = e.tokens.mint("job-b", "inst-demo", "acme/api", &api.digest, 300);
    let id = e.env.cp.enqueue(grant_job(&e.src, "acme/billing", &billing, Some(&for_api))).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.outputs["reason"], "source_grant_refused", "{:?}", r.error);
    assert!(r.error.unwrap().contains("grant allows only \"repository:acme/api:pull\""));

    // A grant for one digest of acme/api used for another of its digests.
    let newer = e.src.push_random_image("acme/api", Some("1.5.0"), 1, 1000, 34).await;
    let for_old = e.tokens.mint("job-b2", "inst-demo", "acme/api", &api.digest, 300);
    let id = e.env.cp.enqueue(grant_job(&e.src, "acme/api", &newer, Some(&for_old))).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.outputs["reason"], "source_grant_refused", "{:?}", r.error);
    assert!(r.error.unwrap().contains(&format!("grant is for digest {}", api.digest)));

    // Expired at the token service (the job itself names no expiry).
    let expired = e.tokens.mint("job-c", "inst-demo", "acme/api", &api.digest, -1);
    let id = e.env.cp.enqueue(grant_job(&e.src, "acme/api", &api, Some(&expired))).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.outputs["reason"], "source_grant_refused", "{:?}", r.error);
    assert!(r.error.unwrap().contains("grant expired"));
    assert!(e.ecr.tags("inst-demo/api").await.is_empty(), "nothing was tagged");

    // A push scope, asked of the token service directly: refused, the grant unspent.
    let grant = e.tokens.mint("job-d", "inst-demo", "acme/api", &api.digest, 300);
    let http = reqwest::Client::new();
    let ask = |scope: &str| {
        let url = url::Url::parse_with_params(
            &e.tokens.realm(),
            [("service", "vendor-registry"), ("scope", scope), ("digest", api.digest.as_str())],
        )
        .unwrap();
        http.get(url).basic_auth(byoc_control_plane::grants::GRANT_USER, Some(&grant)).send()
    };
    let push = ask("repository:acme/api:pull,push").await.unwrap();
    assert_eq!(push.status(), 403);
    assert!(push.text().await.unwrap().contains("GRANT_REFUSED"));
    let pull = ask("repository:acme/api:pull").await.unwrap();
    assert_eq!(pull.status(), 200, "the refused push left the grant unspent");
    // The registry itself refuses a pull token's push.
    let token: serde_json::Value = pull.json().await.unwrap();
    let up = http
        .post(format!("{}/v2/acme/api/blobs/uploads/", e.src.url()))
        .bearer_auth(token["token"].as_str().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(up.status(), 401, "a pull-only token cannot push");
}
