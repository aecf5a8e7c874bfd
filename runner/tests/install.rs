//! Installed as customers install it: the .deb built by `packaging/build-deb`, installed
//! into a throwaway root with dpkg (maintainer scripts run against that root through
//! DPKG_ROOT), and the user-data script run against such a root with a local, signed
//! release (and with tampered ones). systemctl, aws and cfn-signal are stand-ins that
//! record their arguments: nothing leaves the machine.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{BIN, repo, run};

/// Build the package from the binary under test (uncompressed: the debug binary is big).
fn build_deb(out: &Path) -> PathBuf {
    let o = run(Command::new(repo().join("packaging/build-deb"))
        .arg(BIN)
        .arg(out)
        .arg("0.1.0-test1")
        .env("BYOC_DEB_COMPRESSION", "none")
        .env("UPDATER", common::updater_bin()));
    PathBuf::from(String::from_utf8_lossy(&o.stdout).trim())
}

/// An empty root dpkg can install into: its database, and passwd/group files with root.
fn throwaway_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    for d in ["var/lib/dpkg/info", "var/lib/dpkg/updates", "etc"] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    std::fs::write(r.join("var/lib/dpkg/status"), "").unwrap();
    std::fs::write(r.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(r.join("etc/group"), "root:x:0:\n").unwrap();
    std::fs::write(r.join("etc/shadow"), "root:*::0:99999:7:::\n").unwrap();
    std::fs::write(r.join("etc/gshadow"), "root:*::\n").unwrap();
    std::fs::set_permissions(r, std::fs::Permissions::from_mode(0o755)).unwrap();
    root
}

/// dpkg into the throwaway root (its database has no libc6: dependencies are not ours
/// to check there).
fn dpkg_install(root: &Path, deb: &Path) -> std::process::Output {
    Command::new("dpkg")
        .arg(format!("--root={}", root.display()))
        .args(["--force-script-chrootless", "--force-not-root", "--force-depends", "-i"])
        .arg(deb)
        .output()
        .expect("dpkg is required")
}

