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

use clap::{Parser, Subcommand, ValueEnum};

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
    after_help = "The inspection commands' options -o/--output, --state-dir and --config may also come \
                  before the command: byoc-runner -o json jobs list"
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
    /// Run the daemon (systemd's ExecStart).
    Run {
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Show the version, enrollment, the daemon (exit 3 when it is not running), its last
    /// contact with the control plane and a summary of jobs, from the state dir.
    ///
    /// Examples: byoc-runner status; byoc-runner status -o json | jq .contact
    Status(StateArgs),
    /// Print the runner's metrics in Prometheus text format (the same the daemon writes
    /// to `[metrics] textfile`), read from the state dir.
    Metrics(StateArgs),
    /// Inspect jobs recorded in the local journal.
    Jobs {
        #[command(subcommand)]
        cmd: jobs::JobsCmd,
    },
    /// Run a job file locally with no control plane (for vendors testing actions). Exit
    /// codes: the job's own, 124 timed out, 130 cancelled, 125 run-local itself failed.
    ///
    /// Example: byoc-runner run-local examples/jobs/hello.json
    RunLocal(run::LocalArgs),
    /// Print a shell completion script (the package installs bash, zsh and fish ones).
    ///
    /// Example: byoc-runner completions bash > /etc/bash_completion.d/byoc-runner
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), or with --dir write one page per command there
    /// (the package installs them in section 1).
    ///
    /// Example: byoc-runner man | man -l -
    Man {
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
    /// Inspect and verify the signed audit log (offline).
    Audit {
        #[command(subcommand)]
        cmd: audit::AuditCmd,
    },
    /// Pause the runner: it refuses new jobs (reason `paused`) until `resume`; running
    /// jobs finish. Survives restarts. Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner pause --reason "change freeze CHG-42"
    Pause {
        #[command(flatten)]
        state: StateArgs,
        /// Why (shown to the vendor in heartbeats and kept in the audit log).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Undo `pause`.
    Resume(StateArgs),
    /// The last drift check of each terraform workspace, kubernetes component and helm
    /// release: clean, drifted or violating, when, what drifted (addresses and
    /// attribute paths, never values), what a deploy would change. `drift run NAME`
    /// asks for a check now; `drift targets` lists what the runner can check.
    Drift {
        #[command(flatten)]
        state: StateArgs,
        #[command(subcommand)]
        action: Option<drift::DriftAction>,
    },
    /// The customer's secrets jobs wrote on this runner: name, version, keyed digest,
    /// where each was last written and by which job. Never a value (the runner keeps
    /// none).
    Secrets(StateArgs),
    /// List the jobs awaiting a local approval ([[guardrails.approval_rule]]): what
    /// each will do, under which rule, until when.
    Approvals {
        #[command(flatten)]
        state: StateArgs,
        #[command(subcommand)]
        action: Option<approvals::ApprovalsCmd>,
    },
    /// Approve a job awaiting approval: it runs. Audited with who and why. Needs root
    /// or roles.admin_group.
    ///
    /// Example: byoc-runner approvals show JOB && byoc-runner approve JOB --reason CHG-42
    Approve {
        #[command(flatten)]
        state: StateArgs,
        job_id: String,
        #[arg(long)]
        reason: Option<String>,
        /// A runner update: the version you approve (`approvals show JOB` shows it). The
        /// updater installs it, as root, only with your approval of that version.
        #[arg(long)]
        version: Option<String>,
    },
    /// Deny a job awaiting approval: it is refused (approval_denied) and never runs.
    /// Audited. Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner deny JOB --reason "not during the audit"
    Deny {
        #[command(flatten)]
        state: StateArgs,
        job_id: String,
        /// Why (kept in the audit log, reported to the vendor).
        #[arg(long)]
        reason: String,
    },
    /// List the lifecycle roles: enabled or not, ARN, where the switch came from, last
    /// assumed.
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
    /// Copy an OCI artifact (image, index, chart, module, and its referrers) between
    /// two registries with the engine `oci.sync` jobs use. Loopback registries are
    /// plain HTTP; others HTTPS. Secrets come from the environment or files, never argv.
    Sync(sync::SyncArgs),
    /// Check an app config directory as the runner and the install stack would load it.
    ///
    /// Example: byoc-runner app check ./my-app
    App {
        #[command(subcommand)]
        cmd: app::AppCmd,
    },
    /// The policies that decide plans and manifests: list them, or test an input.
    Policy {
        #[command(subcommand)]
        cmd: policy::PolicyCmd,
    },
    /// The terraform state this runner keeps for the install's workspaces (addresses
    /// and serials, never values).
    State {
        #[command(subcommand)]
        cmd: tfstate::TfStateCmd,
    },
    /// The runner's own updates: status, pin, unpin, rollback (docs/OPERATIONS.md).
    ///
    /// Example: byoc-runner update pin ">= 0.2.0, < 0.3.0"
    Update {
        #[command(subcommand)]
        cmd: update::UpdateCmd,
    },
    /// Configuration commands.
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

pub fn main() -> i32 {
    let args = hoist_common_options(std::env::args_os().collect());
    let cli = match Cli::try_parse_from(&args) {
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
            clap_complete::generate(
                shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "byoc-runner",
                &mut std::io::stdout(),
            );
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

/// The manual page from the command definitions: one page on stdout, or a page per
/// command (`byoc-runner-jobs-show.1`, …) in `dir`. Hidden internal commands have none.
fn man(dir: Option<&Path>) -> anyhow::Result<()> {
    let cmd = <Cli as clap::CommandFactory>::command();
    match dir {
        None => {
            let mut out = std::io::stdout().lock();
            clap_mangen::Man::new(cmd).render(&mut out)?;
        }
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            clap_mangen::generate_to(cmd, dir)?;
        }
    }
    Ok(())
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
        match std::fs::read(path) {
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
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut super::Cli::command(),
            "byoc-runner",
            &mut bash,
        );
        let bash = String::from_utf8(bash).unwrap();
        assert!(bash.contains("approvals") && bash.contains("rejections"), "{bash}");
        let mut page = Vec::new();
        clap_mangen::Man::new(super::Cli::command()).render(&mut page).unwrap();
        let page = String::from_utf8(page).unwrap();
        assert!(page.starts_with(".ie") || page.contains(".TH byoc-runner"), "{page}");
        assert!(page.contains("approvals") && !page.contains("sandbox\\-exec"), "{page}");
        let dir = tempfile::tempdir().unwrap();
        super::man(Some(dir.path())).unwrap();
        assert!(dir.path().join("byoc-runner-jobs-show.1").exists());
        assert!(!dir.path().join("byoc-runner-sandbox-exec.1").exists());
    }
}
