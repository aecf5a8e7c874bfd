//! `byoc-runner config check`: the customer's first diagnostic. Every check prints one
//! line (ok / warn / fail / skip) and, when something is wrong, what to do about it.
//! Checks run in the order a start-up would hit them, and a check whose prerequisite
//! failed is skipped rather than reported as a second failure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::config::Config;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
    Skip,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn check(name: &'static str, status: Status, detail: impl Into<String>, fix: Option<&str>) -> Check {
    Check { name, status, detail: detail.into(), fix: fix.map(str::to_string) }
}

const NET_TIMEOUT: Duration = Duration::from_secs(5);
/// Skew below this is not worth a word.
const CLOCK_OK_SECS: i64 = 5;

pub async fn run(config_path: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    let config = match Config::load(config_path) {
        Ok(c) => {
            out.push(check(
                "config",
                Status::Ok,
                format!("{} (digest {})", config_path.display(), &c.digest[..12]),
                None,
            ));
            Some(c)
        }
        Err(e) => {
            out.push(check(
                "config",
                Status::Fail,
                e.problems.join("; "),
                Some(&format!("edit {} (each problem is named above)", config_path.display())),
            ));
            None
        }
    };
    match &config {
        Some(c) => {
            out.push(state_dir(&c.runner.state_dir, &c.disk));
            out.push(admin_group(&c.runner.state_dir, c.roles.admin_group.as_deref()));
            out.extend(control_plane(c).await);
            out.push(imds(c).await);
            out.push(imds_firewall());
            out.extend(install_stack(c).await);
            out.push(updates(&c.update));
            out.push(terraform(&c.terraform));
            out.push(audit_export(c).await);
        }
        None => {
            for name in [
                "state_dir",
                "admin_group",
                "dns",
                "tcp",
                "tls",
                "clock",
                "imds",
                "imds_firewall",
                "install_stack",
                "updates",
                "terraform",
                "audit_export",
            ] {
                out.push(check(name, Status::Skip, "needs a valid configuration", None));
            }
        }
    }
    out.push(journald());
    out.extend(sandbox(config.as_ref()).await);
    out
}

/// Where terraform jobs' providers come from, as each job will meet it: the customer's
/// CLI configuration readable (the runner copies it into every step), the setting no
/// longer used said so.
fn terraform(t: &crate::config::TerraformConfig) -> Check {
    let mirrors = if t.job_provider_mirrors { "allowed" } else { "refused" };
    if let Some(p) = &t.plugin_cache_dir {
        return check(
            "terraform",
            Status::Warn,
            format!("plugin_cache_dir {} is not used (a cache every job's init writes)", p.display()),
            Some(
                "remove terraform.plugin_cache_dir; name a filesystem mirror in terraform.cli_config_file instead",
            ),
        );
    }
    match &t.cli_config_file {
        Some(p) => match std::fs::File::open(p).and_then(|f| f.metadata()) {
            Ok(m) if m.is_file() => check(
                "terraform",
                Status::Ok,
                format!(
                    "providers as {} says (copied read-only into every step); jobs' own mirrors {mirrors}",
                    p.display()
                ),
                None,
            ),
            Ok(_) => check(
                "terraform",
                Status::Fail,
                format!(
                    "cli_config_file {} is not a regular file: every terraform job would fail (terraform_config_unreadable)",
                    p.display()
                ),
                Some("point terraform.cli_config_file at your CLI configuration, or remove it"),
            ),
            Err(e) => check(
                "terraform",
                Status::Fail,
                format!(
                    "cli_config_file {}: {e}: every terraform job would fail (terraform_config_unreadable)",
                    p.display()
                ),
                Some("make it readable by the runner, or remove terraform.cli_config_file"),
            ),
        },
        None => check(
            "terraform",
            Status::Ok,
            format!(
                "no cli_config_file: providers only from a mirror a job names by digest (jobs' own mirrors {mirrors}); none from the registry"
            ),
            None,
        ),
    }
}