fn id_of(root: &Path, file: &str, name: &str) -> u32 {
    std::fs::read_to_string(root.join(file))
        .unwrap()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f[0] == name).then(|| f[2].parse().unwrap())
        })
        .unwrap_or_else(|| panic!("{name} not in {file}"))
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn the_package_installs_its_files_user_and_modes_and_reinstalls_keeping_config() {
    let out = tempfile::tempdir().unwrap();
    let deb = build_deb(out.path());
    // The checksum file names the package.
    let sums = std::fs::read_to_string(out.path().join("SHA256SUMS")).unwrap();
    assert!(sums.contains(deb.file_name().unwrap().to_str().unwrap()), "{sums}");
    // Exactly these paths, nothing else.
    let listing = run(Command::new("dpkg-deb").arg("-c").arg(&deb));
    let mut files: Vec<String> = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .filter(|l| !l.starts_with('d'))
        .map(|l| l.split_whitespace().last().unwrap().to_string())
        .collect();
    files.sort();
    // A manual page per command, generated from the binary's own definitions.
    let (pages, files): (Vec<String>, Vec<String>) =
        files.into_iter().partition(|f| f.starts_with("./usr/share/man/man8/"));
    for page in [
        "byoc-runner.8.gz",
        "byoc-runner-jobs-show.8.gz",
        "byoc-runner-approvals-show.8.gz",
        "byoc-runner-update-pin.8.gz",
    ] {
        assert!(pages.contains(&format!("./usr/share/man/man8/{page}")), "{page} missing: {pages:?}");
    }
    assert!(pages.iter().all(|p| p.ends_with(".8.gz")), "{pages:?}");
    assert!(
        !pages
            .iter()
            .any(|p| p.contains("sandbox-exec") || p.contains("policy-eval") || p.contains("update-apply")),
        "{pages:?}"
    );
    assert_eq!(
        files,
        [
            "./etc/byoc-runner/runner.toml.example",
            "./lib/systemd/system/byoc-runner-imds.service",
            "./lib/systemd/system/byoc-runner-update-root.path",
            "./lib/systemd/system/byoc-runner-update.path",
            "./lib/systemd/system/byoc-runner-update.service",
            "./lib/systemd/system/byoc-runner.service",
            "./usr/bin/byoc-runner",
            "./usr/lib/byoc-runner/byoc-runner-updater",
            "./usr/lib/byoc-runner/imds-firewall",
            "./usr/lib/systemd/catalog/byoc-runner.catalog",
            "./usr/share/bash-completion/completions/byoc-runner",
            "./usr/share/doc/byoc-runner/README.md",
            "./usr/share/fish/vendor_completions.d/byoc-runner.fish",
            "./usr/share/zsh/vendor-completions/_byoc-runner",
        ]
    );

    let root = throwaway_root();
    let r = root.path();
    let o = dpkg_install(r, &deb);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let gid = id_of(r, "etc/group", "byoc-runner");
    let uid = id_of(r, "etc/passwd", "byoc-runner");
    assert!(uid < 1000 && gid < 1000, "a system user and group");
    let passwd = std::fs::read_to_string(r.join("etc/passwd")).unwrap();
    assert!(passwd.contains("byoc-runner:x:") && passwd.contains(":/var/lib/byoc-runner:/usr/sbin/nologin"));
    let etc = r.join("etc/byoc-runner");
    assert_eq!(mode(&etc), 0o750);
    assert_eq!((std::fs::metadata(&etc).unwrap().uid(), std::fs::metadata(&etc).unwrap().gid()), (0, gid));
    assert_eq!(mode(&etc.join("runner.toml.example")), 0o640);
    assert_eq!(std::fs::metadata(etc.join("runner.toml.example")).unwrap().gid(), gid);
    assert_eq!(mode(&r.join("usr/bin/byoc-runner")), 0o755);
    assert_eq!(mode(&r.join("lib/systemd/system/byoc-runner.service")), 0o644);
    let status = run(Command::new("dpkg").arg(format!("--root={}", r.display())).args(["-s", "byoc-runner"]));
    assert!(String::from_utf8_lossy(&status.stdout).contains("Status: install ok installed"));

    assert_eq!(mode(&r.join("usr/lib/byoc-runner/imds-firewall")), 0o755);
    // The installed units verify (with ExecStart pointing into the throwaway root).
    let unit_dir = tempfile::tempdir().unwrap();
    for name in ["byoc-runner.service", "byoc-runner-imds.service"] {
        let unit = std::fs::read_to_string(r.join("lib/systemd/system").join(name))
            .unwrap()
            .replace(
                "/usr/lib/byoc-runner/imds-firewall",
                r.join("usr/lib/byoc-runner/imds-firewall").to_str().unwrap(),
            )
            .replace("/usr/bin/byoc-runner", r.join("usr/bin/byoc-runner").to_str().unwrap());
        std::fs::write(unit_dir.path().join(name), unit).unwrap();
    }
    // --man=no: man:byoc-runner(8) is in the package's root (checked above), not the host's.
    let v = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(unit_dir.path().join("byoc-runner.service"))
        .arg(unit_dir.path().join("byoc-runner-imds.service"))
        .output()
        .expect("systemd-analyze is required");
    assert!(v.status.success() && v.stderr.is_empty(), "{}", String::from_utf8_lossy(&v.stderr));

    // A customer's config and the runner's state survive a reinstall (an upgrade path).
    std::fs::write(etc.join("runner.toml"), "# the customer's\n").unwrap();
    std::fs::write(etc.join("runner.toml.example"), "# edited example\n").unwrap();
    std::fs::create_dir_all(r.join("var/lib/byoc-runner/audit")).unwrap();
    std::fs::write(r.join("var/lib/byoc-runner/audit/log.jsonl"), "{}\n").unwrap();
    let o = dpkg_install(r, &deb);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(etc.join("runner.toml")).unwrap(), "# the customer's\n");
    assert_eq!(mode(&etc.join("runner.toml")), 0o640, "postinst tightens the config's mode");
    assert_eq!(std::fs::read_to_string(etc.join("runner.toml.example")).unwrap(), "# edited example\n");
    assert!(r.join("var/lib/byoc-runner/audit/log.jsonl").exists());
    assert_eq!(id_of(r, "etc/passwd", "byoc-runner"), uid, "the user is not created twice");
    let passwd = std::fs::read_to_string(r.join("etc/passwd")).unwrap();
    assert_eq!(passwd.lines().filter(|l| l.starts_with("byoc-runner:")).count(), 1);
}

