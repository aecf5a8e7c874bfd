//! The instance's own end, read from the metadata service (`[lifecycle] watch`): a Spot
//! interruption notice (`spot/instance-action`) or an Auto Scaling termination
//! (`autoscaling/target-lifecycle-state` = `Terminated`, with a lifecycle hook).
//!
//! On either the runner hands over: it takes no new job (the drain a first SIGTERM
//! starts), lets running jobs finish until `margin` before the deadline, then stops
//! what still runs without reporting it, so that its lease runs out and the control
//! plane gives the job to another runner of the install. Once drained it completes the
//! Auto Scaling lifecycle action (when `[lifecycle]` names the group and hook) and exits
//! cleanly (the unit restarts only on failure). Jobs never reach the metadata service:
//! only the runner's own user does (`byoc-runner-imds.service`).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::config::{Config, LifecycleConfig};
use crate::runtime::Rt;

/// What the metadata service announced.
#[derive(Debug, Clone, PartialEq)]
pub struct Notice {
    /// `spot` or `autoscaling`.
    pub kind: &'static str,
    /// Spot's action (`terminate`, `stop`, `hibernate`) or `terminate`.
    pub action: String,
    /// When the instance goes (unix milliseconds).
    pub deadline_ms: u64,
}

/// IMDSv2 at the SDK's endpoint (`AWS_EC2_METADATA_SERVICE_ENDPOINT`, default
/// 169.254.169.254), never through a proxy.
pub struct Imds {
    http: reqwest::Client,
    base: String,
}

impl Imds {
    pub fn from_env() -> Result<Imds, String> {
        Imds::at(
            &std::env::var("AWS_EC2_METADATA_SERVICE_ENDPOINT")
                .unwrap_or_else(|_| "http://169.254.169.254".into()),
        )
    }

    pub fn at(base: &str) -> Result<Imds, String> {
        let base = base.trim_end_matches('/').to_string();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Imds { http, base })
    }

    /// A metadata path's text; `None` when it does not exist (404).
    pub async fn get(&self, path: &str) -> Result<Option<String>, String> {
        let token = self
            .http
            .put(format!("{}/latest/api/token", self.base))
            .header("x-aws-ec2-metadata-token-ttl-seconds", "60")
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("metadata token: {}", e.without_url()))?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        let r = self
            .http
            .get(format!("{}/latest/meta-data/{path}", self.base))
            .header("x-aws-ec2-metadata-token", token)
            .send()
            .await
            .map_err(|e| format!("{path}: {}", e.without_url()))?;
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let r = r.error_for_status().map_err(|e| format!("{path}: {}", e.without_url()))?;
        let text = r.text().await.map_err(|e| e.to_string())?;
        // Bounded, and cut between characters (`truncate` would panic inside one).
        Ok(Some(text.chars().take(4096).collect()))
    }
}

/// A notice, if the metadata service has one now.
pub async fn check(imds: &Imds, c: &LifecycleConfig, now_ms: u64) -> Result<Option<Notice>, String> {
    if let Some(text) = imds.get("spot/instance-action").await? {
        #[derive(serde::Deserialize)]
        struct Action {
            action: String,
            time: String,
        }
        let a: Action = serde_json::from_str(&text)
            .map_err(|e| format!("spot/instance-action is not what EC2 sends: {e}"))?;
        let deadline_ms = a
            .time
            .trim()
            .parse::<jiff::Timestamp>()
            .map(|t| t.as_millisecond().max(0) as u64)
            // A time we cannot read: the two minutes Spot gives.
            .unwrap_or(now_ms + 120_000);
        let action: String = a.action.chars().filter(|c| c.is_ascii_alphanumeric()).take(32).collect();
        return Ok(Some(Notice { kind: "spot", action, deadline_ms }));
    }
    if let Some(state) = imds.get("autoscaling/target-lifecycle-state").await?
        && state.trim() == "Terminated"
    {
        return Ok(Some(Notice {
            kind: "autoscaling",
            action: "terminate".into(),
            deadline_ms: now_ms + c.hook_timeout.as_millis() as u64,
        }));
    }
    Ok(None)
}