/// The customer's audit copies: each sink can be set up (its CA and header files read,
/// the runner's AWS identity found) as the daemon will at start.
async fn audit_export(c: &Config) -> Check {
    if c.audit.export.is_empty() {
        // Nothing to set up: not a problem (the copy is the customer's choice).
        return check(
            "audit_export",
            Status::Ok,
            "no copy of your own configured ([audit.export]): the audit log is on this VM and with the control plane",
            None,
        );
    }
    match crate::audit_export::sinks(c, "<runner>").await {
        Ok(sinks) => check(
            "audit_export",
            Status::Ok,
            sinks.iter().map(|s| s.target()).collect::<Vec<_>>().join(", "),
            None,
        ),
        Err(e) => check(
            "audit_export",
            Status::Fail,
            e,
            Some("fix [audit.export]: the daemon will not start with a copy it cannot make"),
        ),
    }
}

fn state_dir(dir: &Path, disk: &crate::disk::DiskSettings) -> Check {
    // The runner creates it on first start; then its parent must take it.
    let existing =
        if dir.is_dir() { dir.to_path_buf() } else { dir.parent().unwrap_or(Path::new("/")).to_path_buf() };
    let (free, total) = match crate::disk::space(&existing) {
        Ok(s) => (s.free, s.total),
        Err(e) => {
            return check(
                "state_dir",
                Status::Fail,
                format!("{}: {e}", existing.display()),
                Some("create the state dir's parent, or set runner.state_dir"),
            );
        }
    };
    let writable = nix::unistd::access(&existing, nix::unistd::AccessFlags::W_OK).is_ok();
    let gib = free as f64 / (1u64 << 30) as f64;
    let what = if dir.is_dir() { "exists" } else { "will be created on first start" };
    if !writable {
        return check(
            "state_dir",
            Status::Fail,
            format!("{} {what}, but {} is not writable by this user", dir.display(), existing.display()),
            Some("run as root or the byoc-runner user (the unit's StateDirectory= creates it)"),
        );
    }
    let threshold = disk.threshold(total);
    let detail = format!(
        "{} {what}; {gib:.1} GiB free; new jobs are refused (disk_low) under {} MiB",
        dir.display(),
        threshold >> 20
    );
    if free < threshold {
        check(
            "state_dir",
            Status::Fail,
            format!("{detail}: the runner refuses new jobs now (disk_low)"),
            Some(
                "free disk space (job logs, the journal and the audit log live here), or lower [disk] min_free_mib / min_free_percent",
            ),
        )
    } else if free < threshold.saturating_mul(2) {
        check(
            "state_dir",
            Status::Warn,
            detail,
            Some("less than twice the disk_low threshold free: job logs may reach it"),
        )
    } else {
        check("state_dir", Status::Ok, detail, None)
    }
}

/// Whether members of `roles.admin_group` can use `control/` (pause, approvals,
/// allowances) as the docs say.
fn admin_group(dir: &Path, group: Option<&str>) -> Check {
    let Some(name) = group else {
        return check("admin_group", Status::Ok, "not set: only root pauses, approves and allows", None);
    };
    if !dir.is_dir() {
        return check(
            "admin_group",
            Status::Ok,
            format!("{name}: control/ is prepared on the first start"),
            None,
        );
    }
    let problems = crate::roles::control::problems(dir, name);
    if problems.is_empty() {
        check("admin_group", Status::Ok, format!("members of {name} may pause, approve and allow"), None)
    } else {
        check(
            "admin_group",
            Status::Warn,
            format!("members of {name} cannot act: {}", problems.join("; ")),
            Some("as root, run what each problem names (the install stack's user-data does it)"),
        )
    }
}

/// The proxy `reqwest` will use for this URL, if any (HTTPS_PROXY unless NO_PROXY
/// covers the host).
fn proxy_for(url: &reqwest::Url) -> Option<reqwest::Url> {
    let var = |n: &str| {
        std::env::var(n).ok().or_else(|| std::env::var(n.to_lowercase()).ok()).filter(|v| !v.is_empty())
    };
    let proxy = var(if url.scheme() == "https" { "HTTPS_PROXY" } else { "HTTP_PROXY" })?;
    let host = url.host_str().unwrap_or("");
    let bypass = var("NO_PROXY").is_some_and(|n| {
        n.split(',').map(str::trim).any(|p| {
            p == "*"
                || (!p.is_empty()
                    && (host == p.trim_start_matches('.')
                        || host.ends_with(&format!(".{}", p.trim_start_matches('.')))))
        })
    });
    if bypass { None } else { reqwest::Url::parse(&proxy).ok() }
}

