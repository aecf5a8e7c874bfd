//! Command line: the daemon entry point and the customer's inspection commands, one
//! file per subcommand group. anyhow lives only here, at the edge.
//!
//! | file        | subcommands                                        |
//! |-------------|----------------------------------------------------|
//! | `run.rs`    | `run` (the daemon), `run-local`                    |
//! | `config.rs` | `config validate`, `config check`, `config write` (`config_write.rs`) |
//! | `state.rs`  | `status`, `pause`, `resume`, `roles`               |
//! | `jobs.rs`   | `jobs list/show/logs/rejections`                   |
//! | `audit.rs`  | `audit verify/tail/show/export/prove`              |
//! | `policy.rs` | `policy list/test`, and the hidden `policy-eval`   |
//! | `sync.rs`   | `sync`                                             |
//! | `tfstate.rs`| `state list/show` (terraform state on this runner) |
//! | `update.rs` | `update status/pin/unpin/rollback` (the updater is its own binary) |

mod app;
mod approvals;
mod audit;
mod config;
mod config_write;
mod drift;
mod jobs;
mod policy;
mod run;
mod secrets;
mod state;
mod sync;
mod tfstate;
mod update;

use std::path::{Path, PathBuf};

use clap::{FromArgMatches as _, Parser, Subcommand, ValueEnum};

use crate::config::{Config, DEFAULT_CONFIG_PATH, DEFAULT_STATE_DIR};
use crate::state_dir::StateDir;

/// sysexits.h: the command was used incorrectly (bad arguments or configuration).
pub const EX_USAGE: i32 = 64;
/// sysexits.h: the input data was incorrect.
pub const EX_DATAERR: i32 = 65;

#[derive(Parser)]
#[command(
    name = "byoc-runner",
    version,
    about = "Runs the vendor's signed jobs in this cloud account, and shows what it did",
    after_help = "-o/--output, --state-dir and --config may also come before the command\n\
                  (byoc-runner -o json jobs list). Each command's --help has the detail and an\n\
                  example; the manual is man byoc-runner(8), exit codes in its EXIT STATUS."
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq, Eq)]
pub enum Output {
    #[default]
    Text,
    Json,
}

