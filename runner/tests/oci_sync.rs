//! The artifact-sync engine between two real registries (Debian's docker-registry,
//! distribution 2.8): the source with basic auth (the vendor's, reached with a
//! one-time token), the destination open (standing in for the install's ECR).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use byoc_control_plane::registry::{
    COSIGN_SIG, Cut, CutRelay, HELM_CHART, HELM_CONFIG, LocalRegistry, Pushed, SBOM, TF_MODULE_CONFIG,
    TF_MODULE_LAYER, random_bytes,
};
use byoc_oci_sync::{Copier, Credential, Digest, Options, Registry, Report, Side, SyncError};

const USER: &str = "vendor";
const TOKEN: &str = "one-time-token-4f9c2a7e1b";

struct Pair {
    src: LocalRegistry,
    dst: LocalRegistry,
}

async fn pair() -> Pair {
    let (src, dst) = tokio::join!(LocalRegistry::start(Some((USER, TOKEN))), LocalRegistry::start(None));
    Pair { src, dst }
}

fn copier(src_host: &str, dst_host: &str, secret: &str, options: Options) -> Copier {
    let http = Registry::http_client().unwrap();
    let cred = Credential::Basic { username: USER.into(), secret: secret.into() };
    let src = Registry::new(Side::Source, src_host, None, Some(cred), http.clone()).unwrap();
    let dst = Registry::new(Side::Destination, dst_host, None, None, http).unwrap();
    Copier::new(Arc::new(src), Arc::new(dst), options)
}

async fn sync(
    p: &Pair,
    repo: &str,
    root: &Pushed,
    dst_repo: &str,
    tags: &[&str],
) -> Result<Report, SyncError> {
    sync_with(&copier(&p.src.host(), &p.dst.host(), TOKEN, Options::default()), repo, root, dst_repo, tags)
        .await
}

async fn sync_with(
    c: &Copier,
    repo: &str,
    root: &Pushed,
    dst_repo: &str,
    tags: &[&str],
) -> Result<Report, SyncError> {
    let d = Digest::parse(&root.digest).unwrap();
    let tags: Vec<String> = tags.iter().map(|t| t.to_string()).collect();
    c.copy(repo, &root.digest, Some(&d), dst_repo, &tags).await
}

/// Everything the manifest names arrived byte for byte, under the tag.
async fn assert_copied(p: &Pair, repo: &str, root: &Pushed, dst_repo: &str, tag: &str) {
    let (digest, bytes) = p.dst.manifest(dst_repo, tag).await.expect("tagged at the destination");
    assert_eq!(digest, root.digest);
    assert_eq!(bytes, root.bytes);
    let (_, src_bytes) = p.src.manifest(repo, &root.digest).await.unwrap();
    assert_eq!(src_bytes, bytes);
}

#[tokio::test]
async fn an_image_is_copied_then_a_second_sync_moves_no_blob_bytes() {
    let p = pair().await;
    let img = p.src.push_random_image("vendor/api", Some("1.0"), 3, 300_000, 1).await;
    let r = sync(&p, "vendor/api", &img, "install/api", &["1.0", "stable"]).await.unwrap();
    assert_copied(&p, "vendor/api", &img, "install/api", "1.0").await;
    assert_copied(&p, "vendor/api", &img, "install/api", "stable").await;
    assert_eq!((r.blobs, r.blobs_moved, r.blobs_skipped, r.manifests_pushed), (4, 4, 0, 1));
    assert!(r.bytes_moved > 900_000, "{r:?}");
    assert_eq!(r.bytes_skipped, 0);
    assert_eq!(r.digest, img.digest);
    assert_eq!(r.source, format!("{}/vendor/api@{}", p.src.host(), img.digest));
    assert_eq!(r.destination, format!("{}/install/api@{}", p.dst.host(), img.digest));

    let again = sync(&p, "vendor/api", &img, "install/api", &["1.0"]).await.unwrap();
    assert_eq!((again.bytes_moved, again.bytes_read, again.blobs_moved), (0, 0, 0), "{again:?}");
    assert_eq!((again.blobs_skipped, again.bytes_skipped, again.manifests_pushed), (4, r.bytes_moved, 0));
}