/// The control plane's (or the proxy's) first address, or the failed `dns` check.
async fn resolve(host: &str, port: u16) -> Result<SocketAddr, Check> {
    let addrs: Vec<SocketAddr> =
        match tokio::time::timeout(NET_TIMEOUT, tokio::net::lookup_host((host, port))).await {
            Ok(Ok(a)) => a.collect(),
            Ok(Err(e)) => {
                return Err(check(
                    "dns",
                    Status::Fail,
                    format!("{host}: {e}"),
                    Some("check the VPC's DNS resolver and the control-plane URL (or the proxy's host)"),
                ));
            }
            Err(_) => {
                return Err(check(
                    "dns",
                    Status::Fail,
                    format!("{host}: no answer in 5 s"),
                    Some("check the VPC's DNS resolver"),
                ));
            }
        };
    addrs.first().copied().ok_or_else(|| {
        check("dns", Status::Fail, format!("{host}: no addresses"), Some("check the control-plane URL"))
    })
}

/// What to do about a connection that failed with `e`: a refusal is an answer (the
/// host is reached, nothing listens there), anything else a path that is closed.
fn tcp_fix(e: &std::io::Error, port: u16, proxy: bool) -> String {
    let what = if proxy { "the proxy" } else { "the control plane" };
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => {
            format!(
                "the host answered but nothing listens on port {port}: is {what}'s URL (its port) right, and is it running?"
            )
        }
        _ => format!(
            "allow egress to port {port} (security group, NACL, route to a NAT gateway){}",
            if proxy { "" } else { ", or set HTTPS_PROXY" }
        ),
    }
}

async fn control_plane(c: &Config) -> Vec<Check> {
    let url = &c.control_plane.url;
    let via_proxy = proxy_for(url);
    let target = via_proxy.as_ref().unwrap_or(url);
    let host = target.host_str().unwrap_or("").trim_start_matches('[').trim_end_matches(']').to_string();
    let port = target.port_or_known_default().unwrap_or(443);
    let through = via_proxy
        .as_ref()
        .map(|p| format!(" (through proxy {})", p.host_str().unwrap_or("")))
        .unwrap_or_default();
    let mut out = Vec::new();

    let first = match resolve(&host, port).await {
        Ok(first) => first,
        Err(failed) => {
            out.push(failed);
            return skip_rest(out, &["tcp", "tls", "clock"]);
        }
    };
    out.push(check("dns", Status::Ok, format!("{host} → {}{through}", first.ip()), None));

    match tokio::time::timeout(NET_TIMEOUT, tokio::net::TcpStream::connect(first)).await {
        Ok(Ok(_)) => out.push(check("tcp", Status::Ok, format!("connected to {first}{through}"), None)),
        Ok(Err(e)) => {
            out.push(check(
                "tcp",
                Status::Fail,
                format!("{first}: {e}"),
                Some(&tcp_fix(&e, port, via_proxy.is_some())),
            ));
            return skip_rest(out, &["tls", "clock"]);
        }
        Err(_) => {
            let fix = format!("allow egress to port {port} (security group, NACL, NAT route)");
            out.push(check("tcp", Status::Fail, format!("{first}: no answer in 5 s"), Some(&fix)));
            return skip_rest(out, &["tls", "clock"]);
        }
    }

    let probe = match crate::control_plane::CpClient::new(&c.control_plane) {
        Ok(client) => client.probe().await,
        Err(e) => Err(e),
    };
    let (status, date) = match probe {
        Ok(p) => p,
        Err(e) => {
            out.push(check(
                "tls",
                Status::Fail,
                e.to_string(),
                Some("a certificate error means the server's chain is not trusted: set control_plane.ca_bundle for a TLS-inspecting proxy"),
            ));
            return skip_rest(out, &["clock"]);
        }
    };
    if url.scheme() == "https" {
        out.push(check(
            "tls",
            Status::Ok,
            format!("HTTPS answered {status}; certificate trusted{through}"),
            None,
        ));
    } else {
        out.push(check(
            "tls",
            Status::Warn,
            format!("plain HTTP answered {status} (allow_insecure_loopback: development only)"),
            Some("use an https:// control-plane URL"),
        ));
    }
    out.push(clock(date.as_deref(), c.jobs.max_clock_skew));
    out
}