#[derive(clap::Args, Clone)]
pub(crate) struct StateArgs {
    /// Configuration file (for the state dir location) [default: /etc/byoc-runner/runner.toml].
    /// A file named here must exist.
    #[arg(long, env = "BYOC_RUNNER_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// State directory; overrides the config file.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Output format: text for people, json for scripts.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon (systemd's ExecStart)
    ///
    /// Long-polls the control plane, verifies and runs signed jobs, keeps the journal
    /// and the signed audit log. The package's unit starts it; there is rarely a reason
    /// to run it by hand.
    ///
    /// Example: byoc-runner run --config /etc/byoc-runner/runner.toml
    Run {
        /// Configuration file.
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Version, enrollment, the daemon, last contact, jobs
    ///
    /// Shows the version, the enrollment, whether the daemon runs (exit 3 when it does
    /// not, as `systemctl status`), its last contact with the control plane, disk use,
    /// drift and a summary of jobs, read from the state dir.
    ///
    /// Examples: byoc-runner status; byoc-runner status -o json | jq .contact
    Status(StateArgs),
    /// The runner's metrics in Prometheus text format
    ///
    /// The same the daemon writes to `[metrics] textfile`, read from the state dir.
    ///
    /// Example: byoc-runner metrics | grep byoc_jobs_finished_total
    Metrics(StateArgs),
    /// Jobs in the local journal: list, show, logs, rejections
    Jobs {
        #[command(subcommand)]
        cmd: jobs::JobsCmd,
    },
    /// Run a job file here, with no control plane (for vendors)
    ///
    /// Runs the job as the daemon would (sandbox, policies, masking) and prints its
    /// output. Exit codes: the job's own, 124 timed out, 130 cancelled, 125 run-local
    /// itself failed.
    ///
    /// Example: byoc-runner run-local examples/jobs/hello.json
    RunLocal(run::LocalArgs),
    /// Print a shell completion script
    ///
    /// The package installs bash, zsh and fish ones.
    ///
    /// Example: byoc-runner completions bash > /etc/bash_completion.d/byoc-runner
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page, or write one per command
    ///
    /// Without --dir, the page of byoc-runner itself (roff) on stdout. The package
    /// installs one page per command in section 8.
    ///
    /// Example: byoc-runner man | man -l -
    Man {
        /// Write one page per command here (byoc-runner-jobs-show.8, …).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Print the journal catalog of the audit events' entries (for `journalctl -x`;
    /// the package installs it as /usr/lib/systemd/catalog/byoc-runner.catalog).
    #[command(hide = true)]
    JournalCatalog,
    /// Internal: build a job sandbox from the spec on stdin and exec the job.
    #[command(hide = true)]
    SandboxExec,
    /// Internal: evaluate the policy request on stdin under an address-space limit and
    /// print the decision.
    #[command(hide = true)]
    PolicyEval {
        #[arg(long)]
        memory_mib: u64,
    },
    /// Internal: report, from inside a sandbox, what a job can see and do (JSON).
    #[command(hide = true)]
    SandboxProbe {
        #[arg(long)]
        runner_pid: i32,
        #[arg(long)]
        state_dir: PathBuf,
        #[arg(long, default_value = "/etc/byoc-runner")]
        config_dir: PathBuf,
        /// Another `host:port` the job must not reach (repeatable), besides IMDS
        /// (IPv4 and IPv6) and the ECS/EKS credential addresses, always tried.
        #[arg(long = "unreachable", value_name = "HOST:PORT")]
        unreachable: Vec<String>,
    },
    /// The signed audit log: verify, tail, show, export, prove
    Audit {
        #[command(subcommand)]
        cmd: audit::AuditCmd,
    },
    /// Refuse new jobs until `resume`; running jobs finish
    ///
    /// New jobs are refused with reason `paused`; the pause survives restarts. The
    /// audit log records who paused, when and why before the pause takes effect. Needs
    /// root or roles.admin_group.
    ///
    /// Example: byoc-runner pause --reason "change freeze CHG-42"
    Pause {
        #[command(flatten)]
        state: StateArgs,
        /// Why (shown to the vendor in heartbeats and kept in the audit log).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Lift a pause: the runner takes new jobs again
    ///
    /// The audit log records who lifted which pause, and when, before it is lifted.
    /// Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner resume
    Resume(StateArgs),
    /// Drift of each workspace, component and release
    ///
    /// The last drift check of each terraform workspace, kubernetes component and helm
    /// release: clean, drifted or violating, when, what drifted (addresses and
    /// attribute paths, never values), what a deploy would change. `drift run NAME`
    /// asks for a check now; `drift targets` lists what the runner can check.
    ///
    /// Examples: byoc-runner drift; byoc-runner drift run network
    Drift {
        #[command(flatten)]
        state: StateArgs,
        #[command(subcommand)]
        action: Option<drift::DriftAction>,
    },
    /// The customer's secrets jobs wrote here (never a value)
    ///
    /// Name, version, keyed digest, where each was last written and by which job. The
    /// runner keeps no value.
    ///
    /// Example: byoc-runner secrets -o json
    Secrets(StateArgs),
    /// Jobs awaiting a local approval; `show JOB` for one
    ///
    /// What each held job will do, under which [[guardrails.approval_rule]], until when.
    ///
    /// Examples: byoc-runner approvals; byoc-runner approvals show JOB
    Approvals {
        #[command(flatten)]
        state: StateArgs,
        #[command(subcommand)]
        action: Option<approvals::ApprovalsCmd>,
    },
    /// Approve a held job: it runs (audited)
    ///
    /// The audit log records who approved, their uid and why before the answer is
    /// given. Needs root or roles.admin_group. The job id must be given in full.
    ///
    /// Example: byoc-runner approvals show JOB && byoc-runner approve JOB --reason CHG-42
    Approve {
        #[command(flatten)]
        state: StateArgs,
        /// The held job's id, in full (`byoc-runner approvals` lists them).
        job_id: String,
        /// Why (kept in the audit log, reported to the vendor).
        #[arg(long)]
        reason: Option<String>,
        /// A runner update: the version you approve (`approvals show JOB` shows it). The
        /// updater installs it, as root, only with your approval of that version.
        #[arg(long)]
        version: Option<String>,
    },
    /// Deny a held job: it never runs (audited)
    ///
    /// The job is refused with reason approval_denied. The audit log records who
    /// denied, their uid and why. Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner deny JOB --reason "not during the audit"
    Deny {
        #[command(flatten)]
        state: StateArgs,
        /// The held job's id, in full (`byoc-runner approvals` lists them).
        job_id: String,
        /// Why (kept in the audit log, reported to the vendor).
        #[arg(long)]
        reason: String,
    },
    /// Lifecycle roles: switched on or not, ARN, last assumed
    ///
    /// Each role the app defines: enabled or not, its ARN, where the switch came from,
    /// when it was last assumed, and its local allowance where it needs one.
    ///
    /// Examples: byoc-runner roles --refresh; byoc-runner roles allow NAME --for 2h --reason INC-7
    #[command(args_conflicts_with_subcommands = true)]
    Roles {
        #[command(flatten)]
        state: StateArgs,
        /// Read the switches now (install stack or switches file) instead of showing the
        /// daemon's last reading.
        #[arg(long)]
        refresh: bool,
        #[command(subcommand)]
        action: Option<state::RolesAction>,
    },
    /// Copy an OCI artifact between registries
    ///
    /// An image, index, chart or module, and its referrers, with the engine `oci.sync`
    /// jobs use. Loopback registries are plain HTTP; others HTTPS. Secrets come from the
    /// environment or files, never argv.
    ///
    /// Example: BYOC_SYNC_DEST_TOKEN=… byoc-runner sync reg.vendor.example/app:1.2 123456789012.dkr.ecr.us-east-1.amazonaws.com/app --dest-user AWS
    Sync(sync::SyncArgs),
    /// Check an app config directory as the runner would load it
    App {
        #[command(subcommand)]
        cmd: app::AppCmd,
    },
    /// The policies that decide plans and manifests
    Policy {
        #[command(subcommand)]
        cmd: policy::PolicyCmd,
    },
    /// Terraform state of the install's workspaces (no values)
    State {
        #[command(subcommand)]
        cmd: tfstate::TfStateCmd,
    },
    /// The runner's own updates: status, pin, unpin, rollback
    Update {
        #[command(subcommand)]
        cmd: update::UpdateCmd,
    },
    /// The configuration: check, validate, write
    Config {
        #[command(subcommand)]
        cmd: config::ConfigCmd,
    },
}

/// The options every inspection command takes, which may also come before the command
/// (`byoc-runner -o json jobs list`): moved after it, where the command reads them.
/// Stops at the first argument that is not one of them (the command's name).
fn hoist_common_options(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    const WITH_VALUE: [&str; 4] = ["-o", "--output", "--state-dir", "--config"];
    let Some((program, rest)) = args.split_first() else { return args };
    let mut leading = Vec::new();
    let mut i = 0;
    while let Some(arg) = rest.get(i).and_then(|a| a.to_str()) {
        let inline = WITH_VALUE.iter().any(|o| o.starts_with("--") && arg.starts_with(&format!("{o}=")));
        if inline || (arg.starts_with("-o") && arg.len() > 2 && !arg.starts_with("--")) {
            leading.push(rest[i].clone());
            i += 1;
        } else if WITH_VALUE.contains(&arg) && i + 1 < rest.len() {
            leading.extend_from_slice(&rest[i..i + 2]);
            i += 2;
        } else {
            break;
        }
    }
    if leading.is_empty() {
        return args;
    }
    let mut out = vec![program.clone()];
    out.extend_from_slice(&rest[i..]);
    out.extend(leading);
    out
}

/// The top-level help's groups, in order: every visible command is in one (a test
/// holds it).
const GROUPS: &[(&str, &[&str])] = &[
    (
        "Inspect (reads the state dir; changes nothing)",
        &["status", "jobs", "approvals", "roles", "drift", "secrets", "state", "update", "policy", "metrics"],
    ),
    ("Act (root or roles.admin_group; audited with who)", &["pause", "resume", "approve", "deny"]),
    ("Audit (the signed log, offline)", &["audit"]),
    ("Vendor and daemon", &["run", "run-local", "sync", "app", "config", "completions", "man"]),
];

/// The exit codes every command keeps to (the manual's EXIT STATUS and
/// docs/OPERATIONS.md's table; a test holds them to each other and runs each case).
pub const EXIT_CODES: &[(&str, &str)] = &[
    ("0", "success"),
    ("1", "a runtime failure (the message is on stderr); `audit verify`: the log does not hold"),
    ("2", "`audit verify`: nothing could be verified (the log or the copy is not there or cannot be read)"),
    ("3", "`status`: the daemon is not running (as `systemctl status`)"),
    ("64", "usage: a bad command line, configuration or value typed (EX_USAGE)"),
    ("124 / 130 / N", "`run-local`: the job timed out / was cancelled (Ctrl-C) / exited with N"),
    ("125", "`run-local` itself failed, or refused or stopped the job without an exit code of its own"),
    ("141", "the reader of the output went away (SIGPIPE, as `ls | head`)"),
];

/// The command line's definition, with the commands listed by group in its help.
pub(crate) fn command() -> clap::Command {
    let cmd = <Cli as clap::CommandFactory>::command();
    let mut groups = String::new();
    for (title, names) in GROUPS {
        groups.push_str(&format!("{title}:\n"));
        for name in *names {
            let about = cmd.find_subcommand(name).and_then(|c| c.get_about()).map(|a| a.to_string());
            groups.push_str(&format!("  {name:<12} {}\n", about.unwrap_or_default()));
        }
        groups.push('\n');
    }
    cmd.help_template(format!(
        "{{about-with-newline}}\n{{usage-heading}} {{usage}}\n\n{groups}Options:\n{{options}}{{after-help}}"
    ))
}

pub fn main() -> i32 {
    let args = hoist_common_options(std::env::args_os().collect());
    let cli = match command().try_get_matches_from(&args).and_then(|m| Cli::from_arg_matches(&m)) {
        Ok(c) => c,
        Err(e) => {
            // run-local passes its job's exit codes through: its own stay apart (125).
            let usage = if args.get(1).and_then(|a| a.to_str()) == Some("run-local") {
                crate::run_local::EXIT_RUNNER
            } else {
                EX_USAGE
            };
            let code = if e.use_stderr() { usage } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    // A command whose reader has gone (`| head -1`) ends as `ls` does (SIGPIPE, 141),
    // never with a panic. Not the daemon, run-local (a job's output), or the internal
    // helpers, whose pipes are the runner's own.
    if !matches!(
        cli.cmd,
        Cmd::Run { .. }
            | Cmd::RunLocal(_)
            | Cmd::SandboxExec
            | Cmd::PolicyEval { .. }
            | Cmd::SandboxProbe { .. }
    ) {
        byoc_sandbox::default_sigpipe();
    }
    match cli.cmd {
        // First and without a runtime: the helper must stay single-threaded.
        Cmd::SandboxExec => byoc_sandbox::helper::sandbox_exec_main(),
        Cmd::PolicyEval { memory_mib } => policy::eval(memory_mib),
        Cmd::SandboxProbe { runner_pid, state_dir, config_dir, unreachable } => {
            let key = StateDir::of(&state_dir).key();
            let report = byoc_sandbox::probe::run(&byoc_sandbox::probe::ProbeArgs {
                runner_pid,
                state_dir: &state_dir,
                identity_key: &key,
                config_dir: &config_dir,
                unreachable: &unreachable,
            });
            match serde_json::to_string(&report) {
                Ok(s) => {
                    println!("{s}");
                    0
                }
                Err(_) => 1,
            }
        }
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut command(), "byoc-runner", &mut std::io::stdout());
            0
        }
        Cmd::Man { dir } => edge(|| man(dir.as_deref())),
        Cmd::JournalCatalog => {
            print!("{}", crate::logging::journal_catalog());
            0
        }
        Cmd::Run { config } => run::daemon(&config),
        Cmd::RunLocal(args) => run::local(args),
        Cmd::Status(s) => edge_code(|| state::status(&s)),
        Cmd::Metrics(s) => edge(|| state::metrics(&s)),
        Cmd::Pause { state, reason } => edge(|| state::pause(&state, reason)),
        Cmd::Resume(s) => edge(|| state::resume(&s)),
        Cmd::Update { cmd } => edge(|| update::run(cmd)),
        Cmd::Approvals { state, action: None } => edge(|| approvals::list(&state)),
        Cmd::Approvals { action: Some(action), .. } => edge(|| approvals::run(action)),
        Cmd::Secrets(s) => edge(|| secrets::list(&s)),
        Cmd::Drift { state, action } => edge(|| drift::run(&state, action)),
        Cmd::Approve { state, job_id, reason, version } => {
            edge(|| approvals::decide(&state, &job_id, true, reason, version))
        }
        Cmd::Deny { state, job_id, reason } => {
            edge(|| approvals::decide(&state, &job_id, false, Some(reason), None))
        }
        Cmd::Roles { state, refresh, action: None } => edge(|| state::roles(&state, refresh)),
        Cmd::Roles { action: Some(action), .. } => edge(|| state::roles_action(action)),
        Cmd::Jobs { cmd } => edge(|| jobs::run(cmd)),
        Cmd::Audit { cmd } => audit::run(cmd),
        Cmd::Config { cmd } => config::run(cmd),
        Cmd::Sync(args) => sync::run(args),
        Cmd::Policy { cmd } => policy::run(cmd),
        Cmd::App { cmd } => app::run(cmd),
        Cmd::State { cmd } => tfstate::run(cmd),
    }
}

/// [`edge`] for a command whose success has an exit code of its own.
fn edge_code(f: impl FnOnce() -> anyhow::Result<i32>) -> i32 {
    let mut code = 0;
    match edge(|| f().map(|c| code = c)) {
        0 => code,
        failed => failed,
    }
}

/// Run a command that reports errors with anyhow: the error chain on stderr, exit 64
/// for an error in the command line ([`UsageError`]), else 1.
fn edge(f: impl FnOnce() -> anyhow::Result<()>) -> i32 {
    crate::logging::init_cli();
    match f() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            exit_code_of(&e)
        }
    }
}

/// 64 for an error in the command line, 1 for anything the command met.
pub(crate) fn exit_code_of(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.is::<UsageError>()) { EX_USAGE } else { 1 }
}