#[tokio::test]
async fn a_multi_arch_index_is_copied_with_every_platform() {
    let p = pair().await;
    let amd = p.src.push_random_image("vendor/multi", None, 2, 50_000, 2).await;
    let arm = p.src.push_random_image("vendor/multi", None, 2, 50_000, 3).await;
    let idx = p
        .src
        .push_index("vendor/multi", Some("2.0"), &[(amd.clone(), "amd64"), (arm.clone(), "arm64")])
        .await;
    let r = sync(&p, "vendor/multi", &idx, "install/multi", &["2.0"]).await.unwrap();
    assert_copied(&p, "vendor/multi", &idx, "install/multi", "2.0").await;
    for child in [&amd, &arm] {
        let (d, _) = p.dst.manifest("install/multi", &child.digest).await.expect("child manifest copied");
        assert_eq!(d, child.digest);
    }
    assert_eq!((r.manifests, r.manifests_pushed, r.blobs), (3, 3, 6), "{r:?}");
    // Only the index is tagged: children arrive by digest.
    assert_eq!(p.dst.tags("install/multi").await, vec!["2.0".to_string()]);
}

#[tokio::test]
async fn helm_charts_and_terraform_modules_are_copied_as_oci_artifacts() {
    let p = pair().await;
    let cfg = p
        .src
        .push_bytes(
            "vendor/charts/api",
            HELM_CONFIG,
            br#"{"name":"api","version":"1.2.3","apiVersion":"v2"}"#.to_vec(),
        )
        .await;
    let chart = p.src.push_bytes("vendor/charts/api", HELM_CHART, random_bytes(40_000, 4)).await;
    let chart_m = p
        .src
        .push_image("vendor/charts/api", Some("1.2.3"), cfg, std::slice::from_ref(&chart), None, None)
        .await;
    let r = sync(&p, "vendor/charts/api", &chart_m, "install/charts/api", &["1.2.3"]).await.unwrap();
    assert_copied(&p, "vendor/charts/api", &chart_m, "install/charts/api", "1.2.3").await;
    assert!(p.dst.has_blob("install/charts/api", &chart.digest).await);
    assert_eq!(r.blobs_moved, 2);

    let cfg =
        p.src.push_bytes("vendor/modules/vpc", "application/vnd.oci.empty.v1+json", b"{}".to_vec()).await;
    let zip = p.src.push_bytes("vendor/modules/vpc", TF_MODULE_LAYER, random_bytes(20_000, 5)).await;
    let module = p
        .src
        .push_image(
            "vendor/modules/vpc",
            Some("0.4.0"),
            cfg,
            std::slice::from_ref(&zip),
            Some(TF_MODULE_CONFIG),
            None,
        )
        .await;
    sync(&p, "vendor/modules/vpc", &module, "install/modules/vpc", &["0.4.0"]).await.unwrap();
    assert_copied(&p, "vendor/modules/vpc", &module, "install/modules/vpc", "0.4.0").await;
    assert!(p.dst.has_blob("install/modules/vpc", &zip.digest).await);
}