fn skip_rest(mut out: Vec<Check>, names: &[&'static str]) -> Vec<Check> {
    for n in names {
        out.push(check(n, Status::Skip, "the previous step failed", None));
    }
    out
}

fn clock(date: Option<&str>, max: Duration) -> Check {
    let Some(parsed) = date.and_then(|d| {
        aws_sdk_sts::primitives::DateTime::from_str(d, aws_sdk_sts::primitives::DateTimeFormat::HttpDate).ok()
    }) else {
        return check("clock", Status::Warn, "the control plane sent no Date header to compare with", None);
    };
    let skew = crate::clock::unix_now() - parsed.secs();
    let detail = format!("{skew:+} s against the control plane");
    let fix = "keep the clock synchronised (chrony with the Amazon Time Sync Service, 169.254.169.123)";
    if skew.abs() <= CLOCK_OK_SECS {
        check("clock", Status::Ok, detail, None)
    } else if skew.unsigned_abs() <= max.as_secs() {
        check("clock", Status::Warn, detail, Some(fix))
    } else {
        check(
            "clock",
            Status::Fail,
            format!("{detail}: jobs will be refused as expired or not yet valid (limit {} s)", max.as_secs()),
            Some(fix),
        )
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

/// IMDSv2 at the SDK's endpoint (`AWS_EC2_METADATA_SERVICE_ENDPOINT`, default
/// 169.254.169.254): a token, then the instance id with it.
async fn imds(c: &Config) -> Check {
    let needed = c.roles.stack_name.is_some() && std::env::var_os("AWS_ACCESS_KEY_ID").is_none();
    if std::env::var("AWS_EC2_METADATA_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        let status = if needed { Status::Fail } else { Status::Skip };
        return check(
            "imds",
            status,
            "disabled by AWS_EC2_METADATA_DISABLED",
            needed.then_some("the runner needs its instance role: unset AWS_EC2_METADATA_DISABLED"),
        );
    }
    let base = std::env::var("AWS_EC2_METADATA_SERVICE_ENDPOINT")
        .unwrap_or_else(|_| "http://169.254.169.254".into());
    let base = base.trim_end_matches('/').to_string();
    let http = match reqwest::Client::builder().timeout(Duration::from_secs(2)).no_proxy().build() {
        Ok(h) => h,
        Err(e) => return check("imds", Status::Fail, e.to_string(), None),
    };
    let result = async {
        let token = http
            .put(format!("{base}/latest/api/token"))
            .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
            .send()
            .await
            .map_err(|e| chain(&e.without_url()))?
            .error_for_status()
            .map_err(|e| format!("token: {}", e.without_url()))?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        http.get(format!("{base}/latest/meta-data/instance-id"))
            .header("X-aws-ec2-metadata-token", token)
            .send()
            .await
            .map_err(|e| chain(&e.without_url()))?
            .error_for_status()
            .map_err(|e| format!("instance-id: {}", e.without_url()))?
            .text()
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match result {
        Ok(id) => check("imds", Status::Ok, format!("instance {id} (IMDSv2 at {base})"), None),
        Err(e) => check(
            "imds",
            if needed { Status::Fail } else { Status::Warn },
            format!("{base}: {e}"),
            Some(
                "on EC2: metadata options HttpEndpoint=enabled, HttpTokens=required, hop limit 1; the runner's AWS identity comes from here",
            ),
        ),
    }
}

/// The package's unit that leaves the instance metadata service to root and the
/// runner's user (`byoc-runner-imds.service`, nftables): any other local process
/// reaching it would get the instance role's credentials and the user-data. Root also
/// sees the rules themselves.
fn imds_firewall() -> Check {
    const UNIT: &str = "byoc-runner-imds.service";
    const TABLE: &str = "byoc_runner_imds";
    let fix = format!("systemctl enable --now {UNIT} (the package installs it; it needs nftables)");
    if !Path::new("/run/systemd/system").is_dir() {
        return check(
            "imds_firewall",
            Status::Warn,
            format!(
                "this host does not run systemd, so {UNIT} cannot keep the metadata service to root and the runner"
            ),
            Some(&fix),
        );
    }
    let active = std::process::Command::new("systemctl")
        .args(["is-active", "--quiet", UNIT])
        .status()
        .is_ok_and(|s| s.success());
    if !active {
        return check(
            "imds_firewall",
            Status::Fail,
            format!(
                "{UNIT} is not active: any local process can reach the metadata service (the instance role, the user-data)"
            ),
            Some(&fix),
        );
    }
    if !nix::unistd::geteuid().is_root() {
        return check(
            "imds_firewall",
            Status::Ok,
            format!("{UNIT} is active (run as root to see its rules)"),
            None,
        );
    }
    let listed = std::process::Command::new("nft").args(["list", "table", "inet", TABLE]).output();
    match listed {
        Ok(out) if out.status.success() => {
            let rules = String::from_utf8_lossy(&out.stdout);
            let has = |addr: &str| rules.lines().any(|l| l.contains(addr) && l.contains("skuid"));
            if has("169.254.169.254") && has("fd00:ec2::254") {
                check(
                    "imds_firewall",
                    Status::Ok,
                    format!(
                        "{UNIT} is active: only root and the runner's user reach 169.254.169.254 and fd00:ec2::254"
                    ),
                    None,
                )
            } else {
                check(
                    "imds_firewall",
                    Status::Fail,
                    format!("table inet {TABLE} does not hold the rules for both metadata addresses"),
                    Some(&format!("systemctl restart {UNIT}")),
                )
            }
        }
        _ => check(
            "imds_firewall",
            Status::Fail,
            format!("{UNIT} is active but table inet {TABLE} cannot be listed"),
            Some(&format!("systemctl restart {UNIT}")),
        ),
    }
}

async fn install_stack(c: &Config) -> Vec<Check> {
    let Some(stack) = &c.roles.stack_name else {
        return match &c.roles.switches_file {
            Some(path) => match crate::roles::switches::read_switch_file(path) {
                Ok(f) => {
                    let on: Vec<&str> = f
                        .role
                        .iter()
                        .filter(|r| r.enabled && r.arn.is_some())
                        .map(|r| r.name.as_str())
                        .collect();
                    vec![check(
                        "install_stack",
                        Status::Ok,
                        format!(
                            "switches file {}: on: {}",
                            path.display(),
                            if on.is_empty() { "none".into() } else { on.join(", ") }
                        ),
                        None,
                    )]
                }
                Err(e) => vec![check(
                    "install_stack",
                    Status::Fail,
                    e.to_string(),
                    Some("fix the switches file (docs/ROLES.md)"),
                )],
            },
            None => vec![check(
                "install_stack",
                Status::Warn,
                "no roles.stack_name or roles.switches_file: every job that asks for a role will be refused",
                Some("set roles.stack_name to the install stack's name"),
            )],
        };
    };
    let sdk = crate::roles::sdk_config(c).await;
    let source = crate::roles::switch_source(c, sdk.as_ref());
    let snapshot = match tokio::time::timeout(Duration::from_secs(20), source.read()).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let fix = match e {
                crate::roles::switches::SwitchError::NoCredentials { .. } => {
                    "give the instance an instance profile with the install's runner role (the install stack does), and let the runner reach the metadata service"
                }
                _ => {
                    "the instance role needs cloudformation:DescribeStacks on its own stack; check roles.stack_name and aws.region"
                }
            };
            return vec![check("install_stack", Status::Fail, e.to_string(), Some(fix))];
        }
        Err(_) => {
            return vec![check(
                "install_stack",
                Status::Fail,
                format!("{stack}: no answer in 20 s"),
                Some("allow HTTPS egress to the CloudFormation API"),
            )];
        }
    };
    let crate::roles::switches::Snapshot::Stack(view) = snapshot else {
        return vec![check("install_stack", Status::Fail, "unexpected switch source", None)];
    };
    let arns: Vec<String> = view
        .outputs
        .values()
        .filter_map(|v| crate::roles::switches::arn_role_name(v).map(str::to_string))
        .collect();
    let switches: Vec<String> = view
        .parameters
        .iter()
        .filter(|(k, _)| k.starts_with("Enable") && k.ends_with("Role"))
        .map(|(k, v)| format!("{}={v}", &k[6..k.len() - 4]))
        .collect();
    let mut out = vec![check(
        "install_stack",
        Status::Ok,
        format!(
            "{stack} readable; switches: {}",
            if switches.is_empty() { "none".into() } else { switches.join(", ") }
        ),
        None,
    )];
    out.push(if arns.is_empty() {
        check(
            "role_arns",
            Status::Warn,
            "no lifecycle role ARN among the stack outputs: every role is off",
            Some("switch roles on with the stack's Enable<Key>Role parameters"),
        )
    } else {
        check("role_arns", Status::Ok, format!("{} role(s) available: {}", arns.len(), arns.join(", ")), None)
    });
    out
}

/// The customer's terms for the runner's own updates, as `runner.update` will meet them.
fn updates(terms: &crate::config::UpdateConfig) -> Check {
    use crate::config::UpdateMode;
    let terms_dir = crate::update::terms_dir(&crate::update::own_updater_dir());
    let pin = match crate::update::effective_pin(terms, &terms_dir) {
        Ok(p) => p.map(|p| format!(", pinned to {:?}", p.as_str())).unwrap_or_default(),
        Err(e) => return check("updates", Status::Warn, e, Some("byoc-runner update unpin, or pin again")),
    };
    match (terms.mode, &terms.release_key) {
        (UpdateMode::Off, _) => check(
            "updates",
            Status::Ok,
            "switched off ([update] mode = \"off\"): every update is refused",
            None,
        ),
        (_, None) => check(
            "updates",
            Status::Warn,
            "no release key is pinned: every update is refused (update_disabled)",
            Some(
                "set [update] release_public_key to the key the release is signed with (user-data writes it)",
            ),
        ),
        (mode, Some(key)) => check(
            "updates",
            Status::Ok,
            format!(
                "mode {}, release key {}{pin}, running {}",
                mode.as_str(),
                key.id(),
                crate::update::running_version()
            ),
            None,
        ),
    }
}

fn journald() -> Check {
    let socket = Path::new("/run/systemd/journal/socket");
    if socket.exists() {
        check("journald", Status::Ok, "structured logs go to journald (journalctl -u byoc-runner)", None)
    } else {
        check(
            "journald",
            Status::Warn,
            "no journald socket: logs go to stderr",
            Some("run under systemd (the unit in /lib/systemd/system)"),
        )
    }
}

async fn sandbox(config: Option<&Config>) -> Vec<Check> {
    let mut out = kernel_features(config);
    let Some(c) = config else {
        out.push(check("sandbox", Status::Skip, "needs a valid configuration", None));
        return out;
    };
    if !c.sandbox.enabled {
        out.push(check(
            "sandbox",
            Status::Warn,
            "disabled by [sandbox] enabled = false: jobs run with the runner's privileges",
            Some("set [sandbox] enabled = true"),
        ));
        return out;
    }
    let helper = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/usr/bin/byoc-runner"));
    let scratch = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            out.push(check("sandbox", Status::Fail, format!("temp dir: {e}"), None));
            return out;
        }
    };
    let Some(mut settings) = crate::runtime::sandbox_settings(c, helper) else {
        return out;
    };
    settings.roots_dir = scratch.path().join("roots");
    out.push(match byoc_job_executors::sandboxed::self_test(&settings, scratch.path()).await {
        Ok(()) => check("sandbox", Status::Ok, "a test job ran in a full sandbox (namespaces, new root, seccomp, no capabilities)", None),
        Err(e) => check("sandbox", Status::Fail, e.to_string(), Some("the daemon refuses to start without it: check the unit allows namespaces, or see docs/THREAT_MODEL.md")),
    });
    out.extend(network_boundary(&settings, scratch.path()).await);
    if c.containers.enabled {
        out.extend(containers(c).await);
    }
    out
}