struct Release {
    dir: tempfile::TempDir,
    pubkey: String,
    seckey: PathBuf,
    _keys: tempfile::TempDir,
}

/// A release directory: the package, SHA256SUMS and its minisign signature.
fn signed_release() -> Release {
    let keys = tempfile::tempdir().unwrap();
    let (pub_path, sec) = (keys.path().join("release.pub"), keys.path().join("release.key"));
    run(Command::new("minisign").args(["-G", "-W", "-p"]).arg(&pub_path).arg("-s").arg(&sec));
    let pubkey = std::fs::read_to_string(&pub_path).unwrap().lines().nth(1).unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    build_deb(dir.path());
    sign(dir.path(), &sec);
    Release { dir, pubkey, seckey: sec, _keys: keys }
}

fn sign(dir: &Path, seckey: &Path) {
    let _ = std::fs::remove_file(dir.join("SHA256SUMS.minisig"));
    run(Command::new("minisign").arg("-S").arg("-s").arg(seckey).arg("-m").arg(dir.join("SHA256SUMS")));
}

/// Stand-ins for systemctl, aws and cfn-signal: each appends its arguments to
/// `calls.log`; `aws secretsmanager` prints the bootstrap token.
fn stubs(dir: &Path) -> PathBuf {
    let bin = dir.join("stub-bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = dir.join("calls.log");
    for (name, extra) in [
        ("systemctl", ""),
        ("cfn-signal", ""),
        (
            "aws",
            "case \"$1 $2\" in \"secretsmanager get-secret-value\") echo bootstrap-token-from-secrets-manager ;; \
             \"sts get-caller-identity\") echo AROAEXAMPLEROLEID:i-0123456789abcdef0 ;; esac\n",
        ),
    ] {
        let script = format!("#!/bin/sh\necho \"{name} $*\" >> {}\n{extra}exit 0\n", log.display());
        let p = bin.join(name);
        std::fs::write(&p, script).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    bin
}

fn user_data(root: &Path, release: &Release, stub_bin: &Path) -> std::process::Output {
    user_data_with(root, release, stub_bin, &[])
}

fn user_data_with(
    root: &Path,
    release: &Release,
    stub_bin: &Path,
    extra: &[(&str, &str)],
) -> std::process::Output {
    let path = format!("{}:{}", stub_bin.display(), std::env::var("PATH").unwrap_or_default());
    Command::new("bash")
        .arg(repo().join("packaging/user-data.sh"))
        .env_clear()
        .env("PATH", path)
        .env("BYOC_ROOT", root)
        .env("BYOC_DPKG_OPTS", "--force-depends")
        .env("BYOC_RELEASE_DIR", release.dir.path())
        .env("BYOC_RELEASE_PUBKEY", &release.pubkey)
        .env("BYOC_INSTALL_ID", "inst-demo")
        .env("BYOC_CONTROL_PLANE_URL", "https://cp.vendor.example")
        .env("BYOC_CONTROL_PLANE_KEYS", "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=")
        .env("BYOC_REGION", "eu-west-1")
        .env("BYOC_STACK_NAME", "byoc-install-demo")
        .env("BYOC_SIGNAL_RESOURCE", "RunnerGroup")
        .env("BYOC_AUTOSCALING_GROUP", "inst-demo-byoc-runners")
        .env("BYOC_LIFECYCLE_HOOK", "byoc-drain")
        .env("BYOC_EXTERNAL_ID", "ext-123")
        .env("BYOC_STATE_BUCKET", "inst-demo-state-123456789012")
        .env("BYOC_BOOTSTRAP_SECRET", "arn:aws:secretsmanager:eu-west-1:123456789012:secret:bootstrap")
        .envs(extra.iter().copied())
        .output()
        .unwrap()
}

/// With an admin group the install creates it (in the install's root), names it in
/// runner.toml and gives it control/ (2770, the runner's user as owner); a name that is
/// not a group name stops the install before anything is written.
#[test]
fn user_data_gives_control_to_the_admin_group() {
    let release = signed_release();
    let work = tempfile::tempdir().unwrap();
    let bin = stubs(work.path());
    let root = throwaway_root();
    let r = root.path();
    let o = user_data_with(r, &release, &bin, &[("BYOC_ADMIN_GROUP", "byoc-ops")]);
    assert!(o.status.success(), "user-data failed: {}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(r.join("etc/byoc-runner/runner.toml")).unwrap();
    assert!(text.contains("admin_group = \"byoc-ops\""), "{text}");
    let (uid, gid) = (id_of(r, "etc/passwd", "byoc-runner"), id_of(r, "etc/group", "byoc-ops"));
    // The inbox and approvals are sticky too: no member renames or removes another's.
    for (d, want) in [("control", 0o2770), ("control/audit-inbox", 0o3770), ("control/approvals", 0o3770)] {
        let p = r.join("var/lib/byoc-runner").join(d);
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!((mode(&p), m.uid(), m.gid()), (want, uid, gid), "{d}");
    }
    // A re-run keeps the group (and creates no second one).
    let o = user_data_with(r, &release, &bin, &[("BYOC_ADMIN_GROUP", "byoc-ops")]);
    assert!(o.status.success(), "re-run failed: {}", String::from_utf8_lossy(&o.stderr));
    let groups = std::fs::read_to_string(r.join("etc/group")).unwrap();
    assert_eq!(groups.matches("byoc-ops:").count(), 1, "{groups}");

    let other = throwaway_root();
    let o = user_data_with(other.path(), &release, &bin, &[("BYOC_ADMIN_GROUP", "ops; rm -rf /")]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("BYOC_ADMIN_GROUP is not a group name"));
    assert!(!other.path().join("etc/byoc-runner/runner.toml").exists());
}

/// The account id and the template values an app's role names use reach runner.toml
/// (the runner renders the same role names as the stack); a value that could break out
/// of its TOML string stops the install before anything is written.
#[test]
fn user_data_writes_the_values_role_names_use() {
    let release = signed_release();
    let work = tempfile::tempdir().unwrap();
    let bin = stubs(work.path());
    let root = throwaway_root();
    let r = root.path();
    let values = [
        ("BYOC_ACCOUNT_ID", "123456789012"),
        ("BYOC_INSTALL_NAME", "prod-eu"),
        ("BYOC_ORG_ID", "org7"),
        ("BYOC_APP_ID", "app.3"),
    ];
    let o = user_data_with(r, &release, &bin, &values);
    assert!(o.status.success(), "user-data failed: {}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(r.join("etc/byoc-runner/runner.toml")).unwrap();
    for line in [
        "account_id = \"123456789012\"",
        "install_name = \"prod-eu\"",
        "org_id = \"org7\"",
        "app_id = \"app.3\"",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
    let other = throwaway_root();
    let o = user_data_with(
        other.path(),
        &release,
        &bin,
        &[("BYOC_ORG_ID", "x\"\n[control_plane]\nurl = \"http://evil")],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("BYOC_ORG_ID holds a quote"));
    assert!(!other.path().join("etc/byoc-runner/runner.toml").exists());
}

#[test]
fn user_data_writes_the_customers_audit_copies() {
    let release = signed_release();
    let work = tempfile::tempdir().unwrap();
    let bin = stubs(work.path());
    let root = throwaway_root();
    let r = root.path();
    let pki = byoc_control_plane::tls::test_pki().unwrap();
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(&pki.ca_pem);
    let values = [
        ("BYOC_ACCOUNT_ID", "123456789012"),
        ("BYOC_AUDIT_BUCKET", "create"),
        ("BYOC_AUDIT_LOG_GROUP", "/acme/audit"),
        ("BYOC_AUDIT_OTLP_ENDPOINT", "https://otel.acme.example"),
        ("BYOC_AUDIT_OTLP_CA", ca.as_str()),
    ];
    let o = user_data_with(r, &release, &bin, &values);
    assert!(o.status.success(), "user-data failed: {}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(r.join("etc/byoc-runner/runner.toml")).unwrap();
    let doc: toml::Table = text.parse().unwrap();
    let export = &doc["audit"]["export"];
    // The bucket the stack created has a fixed name.
    assert_eq!(export["s3"]["bucket"].as_str(), Some("inst-demo-audit-123456789012"), "{text}");
    // The instance's own prefix, the one its role may write (role-id:instance-id).
    assert_eq!(
        export["s3"]["prefix"].as_str(),
        Some("byoc-audit/AROAEXAMPLEROLEID:i-0123456789abcdef0"),
        "{text}"
    );
    assert_eq!(export["cloudwatch"]["log_group"].as_str(), Some("/acme/audit"), "{text}");
    assert_eq!(export["otlp"]["endpoint"].as_str(), Some("https://otel.acme.example"), "{text}");
    assert_eq!(export["otlp"]["ca_file"].as_str(), Some("/etc/byoc-runner/otlp-ca.pem"), "{text}");
    assert_eq!(std::fs::read_to_string(r.join("etc/byoc-runner/otlp-ca.pem")).unwrap(), pki.ca_pem);

    // Without them: no copy.
    let plain = throwaway_root();
    assert!(user_data(plain.path(), &release, &bin).status.success());
    assert!(
        !std::fs::read_to_string(plain.path().join("etc/byoc-runner/runner.toml")).unwrap().contains("audit")
    );

    for (var, value, why) in [
        ("BYOC_AUDIT_BUCKET", "x\"\n[control_plane]\nurl = \"http://evil", "BYOC_AUDIT_BUCKET holds a quote"),
        ("BYOC_AUDIT_BUCKET", "Not_A_Bucket", "BYOC_AUDIT_BUCKET is not an S3 bucket name"),
        ("BYOC_AUDIT_OTLP_ENDPOINT", "http://otel.acme.example", "must be an https:// URL"),
        (
            "BYOC_AUTOSCALING_GROUP",
            "g\"\n[control_plane]\nurl = \"http://evil",
            "BYOC_AUTOSCALING_GROUP holds a quote",
        ),
        ("BYOC_AUTOSCALING_GROUP", "g g", "not an Auto Scaling group name"),
        ("BYOC_LIFECYCLE_HOOK", "hook\"\nwatch = false", "BYOC_LIFECYCLE_HOOK holds a quote"),
        ("BYOC_LIFECYCLE_HOOK", "hook.1", "not a lifecycle hook name"),
        ("BYOC_AUDIT_OTLP_CA", "bm90IGEgY2VydA==", "holds no PEM certificate"),
    ] {
        let other = throwaway_root();
        let mut values = vec![(var, value)];
        if var == "BYOC_AUDIT_OTLP_CA" {
            values.push(("BYOC_AUDIT_OTLP_ENDPOINT", "https://otel.acme.example"));
        }
        let o = user_data_with(other.path(), &release, &bin, &values);
        assert!(!o.status.success(), "{var}={value} was accepted");
        assert!(String::from_utf8_lossy(&o.stderr).contains(why), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

fn calls(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("calls.log")).unwrap_or_default()
}

#[test]
fn user_data_installs_configures_starts_and_then_signals_and_is_safe_to_rerun() {
    let release = signed_release();
    let work = tempfile::tempdir().unwrap();
    let bin = stubs(work.path());
    let root = throwaway_root();
    let r = root.path();
    let o = user_data(r, &release, &bin);
    assert!(o.status.success(), "user-data failed: {}", String::from_utf8_lossy(&o.stderr));

    let conf = r.join("etc/byoc-runner/runner.toml");
    let text = std::fs::read_to_string(&conf).unwrap();
    for needle in [
        "url = \"https://cp.vendor.example\"",
        "public_keys = [\"11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=\"]",
        "install_id = \"inst-demo\"",
        "stack_name = \"byoc-install-demo\"",
        "external_id = \"ext-123\"",
        "region = \"eu-west-1\"",
        "[terraform.state]\nbucket = \"inst-demo-state-123456789012\"",
        // On EC2 the runner hands over when the instance is being replaced.
        "[lifecycle]\nautoscaling_group = \"inst-demo-byoc-runners\"\nlifecycle_hook = \"byoc-drain\"\nwatch = true\n",
        // The runner's own updates: approve by default, the key user-data verified with.
        "[update]\nmode = \"approve\"",
    ] {
        assert!(text.contains(needle), "{needle} not in:\n{text}");
    }
    assert!(text.contains(&format!("release_public_key = \"{}\"", release.pubkey)), "{text}");
    assert_eq!(mode(&conf), 0o640);
    // The verified release is kept for the updater to roll back to (root's, 0700, in a
    // directory the runner may only traverse), and it verifies as the updater verifies it.
    let updater = r.join("var/lib/byoc-runner-update");
    assert_eq!((mode(&updater), mode(&updater.join("releases"))), (0o711, 0o700));
    let kept: Vec<_> =
        std::fs::read_dir(updater.join("releases")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let version = kept[0].file_name().unwrap().to_string_lossy().into_owned();
    let key = byoc_runner::update::minisign::PublicKey::parse(&release.pubkey).unwrap();
    byoc_runner::update::release::verify_signed(&kept[0], &key, &version).expect("the kept release verifies");
    run(Command::new(BIN).args(["config", "validate", "--config"]).arg(&conf));
    let token = r.join("var/lib/byoc-runner/bootstrap-token");
    assert_eq!(std::fs::read_to_string(&token).unwrap().trim(), "bootstrap-token-from-secrets-manager");
    assert_eq!(mode(&token), 0o600);
    assert_eq!(std::fs::metadata(&token).unwrap().uid(), id_of(r, "etc/passwd", "byoc-runner"));

    // The stack hears of success only after the unit was started (and so was READY).
    let log = calls(work.path());
    let start = log.find("systemctl restart byoc-runner").expect("the unit was started");
    let signal = log.find("cfn-signal -e 0").expect("the stack was signalled");
    assert!(start < signal, "{log}");
    assert!(log.contains("--stack byoc-install-demo --resource RunnerGroup --region eu-west-1"), "{log}");
    assert!(log.contains(
        "aws secretsmanager get-secret-value --region eu-west-1 --secret-id arn:aws:secretsmanager"
    ));

    // Re-run once enrolled: same config, no second token fetch, signalled again.
    std::fs::create_dir_all(r.join("var/lib/byoc-runner")).unwrap();
    std::fs::write(r.join("var/lib/byoc-runner/enrollment.json"), "{}").unwrap();
    std::fs::remove_file(&token).unwrap();
    let o = user_data(r, &release, &bin);
    assert!(o.status.success(), "re-run failed: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), text);
    assert!(!token.exists(), "no token is fetched once enrolled");
    let log = calls(work.path());
    assert_eq!(log.matches("aws secretsmanager").count(), 1, "{log}");
    assert_eq!(log.matches("cfn-signal -e 0").count(), 2, "{log}");
}

#[test]
fn user_data_refuses_a_tampered_package_a_tampered_checksum_file_and_a_foreign_key() {
    let release = signed_release();
    let deb = std::fs::read_dir(release.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .unwrap();
    let original = std::fs::read(&deb).unwrap();
    let sums = std::fs::read_to_string(release.dir.path().join("SHA256SUMS")).unwrap();

    let refused = |why: &str| {
        let work = tempfile::tempdir().unwrap();
        let bin = stubs(work.path());
        let root = throwaway_root();
        let o = user_data(root.path(), &release, &bin);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "{why}: user-data succeeded");
        assert!(stderr.contains(why), "{why} not in: {stderr}");
        assert!(!root.path().join("usr/bin/byoc-runner").exists(), "{why}: something was installed");
        let log = calls(work.path());
        assert!(log.contains("cfn-signal -e 1"), "{why}: the stack was not told: {log}");
        assert!(!log.contains("systemctl"), "{why}: {log}");
    };

    // One byte of the package changed: its checksum no longer matches.
    let mut tampered = original.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 1;
    std::fs::write(&deb, &tampered).unwrap();
    refused("does not match its checksum");

    // The checksum file rewritten to match the tampered package: the signature fails.
    let digest = String::from_utf8_lossy(&run(Command::new("sha256sum").arg(&deb)).stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let name = deb.file_name().unwrap().to_str().unwrap();
    std::fs::write(release.dir.path().join("SHA256SUMS"), format!("{digest}  {name}\n")).unwrap();
    refused("signature does not verify");

    // Signed, but by a key other than the pinned one.
    let other = tempfile::tempdir().unwrap();
    run(Command::new("minisign")
        .args(["-G", "-W", "-p"])
        .arg(other.path().join("k.pub"))
        .arg("-s")
        .arg(other.path().join("k.key")));
    sign(release.dir.path(), &other.path().join("k.key"));
    refused("signature does not verify");

    // Restored and signed with the pinned key: accepted again (the refusals were real).
    std::fs::write(&deb, &original).unwrap();
    std::fs::write(release.dir.path().join("SHA256SUMS"), &sums).unwrap();
    sign(release.dir.path(), &release.seckey);
    let work = tempfile::tempdir().unwrap();
    let root = throwaway_root();
    let o = user_data(root.path(), &release, &stubs(work.path()));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Values that would be code in a shell or syntax in TOML, from the environment or the
/// stack's parameters file: refused before anything is written or installed, and the
/// command in them never runs.
#[test]
fn user_data_refuses_a_value_that_is_code_before_writing_anything() {
    let release = signed_release();
    let work = tempfile::tempdir().unwrap();
    let bin = stubs(work.path());
    let marker = work.path().join("pwned");
    let hostile = [
        ("BYOC_CONTROL_PLANE_URL", format!("https://x/';touch {}>/dev/null;'", marker.display())),
        ("BYOC_EXTERNAL_ID", format!("ext-$(touch {})", marker.display())),
        ("BYOC_EXTERNAL_ID", "ext\"\n[sandbox]\nenabled = false".to_string()),
        ("BYOC_STACK_NAME", format!("stack`touch {}`", marker.display())),
        ("BYOC_INSTALL_ID", "inst-demo\\".to_string()),
    ];
    for (name, value) in hostile {
        let root = throwaway_root();
        let o = user_data_with(root.path(), &release, &bin, &[(name, value.as_str())]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{name}={value:?} was accepted");
        assert!(err.contains(&format!("{name} holds a quote")), "{name}: {err}");
        assert!(!root.path().join("etc/byoc-runner/runner.toml").exists(), "{name}: a config was written");
        assert_eq!(
            std::fs::read_to_string(root.path().join("var/lib/dpkg/status")).unwrap(),
            "",
            "{name}: installed"
        );
        assert!(!marker.exists(), "{name}: the value ran as a command");
    }
    // The stack's way: a file of NAME=value lines, read as data.
    let params = work.path().join("params");
    std::fs::write(&params, format!("BYOC_EXTERNAL_ID=ext-$(touch {})\n", marker.display())).unwrap();
    let root = throwaway_root();
    let p = params.to_string_lossy().into_owned();
    let o = user_data_with(root.path(), &release, &bin, &[("BYOC_PARAMS_FILE", p.as_str())]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("BYOC_EXTERNAL_ID holds a quote"));
    assert!(!marker.exists() && !root.path().join("etc/byoc-runner/runner.toml").exists());
    std::fs::write(&params, "PATH=/tmp/evil\n").unwrap();
    let o = user_data_with(root.path(), &release, &bin, &[("BYOC_PARAMS_FILE", p.as_str())]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("names PATH, which is not one of this script's inputs")
    );
    // A good parameters file installs like the environment does.
    std::fs::write(&params, "BYOC_EXTERNAL_ID=ext-from-the-stack\nBYOC_ADMIN_GROUP=\n").unwrap();
    let o = user_data_with(root.path(), &release, &bin, &[("BYOC_PARAMS_FILE", p.as_str())]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(root.path().join("etc/byoc-runner/runner.toml")).unwrap();
    assert!(text.contains("external_id = \"ext-from-the-stack\""), "{text}");
}

/// A re-run of user-data after the runner's user planted links where root writes
/// (`control/audit-inbox` to a root-owned directory, the bootstrap token to a root-owned
/// file): the link is replaced, its target keeps its owner, mode and bytes.
#[test]
fn a_rerun_of_user_data_follows_no_link_the_runners_user_planted() {
    let release = signed_release();
    let work = tempfile::tempdir().unwrap();
    let bin = stubs(work.path());
    let root = throwaway_root();
    let r = root.path();
    let o = user_data_with(r, &release, &bin, &[("BYOC_ADMIN_GROUP", "byoc-ops")]);
    assert!(o.status.success(), "user-data failed: {}", String::from_utf8_lossy(&o.stderr));
    let outside = work.path().join("root-owned");
    std::fs::create_dir(&outside).unwrap();
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = work.path().join("root-secret");
    std::fs::write(&secret, "root's own").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let state = r.join("var/lib/byoc-runner");
    std::fs::remove_dir_all(state.join("control/audit-inbox")).unwrap();
    std::os::unix::fs::symlink(&outside, state.join("control/audit-inbox")).unwrap();
    let _ = std::fs::remove_file(state.join("bootstrap-token"));
    std::os::unix::fs::symlink(&secret, state.join("bootstrap-token")).unwrap();
    let before = |p: &Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.uid(), m.gid(), m.mode())
    };
    let (outside_was, secret_was) = (before(&outside), before(&secret));

    let o = user_data_with(r, &release, &bin, &[("BYOC_ADMIN_GROUP", "byoc-ops")]);
    assert!(o.status.success(), "re-run failed: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(before(&outside), outside_was, "the planted link's directory changed owner or mode");
    assert_eq!(
        (before(&secret), std::fs::read_to_string(&secret).unwrap().as_str()),
        (secret_was, "root's own")
    );
    let inbox = std::fs::symlink_metadata(state.join("control/audit-inbox")).unwrap();
    assert!(inbox.is_dir() && inbox.mode() & 0o7777 == 0o3770, "the inbox is a real directory again");
    let token = std::fs::symlink_metadata(state.join("bootstrap-token")).unwrap();
    assert!(token.is_file() && token.mode() & 0o7777 == 0o600);
    assert_eq!(token.uid(), id_of(r, "etc/passwd", "byoc-runner"));
    assert_eq!(
        std::fs::read_to_string(state.join("bootstrap-token")).unwrap().trim(),
        "bootstrap-token-from-secrets-manager"
    );
}