/// The manual's section: byoc-runner is a system daemon and its administration.
const MAN_SECTION: &str = "8";

/// The manual page from the command definitions: one page on stdout, or a page per
/// command (`byoc-runner-jobs-show.8`, …) in `dir`. Hidden internal commands have none.
fn man(dir: Option<&Path>) -> anyhow::Result<()> {
    let mut cmd = command().disable_help_subcommand(true);
    cmd.build();
    match dir {
        None => man_page(&cmd, &mut std::io::stdout().lock())?,
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            man_pages(&cmd, dir)?;
        }
    }
    Ok(())
}

fn man_pages(cmd: &clap::Command, dir: &Path) -> std::io::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        man_pages(sub, dir)?;
    }
    let name = clap_mangen::Man::new(cmd.clone()).section(MAN_SECTION).get_filename();
    let mut file = std::fs::File::create(dir.join(name))?;
    man_page(cmd, &mut file)
}

/// One page: clap's sections, then EXIT STATUS, ENVIRONMENT, FILES and SEE ALSO.
fn man_page(cmd: &clap::Command, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    clap_mangen::Man::new(cmd.clone()).section(MAN_SECTION).render(out)?;
    let esc = |t: &str| t.replace('\\', "\\e").replace('-', "\\-");
    let mut page = String::from(".SH \"EXIT STATUS\"\n");
    for (code, meaning) in EXIT_CODES {
        page.push_str(&format!(".TP\n\\fB{}\\fR\n{}\n", esc(code), esc(meaning)));
    }
    page.push_str(".SH ENVIRONMENT\n");
    for (name, meaning) in [
        ("BYOC_RUNNER_CONFIG", "The configuration file, as --config (a file named here must exist)."),
        ("NO_COLOR", "When set and not empty, no colour on stderr."),
        ("RUST_LOG", "The commands' own log level on stderr (default warn)."),
    ] {
        page.push_str(&format!(".TP\n\\fB{}\\fR\n{}\n", esc(name), esc(meaning)));
    }
    page.push_str(".SH FILES\n");
    for (path, meaning) in [
        (DEFAULT_CONFIG_PATH, "The configuration (root's; readable by the runner's group)."),
        (DEFAULT_STATE_DIR, "The state dir: journal, job logs, audit log, terraform state."),
        ("/var/lib/byoc-runner/audit", "The signed, tamper-evident audit log."),
        (
            "/var/lib/byoc-runner/control",
            "Where the customer's controls meet the daemon: pause, approvals, allowances.",
        ),
        (
            "/var/lib/byoc-runner-update",
            "The root updater's own directory: kept releases, outcomes, the customer's terms.",
        ),
        (
            "/usr/lib/systemd/catalog/byoc-runner.catalog",
            "What each audit event's journal entries mean (journalctl \\-x).",
        ),
    ] {
        page.push_str(&format!(".TP\n{}\n{}\n", esc(path), esc(meaning)));
    }
    let own = cmd.get_display_name().unwrap_or(cmd.get_name()).to_string();
    let mut see: Vec<String> = Vec::new();
    if own != "byoc-runner" {
        see.push(format!("\\fBbyoc\\-runner\\fR({MAN_SECTION})"));
    }
    see.extend(["systemctl(1)", "journalctl(1)", "/usr/share/doc/byoc-runner/README.md"].map(esc));
    page.push_str(&format!(".SH \"SEE ALSO\"\n{}\n", see.join(", ")));
    out.write_all(page.as_bytes())
}