/// What the kernel gives the sandbox: user namespaces, cgroups, seccomp, Landlock.
fn kernel_features(config: Option<&Config>) -> Vec<Check> {
    let mut out = Vec::new();
    let userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    out.push(match userns {
        Some(n) if n > 0 => {
            check("user_namespaces", Status::Ok, format!("user.max_user_namespaces = {n}"), None)
        }
        _ => check(
            "user_namespaces",
            Status::Fail,
            "user namespaces are off",
            Some("sysctl -w user.max_user_namespaces=15000 (and persist it in /etc/sysctl.d)"),
        ),
    });
    let require_limits = config.is_none_or(|c| c.sandbox.require_limits && c.sandbox.cgroups);
    out.push(match byoc_sandbox::cgroup::detect() {
        Some(v) => check("cgroups", Status::Ok, format!("{v:?} (per-job memory, pids and cpu limits)"), None),
        None if require_limits => check(
            "cgroups",
            Status::Fail,
            "no usable cgroup hierarchy: sandboxed jobs are refused (sandbox_limits_unavailable)",
            Some("boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1) and keep Delegate=yes in the unit, or set sandbox.require_limits = false"),
        ),
        None => check(
            "cgroups",
            Status::Warn,
            "no usable cgroup hierarchy: jobs run without memory and pids limits (sandbox.require_limits = false)",
            Some("boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1)"),
        ),
    });
    let seccomp = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Seccomp:")));
    out.push(if seccomp {
        check("seccomp", Status::Ok, "available", None)
    } else {
        check(
            "seccomp",
            Status::Fail,
            "the kernel has no seccomp",
            Some("use a kernel built with CONFIG_SECCOMP_FILTER"),
        )
    });
    out.push(if byoc_sandbox::landlock_supported() {
        check("landlock", Status::Ok, "enabled", None)
    } else {
        check(
            "landlock",
            Status::Warn,
            "not enforced by this kernel: jobs lose the filesystem write restriction",
            Some("boot with lsm=landlock,... (kernel 5.13+)"),
        )
    });
    out
}

