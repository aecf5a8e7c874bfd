//! Read-only until decided: the session a terraform job's processes get until the
//! customer's controls have allowed its plan. It is the role's, narrowed by STS session
//! policies (the session may do only what the role and these both allow): AWS's managed
//! `ReadOnlyAccess`, plus an inline policy with exactly what else planning needs here:
//! the state bucket's lock object of the job's workspace, the customer's secrets the job
//! names (the runner passes them to plan as variables) and the plan-time actions the
//! app declares for the role. Apply gets the role's full session; a plan-only job or a
//! drift check never does. docs/ROLES.md, "Read-only until decided".

use byoc_job_executors::terraform::state::Backend;

/// The managed policy every narrowed session carries, in the role's partition.
pub fn read_only_policy_arn(partition: &str) -> String {
    format!("arn:{partition}:iam::aws:policy/ReadOnlyAccess")
}

/// STS's limit on session policies' plain text (inline and managed together).
const MAX_POLICY_CHARS: usize = 2048;

/// What the narrowed session is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanScope {
    pub policy_arns: Vec<String>,
    /// The inline session policy; `None` when nothing beyond read-only is needed.
    pub policy: Option<String>,
    /// One line for the audit record and the job log.
    pub summary: String,
}

/// What planning needs beyond read-only, for one job.
pub struct Needs<'a> {
    /// The role's ARN (`arn:<partition>:iam::<account>:role/<name>`).
    pub role_arn: &'a str,
    /// Where the runner keeps the job's state (`None`: the job's own backend).
    pub backend: Option<&'a Backend>,
    pub workspace: Option<&'a str>,
    /// The Secrets Manager ids of the customer's secrets the job names.
    pub secret_ids: Vec<String>,
    pub region: Option<&'a str>,
    /// The app's `plan_actions` for the role.
    pub plan_actions: &'a [String],
}