fn load_config(path: &Path) -> Result<Config, i32> {
    Config::load(path).map_err(|e| {
        eprintln!("error: {e}");
        EX_USAGE
    })
}

/// An error in what the user typed (exit 64, EX_USAGE), not in what the command met.
#[derive(Debug)]
pub(crate) struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Returns early with a [`UsageError`].
macro_rules! usage {
    ($($arg:tt)*) => { return Err($crate::cli::UsageError(format!($($arg)*)).into()) };
}
pub(crate) use usage;

impl StateArgs {
    /// `--config` (or `BYOC_RUNNER_CONFIG`), else the default path.
    pub(crate) fn config_path(&self) -> &Path {
        self.config.as_deref().unwrap_or(Path::new(DEFAULT_CONFIG_PATH))
    }

    /// The configuration, if there is one. A file the user named (`--config`,
    /// `BYOC_RUNNER_CONFIG`) must exist and load: a typo is never a silent fallback.
    /// The default one may be absent or unreadable (a member of the admin group cannot
    /// read it): the commands then use the defaults; one that does not parse is said
    /// on stderr, and the defaults used.
    pub(crate) fn config(&self) -> anyhow::Result<Option<Config>> {
        let path = self.config_path();
        let named = self.config.is_some();
        match std::fs::File::open(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && named => {
                usage!("config file {} does not exist (--config or BYOC_RUNNER_CONFIG)", path.display())
            }
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied && named => anyhow::bail!(
                "permission denied reading {}: run as root (sudo), or leave out --config and give --state-dir",
                path.display()
            ),
            Err(_) => Ok(None),
            Ok(_) => match Config::load(path) {
                Ok(c) => Ok(Some(c)),
                Err(e) if named => Err(UsageError(e.to_string()).into()),
                Err(e) => {
                    eprintln!("warning: {e}\nwarning: using the defaults (state dir {DEFAULT_STATE_DIR})");
                    Ok(None)
                }
            },
        }
    }
}

