//! The runner on a real VM, installed as a customer's stack installs it: Debian 12 under
//! qemu (systemd as PID 1, cgroup v2, cloud-init), the install stack's own user-data
//! (rendered from `ami/install-stack.yaml` with the stack's parameters and resources as
//! moto created them) fetching a signed release over HTTPS, the bootstrap token from
//! Secrets Manager, and the shipped unit. The control plane, moto, the release server and
//! a fake instance metadata service run on the host's loopback; the guest reaches them,
//! and nothing else, through qemu's user-mode network (see `byoc_control_plane::vm`).
//!
//! One guest is booted (a cold boot under software emulation takes about a minute) and
//! the cases run in order inside it; the cases that disturb the runner (stop, kill,
//! reboot) come last. This file has its own `main` (harness = false) so the order is
//! explicit; it prints libtest's lines so `scripts/test` counts its cases.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use byoc_control_plane::imds::FakeImds;
use byoc_control_plane::moto::MotoServer;
use byoc_control_plane::state::JobState;
use byoc_control_plane::vm::{Forward, IMDS_ADDR, Vm, VmImage, VmOptions, serve_files_tls};
use byoc_control_plane::{ControlPlane, ControlPlaneConfig, EnqueueRequest, Faults, JobView};
use byoc_protocol::JobStatus;
use common::{BIN, repo, run};

const RELEASE_ADDR: &str = "169.254.100.1";
const CP_ADDR: &str = "169.254.100.2";
const AWS_ADDR: &str = "169.254.100.3";
/// The install's registry (ECR's host, as moto names it, mapped to a local registry).
const REGISTRY_ADDR: &str = "169.254.100.4";
const ECR_HOST: &str = "123456789012.dkr.ecr.us-east-1.amazonaws.com";
const STACK: &str = "byoc-vm-install";
const REGION: &str = "us-east-1";

/// Everything on the host side, and the guest.
struct World {
    rt: tokio::runtime::Runtime,
    cp: ControlPlane,
    moto: MotoServer,
    vm: Vm,
    image: VmImage,
    vm_options: VmOptions,
    bootstrap_secret: String,
    /// The install's registry, where releases are published for `runner.update`.
    registry: byoc_control_plane::registry::LocalRegistry,
    /// Release directories by name (`vm2`, `vm3-exits`, `foreign-key`, …).
    releases: PathBuf,
    _imds: FakeImds,
    _release: tokio::task::JoinHandle<()>,
    _dirs: Vec<tempfile::TempDir>,
}

impl World {
    fn wait_job(&mut self, job_id: &str, timeout: Duration, done: impl Fn(&JobView) -> bool) -> JobView {
        match self.rt.block_on(self.cp.wait_for(job_id, timeout, done)) {
            Some(v) => v,
            None => panic!(
                "job {job_id} did not get there in {timeout:?}: {:?}\nrunner journal:\n{}",
                self.cp.job(job_id),
                self.journal_tail()
            ),
        }
    }

    fn finished(&mut self, job_id: &str) -> JobView {
        self.wait_job(job_id, Duration::from_secs(300), |v| v.result.is_some())
    }

    fn output(&self, job_id: &str) -> String {
        common::job_output(&self.cp.log(job_id).unwrap_or_default())
    }

    fn journal_tail(&mut self) -> String {
        self.vm
            .exec("journalctl -u byoc-runner --no-pager -n 60", Duration::from_secs(60))
            .map(|o| o.stdout)
            .unwrap_or_else(|e| e.to_string())
    }
}

/// Three releases a user-data must refuse, in subdirectories of `dir`, each of version
/// 0.1.0-vm2 so that an install of any of them would show: a package with one byte
/// changed, a SHA256SUMS changed after signing, and one signed with a foreign key.
fn tampered_releases(dir: &Path, keys: &Path) {
    let good = dir.join("vm2");
    std::fs::create_dir_all(&good).unwrap();
    let bin = good.join("byoc-runner");
    run(Command::new("objcopy").arg("--strip-debug").arg(BIN).arg(&bin));
    let deb = run(Command::new(repo().join("packaging/build-deb"))
        .arg(&bin)
        .arg(&good)
        .arg("0.1.0-vm2")
        .env("BYOC_DEB_COMPRESSION", "none")
        .env("UPDATER", common::updater_bin()));
    let deb = PathBuf::from(String::from_utf8_lossy(&deb.stdout).trim());
    let deb_name = deb.file_name().unwrap().to_owned();
    std::fs::remove_file(&bin).unwrap();
    let secret = keys.join("release.key");
    let sign = |sums: &Path, key: &Path| {
        run(Command::new("minisign").arg("-S").arg("-s").arg(key).arg("-m").arg(sums));
    };
    // The good one stays: the update cases send it.
    sign(&good.join("SHA256SUMS"), &secret);
    let copy_set = |name: &str| -> PathBuf {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(good.join(&deb_name), d.join(&deb_name)).unwrap();
        std::fs::copy(good.join("SHA256SUMS"), d.join("SHA256SUMS")).unwrap();
        d
    };
    // One byte of the package changed; SHA256SUMS and its signature are genuine.
    let d = copy_set("tampered-package");
    sign(&d.join("SHA256SUMS"), &secret);
    let p = d.join(&deb_name);
    let mut bytes = std::fs::read(&p).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&p, bytes).unwrap();
    // SHA256SUMS edited after it was signed (as if to match a swapped package).
    let d = copy_set("tampered-checksums");
    sign(&d.join("SHA256SUMS"), &secret);
    let sums = std::fs::read_to_string(d.join("SHA256SUMS")).unwrap();
    let flipped = match sums.strip_prefix('0') {
        Some(rest) => format!("1{rest}"),
        None => format!("0{}", &sums[1..]),
    };
    std::fs::write(d.join("SHA256SUMS"), flipped).unwrap();
    // Signed with a key the stack does not pin.
    let d = copy_set("foreign-key");
    let (fp, fs) = (keys.join("foreign.pub"), keys.join("foreign.key"));
    run(Command::new("minisign").args(["-G", "-W", "-p"]).arg(&fp).arg("-s").arg(&fs));
    sign(&d.join("SHA256SUMS"), &fs);
    // A release whose runner exits at start (`run`), as a broken build would; everything
    // else it does as the real binary (build-deb runs it for completions and pages).
    let d = dir.join("vm3-exits");
    std::fs::create_dir_all(&d).unwrap();
    let exits = d.join("byoc-runner");
    let script =
        format!("#!/bin/sh\n[ \"$1\" = run ] && {{ echo 'broken build' >&2; exit 1; }}\nexec {BIN} \"$@\"\n");
    std::fs::write(&exits, script).unwrap();
    std::fs::set_permissions(&exits, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    run(Command::new(repo().join("packaging/build-deb"))
        .arg(&exits)
        .arg(&d)
        .arg("0.1.0-vm3")
        .env("BYOC_DEB_COMPRESSION", "none")
        .env("UPDATER", common::updater_bin()));
    std::fs::remove_file(&exits).unwrap();
    sign(&d.join("SHA256SUMS"), &secret);
}

/// The release: a .deb of the binary under test (debug info stripped: the guest unpacks
/// it under emulation), SHA256SUMS and its minisign signature; the key line.
fn signed_release(dir: &Path, keys: &Path) -> String {
    let bin = dir.join("byoc-runner");
    run(Command::new("objcopy").arg("--strip-debug").arg(BIN).arg(&bin));
    run(Command::new(repo().join("packaging/build-deb"))
        .arg(&bin)
        .arg(dir)
        .arg("0.1.0-vm1")
        .env("BYOC_DEB_COMPRESSION", "none")
        .env("UPDATER", common::updater_bin()));
    std::fs::remove_file(&bin).unwrap();
    let (public, secret) = (keys.join("release.pub"), keys.join("release.key"));
    run(Command::new("minisign").args(["-G", "-W", "-p"]).arg(&public).arg("-s").arg(&secret));
    run(Command::new("minisign").arg("-S").arg("-s").arg(&secret).arg("-m").arg(dir.join("SHA256SUMS")));
    std::fs::read_to_string(&public).unwrap().lines().nth(1).unwrap().to_string()
}

