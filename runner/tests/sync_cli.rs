//! `byoc-runner sync`: the engine from the command line, between two local registries.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use byoc_control_plane::registry::LocalRegistry;

const TOKEN: &str = "cli-token-8d1f0b3c5e";

fn sync(args: &[&str], token: Option<&str>) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_byoc-runner"));
    c.arg("sync").args(args).env_remove("BYOC_SYNC_SRC_TOKEN").env_remove("BYOC_SYNC_DEST_TOKEN");
    if let Some(t) = token {
        c.env("BYOC_SYNC_SRC_TOKEN", t);
    }
    let out = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn sync_copies_reports_and_refuses_with_reason_codes() {
    let (src, dst) = tokio::join!(LocalRegistry::start(Some(("ci", TOKEN))), LocalRegistry::start(None));
    let img = src.push_random_image("vendor/tool", Some("2.1"), 2, 100_000, 31).await;
    let from = format!("{}/vendor/tool:2.1", src.host());
    let pinned = format!("{}/vendor/tool@{}", src.host(), img.digest);
    let to = format!("{}/mirror/tool", dst.host());

    // Tag taken from the source; JSON report.
    let (code, out, err) = sync(&["--src-user", "ci", "-o", "json", &from, &to], Some(TOKEN));
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["report"]["digest"], img.digest.as_str());
    assert_eq!(v["report"]["blobs_moved"], 3);
    assert_eq!(v["report"]["tags"][0], "2.1");
    assert_eq!(dst.manifest("mirror/tool", "2.1").await.unwrap().0, img.digest);

    // Pinned by digest, text output, everything already there.
    let (code, out, err) = sync(&["--src-user", "ci", &pinned, &format!("{to}:stable")], Some(TOKEN));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("0 moved, 3 present") && out.contains("0 bytes moved"), "{out}");
    assert_eq!(dst.manifest("mirror/tool", "stable").await.unwrap().0, img.digest);

    // A wrong token: exit 1, a reason code, the token nowhere.
    let wrong = "cli-wrong-token-77777";
    let (code, out, err) = sync(&["--src-user", "ci", "-o", "json", &from, &to], Some(wrong));
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["code"], "source_unauthorized");
    assert!(v["error"].as_str().unwrap().contains(&src.host()));
    assert!(!out.contains(wrong) && !err.contains(wrong));

    // Usage errors: a user without a token, a destination with a digest, a bad reference.
    let (code, _, err) = sync(&["--src-user", "ci", &from, &to], None);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("no token"), "{err}");
    let (code, _, err) = sync(&[&from, &format!("{to}@{}", img.digest)], None);
    assert_eq!((code, err.contains("no digest")), (64, true), "{err}");
    let (code, _, err) = sync(&["not a reference", &to], None);
    assert_eq!(code, 64, "{err}");
}