/// The state dir a command reads: `--state-dir`, else the configuration's, else the
/// default. Checked as `status` checks it, so a typo or a missing `sudo` is an error
/// and never an answer of "nothing here".
fn state_dir(s: &StateArgs) -> anyhow::Result<PathBuf> {
    let dir = state_dir_unchecked(s)?;
    crate::inspect::check_state_dir(&dir)?;
    Ok(dir)
}

/// For the customer's controls (pause, resume, approvals, approve, deny): members of
/// the admin group reach `control/` and nothing else of the state dir, so that is what
/// must be there and readable. A state dir the runner has never used has none.
fn control_state_dir(s: &StateArgs) -> anyhow::Result<PathBuf> {
    let dir = state_dir_unchecked(s)?;
    let control = StateDir::of(&dir).control();
    match std::fs::read_dir(&control) {
        Ok(_) => Ok(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::inspect::check_state_dir(&dir)?;
            anyhow::bail!(
                "state dir {} has no {}: the runner has never run with it (is --state-dir or the config's [runner] state_dir right?)",
                dir.display(),
                crate::state_dir::CONTROL_DIR
            )
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            Err(crate::inspect::InspectError::Permission(control.display().to_string()).into())
        }
        Err(e) => anyhow::bail!("reading {}: {e}", control.display()),
    }
}