/// The narrowed session for `needs`, or why none can be made (the job must not run
/// with more than this).
pub fn plan_scope(needs: &Needs<'_>) -> Result<PlanScope, String> {
    let mut parts = needs.role_arn.splitn(6, ':');
    let (Some("arn"), Some(partition), Some("iam"), Some(""), Some(account)) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(format!(
            "the role ARN {:?} is not arn:<partition>:iam::<account>:role/…",
            needs.role_arn
        ));
    };
    let mut statements = Vec::new();
    let mut summary = vec!["ReadOnlyAccess".to_string()];
    if let (Some(Backend::S3 { bucket, key_prefix, region, .. }), Some(workspace)) =
        (needs.backend, needs.workspace)
    {
        let key = format!("{}/{workspace}/terraform.tfstate", key_prefix.trim_matches('/'));
        statements.push(serde_json::json!({
            "Sid": "StateLock",
            "Effect": "Allow",
            "Action": ["s3:PutObject", "s3:DeleteObject"],
            "Resource": format!("arn:{partition}:s3:::{bucket}/{key}.tflock"),
        }));
        // A bucket encrypted with a KMS key: the state is read, and the lock written,
        // through S3 only.
        statements.push(serde_json::json!({
            "Sid": "StateKms",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": "*",
            "Condition": {"StringEquals": {"kms:ViaService": format!("s3.{region}.amazonaws.com")}},
        }));
        summary.push(format!("the state lock s3://{bucket}/{key}.tflock"));
    }
    if !needs.secret_ids.is_empty() {
        let region = needs.region.unwrap_or("*");
        let resources: Vec<String> = needs
            .secret_ids
            .iter()
            .map(|id| format!("arn:{partition}:secretsmanager:{region}:{account}:secret:{id}-??????"))
            .collect();
        statements.push(serde_json::json!({
            "Sid": "NamedSecrets",
            "Effect": "Allow",
            "Action": ["secretsmanager:GetSecretValue"],
            "Resource": resources,
        }));
        summary.push(format!("{} named secret(s)", needs.secret_ids.len()));
    }
    if !needs.plan_actions.is_empty() {
        statements.push(serde_json::json!({
            "Sid": "DeclaredPlanActions",
            "Effect": "Allow",
            "Action": needs.plan_actions,
            "Resource": "*",
        }));
        summary.push(format!("the app's plan_actions {}", needs.plan_actions.join(", ")));
    }
    let policy_arns = vec![read_only_policy_arn(partition)];
    let policy = (!statements.is_empty())
        .then(|| serde_json::json!({"Version": "2012-10-17", "Statement": statements}).to_string());
    let chars = policy.as_ref().map_or(0, String::len) + policy_arns.iter().map(String::len).sum::<usize>();
    if chars > MAX_POLICY_CHARS {
        return Err(format!(
            "the read-only session's policies come to {chars} characters, more than STS takes ({MAX_POLICY_CHARS}): \
             fewer plan_actions or named secrets"
        ));
    }
    Ok(PlanScope { policy_arns, policy, summary: summary.join(" + ") })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s3() -> Backend {
        Backend::S3 {
            bucket: "state-b".into(),
            region: "eu-west-1".into(),
            key_prefix: "inst-1/".into(),
            endpoint: None,
        }
    }

    #[test]
    fn the_narrowed_session_is_read_only_plus_exactly_the_state_lock_secrets_and_declared_actions() {
        let backend = s3();
        let actions = vec!["ec2:CreateNetworkInterface".to_string()];
        let scope = plan_scope(&Needs {
            role_arn: "arn:aws-us-gov:iam::123456789012:role/inst-1-maintenance",
            backend: Some(&backend),
            workspace: Some("api"),
            secret_ids: vec!["inst-1/secrets/db_password".into()],
            region: Some("eu-west-1"),
            plan_actions: &actions,
        })
        .expect("scope");
        assert_eq!(scope.policy_arns, vec!["arn:aws-us-gov:iam::aws:policy/ReadOnlyAccess"]);
        let policy: serde_json::Value =
            serde_json::from_str(scope.policy.as_deref().unwrap_or("")).expect("json");
        let statements = policy["Statement"].as_array().cloned().unwrap_or_default();
        let by_sid = |sid: &str| statements.iter().find(|s| s["Sid"] == sid).cloned().unwrap_or_default();
        assert_eq!(
            by_sid("StateLock")["Resource"],
            "arn:aws-us-gov:s3:::state-b/inst-1/api/terraform.tfstate.tflock"
        );
        assert_eq!(by_sid("StateLock")["Action"], serde_json::json!(["s3:PutObject", "s3:DeleteObject"]));
        assert_eq!(
            by_sid("NamedSecrets")["Resource"][0],
            "arn:aws-us-gov:secretsmanager:eu-west-1:123456789012:secret:inst-1/secrets/db_password-??????"
        );
        assert_eq!(by_sid("DeclaredPlanActions")["Action"][0], "ec2:CreateNetworkInterface");
        assert_eq!(
            by_sid("StateKms")["Condition"]["StringEquals"]["kms:ViaService"],
            "s3.eu-west-1.amazonaws.com"
        );
        // Nothing else is allowed: no statement grants anything but these.
        assert_eq!(statements.len(), 4);
    }

    #[test]
    fn local_state_and_nothing_declared_is_read_only_alone() {
        let backend = Backend::Local { root: "/var/lib/byoc-runner/tfstate".into() };
        let scope = plan_scope(&Needs {
            role_arn: "arn:aws:iam::123456789012:role/r",
            backend: Some(&backend),
            workspace: Some("api"),
            secret_ids: vec![],
            region: None,
            plan_actions: &[],
        })
        .expect("scope");
        assert_eq!(scope.policy, None);
        assert_eq!(scope.policy_arns, vec!["arn:aws:iam::aws:policy/ReadOnlyAccess"]);
    }

    #[test]
    fn what_cannot_be_narrowed_is_refused() {
        let refused = |arn: &str, actions: Vec<String>| {
            plan_scope(&Needs {
                role_arn: arn,
                backend: None,
                workspace: None,
                secret_ids: vec![],
                region: None,
                plan_actions: &actions,
            })
            .err()
            .unwrap_or_default()
        };
        assert!(refused("inst-1-maintenance", vec![]).contains("not arn:"));
        let many: Vec<String> = (0..200).map(|i| format!("ec2:CreateThing{i}")).collect();
        assert!(refused("arn:aws:iam::123456789012:role/r", many).contains("more than STS takes"));
    }
}
