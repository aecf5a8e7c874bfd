//! First start: enroll with the bootstrap token (used once, never stored) and keep the
//! enrollment record; later starts read it.

use super::*;

pub(super) async fn enroll_if_needed(
    config: &Config,
    key: &ed25519_dalek::SigningKey,
) -> Result<Enrollment, DaemonError> {
    let state_dir = &config.runner.state_dir;
    if let Some(e) = identity::load_enrollment(state_dir)? {
        if e.install_id != config.runner.install_id {
            return Err(DaemonError::InstallMismatch {
                enrolled: e.install_id,
                configured: config.runner.install_id.clone(),
            });
        }
        return Ok(e);
    }
    let token = match (&config.runner.bootstrap_token_file, std::env::var(BOOTSTRAP_TOKEN_ENV)) {
        (_, Ok(t)) if !t.trim().is_empty() => t.trim().to_string(),
        (Some(path), _) => std::fs::read_to_string(path)
            .map_err(|e| DaemonError::BootstrapToken { path: path.display().to_string(), source: e })?
            .trim()
            .to_string(),
        _ => return Err(DaemonError::NoBootstrapToken),
    };
    let client = CpClient::new(&config.control_plane)?;
    let public_key = byoc_protocol::b64(key.verifying_key().as_bytes());
    let req = EnrollRequest {
        bootstrap_token: token,
        public_key: public_key.clone(),
        hostname: config.runner.hostname.clone().unwrap_or_else(hostname),
    };
    // Until it works or fails for good: without an identity there is nothing else to do.
    let policy = retry::Policy::new(config.poll.backoff_initial, config.poll.backoff_max);
    let enrolled = retry::retry(policy, &CancellationToken::new(), |_| async {
        match client.enroll(&req).await {
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, "Enrolling with the control plane failed ({e}); retrying.");
                Err(e)
            }
            done => Ok(done),
        }
    })
    .await;
    let resp = match enrolled {
        Retried::Done(Ok(r)) => r,
        Retried::Done(Err(ClientError::Unauthorized { body, .. })) => {
            return Err(DaemonError::EnrollmentRefused(body));
        }
        Retried::Done(Err(e)) | Retried::Exhausted(e) => return Err(e.into()),
        Retried::Stopped => unreachable!("the enrollment retry has no stop"),
    };
    if resp.install_id != config.runner.install_id {
        return Err(DaemonError::InstallMismatch {
            enrolled: resp.install_id,
            configured: config.runner.install_id.clone(),
        });
    }
    let e = Enrollment {
        runner_id: resp.runner_id,
        install_id: resp.install_id,
        control_plane_url: config.control_plane.url.to_string(),
        enrolled_at: unix_now(),
        public_key,
    };
    identity::save_enrollment(state_dir, &e)?;
    // The token is spent; do not leave it lying around where we can remove it.
    if let Some(path) = &config.runner.bootstrap_token_file
        && let Err(err) = std::fs::remove_file(path)
    {
        tracing::warn!(path = %path.display(), error = %err, "Could not remove the used bootstrap token file: {err}.");
    }
    tracing::info!(runner_id = %e.runner_id, "Enrolled with the control plane.");
    Ok(e)
}

fn hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "unknown".into())
}