fn state_dir_unchecked(s: &StateArgs) -> anyhow::Result<PathBuf> {
    let config = s.config()?;
    if let Some(d) = &s.state_dir {
        return Ok(d.clone());
    }
    Ok(config.map(|c| c.runner.state_dir).unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR)))
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    #[test]
    fn common_options_before_the_command_move_after_it() {
        let args = |s: &str| s.split(' ').map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            super::hoist_common_options(args("byoc-runner -o json --state-dir /s jobs list --limit 2")),
            args("byoc-runner jobs list --limit 2 -o json --state-dir /s")
        );
        assert_eq!(
            super::hoist_common_options(args("byoc-runner --output=json -ojson status")),
            args("byoc-runner status --output=json -ojson")
        );
        for unchanged in
            ["byoc-runner jobs list -o json", "byoc-runner --version", "byoc-runner -o", "byoc-runner"]
        {
            assert_eq!(super::hoist_common_options(args(unchanged)), args(unchanged));
        }
    }

    #[test]
    fn the_command_definitions_are_consistent() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn completions_and_the_manual_come_from_the_definitions() {
        let mut bash = Vec::new();
        clap_complete::generate(clap_complete::Shell::Bash, &mut super::command(), "byoc-runner", &mut bash);
        let bash = String::from_utf8(bash).unwrap();
        assert!(bash.contains("approvals") && bash.contains("rejections"), "{bash}");
        let mut page = Vec::new();
        let mut cmd = super::command();
        cmd.build();
        super::man_page(&cmd, &mut page).unwrap();
        let page = String::from_utf8(page).unwrap();
        assert!(page.contains(".TH byoc-runner 8"), "{page}");
        assert!(page.contains("approvals") && !page.contains("sandbox\\-exec"), "{page}");
        for section in [
            ".SH NAME",
            ".SH SYNOPSIS",
            ".SH \"EXIT STATUS\"",
            ".SH ENVIRONMENT",
            ".SH FILES",
            ".SH \"SEE ALSO\"",
        ] {
            assert!(page.contains(section), "{section} missing: {page}");
        }
        let dir = tempfile::tempdir().unwrap();
        super::man(Some(dir.path())).unwrap();
        let show = std::fs::read_to_string(dir.path().join("byoc-runner-jobs-show.8")).unwrap();
        assert!(show.contains(".SH \"EXIT STATUS\"") && show.contains("\\fBbyoc\\-runner\\fR(8)"), "{show}");
        assert!(!dir.path().join("byoc-runner-sandbox-exec.8").exists());
    }

    /// Every visible command, recursively.
    fn visible(cmd: &clap::Command, path: String, out: &mut Vec<(String, clap::Command)>) {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
            let name = format!("{path} {}", sub.get_name()).trim().to_string();
            out.push((name.clone(), sub.clone()));
            visible(sub, name, out);
        }
    }

    #[test]
    fn the_help_is_grouped_short_described_and_exemplified() {
        let mut cmd = super::command();
        cmd.build();
        let top: Vec<&str> = cmd
            .get_subcommands()
            .filter(|s| !s.is_hide_set() && s.get_name() != "help")
            .map(|s| s.get_name())
            .collect();
        let grouped: Vec<&str> = super::GROUPS.iter().flat_map(|(_, names)| names.iter().copied()).collect();
        let mut sorted = grouped.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), grouped.len(), "a command in two groups");
        let mut want = top.clone();
        want.sort();
        assert_eq!(sorted, want, "every command in one group of the help");
        let mut all = Vec::new();
        visible(&cmd, String::new(), &mut all);
        let mut problems = Vec::new();
        for (name, sub) in &all {
            let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
            // "  NAME  ABOUT" in a parent's list fits 80 columns.
            let leaf = name.rsplit(' ').next().unwrap_or(name);
            if about.is_empty() || about.contains('\n') || 2 + leaf.len().max(12) + 1 + about.len() > 80 {
                problems.push(format!("{name}: the summary must be one line within 80 columns: {about:?}"));
            }
            let long = sub.get_long_about().map(|a| a.to_string()).unwrap_or_default();
            if sub.get_subcommands().next().is_none() && !long.contains("Example") {
                problems.push(format!("{name}: no example in its --help"));
            }
            for arg in sub.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = arg.get_id().as_str();
                if !["help", "version"].contains(&id) && arg.get_help().is_none() {
                    problems.push(format!("{name}: argument {id} has no description"));
                }
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        let help = cmd.render_help().to_string();
        for (title, _) in super::GROUPS {
            assert!(help.contains(title), "{help}");
        }
        assert!(help.lines().all(|l| l.chars().count() <= 100), "{help}");
    }
}
