//! HTTP client for the control plane's admin API (used by the CLI and the demo when
//! the control plane runs as its own process).

use anyhow::{Context as _, bail};
use reqwest::Client;

use crate::state::{EnqueueRequest, Faults, JobView};

pub struct AdminClient {
    base: String,
    token: String,
    http: Client,
}

impl AdminClient {
    pub fn new(base: &str, token: &str) -> anyhow::Result<Self> {
        Ok(AdminClient {
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
            http: Client::builder().build().context("building HTTP client")?,
        })
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> anyhow::Result<reqwest::Response> {
        let resp = req.bearer_auth(&self.token).send().await.context("calling the admin API")?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            bail!("admin API answered {status}: {body}");
        }
        Ok(resp)
    }

    pub async fn info(&self) -> anyhow::Result<serde_json::Value> {
        Ok(self.send(self.http.get(format!("{}/admin/info", self.base))).await?.json().await?)
    }

    pub async fn bootstrap_token(&self) -> anyhow::Result<String> {
        let v: serde_json::Value =
            self.send(self.http.post(format!("{}/admin/bootstrap-tokens", self.base))).await?.json().await?;
        v["bootstrap_token"].as_str().map(str::to_string).context("no bootstrap_token in answer")
    }

    pub async fn enqueue(&self, req: &EnqueueRequest) -> anyhow::Result<String> {
        let v: serde_json::Value =
            self.send(self.http.post(format!("{}/admin/jobs", self.base)).json(req)).await?.json().await?;
        v["job_id"].as_str().map(str::to_string).context("no job_id in answer")
    }

    pub async fn jobs(&self) -> anyhow::Result<Vec<JobView>> {
        Ok(self.send(self.http.get(format!("{}/admin/jobs", self.base))).await?.json().await?)
    }

    pub async fn job(&self, id: &str) -> anyhow::Result<JobView> {
        Ok(self.send(self.http.get(format!("{}/admin/jobs/{id}", self.base))).await?.json().await?)
    }

    pub async fn log(&self, id: &str) -> anyhow::Result<Vec<u8>> {
        Ok(self
            .send(self.http.get(format!("{}/admin/jobs/{id}/log", self.base)))
            .await?
            .bytes()
            .await?
            .to_vec())
    }

    pub async fn cancel(&self, id: &str) -> anyhow::Result<()> {
        self.send(self.http.post(format!("{}/admin/jobs/{id}/cancel", self.base))).await?;
        Ok(())
    }

    pub async fn set_faults(&self, f: &Faults) -> anyhow::Result<()> {
        self.send(self.http.put(format!("{}/admin/faults", self.base)).json(f)).await?;
        Ok(())
    }
}