/// The template's UserData with `${…}` substituted as CloudFormation's Fn::Sub would.
fn render_user_data(template: &serde_json::Value, vars: &[(&str, String)]) -> String {
    let lt = &template["Resources"]["RunnerLaunchTemplate"]["Properties"]["LaunchTemplateData"];
    let sub =
        lt["UserData"]["Fn::Base64"]["Fn::Sub"].as_str().expect("the template's UserData is an Fn::Sub");
    let mut out = String::new();
    let mut rest = sub;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after.find('}').expect("unterminated ${ in UserData");
        let name = &after[..end];
        if let Some(literal) = name.strip_prefix('!') {
            out.push_str("${");
            out.push_str(literal);
            out.push('}');
        } else {
            let value = vars
                .iter()
                .find(|(k, _)| *k == name)
                .unwrap_or_else(|| panic!("UserData names ${{{name}}}, which the suite does not set"));
            out.push_str(&value.1);
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

fn template() -> serde_json::Value {
    let out = run(Command::new(repo().join(".venv/bin/python"))
        .args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"])
        .arg(repo().join("ami/install-stack.yaml")));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A resource's physical id (what `Ref` gives) from DescribeStackResources' answer.
fn physical_id(resources: &str, logical: &str) -> String {
    let at = resources
        .find(&format!("<LogicalResourceId>{logical}</LogicalResourceId>"))
        .unwrap_or_else(|| panic!("no resource {logical}: {resources}"));
    let member = &resources[..at];
    let member = &member[member.rfind("<member>").unwrap()..];
    let rest = &resources[at..];
    let end = rest.find("</member>").unwrap_or(rest.len());
    let whole = format!("{member}{}", &rest[..end]);
    whole.split("<PhysicalResourceId>").nth(1).and_then(|s| s.split('<').next()).unwrap().to_string()
}

/// What stands in for the cloud inside the guest, as vendor-data (cloud-init applies it
/// before the user-data runs): trust for the test CA (the release and control plane
/// certificates), and AWS's endpoints at moto for the aws CLI (a wrapper adding
/// `--endpoint-url`: this Debian's aws CLI predates AWS_ENDPOINT_URL) and for the runner
/// (a drop-in, which also maps ECR's host to the suite's registry), and for the
/// updater's `config check` (another drop-in).
fn vendor_data(ca_pem: &str, aws_url: &str) -> String {
    let indent = |s: &str, n: usize| s.lines().map(|l| format!("{}{l}\n", " ".repeat(n))).collect::<String>();
    format!(
        "#cloud-config\nlocale: false\nca_certs:\n  trusted:\n    - |\n{ca}write_files:\n  - path: /usr/local/bin/aws\n    permissions: '0755'\n    content: |\n      #!/bin/sh\n      exec /usr/bin/aws --endpoint-url {aws_url} \"$@\"\n  - path: /etc/systemd/system/byoc-runner.service.d/test-endpoints.conf\n    content: |\n      [Service]\n      Environment=AWS_ENDPOINT_URL={aws_url}\n      Environment=\"BYOC_RUNNER__OCI__REGISTRY_ENDPOINTS={{ \\\"{ECR_HOST}\\\" = \\\"https://{REGISTRY_ADDR}\\\" }}\"\n  - path: /etc/systemd/system/byoc-runner-update.service.d/test-endpoints.conf\n    content: |\n      [Service]\n      Environment=AWS_ENDPOINT_URL={aws_url}\n",
        ca = indent(ca_pem, 6),
    )
}

fn setup() -> World {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let image = VmImage::get().unwrap_or_else(|e| panic!("the VM image: {e}"));
    let pki = byoc_control_plane::tls::test_pki_for(&[RELEASE_ADDR, CP_ADDR, REGISTRY_ADDR]).unwrap();
    let (release_dir, keys) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let release_key = signed_release(release_dir.path(), keys.path());
    tampered_releases(release_dir.path(), keys.path());

    let cp = rt
        .block_on(ControlPlane::start(ControlPlaneConfig {
            tls: Some(pki.server.clone()),
            ..Default::default()
        }))
        .unwrap();
    let moto = rt.block_on(MotoServer::start());
    let imds = rt.block_on(FakeImds::start()).unwrap();
    let registry = rt.block_on(byoc_control_plane::registry::LocalRegistry::start_tls(
        &pki.server_cert_pem,
        &pki.server_key_pem,
    ));
    let (release_port, release_task) =
        rt.block_on(serve_files_tls(release_dir.path().to_path_buf(), pki.server.clone()));
    let port_of = |url: &str| url.rsplit(':').next().unwrap().trim_end_matches('/').parse::<u16>().unwrap();

    // The install stack, created by moto's CloudFormation from the shipped template.
    let template = template();
    let control_plane_url = format!("https://{CP_ADDR}");
    let bootstrap_token = cp.bootstrap_token();
    let (resources, secret_arn) = rt.block_on(async {
        let images = moto
            .query("ec2", &[("Action".into(), "DescribeImages".into()), ("Version".into(), "2016-11-15".into())])
            .await;
        let image_id = images.split("<imageId>").nth(1).and_then(|s| s.split('<').next()).unwrap().to_string();
        let params = [
            ("InstallId", cp.install_id()),
            ("ControlPlaneUrl", control_plane_url.clone()),
            ("ControlPlanePublicKeys", cp.public_key_b64()),
            ("ReleaseUrl", format!("https://{RELEASE_ADDR}")),
            ("ReleasePublicKey", release_key.clone()),
            ("ImageId", image_id),
            ("BootstrapToken", bootstrap_token.clone()),
            ("ExternalId", "vm-suite-external-id".to_string()),
            // The example app's one required secret (docs/SECRETS.md).
            ("SecretDbPassword", "vm-suite-db-password".to_string()),
        ];
        let params: Vec<(&str, &str)> = params.iter().map(|(k, v)| (*k, v.as_str())).collect();
        moto.put_stack("CreateStack", STACK, &template, &params).await;
        let described = moto
            .query(
                "cloudformation",
                &[("Action".into(), "DescribeStacks".into()), ("StackName".into(), STACK.into())],
            )
            .await;
        assert!(described.contains("CREATE_COMPLETE"), "{described}");
        let resources = moto
            .query(
                "cloudformation",
                &[("Action".into(), "DescribeStackResources".into()), ("StackName".into(), STACK.into())],
            )
            .await;
        // moto's CloudFormation does not create AWS::SecretsManager::Secret resources: the
        // suite creates the stack's bootstrap secret as the stack would.
        let secret = moto
            .json_call(
                "secretsmanager",
                "secretsmanager.CreateSecret",
                serde_json::json!({"Name": format!("{STACK}-BootstrapSecret"), "SecretString": bootstrap_token}),
            )
            .await;
        (resources, secret["ARN"].as_str().expect("CreateSecret's ARN").to_string())
    });
    let user_data = render_user_data(
        &template,
        &[
            ("InstallId", cp.install_id()),
            ("ControlPlaneUrl", control_plane_url),
            ("ControlPlanePublicKeys", cp.public_key_b64()),
            ("AWS::Region", REGION.into()),
            ("AWS::AccountId", "123456789012".into()),
            ("AWS::StackName", STACK.into()),
            ("ExternalId", "vm-suite-external-id".into()),
            ("BootstrapSecret", secret_arn.clone()),
            ("StateBucket", physical_id(&resources, "StateBucket")),
            ("AdminGroup", ADMIN_GROUP.into()),
            ("RunnerUpdates", "approve".into()),
            // No copy of the audit log of the customer's own (the stack's defaults).
            ("AuditBucket", String::new()),
            ("AuditLogGroup", String::new()),
            ("AuditOtlpEndpoint", String::new()),
            ("AuditOtlpCaBundle", String::new()),
            ("ReleaseUrl", format!("https://{RELEASE_ADDR}")),
            ("ReleasePublicKey", release_key),
        ],
    );
    let secret_arn_for_world = secret_arn;
    let forwards = vec![
        Forward { guest_addr: IMDS_ADDR.into(), guest_port: 80, host_port: port_of(&imds.url) },
        Forward { guest_addr: RELEASE_ADDR.into(), guest_port: 443, host_port: release_port },
        Forward { guest_addr: CP_ADDR.into(), guest_port: 443, host_port: port_of(&cp.runner_url()) },
        Forward { guest_addr: AWS_ADDR.into(), guest_port: 80, host_port: port_of(&moto.url()) },
        Forward { guest_addr: REGISTRY_ADDR.into(), guest_port: 443, host_port: port_of(&registry.url()) },
    ];
    let vm_options = VmOptions {
        user_data,
        vendor_data: Some(vendor_data(&pki.ca_pem, &format!("http://{AWS_ADDR}"))),
        forwards,
        memory_mib: None,
    };
    let vm = Vm::boot(&image, &vm_options).unwrap_or_else(|e| panic!("booting the VM: {e}"));
    World {
        rt,
        cp,
        moto,
        vm,
        image,
        vm_options,
        bootstrap_secret: secret_arn_for_world,
        registry,
        releases: release_dir.path().to_path_buf(),
        _imds: imds,
        _release: release_task,
        _dirs: vec![release_dir, keys],
    }
}

// ---- the cases, in the order they run -------------------------------------------------

/// cloud-init ran the stack's user-data: release verified and installed, config written,
/// token fetched, unit started and READY, stack signalled; the system is not degraded.
fn the_stacks_user_data_installs_and_the_unit_becomes_ready(w: &mut World) {
    w.vm.wait_agent(Duration::from_secs(300)).unwrap_or_else(|e| panic!("{e}\n{}", w.vm.serial_tail(80)));
    let status = w.vm.exec("cloud-init status --wait --long", Duration::from_secs(600)).unwrap();
    let install_log =
        w.vm.sh("journalctl -t byoc-install --no-pager -o cat; tail -40 /var/log/cloud-init-output.log");
    assert!(status.ok(), "cloud-init: {}\n{install_log}", status.stdout);
    assert!(install_log.contains("release verified: byoc-runner_0.1.0-vm1_"), "{install_log}");
    assert!(install_log.contains("byoc-runner is enrolled and polling"), "{install_log}");
    assert_eq!(w.vm.sh("systemctl is-active byoc-runner").trim(), "active");
    assert_eq!(
        w.vm.sh("systemctl is-system-running || true").trim(),
        "running",
        "{}",
        w.vm.sh("systemctl --failed --no-pager")
    );
    let show = w.vm.sh("systemctl show byoc-runner -p Type -p User -p StatusText -p NRestarts");
    assert!(show.contains("Type=notify") && show.contains("User=byoc-runner"), "{show}");
    assert!(show.contains("StatusText=") && !show.contains("StatusText=\n"), "no status text: {show}");
    // Enrolled with the stack's one-time token, which is gone from the VM afterwards.
    assert_eq!(w.cp.runners().len(), 1, "{:?}", w.cp.runners());
    assert!(
        !w.vm.exec("test -e /var/lib/byoc-runner/bootstrap-token", Duration::from_secs(30)).unwrap().ok()
    );
    let token_reads = w.rt.block_on(w.moto.calls_of("GetSecretValue"));
    assert_eq!(token_reads.len(), 1, "{token_reads:?}");
    // The stack was told (moto's SignalResource is not modelled beyond recording the
    // call: the aws CLI retries its error, so there may be several).
    let signals = w.rt.block_on(w.moto.calls_of("SignalResource"));
    assert!(!signals.is_empty(), "the stack was never signalled");
    for call in &signals {
        assert_eq!(call.params.get("Status").map(String::as_str), Some("SUCCESS"), "{call:?}");
        assert_eq!(call.params.get("LogicalResourceId").map(String::as_str), Some("RunnerGroup"), "{call:?}");
    }
    // The unit runs the runner as its own user.
    let user = w.vm.sh("stat -c %U /proc/$(systemctl show -p MainPID --value byoc-runner)");
    assert_eq!(user.trim(), "byoc-runner");
}

fn exposure(w: &mut World) -> f64 {
    let out = w.vm.sh("systemd-analyze security byoc-runner --no-pager 2>&1 | tail -1");
    out.split("level for byoc-runner.service:")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("systemd-analyze security said: {out}"))
}

/// The running unit's exposure score, as systemd itself rates it.
fn the_running_unit_is_rated_at_most_3_by_systemd_analyze_security(w: &mut World) {
    let score = exposure(w);
    eprintln!("vm: systemd-analyze security byoc-runner: {score}");
    assert!(
        score <= 3.0,
        "exposure {score} > 3.0:\n{}",
        w.vm.sh("systemd-analyze security byoc-runner --no-pager")
    );
}

/// `byoc-runner config check` on the VM: IMDSv2, the stack, the sandbox, the boundary.
fn config_check_on_the_vm_is_all_ok(w: &mut World) {
    // As the runner's user, with the endpoint stand-in the unit gets from its drop-in.
    let out =
        w.vm.exec(
            &format!(
                "runuser -u byoc-runner -- env AWS_ENDPOINT_URL=http://{AWS_ADDR} \
             byoc-runner config check --config /etc/byoc-runner/runner.toml --output json"
            ),
            Duration::from_secs(120),
        )
        .unwrap();
    let report: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|_| panic!("config check printed {}\n{}", out.stdout, out.stderr));
    let checks = report["checks"].as_array().unwrap();
    // Docker is not part of this image: container actions are not what this suite runs.
    let not_ok: Vec<&serde_json::Value> = checks
        .iter()
        .filter(|c| c["status"] != "ok" && !(c["name"] == "docker" && c["status"] == "warn"))
        .collect();
    assert!(not_ok.is_empty(), "not ok: {not_ok:#?}");
    for name in ["imds", "imds_firewall", "install_stack", "sandbox", "network_boundary"] {
        assert!(
            checks.iter().any(|c| c["name"] == name && c["status"] == "ok"),
            "no ok {name} check: {checks:#?}"
        );
    }
    assert!(out.ok(), "{}", out.stderr);
}

/// Only root and the runner's user reach the metadata service (the package's
/// byoc-runner-imds.service, nftables): a local unprivileged user gets neither the
/// instance role's credentials nor the user-data, while the runner still does (the
/// config check above got its IMDSv2 token as the runner's user).
fn only_root_and_the_runner_reach_the_metadata_service(w: &mut World) {
    let mut connect = |who: &str| {
        let as_who = match who {
            "root" => String::new(),
            "runner" => {
                "setpriv --reuid=$(id -u byoc-runner) --regid=$(id -g byoc-runner) --clear-groups ".into()
            }
            uid => format!("setpriv --reuid={uid} --regid={uid} --clear-groups "),
        };
        w.vm.sh(&format!(
            "{as_who}bash -c 'if (exec 3<>/dev/tcp/169.254.169.254/80) 2>/dev/null; then echo reached; else echo refused; fi'"
        ))
    };
    assert_eq!(connect("65534").trim(), "refused", "a local user reached the metadata service");
    assert_eq!(connect("1000").trim(), "refused", "a local user reached the metadata service");
    assert_eq!(connect("root").trim(), "reached");
    assert_eq!(connect("runner").trim(), "reached");
    let user_data = w.vm.exec(
        "setpriv --reuid=65534 --regid=65534 --clear-groups curl -sf -m 5 http://169.254.169.254/latest/user-data",
        Duration::from_secs(30),
    );
    assert!(user_data.is_ok_and(|o| !o.ok() && o.stdout.is_empty()), "a local user read the user-data");
    let rules = w.vm.sh("nft list table inet byoc_runner_imds");
    assert!(rules.contains("fd00:ec2::254") && rules.contains("skuid"), "{rules}");
    assert!(w.vm.sh("systemctl is-enabled byoc-runner-imds.service").contains("enabled"));
}

/// The stack's AdminGroup in this suite.
const ADMIN_GROUP: &str = "byoc-admins";

/// `byoc-runner ARGS` as local user `who`.
fn as_user(w: &mut World, who: &str, args: &str) -> byoc_control_plane::vm::ExecOutput {
    w.vm.exec(&format!("cd / && runuser -u {who} -- byoc-runner {args}"), Duration::from_secs(60)).unwrap()
}

/// A member of the admin group who is not root pauses and resumes the runner, answers
/// a held job and allows a role, each attributed to them as the kernel knows them; a
/// user outside the group can do none of it and changes nothing.
fn a_non_root_admin_can_pause_approve_and_allow(w: &mut World) {
    w.vm.sh(&format!("id alice >/dev/null 2>&1 || useradd -m -G {ADMIN_GROUP} alice; id bob >/dev/null 2>&1 || useradd -m bob"));
    let paused_file = "/var/lib/byoc-runner/control/paused.json";
    // Outside the group: refused, nothing written.
    let o = as_user(w, "bob", "pause --reason nope");
    assert!(!o.ok() && o.stderr.contains(ADMIN_GROUP), "bob paused: {} {}", o.stdout, o.stderr);
    assert!(!w.vm.exec(&format!("test -e {paused_file}"), Duration::from_secs(30)).unwrap().ok());
    // A member: pauses, and the runner names them.
    let o = as_user(w, "alice", "pause --reason 'change freeze'");
    assert!(o.ok(), "alice could not pause: {} {}", o.stdout, o.stderr);
    let status = w.vm.sh("byoc-runner status");
    assert!(status.contains("paused:         yes, by alice (uid"), "{status}");
    let o = as_user(w, "bob", "resume");
    assert!(!o.ok(), "bob resumed");
    let o = as_user(w, "alice", "resume");
    assert!(o.ok(), "alice could not resume: {} {}", o.stdout, o.stderr);
    assert!(w.vm.sh("byoc-runner status").contains("paused:         no"));
    // Both on record in her name, as the kernel knows her (the CLI's records, before
    // the file changed).
    w.vm.wait_for(
        "byoc-runner audit export --event runner_resumed | grep -q '\\[left by alice (uid'",
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("alice's resume is not on record in her name: {e}\n{}", w.journal_tail()));
    let paused = w.vm.sh("byoc-runner audit export --event runner_paused");
    assert!(paused.contains("[left by alice (uid") && paused.contains("change freeze"), "{paused}");
    // The inbox is sticky: a member cannot hold back, or replay later, a record someone
    // else left (a name the daemon does not drain, so it stays for the test).
    let inbox = "/var/lib/byoc-runner/control/audit-inbox";
    assert_eq!(w.vm.sh(&format!("stat -c %a {inbox}")).trim(), "3770");
    w.vm.sh(&format!("echo '{{}}' > {inbox}/root-record.hold && chmod 0644 {inbox}/root-record.hold"));
    for attempt in
        [format!("mv {inbox}/root-record.hold {inbox}/.held"), format!("rm -f {inbox}/root-record.hold")]
    {
        let o = w.vm.exec(&format!("runuser -u alice -- {attempt}"), Duration::from_secs(30)).unwrap();
        assert!(!o.ok(), "alice could: {attempt}");
    }
    assert!(w.vm.exec(&format!("test -f {inbox}/root-record.hold"), Duration::from_secs(30)).unwrap().ok());
    w.vm.sh(&format!("rm -f {inbox}/root-record.hold"));

    // A held job, approved by the member.
    w.vm.sh("cp /etc/byoc-runner/runner.toml /root/runner.toml.before-approvals && \
         printf '\n[[guardrails.approval_rule]]\nname = \"vm-admin\"\nkinds = [\"action.script\"]\n' \
           >> /etc/byoc-runner/runner.toml && systemctl restart byoc-runner");
    let id = w.cp.enqueue(script("echo ran-after-approval")).unwrap();
    w.vm.wait_for(
        &format!("test -e /var/lib/byoc-runner/control/approvals/{id}.request.json"),
        Duration::from_secs(120),
    )
    .unwrap_or_else(|e| panic!("the job was never held: {e}\n{}", w.journal_tail()));
    let listed = as_user(w, "alice", "approvals --output json");
    assert!(
        listed.ok() && listed.stdout.contains(&id),
        "alice cannot list: {} {}",
        listed.stdout,
        listed.stderr
    );
    let o = as_user(w, "bob", &format!("approve {id} --reason mine"));
    assert!(!o.ok(), "bob approved");
    let o = as_user(w, "alice", &format!("approve {id} --reason 'read it'"));
    assert!(o.ok(), "alice could not approve: {} {}", o.stdout, o.stderr);
    let v = w.finished(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{}", w.journal_tail());
    let approved = w.vm.sh("byoc-runner audit export --state-dir /var/lib/byoc-runner | grep '\"approved\"'");
    assert!(approved.contains("[left by alice (uid"), "{approved}");
    w.vm.sh(
        "cp /root/runner.toml.before-approvals /etc/byoc-runner/runner.toml && systemctl restart byoc-runner",
    );

    // A role allowed by the member, honoured in their name. The runner learns the app's
    // roles from the first job that asks for one.
    let id =
        w.cp.enqueue(common::roles::role_job(
            "component",
            "deploy",
            "inst-demo-maintenance",
            common::roles::named("api"),
            "true",
        ))
        .unwrap();
    w.finished(&id);
    let roles: serde_json::Value = serde_json::from_str(&w.vm.sh("byoc-runner roles --output json")).unwrap();
    let listed = roles["roles"].as_array().cloned().unwrap_or_default();
    let role = listed
        .iter()
        .find(|r| r["role_type"] == "break_glass")
        .or(listed.first())
        .and_then(|r| r["name"].as_str())
        .unwrap_or_else(|| panic!("no roles known after a role job: {roles}\n{}", w.journal_tail()))
        .to_string();
    let o = as_user(w, "bob", &format!("roles allow {role} --for 1h --reason mine"));
    assert!(!o.ok(), "bob allowed a role");
    let o = as_user(w, "alice", &format!("roles allow {role} --for 1h --reason vm-suite"));
    assert!(o.ok(), "alice could not allow: {} {}", o.stdout, o.stderr);
    let seen = w.vm.wait_for(
        "byoc-runner audit export --state-dir /var/lib/byoc-runner | grep allowance_seen | grep 'alice (uid'",
        Duration::from_secs(60),
    );
    assert!(seen.is_ok(), "the allowance was not honoured in alice's name: {seen:?}");
    let o = as_user(w, "alice", &format!("roles revoke {role}"));
    assert!(o.ok(), "alice could not revoke: {} {}", o.stdout, o.stderr);
}

fn script(s: &str) -> EnqueueRequest {
    EnqueueRequest::new("action.script", serde_json::json!({ "script": s }))
}

/// A job under the shipped unit: in a cgroup v2 leaf of the unit's delegated subtree,
/// with the sandbox's limits, and inside the network boundary (no metadata service).
fn a_job_runs_sandboxed_in_the_units_cgroup_v2_subtree(w: &mut World) {
    // A service on the guest's loopback, which the guest itself reaches.
    w.vm.sh("systemd-run --unit=vm-loopback-http python3 -m http.server --bind 127.0.0.1 7777");
    w.vm.wait_for("curl -sf -o /dev/null http://127.0.0.1:7777/", Duration::from_secs(60)).unwrap();
    let id = w
        .cp
        .enqueue(script(
            "if (exec 3<>/dev/tcp/169.254.169.254/80) 2>/dev/null; then echo imds-reached; else echo imds-blocked; fi; \
             if (exec 3<>/dev/tcp/127.0.0.1/7777) 2>/dev/null; then echo loopback-reached; else echo loopback-blocked; fi; \
             echo waiting; sleep 3777",
        ))
        .unwrap();
    w.wait_job(&id, Duration::from_secs(120), |v| v.log_size > 0);
    let cgroup =
        w.vm.wait_for("cat /proc/$(pgrep -f '[s]leep 3777' | head -1)/cgroup", Duration::from_secs(60))
            .unwrap()
            .stdout;
    assert!(cgroup.starts_with("0::/system.slice/byoc-runner.service/"), "the job's cgroup: {cgroup}");
    w.rt.block_on(async { w.cp.cancel(&id) }).unwrap();
    let v = w.finished(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Cancelled);
    let out = w.output(&id);
    w.vm.sh("systemctl stop vm-loopback-http");
    assert!(out.contains("imds-blocked") && out.contains("loopback-blocked"), "{out}");
    let log = String::from_utf8_lossy(&w.cp.log(&id).unwrap()).into_owned();
    assert!(log.contains("[sandbox] cgroup V2 limits: memory"), "{log}");
    // The runner itself reaches the metadata service (config check, below, proves IMDSv2).
}

/// A benchmark figure, not a timed assertion: on the guest (cgroup v2, the shipped
/// unit), the time from the runner starting a job to the job's first instruction
/// (both read from the guest's clock), to set beside the host's (`byoc-bench`, same
/// figure). Under software emulation the guest runs many times slower than the host.
fn pickup_on_the_guest_is_measured(w: &mut World) {
    let mut started_to_child = Vec::new();
    for _ in 0..20 {
        let req = EnqueueRequest::new(
            "action.script",
            serde_json::json!({"script": "echo $(( ${EPOCHREALTIME/./} / 1000 ))", "interpreter": "/bin/bash"}),
        );
        let id = w.cp.enqueue(req).unwrap();
        let v = w.finished(&id);
        let r = v.result.unwrap();
        assert_eq!(r.status, JobStatus::Succeeded, "{:?}", r.error);
        let out = w.output(&id);
        let child_ms: u64 =
            out.trim().lines().last().unwrap_or("").parse().unwrap_or_else(|_| panic!("{out}"));
        started_to_child.push(child_ms.saturating_sub(r.started_at_ms.expect("started_at_ms")));
    }
    started_to_child.sort_unstable();
    println!(
        "vm: pickup on the guest, runner started -> child running: p50 {} ms, max {} ms (n={})",
        started_to_child[started_to_child.len() / 2],
        started_to_child.last().unwrap(),
        started_to_child.len()
    );
}

/// The sandbox probe, run as a job under the shipped unit, finds every escape closed.
fn the_sandbox_probe_finds_every_escape_closed_under_the_unit(w: &mut World) {
    let pid = w.vm.sh("systemctl show -p MainPID --value byoc-runner").trim().to_string();
    let id =
        w.cp.enqueue(script(&format!(
            "exec /usr/bin/byoc-runner sandbox-probe --runner-pid {pid} --state-dir /var/lib/byoc-runner \
             --config-dir /etc/byoc-runner"
        )))
        .unwrap();
    let v = w.finished(&id);
    let out = w.output(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
    let report = common::probe_report_all_held(&out);
    assert_eq!(report["hostname"], "byoc-job");
}

/// No process in the guest runs `command` (the bracket keeps pgrep from matching the
/// shell that runs it).
fn assert_no_process(w: &mut World, command: &str, what: &str) {
    let pattern = format!("[{}]{}", &command[..1], &command[1..]);
    assert_eq!(w.vm.sh(&format!("pgrep -c -f '{pattern}' || true")).trim(), "0", "{what}");
}

fn set_limits(w: &mut World, memory_mib: u64, pids: u64) {
    w.vm.sh(&format!(
        "printf '\\n[sandbox]\\nmemory_mib = {memory_mib}\\npids = {pids}\\n' >> /etc/byoc-runner/runner.toml && systemctl restart byoc-runner"
    ));
}

/// cgroup v2 limits apply: a memory hog is killed and the job says so; a fork bomb
/// meets the pids limit.
fn cgroup_v2_limits_stop_a_memory_hog_and_a_fork_bomb(w: &mut World) {
    set_limits(w, 96, 32);
    let id =
        w.cp.enqueue(script("set -e; head -c 400000000 /dev/zero | tail > /dev/null; echo survived"))
            .unwrap();
    let r = w.finished(&id).result.unwrap();
    let log = w.output(&id);
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert!(r.error.as_deref().unwrap_or("").contains("memory limit of 96 MiB"), "{:?}\n{log}", r.error);
    assert!(
        String::from_utf8_lossy(&w.cp.log(&id).unwrap()).contains("cgroup V2 limits: memory 96 MiB"),
        "{log}"
    );

    let mut req = script("for i in $(seq 1 60); do sleep 3301 & done; wait");
    req.timeout_secs = 120;
    let id = w.cp.enqueue(req).unwrap();
    let r = w.finished(&id).result.unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{}", w.output(&id));
    assert!(r.error.as_deref().unwrap_or("").contains("limit of 32 processes"), "{:?}", r.error);
    assert_no_process(w, "sleep 3301", "the fork bomb outlived its job");
}

/// The journal has the runner's structured fields: a job's records by BYOC_JOB_ID, a
/// refused job by BYOC_AUDIT_EVENT, with its catalogued MESSAGE_ID.
fn the_journal_has_structured_fields(w: &mut World) {
    let id = w.cp.enqueue(script("echo journal-me")).unwrap();
    w.finished(&id);
    let out = w.vm.sh(&format!("journalctl -u byoc-runner BYOC_JOB_ID={id} -o json --no-pager"));
    let records: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(!records.is_empty(), "no journal records for {id}");
    // The job's span fields, prefixed BYOC_, on the record of its start.
    let started = records
        .iter()
        .find(|r| r["BYOC_AUDIT_EVENT"] == "job_started")
        .unwrap_or_else(|| panic!("{records:?}"));
    assert_eq!(started["BYOC_INSTALL_ID"], w.cp.install_id());
    assert_eq!(started["BYOC_KIND"], "action.script");
    assert_eq!(started["SYSLOG_IDENTIFIER"], "byoc-runner");
    // Expired (signature good, so its id is the job's own): refused and audited.
    let mut expired = script("echo never");
    expired.tamper.issued_offset_secs = Some(-7200);
    expired.tamper.expires_offset_secs = Some(-3600);
    let id = w.cp.enqueue(expired).unwrap();
    let v = w.wait_job(&id, Duration::from_secs(120), |v| v.state == JobState::Rejected);
    let reason = v.rejections[0].0.code();
    let out = w.vm.sh(&format!(
        "journalctl -u byoc-runner BYOC_AUDIT_EVENT=job_rejected BYOC_JOB_ID={id} -o json --no-pager"
    ));
    let records: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 1, "job_rejected records for {id}: {out}");
    assert_eq!(records[0]["BYOC_REASON"], reason, "{:?}", records[0]);
    assert_eq!(records[0]["MESSAGE_ID"], byoc_runner::logging::audit_message_id("job_rejected"));
    assert_eq!(records[0]["PRIORITY"], "4", "a refusal is a warning: {:?}", records[0]);
}

/// The watchdog's negative case: a runner whose poll loop is wedged (a test-only fault
/// switch in the unit's environment) stops sending WATCHDOG=1 and systemd restarts it.
fn a_wedged_poll_loop_is_restarted_by_the_watchdog(w: &mut World) {
    let before = w.vm.sh("systemctl show byoc-runner -p NRestarts --value").trim().parse::<u32>().unwrap();
    // A short poll and backoff bring the runner's stall threshold down to about 50 s;
    // WatchdogSec=10s then restarts it soon after.
    w.vm.sh("cp /etc/byoc-runner/runner.toml /root/runner.toml.saved && \
         printf '\n[poll]\nwait_secs = 5\nbackoff_max_secs = 5\n' >> /etc/byoc-runner/runner.toml && \
         mkdir -p /run/systemd/system/byoc-runner.service.d && \
         printf '[Service]\nEnvironment=BYOC_RUNNER_TEST_FAULT_WEDGE_POLL_LOOP=1\nWatchdogSec=10s\n' \
           > /run/systemd/system/byoc-runner.service.d/wedge.conf && \
         systemctl daemon-reload && systemctl restart byoc-runner");
    let restarted = w.vm.wait_for(
        &format!("test \"$(systemctl show byoc-runner -p NRestarts --value)\" -gt {before}"),
        Duration::from_secs(300),
    );
    let journal = w.vm.sh("journalctl -u byoc-runner --no-pager -o cat -n 200");
    w.vm.sh("rm /run/systemd/system/byoc-runner.service.d/wedge.conf && \
         cp /root/runner.toml.saved /etc/byoc-runner/runner.toml && \
         systemctl daemon-reload && systemctl reset-failed byoc-runner; systemctl restart byoc-runner");
    assert!(restarted.is_ok(), "{restarted:?}\n{journal}");
    assert!(journal.contains("the poll loop is wedged on purpose"), "{journal}");
    assert!(journal.contains("Poll loop stalled; withholding watchdog ping."), "{journal}");
    assert!(journal.contains("Watchdog timeout"), "systemd did not report a watchdog timeout:\n{journal}");
    assert_eq!(w.vm.sh("systemctl is-active byoc-runner").trim(), "active");
}

fn failure_signals(w: &World) -> usize {
    w.rt.block_on(w.moto.calls_of("SignalResource"))
        .iter()
        .filter(|c| c.params.get("Status").map(String::as_str) == Some("FAILURE"))
        .count()
}

/// The stack's user-data, run again on the VM as cloud-init ran it (as root, the same
/// script) but with its release URL pointing at a tampered release: nothing is
/// installed, the runner keeps running, the stack is told FAILURE and the script says why.
fn the_user_data_refuses_tampered_releases_and_tells_the_stack(w: &mut World) {
    let installed = w.vm.sh("dpkg-query -W -f '${Version}' byoc-runner");
    let binary = w.vm.sh("sha256sum /usr/bin/byoc-runner");
    for (set, why) in [
        ("tampered-package", "does not match its checksum in the signed SHA256SUMS"),
        ("tampered-checksums", "SHA256SUMS signature does not verify with the pinned release key"),
        ("foreign-key", "SHA256SUMS signature does not verify with the pinned release key"),
    ] {
        let failures_before = failure_signals(w);
        let out = w
            .vm
            .exec(
                &format!(
                    "sed \"s|^BYOC_RELEASE_URL=.*|BYOC_RELEASE_URL=https://{RELEASE_ADDR}/{set}|\" \
                     /var/lib/cloud/instance/user-data.txt > /root/user-data-{set} && bash /root/user-data-{set}"
                ),
                Duration::from_secs(300),
            )
            .unwrap();
        assert!(!out.ok(), "{set}: the user-data succeeded:\n{}\n{}", out.stdout, out.stderr);
        assert!(
            out.stderr.contains("byoc-install: FAILED: ") && out.stderr.contains(why),
            "{set}: {}",
            out.stderr
        );
        assert_eq!(w.vm.sh("dpkg-query -W -f '${Version}' byoc-runner"), installed, "{set} was installed");
        assert_eq!(w.vm.sh("sha256sum /usr/bin/byoc-runner"), binary, "{set} changed the binary");
        assert_eq!(w.vm.sh("systemctl is-active byoc-runner").trim(), "active");
        assert!(failure_signals(w) > failures_before, "{set}: the stack was not told FAILURE");
    }
}

// ---- the runner's own updates ------------------------------------------------------

/// Publish the release in `releases/<name>` to the install's registry and send it to
/// the runner as `runner.update` of `version`; the job's id.
fn send_update(w: &mut World, name: &str, version: &str) -> String {
    let dir = w.releases.join(name);
    let files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    let files: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
    let pushed = w.rt.block_on(w.registry.push_tar_artifact_bytes(
        "inst-demo/byoc-runner",
        Some(name),
        "application/vnd.byoc.runner.release",
        &files,
    ));
    w.cp.publish_release(byoc_control_plane::Release {
        version: version.into(),
        reference: format!("{ECR_HOST}/inst-demo/byoc-runner@{}", pushed.digest),
        min_rollback_version: Some("0.1.0-vm1".into()),
        downgrade: false,
    })
    .unwrap();
    let runner_id = w.cp.runners()[0].runner_id.clone();
    w.cp.update_runner(
        &runner_id,
        byoc_control_plane::UpdateRunner {
            version: version.into(),
            requested_role: Some(format!("{}-maintenance", w.cp.install_id())),
            app_config: Some(common::roles::app_config()),
        },
    )
    .unwrap()
}

/// The stack's default `RunnerUpdates = approve`: the job waits for a local admin.
/// Approve the update job `id` to `version` as root (the version typed, as a person would).
fn approve(w: &mut World, id: &str, version: &str) {
    w.vm.wait_for(
        &format!("test -e /var/lib/byoc-runner/control/approvals/{id}.request.json"),
        Duration::from_secs(180),
    )
    .unwrap_or_else(|e| panic!("the update was never held for approval: {e}\n{}", w.journal_tail()));
    let o =
        w.vm.exec(
            &format!("byoc-runner approve {id} --version {version} --reason vm-suite"),
            Duration::from_secs(60),
        )
        .unwrap();
    assert!(o.ok(), "approve: {} {}", o.stdout, o.stderr);
}

fn installed_version(w: &mut World) -> String {
    w.vm.sh("dpkg-query -W -f '${Version}' byoc-runner")
}

fn audit_count(w: &mut World, event: &str) -> usize {
    w.vm.sh(&format!(
        "byoc-runner audit export --state-dir /var/lib/byoc-runner | grep -c '\"{event}\"' || true"
    ))
    .trim()
    .parse()
    .unwrap_or(0)
}

/// Wait until the control plane hears `version` from the runner with no update pending.
fn wait_version(w: &mut World, version: &str, timeout: Duration) {
    let seen = w.rt.block_on(w.cp.wait_until(timeout, |cp| {
        cp.runners().iter().any(|r| r.version.as_deref() == Some(version) && r.pending_update.is_none())
    }));
    assert!(
        seen,
        "the runner never said it runs {version}: {:?}\n{}\n{}",
        w.cp.runners(),
        w.vm.sh("journalctl -u byoc-runner-update --no-pager -n 40"),
        w.journal_tail()
    );
}

/// Refused before anything is fetched or installed: a version outside the customer's
/// pin (`update pin`), and updates switched off (`[update] mode = "off"`); and a release
/// signed by another key, or whose package was changed after signing, is refused once
/// fetched, with nothing staged or installed.
fn an_update_outside_the_customers_terms_or_signed_by_another_key_is_refused(w: &mut World) {
    let before = installed_version(w);
    let o = w.vm.exec("byoc-runner update pin 0.1.0-vm1", Duration::from_secs(60)).unwrap();
    assert!(o.ok(), "pin: {} {}", o.stdout, o.stderr);
    let id = send_update(w, "vm2", "0.1.0-vm2");
    let v = w.wait_job(&id, Duration::from_secs(180), |v| !v.rejections.is_empty());
    assert_eq!(v.rejections[0].0, byoc_protocol::RejectReason::UpdatePinned, "{:?}", v.rejections);
    w.vm.sh("byoc-runner update unpin");

    w.vm.sh("cp /etc/byoc-runner/runner.toml /root/runner.toml.before-off && \
             sed -i 's/^mode = \"approve\"/mode = \"off\"/' /etc/byoc-runner/runner.toml && systemctl restart byoc-runner");
    let id = send_update(w, "vm2", "0.1.0-vm2");
    let v = w.wait_job(&id, Duration::from_secs(180), |v| !v.rejections.is_empty());
    assert_eq!(v.rejections[0].0, byoc_protocol::RejectReason::UpdateDisabled, "{:?}", v.rejections);
    w.vm.sh("cp /root/runner.toml.before-off /etc/byoc-runner/runner.toml && systemctl restart byoc-runner");

    for (set, reason) in
        [("foreign-key", "update_signature_invalid"), ("tampered-package", "update_digest_mismatch")]
    {
        let id = send_update(w, set, "0.1.0-vm2");
        approve(w, &id, "0.1.0-vm2");
        let r = w.finished(&id).result.unwrap();
        assert_eq!(r.status, JobStatus::Failed);
        assert_eq!(r.outputs["reason"], reason, "{set}: {}\n{}", r.outputs, w.output(&id));
    }
    assert!(
        !w.vm.exec("test -e /var/lib/byoc-runner/update/request.json", Duration::from_secs(30)).unwrap().ok()
    );
    assert_eq!(installed_version(w), before, "nothing was installed");
}

/// The runner's own user against root, on the shipped units. As that user: a genuine
/// signed SHA256SUMS with a swapped package whose postinst would leave a mark, staged
/// files that are links to root-owned files, the staged directory a link to a
/// root-owned directory, a garbage request, an update no person approved, and a
/// rollback request with updates switched off. Each is refused with its reason and
/// audited; no owner or mode changes, nothing is installed, the mark is never made.
fn the_runners_user_cannot_steer_the_root_updater(w: &mut World) {
    use base64::Engine as _;
    let before = installed_version(w);
    let arch = w.vm.sh("dpkg --print-architecture").trim().to_string();
    let package = format!("byoc-runner_{before}_{arch}.deb");
    let stat =
        "stat -c '%n %U:%G %a' /etc/byoc-runner/runner.toml /usr/lib/byoc-runner /usr/lib/byoc-runner/*";
    let owners = w.vm.sh(stat);
    let refused_before = audit_count(w, "update_refused");
    // What the runner's user can get: the installed release's signed sums (copied here
    // by root, as the install's registry would serve them) and a package it built.
    w.vm.sh(&format!(
        "rm -rf /tmp/evil && mkdir -p /tmp/evil/pkg/DEBIAN && \
         printf 'Package: byoc-runner\\nVersion: {before}\\nArchitecture: {arch}\\nMaintainer: x <x@example.com>\\nDescription: x\\n' > /tmp/evil/pkg/DEBIAN/control && \
         printf '#!/bin/sh\\ntouch /root/pwned-by-postinst\\n' > /tmp/evil/pkg/DEBIAN/postinst && chmod 755 /tmp/evil/pkg/DEBIAN/postinst && \
         dpkg-deb --build /tmp/evil/pkg /tmp/evil/{package} >/dev/null && rm -rf /tmp/evil/pkg && \
         cp /var/lib/byoc-runner-update/releases/{before}/SHA256SUMS* /tmp/evil/ && chmod -R a+rX /tmp/evil"
    ));
    let set_mode = |w: &mut World, mode: &str| {
        w.vm.sh(&format!(
            "sed -i 's/^mode = .*/mode = \"{mode}\"/' /etc/byoc-runner/runner.toml && systemctl restart byoc-runner"
        ));
    };
    w.vm.sh("cp /etc/byoc-runner/runner.toml /root/runner.toml.before-steer");
    // Stage as the runner's user, ask, and wait for root's answer to that job.
    let ask = |w: &mut World, job: &str, staged: &str, extra: serde_json::Value| -> String {
        let mut request = serde_json::json!({
            "job_id": job, "version": before, "from_version": before, "package": package,
            "package_sha256": "", "sums_sha256": "", "staged_at_ms": 1,
        });
        for (k, v) in extra.as_object().unwrap() {
            request[k] = v.clone();
        }
        let encoded = base64::engine::general_purpose::STANDARD.encode(request.to_string());
        let script = format!(
            "cd /var/lib/byoc-runner && mkdir -p update && rm -rf update/staged && {staged} && \
             echo {encoded} | base64 -d > update/request.json.tmp && mv update/request.json.tmp update/request.json"
        );
        let o =
            w.vm.exec(&format!("runuser -u byoc-runner -- sh -ec '{script}'"), Duration::from_secs(60))
                .unwrap();
        assert!(o.ok(), "as the runner's user: {script}: {} {}", o.stdout, o.stderr);
        let answered = w.vm.wait_for(
            &format!("grep -q '\"job_id\": \"{job}\"' /var/lib/byoc-runner-update/last.json && cat /var/lib/byoc-runner-update/last.json"),
            Duration::from_secs(300),
        );
        answered
            .unwrap_or_else(|e| {
                panic!(
                    "{job}: no answer: {e}\n{}",
                    w.vm.sh("journalctl -u byoc-runner-update --no-pager -n 40")
                )
            })
            .stdout
    };
    set_mode(w, "auto");
    let swapped = ask(
        w,
        "steer-swapped",
        "mkdir update/staged && cp /tmp/evil/* update/staged/",
        serde_json::json!({}),
    );
    assert!(swapped.contains("update_digest_mismatch"), "{swapped}");
    let links = ask(
        w,
        "steer-links",
        &format!(
            "mkdir update/staged && ln -s /etc/byoc-runner/runner.toml update/staged/SHA256SUMS && \
             ln -s /usr/lib/byoc-runner/byoc-runner-updater update/staged/{package} && cp /tmp/evil/SHA256SUMS.minisig update/staged/"
        ),
        serde_json::json!({}),
    );
    assert!(links.contains("update_release_invalid") && links.contains("not followed"), "{links}");
    let dir_link =
        ask(w, "steer-dir-link", "ln -s /usr/lib/byoc-runner update/staged", serde_json::json!({}));
    assert!(dir_link.contains("update_release_invalid"), "{dir_link}");
    let garbage = w.vm.exec(
        "runuser -u byoc-runner -- sh -ec 'echo garbage > /var/lib/byoc-runner/update/request.json.tmp && \
         mv /var/lib/byoc-runner/update/request.json.tmp /var/lib/byoc-runner/update/request.json'",
        Duration::from_secs(60),
    );
    assert!(garbage.unwrap().ok());
    let g = w.vm.wait_for(
        "grep -q update_request_invalid /var/lib/byoc-runner-update/last.json",
        Duration::from_secs(300),
    );
    assert!(g.is_ok(), "the garbage request was not refused: {g:?}");
    set_mode(w, "approve");
    let unapproved = ask(
        w,
        "steer-unapproved",
        "mkdir update/staged && cp /tmp/evil/* update/staged/",
        serde_json::json!({}),
    );
    assert!(unapproved.contains("update_not_approved"), "{unapproved}");
    set_mode(w, "off");
    let rollback = ask(w, "steer-rollback", "mkdir update/staged", serde_json::json!({"rollback": true}));
    assert!(rollback.contains("update_rollback_refused"), "{rollback}");
    w.vm.sh(
        "cp /root/runner.toml.before-steer /etc/byoc-runner/runner.toml && systemctl restart byoc-runner",
    );

    assert_eq!(w.vm.sh(stat), owners, "an owner or mode changed");
    assert_eq!(installed_version(w), before, "something was installed");
    assert!(
        !w.vm.exec("test -e /root/pwned-by-postinst", Duration::from_secs(30)).unwrap().ok(),
        "the swapped package ran"
    );
    // Each refusal reaches the audit log, none lost to the next.
    let audited = w.vm.wait_for(
        &format!("test \"$(byoc-runner audit export --state-dir /var/lib/byoc-runner | grep -c update_refused)\" -ge {}", refused_before + 6),
        Duration::from_secs(120),
    );
    assert!(audited.is_ok(), "not every refusal was audited: {audited:?}");
    w.vm.sh("runuser -u byoc-runner -- rm -rf /var/lib/byoc-runner/update/staged /var/lib/byoc-runner/update/request.json");
}

/// A window rule for updates whose window opens hours from now (the guest's clock): the
/// update is claimed and held, waiting for the window, with nothing fetched, staged or
/// installed; the vendor's cancel then settles it without it ever running.
fn an_update_outside_the_maintenance_window_waits_for_it(w: &mut World) {
    let before = installed_version(w);
    w.vm.sh(concat!(
        "cp /etc/byoc-runner/runner.toml /root/runner.toml.before-window && ",
        r#"printf '\n[[guardrails.window]]\nname = "updates"\nonce = ["%s/1h"]\n'"#,
        r#" "$(date -u -d '+6 hours' +%Y-%m-%dT%H:%MZ)" >> /etc/byoc-runner/runner.toml && "#,
        r#"printf '\n[[guardrails.window_rule]]\nname = "updates"\nwindows = ["updates"]\neffects = ["update"]\n'"#,
        " >> /etc/byoc-runner/runner.toml && systemctl restart byoc-runner",
    ));
    let id = send_update(w, "vm2", "0.1.0-vm2");
    let held = w.wait_job(&id, Duration::from_secs(180), |v| {
        v.waiting.as_ref().is_some_and(|h| h.state == "waiting_window")
    });
    assert!(held.result.is_none(), "{held:?}");
    assert!(
        !w.vm.exec("test -e /var/lib/byoc-runner/update/request.json", Duration::from_secs(30)).unwrap().ok(),
        "staged while waiting for its window"
    );
    w.cp.cancel(&id).unwrap();
    let r = w.finished(&id).result.unwrap();
    assert_eq!(r.status, JobStatus::Cancelled, "{r:?}");
    assert_eq!(installed_version(w), before, "nothing was installed");
    assert_eq!(audit_count(w, "update_started"), 0);
    w.vm.sh(
        "cp /root/runner.toml.before-window /etc/byoc-runner/runner.toml && systemctl restart byoc-runner",
    );
}

/// The whole path on the shipped units: the update is held for approval, fetched from
/// the install's registry, verified, staged; the updater drains the runner, installs
/// the release, starts it and sees it healthy; the runner reports the new version, jobs
/// run after it, and the audit log verifies across the update with both records.
fn a_good_update_is_approved_applied_and_the_audit_chain_continues(w: &mut World) {
    let id = send_update(w, "vm2", "0.1.0-vm2");
    approve(w, &id, "0.1.0-vm2");
    let r = w.finished(&id).result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{}", r.error, w.output(&id));
    wait_version(w, "0.1.0-vm2", Duration::from_secs(600));
    assert_eq!(installed_version(w), "0.1.0-vm2");
    assert_eq!(w.vm.sh("systemctl is-active byoc-runner").trim(), "active");
    let status: serde_json::Value =
        serde_json::from_str(&w.vm.sh("byoc-runner update status --output json")).unwrap();
    assert_eq!(status["running_version"], "0.1.0-vm2", "{status}");
    assert_eq!(status["last"]["result"], "applied", "{status}");
    assert_eq!(status["kept"], serde_json::json!(["0.1.0-vm2", "0.1.0-vm1"]), "{status}");
    let unit = w.vm.sh("systemctl show byoc-runner-update -p Result -p ExecMainStatus");
    assert!(unit.contains("Result=success") && unit.contains("ExecMainStatus=0"), "the updater unit: {unit}");
    let recorded = w.vm.wait_for(
        "byoc-runner audit export --state-dir /var/lib/byoc-runner | grep -q '\"update_applied\"'",
        Duration::from_secs(120),
    );
    assert!(recorded.is_ok(), "update_applied was not audited: {recorded:?}");
    assert_eq!(audit_count(w, "update_started"), 1);
    let verify =
        w.vm.exec(
            "runuser -u byoc-runner -- byoc-runner audit verify --config /etc/byoc-runner/runner.toml",
            Duration::from_secs(120),
        )
        .unwrap();
    assert!(verify.ok(), "audit verify across the update: {}\n{}", verify.stdout, verify.stderr);
    let id = w.cp.enqueue(script("echo after-update")).unwrap();
    assert_eq!(w.finished(&id).result.unwrap().status, JobStatus::Succeeded);
    assert!(w.output(&id).contains("after-update"));
}

/// A release whose runner exits at start: the updater reinstalls the kept package
/// within its bound, the runner is back on the version before and says so, and the
/// audit log has `update_rolled_back` with the reason.
fn a_release_that_exits_at_start_is_rolled_back_automatically(w: &mut World) {
    let id = send_update(w, "vm3-exits", "0.1.0-vm3");
    approve(w, &id, "0.1.0-vm3");
    let r = w.finished(&id).result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "staged: {:?}\n{}", r.error, w.output(&id));
    let back = w.vm.wait_for(
        "byoc-runner audit export --state-dir /var/lib/byoc-runner | grep '\"update_rolled_back\"'",
        Duration::from_secs(900),
    );
    let record = back.unwrap_or_else(|e| {
        panic!(
            "no rollback was audited: {e}\n{}",
            w.vm.sh("journalctl -u byoc-runner-update --no-pager -n 60")
        )
    });
    assert!(
        record.stdout.contains("0.1.0-vm2 -> 0.1.0-vm3") && record.stdout.contains("did not start"),
        "{}",
        record.stdout
    );
    assert_eq!(installed_version(w), "0.1.0-vm2");
    assert_eq!(w.vm.sh("systemctl is-active byoc-runner").trim(), "active");
    wait_version(w, "0.1.0-vm2", Duration::from_secs(120));
    let id = w.cp.enqueue(script("echo after-rollback")).unwrap();
    assert_eq!(w.finished(&id).result.unwrap().status, JobStatus::Succeeded);
}

/// The customer's rollback (`update rollback`), with the VM reset (a power loss) while
/// the updater runs: at the next boot the updater resumes, and the runner comes back
/// on a working version (the one before or the one asked for), its audit log intact.
fn a_reset_during_a_rollback_comes_back_on_a_working_version(w: &mut World) {
    let o = w.vm.exec("byoc-runner update rollback --output json", Duration::from_secs(120)).unwrap();
    assert!(o.ok(), "rollback: {} {}", o.stdout, o.stderr);
    assert!(o.stdout.contains("0.1.0-vm1"), "{}", o.stdout);
    w.vm.wait_for("test -e /var/lib/byoc-runner-update/progress.json", Duration::from_secs(300))
        .unwrap_or_else(|e| {
            panic!(
                "the updater never started: {e}\n{}",
                w.vm.sh("journalctl -u byoc-runner-update --no-pager -n 40")
            )
        });
    w.vm.reset(Duration::from_secs(600)).unwrap_or_else(|e| panic!("{e}\n{}", w.vm.serial_tail(60)));
    let settled = w.vm.wait_for(
        "! test -e /var/lib/byoc-runner-update/progress.json && ! test -e /var/lib/byoc-runner-update/rollback.json && systemctl is-active byoc-runner",
        Duration::from_secs(900),
    );
    assert!(
        settled.is_ok(),
        "not settled after the reset: {settled:?}\n{}\n{}",
        w.vm.sh("journalctl -b -u byoc-runner-update --no-pager -n 60"),
        w.journal_tail()
    );
    let version = installed_version(w);
    assert!(["0.1.0-vm1", "0.1.0-vm2"].contains(&version.as_str()), "{version}");
    assert_eq!(w.vm.sh("dpkg-query -W -f '${Status}' byoc-runner"), "install ok installed");
    wait_version(w, &version, Duration::from_secs(300));
    let verify =
        w.vm.exec(
            "runuser -u byoc-runner -- byoc-runner audit verify --config /etc/byoc-runner/runner.toml",
            Duration::from_secs(120),
        )
        .unwrap();
    assert!(verify.ok(), "audit verify after the reset: {}\n{}", verify.stdout, verify.stderr);
    let id = w.cp.enqueue(script("echo after-reset")).unwrap();
    assert_eq!(w.finished(&id).result.unwrap().status, JobStatus::Succeeded);
}

/// `systemctl stop` drains: a running job finishes within the grace period and the
/// runner stops cleanly.
fn systemctl_stop_drains_a_running_job(w: &mut World) {
    let id = w.cp.enqueue(script("echo started; sleep 8; echo finished")).unwrap();
    w.wait_job(&id, Duration::from_secs(120), |v| v.log_size > 0);
    let stopped = w.vm.exec("systemctl stop byoc-runner", Duration::from_secs(120)).unwrap();
    assert!(stopped.ok(), "{}", stopped.stderr);
    let v = w.finished(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{}", w.output(&id));
    assert!(w.output(&id).contains("finished"));
    let result = w.vm.sh("systemctl show byoc-runner -p Result -p ActiveState");
    assert!(result.contains("Result=success") && result.contains("ActiveState=inactive"), "{result}");
    w.vm.sh("systemctl start byoc-runner");
}

/// A second stop request while the runner drains (SIGTERM to the runner alone, as
/// `docs/OPERATIONS.md` says) cancels the running job, and the runner stops.
fn a_second_stop_request_cancels_the_running_job(w: &mut World) {
    let id = w.cp.enqueue(script("echo started; sleep 600")).unwrap();
    w.wait_job(&id, Duration::from_secs(120), |v| v.log_size > 0);
    w.vm.sh("systemctl stop --no-block byoc-runner");
    w.vm.wait_for(
        "test \"$(systemctl show -p ActiveState --value byoc-runner)\" = deactivating",
        Duration::from_secs(60),
    )
    .unwrap();
    w.vm.sh("systemctl kill --kill-who=main -s TERM byoc-runner");
    let v = w.finished(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Cancelled, "{}", w.output(&id));
    let stopped = w.vm.wait_for(
        "test \"$(systemctl show -p ActiveState --value byoc-runner)\" = inactive",
        Duration::from_secs(120),
    );
    let result = w.vm.sh("systemctl show byoc-runner -p Result");
    w.vm.sh("systemctl start byoc-runner");
    assert!(stopped.is_ok(), "{stopped:?}");
    assert_eq!(result.trim(), "Result=success");
    assert_no_process(w, "sleep 600", "the cancelled job's processes remain");
}

/// SIGKILL of the runner: systemd restarts it, and the job it was running is reported
/// interrupted (never run again).
fn a_killed_runner_is_restarted_and_reports_the_job_interrupted(w: &mut World) {
    let id = w.cp.enqueue(script("echo started; sleep 600")).unwrap();
    w.wait_job(&id, Duration::from_secs(120), |v| v.log_size > 0);
    let before = w.vm.sh("systemctl show byoc-runner -p NRestarts --value");
    w.vm.sh("systemctl kill -s SIGKILL byoc-runner");
    let v = w.finished(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Interrupted, "{}", w.output(&id));
    let after = w.vm.wait_for(
        &format!("test \"$(systemctl show byoc-runner -p NRestarts --value)\" -gt {} && systemctl is-active byoc-runner", before.trim()),
        Duration::from_secs(120),
    );
    assert!(after.is_ok(), "{after:?}");
    assert_no_process(w, "sleep 600", "the job's processes outlived the runner");
}

/// A reboot: the runner comes back by itself, its audit log verifies, nothing re-runs.
fn after_a_reboot_the_runner_returns_and_its_audit_log_verifies(w: &mut World) {
    let jobs_before = w.cp.jobs().len();
    let started_before: usize = w.cp.jobs().iter().map(|j| j.claims as usize).sum();
    w.vm.reboot(Duration::from_secs(300)).unwrap_or_else(|e| panic!("{e}\n{}", w.vm.serial_tail(60)));
    w.vm.wait_for("systemctl is-active byoc-runner", Duration::from_secs(300)).unwrap();
    let verify =
        w.vm.exec(
            "runuser -u byoc-runner -- byoc-runner audit verify --config /etc/byoc-runner/runner.toml",
            Duration::from_secs(120),
        )
        .unwrap();
    assert!(verify.ok(), "audit verify: {}\n{}", verify.stdout, verify.stderr);
    let id = w.cp.enqueue(script("echo after-reboot")).unwrap();
    assert_eq!(w.finished(&id).result.unwrap().status, JobStatus::Succeeded);
    assert_eq!(w.cp.jobs().len(), jobs_before + 1);
    let started_after: usize = w.cp.jobs().iter().map(|j| j.claims as usize).sum();
    assert_eq!(started_after, started_before + 1, "a job was claimed again after the reboot");
}

/// A fresh instance whose control plane is unreachable at first boot: the unit keeps
/// retrying enrollment with backoff (the user-data's `systemctl restart` waits for
/// READY) and becomes ready, and the stack is signalled, once the control plane is back.
fn a_first_boot_with_the_control_plane_down_becomes_ready_when_it_returns(w: &mut World) {
    // The harness's clean power-off: the guest stops by itself, qemu is not killed.
    let off = w.vm.power_off(Duration::from_secs(180));
    assert!(off.is_some(), "the guest did not power off within 180 s\n{}", w.vm.serial_tail(30));
    let token = w.cp.bootstrap_token();
    let secret = w.bootstrap_secret.clone();
    w.rt.block_on(async {
        w.moto
            .json_call(
                "secretsmanager",
                "secretsmanager.PutSecretValue",
                serde_json::json!({"SecretId": secret, "SecretString": token}),
            )
            .await;
        w.cp.set_faults(Faults { down: true, ..Default::default() }).await
    })
    .unwrap();
    let successes = |w: &World| {
        w.rt.block_on(w.moto.calls_of("SignalResource"))
            .iter()
            .filter(|c| c.params.get("Status").map(String::as_str) == Some("SUCCESS"))
            .count()
    };
    let signalled_before = successes(w);
    w.vm = Vm::boot(&w.image, &w.vm_options).unwrap_or_else(|e| panic!("booting the second VM: {e}"));
    w.vm.wait_agent(Duration::from_secs(300)).unwrap_or_else(|e| panic!("{e}\n{}", w.vm.serial_tail(80)));
    let retrying = w.vm.wait_for(
        "test \"$(journalctl -u byoc-runner -o cat --no-pager | grep -c 'Enrolling with the control plane failed')\" -ge 2",
        Duration::from_secs(400),
    );
    assert!(
        retrying.is_ok(),
        "the runner did not retry enrollment twice: {retrying:?}\n{}",
        w.journal_tail()
    );
    assert_eq!(w.vm.sh("systemctl is-active byoc-runner || true").trim(), "activating");
    w.rt.block_on(w.cp.set_faults(Faults::default())).unwrap();
    let status = w.vm.exec("cloud-init status --wait", Duration::from_secs(600)).unwrap();
    assert!(status.ok(), "cloud-init: {}\n{}", status.stdout, w.journal_tail());
    assert_eq!(w.vm.sh("systemctl is-active byoc-runner").trim(), "active");
    assert_eq!(w.cp.runners().len(), 2, "{:?}", w.cp.runners());
    assert!(successes(w) > signalled_before, "the stack was not signalled after the outage");
}

/// A second instance of the install takes over the job of one that loses power
/// mid-job: its lease runs out, the control plane leases the job anew to the other
/// guest, which runs it to the end.
fn a_second_instance_takes_over_when_the_first_loses_power(w: &mut World) {
    let runner_of = |vm: &mut Vm| -> String {
        let enrollment = vm.sh("cat /var/lib/byoc-runner/enrollment.json");
        let v: serde_json::Value =
            serde_json::from_str(&enrollment).unwrap_or_else(|e| panic!("{e}: {enrollment}"));
        v["runner_id"].as_str().unwrap().to_string()
    };
    let first_id = runner_of(&mut w.vm);
    w.rt.block_on(async {
        let token = w.cp.bootstrap_token();
        w.moto
            .json_call(
                "secretsmanager",
                "secretsmanager.PutSecretValue",
                serde_json::json!({"SecretId": w.bootstrap_secret, "SecretString": token}),
            )
            .await;
    });
    // The group's other instance, from the same user-data.
    let mut second = Vm::boot(&w.image, &w.vm_options).unwrap_or_else(|e| panic!("booting another VM: {e}"));
    second.wait_agent(Duration::from_secs(300)).unwrap_or_else(|e| panic!("{e}\n{}", second.serial_tail(80)));
    let status = second.exec("cloud-init status --wait", Duration::from_secs(600)).unwrap();
    assert!(status.ok(), "cloud-init: {}", status.stdout);
    let second_id = runner_of(&mut second);
    assert_ne!(first_id, second_id);
    // A job on the first instance, which loses power mid-job.
    let job =
        w.cp.enqueue(EnqueueRequest {
            runner_id: Some(first_id.clone()),
            ..common::script("echo begun; sleep 40; echo ended")
        })
        .unwrap();
    let begun = w.rt.block_on(w.cp.wait_until(Duration::from_secs(120), |cp| {
        cp.log(&job).is_some_and(|l| l.windows(5).any(|b| b == b"begun"))
    }));
    assert!(begun, "{:?}\n{}", w.cp.job(&job), w.journal_tail());
    w.vm.kill();
    // Its lease runs out; the second instance gets the job under epoch 2.
    let view = match w.rt.block_on(w.cp.wait_for(&job, Duration::from_secs(300), |v| v.result.is_some())) {
        Some(v) => v,
        None => panic!("{:?}\n{}", w.cp.job(&job), second.sh("journalctl -u byoc-runner --no-pager -n 60")),
    };
    assert_eq!(view.result.as_ref().unwrap().status, JobStatus::Succeeded, "{view:?}");
    assert_eq!(view.leases, [(first_id.clone(), 1), (second_id.clone(), 2)]);
    let log = w.output(&job);
    assert!(log.contains("begun") && log.contains("ended"), "{log}");
    let earlier = w.cp.earlier_logs(&job);
    assert!(earlier[0].1.windows(5).any(|b| b == b"begun"), "the first instance's part is kept: {earlier:?}");
    let journal = second.sh("journalctl -u byoc-runner -o cat --no-pager");
    assert!(journal.contains("lease epoch 2"), "{journal}");
}

type Case = (&'static str, fn(&mut World));

const CASES: &[Case] = &[
    (
        "the_stacks_user_data_installs_and_the_unit_becomes_ready",
        the_stacks_user_data_installs_and_the_unit_becomes_ready,
    ),
    (
        "the_running_unit_is_rated_at_most_3_by_systemd_analyze_security",
        the_running_unit_is_rated_at_most_3_by_systemd_analyze_security,
    ),
    ("config_check_on_the_vm_is_all_ok", config_check_on_the_vm_is_all_ok),
    (
        "only_root_and_the_runner_reach_the_metadata_service",
        only_root_and_the_runner_reach_the_metadata_service,
    ),
    ("a_non_root_admin_can_pause_approve_and_allow", a_non_root_admin_can_pause_approve_and_allow),
    (
        "a_job_runs_sandboxed_in_the_units_cgroup_v2_subtree",
        a_job_runs_sandboxed_in_the_units_cgroup_v2_subtree,
    ),
    ("pickup_on_the_guest_is_measured", pickup_on_the_guest_is_measured),
    (
        "the_sandbox_probe_finds_every_escape_closed_under_the_unit",
        the_sandbox_probe_finds_every_escape_closed_under_the_unit,
    ),
    ("the_journal_has_structured_fields", the_journal_has_structured_fields),
    (
        "cgroup_v2_limits_stop_a_memory_hog_and_a_fork_bomb",
        cgroup_v2_limits_stop_a_memory_hog_and_a_fork_bomb,
    ),
    ("a_wedged_poll_loop_is_restarted_by_the_watchdog", a_wedged_poll_loop_is_restarted_by_the_watchdog),
    (
        "the_user_data_refuses_tampered_releases_and_tells_the_stack",
        the_user_data_refuses_tampered_releases_and_tells_the_stack,
    ),
    (
        "an_update_outside_the_customers_terms_or_signed_by_another_key_is_refused",
        an_update_outside_the_customers_terms_or_signed_by_another_key_is_refused,
    ),
    ("the_runners_user_cannot_steer_the_root_updater", the_runners_user_cannot_steer_the_root_updater),
    (
        "an_update_outside_the_maintenance_window_waits_for_it",
        an_update_outside_the_maintenance_window_waits_for_it,
    ),
    (
        "a_good_update_is_approved_applied_and_the_audit_chain_continues",
        a_good_update_is_approved_applied_and_the_audit_chain_continues,
    ),
    (
        "a_release_that_exits_at_start_is_rolled_back_automatically",
        a_release_that_exits_at_start_is_rolled_back_automatically,
    ),
    (
        "a_reset_during_a_rollback_comes_back_on_a_working_version",
        a_reset_during_a_rollback_comes_back_on_a_working_version,
    ),
    ("systemctl_stop_drains_a_running_job", systemctl_stop_drains_a_running_job),
    ("a_second_stop_request_cancels_the_running_job", a_second_stop_request_cancels_the_running_job),
    (
        "a_killed_runner_is_restarted_and_reports_the_job_interrupted",
        a_killed_runner_is_restarted_and_reports_the_job_interrupted,
    ),
    (
        "after_a_reboot_the_runner_returns_and_its_audit_log_verifies",
        after_a_reboot_the_runner_returns_and_its_audit_log_verifies,
    ),
    (
        "a_first_boot_with_the_control_plane_down_becomes_ready_when_it_returns",
        a_first_boot_with_the_control_plane_down_becomes_ready_when_it_returns,
    ),
    // Last: the guest the cases run on loses power.
    (
        "a_second_instance_takes_over_when_the_first_loses_power",
        a_second_instance_takes_over_when_the_first_loses_power,
    ),
];

fn main() {
    // qemu starts this binary for each connection the guest makes to a forward.
    byoc_control_plane::vm::relay_if_asked();
    // `cargo test -- NAME` runs the cases whose names contain NAME (and the first, which
    // installs); --list lists them.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    if std::env::args().any(|a| a == "--list") {
        for (name, _) in CASES {
            println!("{name}: test");
        }
        return;
    }
    let started = Instant::now();
    let selected: Vec<&Case> = CASES
        .iter()
        .enumerate()
        .filter(|(i, (name, _))| *i == 0 || args.is_empty() || args.iter().any(|a| name.contains(a.as_str())))
        .map(|(_, c)| c)
        .collect();
    println!("\nrunning {} tests", selected.len());
    let mut world = match std::panic::catch_unwind(setup) {
        Ok(w) => w,
        Err(_) => {
            for (name, _) in &selected {
                println!("test {name} ... FAILED");
            }
            println!(
                "\ntest result: FAILED. 0 passed; {} failed; 0 ignored; 0 measured; 0 filtered out; finished in {:.2}s\n",
                selected.len(),
                started.elapsed().as_secs_f64()
            );
            std::process::exit(101);
        }
    };
    let mut failed = Vec::new();
    for (i, (name, case)) in selected.iter().enumerate() {
        if i > 0 && failed.first() == Some(&selected[0].0) {
            // Nothing else can be checked on a VM the install did not finish on.
            println!("test {name} ... FAILED (the install failed)");
            failed.push(*name);
            continue;
        }
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&mut world)));
        match outcome {
            Ok(()) => println!("test {name} ... ok ({:.1}s)", t.elapsed().as_secs_f64()),
            Err(_) => {
                println!("test {name} ... FAILED ({:.1}s)", t.elapsed().as_secs_f64());
                failed.push(*name);
                let journal = world
                    .vm
                    .exec("journalctl -u byoc-runner --no-pager -n 60", Duration::from_secs(60))
                    .map(|o| o.stdout)
                    .unwrap_or_else(|e| e.to_string());
                eprintln!(
                    "---- {name}: runner journal ----\n{journal}\n---- serial console ----\n{}",
                    world.vm.serial_tail(40)
                );
            }
        }
    }
    let _ = world.vm.power_off(Duration::from_secs(120));
    // Before exit(), which runs no destructors: the guests' and servers' temp dirs go.
    drop(world);
    let passed = selected.len() - failed.len();
    if !failed.is_empty() {
        println!("\nfailures:");
        for name in &failed {
            println!("    {name}");
        }
    }
    println!(
        "\ntest result: {}. {passed} passed; {} failed; 0 ignored; 0 measured; 0 filtered out; finished in {:.2}s\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        std::process::exit(101);
    }
}