/// Container actions: the Docker Engine, and the static busybox their output relay,
/// network boundary and role sessions need.
async fn containers(c: &Config) -> Vec<Check> {
    let sock = &c.containers.docker_socket;
    let mut out = vec![match tokio::net::UnixStream::connect(sock).await {
        Ok(_) => check("docker", Status::Ok, format!("{} reachable", sock.display()), None),
        Err(e) => check(
            "docker",
            Status::Warn,
            format!("{}: {e}: container actions will fail", sock.display()),
            Some("start Docker and add byoc-runner to the docker group, or set [containers] enabled = false"),
        ),
    }];
    let busybox = &c.roles.busybox;
    out.push(if crate::roles::creds::is_static_elf(busybox) {
        check(
            "container_busybox",
            Status::Ok,
            format!("static {}: containers' output is relayed, their network boundary set up and their role sessions renewed through credential_process", busybox.display()),
            None,
        )
    } else {
        check(
            "container_busybox",
            Status::Fail,
            format!("{} is missing or not statically linked: container jobs are refused (container_output_unavailable: it relays their output; networked ones sandbox_network_unavailable: it sets up their network boundary)", busybox.display()),
            Some("apt-get install busybox-static, or point [roles] busybox at a static busybox"),
        )
    });
    out
}

/// The job network boundary: the user-mode stack is there, and a probe job in a
/// sandbox with it cannot reach IMDS (IPv4, IPv6), the ECS/EKS credential addresses
/// or a service on this host's loopback, which it must find refused.
async fn network_boundary(settings: &byoc_job_executors::SandboxSettings, scratch: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    let net = &settings.network;
    if let Err(e) = byoc_job_executors::jobnet::check_available(net) {
        out.push(check(
            "network_stack",
            Status::Fail,
            format!("{e}: networked jobs are refused (sandbox_network_unavailable)"),
            Some("apt-get install slirp4netns (the package depends on it); the unit needs DeviceAllow=/dev/net/tun rw"),
        ));
        out.push(check("network_boundary", Status::Skip, "needs the user-mode network stack", None));
        return out;
    }
    out.push(check(
        "network_stack",
        Status::Ok,
        format!(
            "{} and /dev/net/tun: {}",
            net.slirp4netns.display(),
            byoc_job_executors::jobnet::describe(byoc_job_executors::jobnet::NetworkUse::UserMode, net)
        ),
        None,
    ));
    // A service on the host's loopback that the probe must not reach.
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            out.push(check(
                "network_boundary",
                Status::Fail,
                format!("binding a loopback listener: {e}"),
                None,
            ));
            return out;
        }
    };
    let Ok(addr) = listener.local_addr() else { return out };
    let reached = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = reached.clone();
    let watcher = tokio::spawn(async move {
        if listener.accept().await.is_ok() {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let result = byoc_job_executors::sandboxed::probe_boundary(settings, scratch, &[addr]).await;
    watcher.abort();
    out.push(match result {
        Ok(attempts) if !attempts.is_empty() && attempts.iter().all(|(_, refused, _)| *refused) && !reached.load(std::sync::atomic::Ordering::SeqCst) => check(
            "network_boundary",
            Status::Ok,
            format!(
                "a probe job could not reach {}",
                attempts.iter().map(|(t, _, _)| t.as_str()).collect::<Vec<_>>().join(", ")
            ),
            None,
        ),
        Ok(attempts) => check(
            "network_boundary",
            Status::Fail,
            format!(
                "a probe job reached {}",
                attempts
                    .iter()
                    .filter(|(_, refused, _)| !refused)
                    .map(|(t, _, d)| format!("{t} ({d})"))
                    .chain(reached.load(std::sync::atomic::Ordering::SeqCst).then(|| format!("the host's {addr}")))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Some("jobs can reach the instance's metadata or the host: do not run jobs here; see docs/THREAT_MODEL.md"),
        ),
        Err(e) => check(
            "network_boundary",
            Status::Fail,
            format!("the probe job could not run: {e}"),
            Some("networked jobs will fail the same way: see the detail, and docs/OPERATIONS.md"),
        ),
    });
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_refused_connection_names_the_port_and_not_egress() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let fix = super::tcp_fix(&refused, 8443, false);
        assert!(fix.contains("nothing listens on port 8443") && !fix.contains("egress"), "{fix}");
        let unreachable = std::io::Error::from(std::io::ErrorKind::NetworkUnreachable);
        let fix = super::tcp_fix(&unreachable, 8443, false);
        assert!(fix.contains("egress to port 8443") && !fix.contains("port 443 "), "{fix}");
    }

    #[test]
    fn where_terraforms_providers_come_from_is_checked() {
        let d = tempfile::tempdir().unwrap();
        let rc = d.path().join("terraform.rc");
        let mut t = crate::config::TerraformConfig {
            binary: "/usr/bin/terraform".into(),
            plan_max_age: std::time::Duration::from_secs(3600),
            cli_config_file: None,
            job_provider_mirrors: true,
            plugin_cache_dir: None,
            state: Default::default(),
        };
        assert_eq!(super::terraform(&t).status, super::Status::Ok);
        t.cli_config_file = Some(rc.clone());
        t.job_provider_mirrors = false;
        let missing = super::terraform(&t);
        assert_eq!(missing.status, super::Status::Fail, "{missing:?}");
        assert!(missing.detail.contains("terraform_config_unreadable"), "{missing:?}");
        std::fs::write(&rc, "provider_installation {}\n").unwrap();
        let ok = super::terraform(&t);
        assert_eq!(ok.status, super::Status::Ok);
        assert!(ok.detail.contains("refused"), "{ok:?}");
        t.plugin_cache_dir = Some(d.path().join("cache"));
        assert_eq!(super::terraform(&t).status, super::Status::Warn);
    }

    #[test]
    fn the_update_terms_are_checked_as_a_job_would_meet_them() {
        use crate::config::{UpdateConfig, UpdateMode};
        let keyed = UpdateConfig {
            mode: UpdateMode::Auto,
            release_key: Some(
                crate::update::minisign::PublicKey::parse(
                    "RWTpvzX1SCQie+b1b2ukH1NaNGEZZsjO1BHIJzyMHfMSjHTInVYVd1fe",
                )
                .unwrap(),
            ),
            ..Default::default()
        };
        let c = super::updates(&keyed);
        assert_eq!(c.status, super::Status::Ok, "{}", c.detail);
        assert!(c.detail.contains("mode auto, release key 7B222448F535BFE9"), "{}", c.detail);
        let c = super::updates(&UpdateConfig { release_key: None, ..keyed.clone() });
        assert_eq!(c.status, super::Status::Warn);
        assert!(c.fix.unwrap().contains("release_public_key"));
        let c = super::updates(&UpdateConfig { mode: UpdateMode::Off, ..keyed });
        assert_eq!(c.status, super::Status::Ok);
    }
}