#[tokio::test]
async fn referrers_are_copied_and_listed_under_the_tag_schema() {
    let p = pair().await;
    let img = p.src.push_random_image("vendor/signed", Some("3.0"), 1, 10_000, 6).await;
    let sig = p.src.push_referrer("vendor/signed", &img, COSIGN_SIG, b"signature-bytes").await;
    let sbom = p.src.push_referrer("vendor/signed", &img, SBOM, br#"{"spdxVersion":"SPDX-2.3"}"#).await;
    // A signature of the SBOM: referrers of referrers are followed.
    let sbom_sig = p.src.push_referrer("vendor/signed", &sbom, COSIGN_SIG, b"sbom-signature").await;
    let r = sync(&p, "vendor/signed", &img, "install/signed", &["3.0"]).await.unwrap();
    assert_eq!(r.referrers, 3, "{r:?}");
    for m in [&sig, &sbom, &sbom_sig] {
        let (d, b) = p.dst.manifest("install/signed", &m.digest).await.expect("referrer copied");
        assert_eq!((d, b), (m.digest.clone(), m.bytes.clone()));
    }
    let listed: Vec<String> = p
        .dst
        .index_entries("install/signed", &format!("sha256-{}", &img.digest[7..]))
        .await
        .iter()
        .map(|e| e["digest"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed, vec![sig.digest.clone(), sbom.digest.clone()]);
    let listed = p.dst.index_entries("install/signed", &format!("sha256-{}", &sbom.digest[7..])).await;
    assert_eq!(listed[0]["artifactType"], COSIGN_SIG);

    // Without referrers the artifact alone is copied.
    let plain =
        copier(&p.src.host(), &p.dst.host(), TOKEN, Options { referrers: false, ..Options::default() });
    let r = sync_with(&plain, "vendor/signed", &img, "install/unsigned", &["3.0"]).await.unwrap();
    assert_eq!(r.referrers, 0);
    assert!(p.dst.manifest("install/unsigned", &sig.digest).await.is_none());
}

#[tokio::test]
async fn a_corrupt_source_blob_fails_the_sync_and_nothing_is_tagged() {
    let p = pair().await;
    // Two sizes: one read whole (small), one streamed in chunks.
    for (size, seed) in [(20_000usize, 7u64), (3_000_000, 8)] {
        let repo = format!("vendor/corrupt{seed}");
        let img = p.src.push_random_image(&repo, Some("1"), 1, size, seed).await;
        let layer: serde_json::Value = serde_json::from_slice(&img.bytes).unwrap();
        let layer_digest = layer["layers"][0]["digest"].as_str().unwrap().to_string();
        let path = p.src.blob_path(&layer_digest);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[size / 2] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let c = copier(
            &p.src.host(),
            &p.dst.host(),
            TOKEN,
            Options { chunk_size: 1 << 20, ..Options::default() },
        );
        let err = sync_with(&c, &repo, &img, "install/corrupt", &["1"]).await.unwrap_err();
        assert_eq!(err.code(), "source_digest_mismatch", "{err}");
        assert!(err.to_string().contains(&layer_digest) && err.to_string().contains("source"), "{err}");
        assert!(p.dst.tags("install/corrupt").await.is_empty());
        assert!(p.dst.manifest("install/corrupt", &img.digest).await.is_none());
        assert!(!p.dst.has_blob("install/corrupt", &layer_digest).await);
    }
}

#[tokio::test]
async fn a_download_cut_mid_blob_is_resumed_from_where_it_stopped() {
    let p = pair().await;
    let img = p.src.push_random_image("vendor/big", Some("1"), 1, 8_000_000, 9).await;
    let relay =
        CutRelay::start(format!("127.0.0.1:{}", p.src.port).parse().unwrap(), Cut::Downstream(3_000_000))
            .await;
    // The relay is on loopback too, so plain HTTP; the source is reached through it.
    let c =
        copier(&relay.host(), &p.dst.host(), TOKEN, Options { chunk_size: 2 << 20, ..Options::default() });
    let r = sync_with(&c, "vendor/big", &img, "install/big", &["1"]).await.unwrap();
    assert_eq!(relay.cuts.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_copied(&p, "vendor/big", &img, "install/big", "1").await;
    assert!(r.resumed >= 1, "{r:?}");
    assert_eq!(r.restarted, 0, "{r:?}");
    // Resumed with a range request: no byte read twice.
    assert_eq!(r.bytes_read, r.bytes_moved, "{r:?}");
}

#[tokio::test]
async fn an_upload_cut_mid_blob_is_completed_and_verified() {
    let p = pair().await;
    let img = p.src.push_random_image("vendor/up", Some("1"), 1, 6_000_000, 10).await;
    let relay =
        CutRelay::start(format!("127.0.0.1:{}", p.dst.port).parse().unwrap(), Cut::Upstream(4_000_000)).await;
    let c =
        copier(&p.src.host(), &relay.host(), TOKEN, Options { chunk_size: 2 << 20, ..Options::default() });
    let r = sync_with(&c, "vendor/up", &img, "install/up", &["1"]).await.unwrap();
    assert_eq!(relay.cuts.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_copied(&p, "vendor/up", &img, "install/up", "1").await;
    // distribution 2.8 drops an upload whose chunk was cut: the blob starts over.
    assert!(r.resumed + r.restarted >= 1, "{r:?}");
}

#[tokio::test]
async fn an_upload_the_destination_dropped_is_started_over_a_bounded_number_of_times() {
    use byoc_control_plane::registry::ReferrersFront;
    let p = pair().await;
    let img = p.src.push_random_image("vendor/drop", Some("1"), 1, 5_000_000, 21).await;
    // distribution answers a chunk 404 BLOB_UPLOAD_UNKNOWN once it has dropped the
    // session (it does so after a cut chunk, even after a status query said resume).
    let front = ReferrersFront::dropping_uploads(&p.dst, 1).await;
    let c =
        copier(&p.src.host(), &front.host(), TOKEN, Options { chunk_size: 2 << 20, ..Options::default() });
    let r = sync_with(&c, "vendor/drop", &img, "install/drop", &["1"]).await.unwrap();
    assert_eq!(r.restarted, 1, "{r:?}");
    assert_copied(&p, "vendor/drop", &img, "install/drop", "1").await;
    // A destination that drops every upload is given up on, naming the blob.
    let front = ReferrersFront::dropping_uploads(&p.dst, u64::MAX).await;
    let c =
        copier(&p.src.host(), &front.host(), TOKEN, Options { chunk_size: 2 << 20, ..Options::default() });
    let err = sync_with(&c, "vendor/drop", &img, "install/drop2", &["1"]).await.unwrap_err();
    assert!(err.to_string().contains("restarts"), "{err}");
    assert!(err.code().starts_with("destination_"), "{}", err.code());
    assert_eq!(
        front.chunks_seen.load(std::sync::atomic::Ordering::SeqCst),
        4,
        "one chunk per try, 1 + 3 restarts"
    );
    assert!(p.dst.tags("install/drop2").await.is_empty());
}

#[tokio::test]
async fn a_wrong_token_is_a_clear_error_naming_the_source() {
    let p = pair().await;
    let img = p.src.push_random_image("vendor/api", Some("1"), 1, 1000, 11).await;
    let c = copier(&p.src.host(), &p.dst.host(), "not-the-token-000000", Options::default());
    let err = sync_with(&c, "vendor/api", &img, "install/api", &["1"]).await.unwrap_err();
    assert_eq!(err.code(), "source_unauthorized");
    let msg = err.to_string();
    assert!(msg.contains("source registry") && msg.contains(&p.src.host()) && msg.contains("401"), "{msg}");
    assert!(!msg.contains("not-the-token"), "{msg}");
    assert!(p.dst.tags("install/api").await.is_empty());
}

#[tokio::test]
async fn a_missing_artifact_or_a_different_digest_is_refused() {
    let p = pair().await;
    let img = p.src.push_random_image("vendor/api", Some("1"), 1, 1000, 12).await;
    let other = p.src.push_random_image("vendor/api", Some("2"), 1, 1000, 13).await;
    let c = copier(&p.src.host(), &p.dst.host(), TOKEN, Options::default());
    let err = c.copy("vendor/api", "2", Some(&Digest::parse(&img.digest).unwrap()), "install/api", &[]).await;
    // Asked by digest: the digest wins, whatever tag 2 points at.
    assert_eq!(err.unwrap().digest, img.digest);
    let missing = Digest::of(b"nothing");
    let err = c.copy("vendor/api", missing.as_str(), Some(&missing), "install/api", &[]).await.unwrap_err();
    assert_eq!(err.code(), "source_not_found", "{err}");
    let _ = other;
}

#[tokio::test]
async fn blobs_are_mounted_within_one_registry() {
    let p = pair().await;
    let img = p.dst.push_random_image("shared/base", Some("1"), 2, 20_000, 14).await;
    let http = Registry::http_client().unwrap();
    let src = Registry::new(Side::Source, &p.dst.host(), None, None, http.clone()).unwrap();
    let dst = Registry::new(Side::Destination, &p.dst.host(), None, None, http).unwrap();
    let c = Copier::new(Arc::new(src), Arc::new(dst), Options::default());
    let r = sync_with(&c, "shared/base", &img, "install/base", &["1"]).await.unwrap();
    assert_eq!((r.blobs_mounted, r.blobs_moved, r.bytes_read), (3, 0, 0), "{r:?}");
    assert!(p.dst.manifest("install/base", "1").await.is_some());
}

#[tokio::test]
async fn busy_registries_are_retried_and_a_forbidden_destination_is_named() {
    use byoc_control_plane::registry::StatusRelay;
    let p = pair().await;
    let img = p.src.push_random_image("vendor/api", Some("1"), 2, 50_000, 15).await;
    for status in [503, 429] {
        // The first three connections to the source are refused with `status`.
        let relay = StatusRelay::start(format!("127.0.0.1:{}", p.src.port).parse().unwrap(), status, 3).await;
        let mut c = copier(&relay.host(), &p.dst.host(), TOKEN, Options::default());
        Arc::get_mut(&mut c.src).unwrap().retry.first_backoff = std::time::Duration::from_millis(10);
        let r = sync_with(&c, "vendor/api", &img, &format!("install/busy{status}"), &["1"]).await.unwrap();
        assert_eq!(relay.served.load(std::sync::atomic::Ordering::SeqCst), 3, "{status}");
        assert_eq!(r.blobs_moved, 3);
    }
    // A destination that keeps saying 503 gives up with the status and the side.
    let relay = StatusRelay::start(format!("127.0.0.1:{}", p.dst.port).parse().unwrap(), 503, u64::MAX).await;
    let mut c = copier(&p.src.host(), &relay.host(), TOKEN, Options::default());
    Arc::get_mut(&mut c.dst).unwrap().retry.first_backoff = std::time::Duration::from_millis(5);
    let err = sync_with(&c, "vendor/api", &img, "install/down", &["1"]).await.unwrap_err();
    assert_eq!(err.code(), "destination_http_error", "{err}");
    assert!(err.to_string().contains("503") && err.to_string().contains("attempts"), "{err}");
    // 403 is not retried: the credential is not allowed, say so.
    let relay = StatusRelay::start(format!("127.0.0.1:{}", p.dst.port).parse().unwrap(), 403, u64::MAX).await;
    let c = copier(&p.src.host(), &relay.host(), TOKEN, Options { parallel: 1, ..Options::default() });
    let err = sync_with(&c, "vendor/api", &img, "install/denied", &["1"]).await.unwrap_err();
    assert_eq!(err.code(), "destination_forbidden", "{err}");
    assert_eq!(relay.served.load(std::sync::atomic::Ordering::SeqCst), 1, "403 must not be retried");
}

#[tokio::test]
async fn referrers_are_found_through_the_referrers_api_where_the_source_has_it() {
    use byoc_control_plane::registry::ReferrersFront;
    let p = pair().await;
    let img = p.src.push_random_image("vendor/oci11", Some("1"), 1, 5_000, 16).await;
    let sig = p.src.push_referrer("vendor/oci11", &img, COSIGN_SIG, b"signature").await;
    // The front hides the tag schema: the API is the only way to find the signature.
    let front = ReferrersFront::start(&p.src).await;
    let c = copier(&front.host(), &p.dst.host(), TOKEN, Options::default());
    let r = sync_with(&c, "vendor/oci11", &img, "install/oci11", &["1"]).await.unwrap();
    assert_eq!(r.referrers, 1, "{r:?}");
    assert!(front.api_calls.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    assert!(p.dst.manifest("install/oci11", &sig.digest).await.is_some());
    // The destination (no API) lists it under the tag schema.
    let listed = p.dst.index_entries("install/oci11", &format!("sha256-{}", &img.digest[7..])).await;
    assert_eq!(listed[0]["digest"], sig.digest.as_str());

    // A destination with the API indexes referrers from their `subject` itself: no
    // fallback tag is written there.
    let dst_front = ReferrersFront::start(&p.dst).await;
    let c = copier(&front.host(), &dst_front.host(), TOKEN, Options::default());
    let r = sync_with(&c, "vendor/oci11", &img, "install/oci11-api", &["1"]).await.unwrap();
    assert_eq!(r.referrers, 1);
    assert!(p.dst.manifest("install/oci11-api", &sig.digest).await.is_some());
    assert_eq!(p.dst.tags("install/oci11-api").await, vec!["1".to_string()]);
}

#[tokio::test]
async fn a_bearer_token_realm_is_used_with_the_one_time_token_and_scoped_per_repository() {
    use byoc_control_plane::registry::TokenFront;
    let p = pair().await;
    // The vendor side behind a token realm (the open destination registry serves as
    // its backend here; the basic-auth source is not needed).
    let img = p.dst.push_random_image("vendor/hub", Some("1"), 2, 20_000, 17).await;
    let front = TokenFront::start(&p.dst, USER, TOKEN).await;
    let c = copier(&front.host(), &p.src.host(), TOKEN, Options::default());
    // Destination: the basic-auth registry, with its own credential.
    let http = Registry::http_client().unwrap();
    let dst_cred = Credential::Basic { username: USER.into(), secret: TOKEN.into() };
    let dst = Registry::new(Side::Destination, &p.src.host(), None, Some(dst_cred), http).unwrap();
    let c = Copier::new(c.src.clone(), Arc::new(dst), Options::default());
    let r = sync_with(&c, "vendor/hub", &img, "install/hub", &["1"]).await.unwrap();
    assert_eq!(r.blobs_moved, 3);
    assert_eq!(p.src.manifest("install/hub", "1").await.unwrap().0, img.digest);
    let issued = front.issued.lock().unwrap().clone();
    assert!(!issued.is_empty());
    assert!(
        issued.iter().all(|(_, scopes)| scopes == &vec!["repository:vendor/hub:pull".to_string()]),
        "{issued:?}"
    );

    // The wrong one-time token is refused at the realm: a source error, no token leaked.
    let wrong = copier(&front.host(), &p.src.host(), "wrong-token-00000000", Options::default());
    let err = sync_with(&wrong, "vendor/hub", &img, "install/hub2", &["1"]).await.unwrap_err();
    assert_eq!(err.code(), "source_unauthorized", "{err}");
    assert!(!err.to_string().contains("wrong-token"));
}

#[tokio::test]
async fn an_https_registry_is_trusted_through_the_ca_bundle_and_refused_without_it() {
    let pki = byoc_control_plane::tls::test_pki().unwrap();
    let (tls, dst) = tokio::join!(
        LocalRegistry::start_tls(&pki.server_cert_pem, &pki.server_key_pem),
        LocalRegistry::start(None)
    );
    let img = tls.push_random_image("vendor/tls", Some("1"), 1, 10_000, 18).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    // The vendor's host name, reached at the TLS registry (its certificate is for 127.0.0.1).
    let url = format!("https://127.0.0.1:{}", tls.port);
    let copier_with = |http: byoc_oci_sync::client::Http| {
        let src =
            Registry::new(Side::Source, "registry.vendor.test", Some(&url), None, http.clone()).unwrap();
        let d = Registry::new(Side::Destination, &dst.host(), None, None, http).unwrap();
        Copier::new(Arc::new(src), Arc::new(d), Options::default())
    };
    let mut untrusting = copier_with(Registry::http_client().unwrap());
    Arc::get_mut(&mut untrusting.src).unwrap().retry.attempts = 1;
    let err = sync_with(&untrusting, "vendor/tls", &img, "install/tls", &["1"]).await.unwrap_err();
    assert_eq!(err.code(), "source_unreachable", "{err}");
    assert!(err.to_string().to_lowercase().contains("certificate"), "{err}");
    let trusting = copier_with(Registry::http_client_with_ca(Some(&ca)).unwrap());
    let r = sync_with(&trusting, "vendor/tls", &img, "install/tls", &["1"]).await.unwrap();
    assert_eq!(r.source, format!("registry.vendor.test/vendor/tls@{}", img.digest));
    assert_eq!(dst.manifest("install/tls", "1").await.unwrap().0, img.digest);
}

/// A vendor registry the runner may reach (the customer configured it) that points the
/// runner elsewhere: a token realm on the host's loopback or the metadata address, a
/// redirect there. The guarded client follows none of it: `endpoint_refused`, and the
/// loopback service it names never sees a connection.
#[tokio::test]
async fn a_registry_that_points_elsewhere_is_not_followed() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // The loopback service a hostile registry points at.
    let canary = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let canary_at = canary.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let canary_task = tokio::spawn(async move {
        while canary.accept().await.is_ok() {
            counted.fetch_add(1, Ordering::SeqCst);
        }
    });
    for (name, answer) in [
        ("realm on loopback", format!("401 Bearer realm=\"https://{canary_at}/token\",service=\"reg\"")),
        ("realm over http", "401 Bearer realm=\"http://registry.example.com/token\"".to_string()),
        ("realm on the metadata address", "401 Bearer realm=\"https://169.254.169.254/token\"".to_string()),
        ("redirect to loopback", format!("307 http://{canary_at}/v2/x")),
        ("redirect to the metadata address", "307 https://169.254.169.254/latest/meta-data/".to_string()),
    ] {
        let answer = Arc::new(answer);
        let app = axum::Router::new().fallback(move || {
            let answer = answer.clone();
            async move {
                let (status, value) = answer.split_once(' ').unwrap();
                let (code, header) = match status {
                    "401" => (axum::http::StatusCode::UNAUTHORIZED, "www-authenticate"),
                    _ => (axum::http::StatusCode::TEMPORARY_REDIRECT, "location"),
                };
                (code, [(header, value.to_string())])
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        // The customer named this registry; nothing it answers widens that.
        let reach = byoc_oci_sync::Reach::guarded([format!("http://{at}")]);
        let http = Registry::http_client_for(None, reach).unwrap();
        let cred = Credential::Basic { username: USER.into(), secret: TOKEN.into() };
        let mut src = Registry::new(
            Side::Source,
            &at.to_string(),
            Some(&format!("http://{at}")),
            Some(cred),
            http.clone(),
        )
        .unwrap();
        src.retry.attempts = 1;
        let digest = format!("sha256:{}", "b".repeat(64));
        let err = match src.get_manifest("vendor/api", &digest).await {
            Ok(_) => panic!("{name}: the manifest was fetched"),
            Err(e) => e,
        };
        assert_eq!(err.code(), "endpoint_refused", "{name}: {err}");
        assert!(!err.to_string().contains(TOKEN), "{name}: {err}");
        server.abort();
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0, "the loopback service was reached");
    canary_task.abort();
}
