//! `byoc-control-plane`: run the reference control plane, or drive a running one
//! through its admin API.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use byoc_control_plane::admin::AdminClient;
use byoc_control_plane::{ControlPlane, ControlPlaneConfig, EnqueueRequest, Faults};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "byoc-control-plane",
    version,
    about = "Reference control plane for byoc-runner (loopback, in memory)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args)]
struct AdminArgs {
    /// Admin API base URL, as printed by `serve`.
    #[arg(long, env = "BYOC_CP_ADMIN_URL")]
    admin_url: String,
    /// Admin token, as printed by `serve`.
    #[arg(long, env = "BYOC_CP_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the runner API and the admin API; prints their addresses as one JSON line.
    Serve {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        #[arg(long, default_value = "127.0.0.1:0")]
        admin_listen: SocketAddr,
        #[arg(long, default_value = "inst-demo")]
        install_id: String,
        /// Longest a poll is held, seconds.
        #[arg(long, default_value_t = 30)]
        hold_secs: u64,
        #[arg(long, default_value_t = 60)]
        lease_secs: u64,
    },
    /// Create a one-time bootstrap token for enrolling a runner.
    BootstrapToken(AdminArgs),
    /// Enqueue a job. The spec is JSON, or @FILE.
    Enqueue {
        #[command(flatten)]
        admin: AdminArgs,
        #[arg(long)]
        kind: String,
        #[arg(long, default_value = "null")]
        spec: String,
        #[arg(long, default_value_t = 600)]
        timeout_secs: u64,
    },
    /// List jobs (JSON).
    Jobs(AdminArgs),
    /// Show one job (JSON).
    Job {
        #[command(flatten)]
        admin: AdminArgs,
        id: String,
    },
    /// Print a job's uploaded log.
    Log {
        #[command(flatten)]
        admin: AdminArgs,
        id: String,
    },
    /// Ask the runner to cancel a job.
    Cancel {
        #[command(flatten)]
        admin: AdminArgs,
        id: String,
    },
    /// Set fault switches (all unset switches are cleared).
    Faults {
        #[command(flatten)]
        admin: AdminArgs,
        #[arg(long)]
        down: bool,
        #[arg(long, default_value_t = 0.0)]
        error_rate: f64,
        #[arg(long, default_value_t = 0)]
        slow_ms: u64,
        #[arg(long, default_value_t = 0.0)]
        cut_rate: f64,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    let client = |a: &AdminArgs| AdminClient::new(&a.admin_url, &a.admin_token);
    match cli.cmd {
        Cmd::Serve { listen, admin_listen, install_id, hold_secs, lease_secs } => {
            let cp = ControlPlane::start(ControlPlaneConfig {
                runner_addr: listen,
                admin_addr: admin_listen,
                hold_max: Duration::from_secs(hold_secs),
                lease_secs,
                install_id,
                ..Default::default()
            })
            .await
            .context("starting the control plane")?;
            println!(
                "{}",
                serde_json::json!({
                    "runner_url": cp.runner_url(),
                    "admin_url": cp.admin_url(),
                    "admin_token": cp.admin_token(),
                    "install_id": cp.install_id(),
                    "public_key": cp.public_key_b64(),
                })
            );
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Cmd::BootstrapToken(a) => println!("{}", client(&a)?.bootstrap_token().await?),
        Cmd::Enqueue { admin, kind, spec, timeout_secs } => {
            let text = match spec.strip_prefix('@') {
                Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?,
                None => spec,
            };
            let spec: serde_json::Value = serde_json::from_str(&text).context("parsing --spec as JSON")?;
            let mut req = EnqueueRequest::new(&kind, spec);
            req.timeout_secs = timeout_secs;
            println!("{}", client(&admin)?.enqueue(&req).await?);
        }
        Cmd::Jobs(a) => println!("{}", serde_json::to_string_pretty(&client(&a)?.jobs().await?)?),
        Cmd::Job { admin, id } => {
            println!("{}", serde_json::to_string_pretty(&client(&admin)?.job(&id).await?)?)
        }
        Cmd::Log { admin, id } => {
            use std::io::Write as _;
            std::io::stdout().write_all(&client(&admin)?.log(&id).await?)?;
        }
        Cmd::Cancel { admin, id } => client(&admin)?.cancel(&id).await?,
        Cmd::Faults { admin, down, error_rate, slow_ms, cut_rate } => {
            client(&admin)?
                .set_faults(&Faults { down, error_rate, slow_ms, cut_rate, lose_log_acks: 0, fail_claims: 0 })
                .await?
        }
    }
    Ok(())
}