/// Watch until a notice comes; then drain, and cut what still runs `margin` before the
/// deadline. The notice is kept in `seen` for the stop (the lifecycle action).
pub fn spawn_watch(rt: &Rt, drain: CancellationToken, seen: Arc<OnceLock<Notice>>) {
    let c = rt.config.lifecycle.clone();
    if !c.watch {
        return;
    }
    let rt = rt.clone();
    tokio::spawn(async move {
        let imds = match Imds::from_env() {
            Ok(i) => i,
            Err(e) => {
                tracing::error!(error = %e, "Cannot watch the instance's lifecycle: {e}.");
                return;
            }
        };
        let mut tick = tokio::time::interval(c.poll);
        let mut failing = false;
        let notice = loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = drain.cancelled() => return,
            }
            match check(&imds, &c, rt.clock.now_ms()).await {
                Ok(Some(n)) => break n,
                Ok(None) => failing = false,
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "Reading the instance's lifecycle from the metadata service failed: {e}.");
                }
                Err(_) => {}
            }
        };
        let left_ms = notice.deadline_ms.saturating_sub(rt.clock.now_ms());
        tracing::warn!(
            kind = notice.kind,
            action = %notice.action,
            secs_left = left_ms / 1000,
            "The instance is being replaced: taking no new job, handing over what cannot finish."
        );
        rt.audit_or_log(
            crate::audit_records::note(
                "lifecycle_notice",
                format!(
                    "{} {} at {}: draining; jobs still running {} s before are stopped and left to another runner",
                    notice.kind,
                    notice.action,
                    crate::clock::rfc3339_ms(notice.deadline_ms),
                    c.margin.as_secs()
                ),
            ),
            "the lifecycle notice",
        );
        let _ = seen.set(notice.clone());
        drain.cancel();
        let cut = Duration::from_millis(left_ms.saturating_sub(c.margin.as_millis() as u64));
        tokio::time::sleep(cut).await;
        // What is still running is not reported: its lease runs out and the control
        // plane gives it to another runner. Reporting stops first, so no cut job's
        // result slips out.
        tracing::warn!("The instance's deadline is near: stopping the jobs still running, unreported.");
        rt.stop_reporting.cancel();
        rt.abort.cancel();
    });
}

/// Tell Auto Scaling the instance may go (`CompleteLifecycleAction`, `CONTINUE`), under
/// the runner's own identity. Returns what to audit.
pub async fn complete_lifecycle_action(config: &Config) -> Result<String, String> {
    let c = &config.lifecycle;
    let (Some(group), Some(hook)) = (&c.autoscaling_group, &c.lifecycle_hook) else {
        return Err("no lifecycle.autoscaling_group and lifecycle_hook configured".into());
    };
    let imds = Imds::from_env()?;
    let instance = imds.get("instance-id").await?.ok_or("the metadata service has no instance-id")?;
    let region = config.aws.region.clone().ok_or("aws.region is needed to complete the lifecycle action")?;
    let url = match config
        .aws
        .endpoint_url
        .clone()
        .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok().filter(|u| !u.is_empty()))
    {
        Some(e) => format!("{}/", e.trim_end_matches('/')),
        None => format!("https://autoscaling.{region}.amazonaws.com/"),
    };
    let body = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("Action", "CompleteLifecycleAction")
        .append_pair("Version", "2011-01-01")
        .append_pair("AutoScalingGroupName", group)
        .append_pair("LifecycleHookName", hook)
        .append_pair("InstanceId", instance.trim())
        .append_pair("LifecycleActionResult", "CONTINUE")
        .finish();
    let identity = crate::audit_export::AwsIdentity::from_config(config).await?;
    let keys = identity.keys().await.map_err(|e| e.0)?;
    let headers = byoc_job_executors::aws_sign::signed_headers(
        &keys.identity(),
        &byoc_job_executors::aws_sign::Request {
            region: &region,
            service: "autoscaling",
            method: "POST",
            url: &url,
            headers: &[("content-type", "application/x-www-form-urlencoded; charset=utf-8")],
            body: body.as_bytes(),
            payload_hash_header: false,
            time: SystemTime::now(),
        },
    )?;
    let http =
        reqwest::Client::builder().timeout(Duration::from_secs(30)).build().map_err(|e| e.to_string())?;
    let mut req = http.post(&url).body(body);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let resp = req.send().await.map_err(|e| byoc_oci_sync::client::error_chain(&e))?;
    let status = resp.status().as_u16();
    let answer = resp.bytes().await.unwrap_or_default();
    if !(200..300).contains(&status) {
        return Err(format!(
            "CompleteLifecycleAction: HTTP {status} {}",
            crate::audit_export::answer_text(&answer)
        ));
    }
    Ok(format!("{group}/{hook}: {} may terminate (CONTINUE)", instance.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use byoc_control_plane::imds::FakeImds;

    #[tokio::test]
    async fn notices_are_read_as_ec2_words_them() {
        let fake = FakeImds::start().await.unwrap();
        let imds = Imds::at(&fake.url).unwrap();
        let c = LifecycleConfig { hook_timeout: Duration::from_secs(300), ..Default::default() };
        let now = 1_800_000_000_000;
        assert_eq!(check(&imds, &c, now).await.unwrap(), None, "in service, no Spot notice");
        fake.target_lifecycle_state("Terminated");
        assert_eq!(
            check(&imds, &c, now).await.unwrap(),
            Some(Notice { kind: "autoscaling", action: "terminate".into(), deadline_ms: now + 300_000 })
        );
        // A Spot notice wins, with the deadline it names.
        fake.spot_notice("stop", 1_800_000_120);
        assert_eq!(
            check(&imds, &c, now).await.unwrap(),
            Some(Notice { kind: "spot", action: "stop".into(), deadline_ms: 1_800_000_120_000 })
        );
        // Nothing listens: an error, never a notice.
        drop(fake);
        assert!(check(&Imds::at("http://127.0.0.1:9").unwrap(), &c, now).await.is_err());
    }
}
