//! The customer's role switches, read from the customer's side and never from a job:
//! the install stack (CloudFormation parameters `Enable<Key>Role`, role ARNs among its
//! outputs), or a local file for installs not managed by CloudFormation. Read afresh
//! before each job that asks for a role.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::model::{RoleDef, RoleType};

#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("reading install stack {stack}: {message}")]
    Stack { stack: String, message: String },
    #[error("reading install stack {stack}: {message}")]
    NoCredentials { stack: String, message: String },
    #[error(
        "install stack {stack} not found (is roles.stack_name right, and may the runner's instance role read it?)"
    )]
    StackMissing { stack: String },
    #[error("reading role switches {path}: {message}")]
    File { path: PathBuf, message: String },
}

/// One role's switch as the customer set it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Switch {
    pub enabled: bool,
    /// Not switched off but not there either: no ARN for it (or no entry at all).
    pub missing: bool,
    pub arn: Option<String>,
    /// Where the answer came from, for the customer (`stack parameter EnableXRole=false`).
    pub source: String,
    /// What to do to switch it on, when it is off.
    pub how_to_enable: Option<String>,
}

/// A stack's parameters and outputs, as read.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StackView {
    pub stack: String,
    pub parameters: BTreeMap<String, String>,
    pub outputs: BTreeMap<String, String>,
}

/// The local switches file (`[[role]]` entries keyed by the role's resolved name).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchFile {
    #[serde(default)]
    pub role: Vec<FileRole>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRole {
    pub name: String,
    #[serde(default)]
    pub arn: Option<String>,
    pub enabled: bool,
}

/// All the switches at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case")]
pub enum Snapshot {
    Stack(StackView),
    File {
        path: PathBuf,
        file: SwitchFile,
    },
    /// No switch source is configured: every role is off.
    None,
}

fn truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "yes" | "enabled" | "on" | "1")
}

/// The role name at the end of an IAM role ARN (`arn:aws:iam::1:role/path/name`).
pub fn arn_role_name(arn: &str) -> Option<&str> {
    let (head, resource) = arn.split_once(":role/")?;
    (head.starts_with("arn:") && head.contains(":iam:")).then(|| resource.rsplit('/').next()).flatten()
}

impl Snapshot {
    pub fn switch_for(&self, role: &RoleDef) -> Switch {
        let break_glass = role.role_type == RoleType::BreakGlass;
        match self {
            Snapshot::None => Switch {
                enabled: false,
                missing: true,
                arn: None,
                source: "no switch source configured".into(),
                how_to_enable: Some(
                    "set roles.stack_name (CloudFormation install stack) or roles.switches_file in runner.toml".into(),
                ),
            },
            Snapshot::File { path, file } => {
                let entry = file.role.iter().find(|r| r.name == role.name);
                let how = format!("set enabled = true and the role's arn for name = {:?} in {}", role.name, path.display());
                match entry {
                    None => Switch {
                        enabled: false,
                        missing: true,
                        arn: None,
                        source: format!("not listed in {}", path.display()),
                        how_to_enable: Some(how),
                    },
                    Some(e) => Switch {
                        enabled: e.enabled && e.arn.is_some(),
                        missing: e.enabled && e.arn.is_none(),
                        arn: e.arn.clone(),
                        source: format!("{} (enabled = {})", path.display(), e.enabled),
                        how_to_enable: (!(e.enabled && e.arn.is_some())).then_some(how),
                    },
                }
            }
            Snapshot::Stack(view) => {
                let param = format!("Enable{}Role", role.key);
                let arn_output =
                    view.outputs.iter().find(|(_, v)| arn_role_name(v) == Some(role.name.as_str()));
                let arn = arn_output.map(|(_, v)| v.clone());
                let how = format!(
                    "update install stack {} with parameter {param}=true (the stack then creates the role and outputs its ARN)",
                    view.stack
                );
                let (enabled, missing, source) = match (view.parameters.get(&param), arn_output) {
                    (Some(v), Some((out, _))) => {
                        (truthy(v), false, format!("stack parameter {param}={v}, ARN from output {out}"))
                    }
                    (Some(v), None) => (
                        false,
                        truthy(v),
                        format!("stack parameter {param}={v}, no ARN for it among the stack outputs"),
                    ),
                    (None, Some((out, _))) if break_glass => (
                        false,
                        false,
                        format!("break-glass roles are off unless stack parameter {param} is true (ARN in output {out})"),
                    ),
                    (None, Some((out, _))) => (true, false, format!("stack output {out}")),
                    (None, None) => (false, true, format!("absent from install stack {}", view.stack)),
                };
                Switch { enabled, missing, arn, source, how_to_enable: (!enabled).then_some(how) }
            }
        }
    }
}

/// Where switches are read from. A trait so tests can count reads and inject faults.
pub trait SwitchSource: Send + Sync {
    fn read(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Snapshot, SwitchError>> + Send + '_>>;
    fn describe(&self) -> String;
}

pub struct FileSource {
    pub path: PathBuf,
}

pub fn read_switch_file(path: &Path) -> Result<SwitchFile, SwitchError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| SwitchError::File { path: path.into(), message: e.to_string() })?;
    toml::from_str(&text)
        .map_err(|e| SwitchError::File { path: path.into(), message: e.message().to_string() })
}

impl SwitchSource for FileSource {
    fn read(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Snapshot, SwitchError>> + Send + '_>> {
        Box::pin(async move {
            Ok(Snapshot::File { path: self.path.clone(), file: read_switch_file(&self.path)? })
        })
    }
    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }
}

pub struct NoSource;

impl SwitchSource for NoSource {
    fn read(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Snapshot, SwitchError>> + Send + '_>> {
        Box::pin(async { Ok(Snapshot::None) })
    }
    fn describe(&self) -> String {
        "none".into()
    }
}

/// The install stack, read with CloudFormation DescribeStacks under the runner's own
/// identity (its instance role on EC2).
pub struct StackSource {
    pub client: aws_sdk_cloudformation::Client,
    pub stack: String,
}

impl SwitchSource for StackSource {
    fn read(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Snapshot, SwitchError>> + Send + '_>> {
        Box::pin(async move {
            let out = self.client.describe_stacks().stack_name(&self.stack).send().await.map_err(|e| {
                let said = super::aws_error_text(&e);
                if said.no_credentials {
                    SwitchError::NoCredentials { stack: self.stack.clone(), message: said.text }
                } else if said.text.contains("does not exist") {
                    SwitchError::StackMissing { stack: self.stack.clone() }
                } else {
                    SwitchError::Stack { stack: self.stack.clone(), message: said.text }
                }
            })?;
            let stack = out
                .stacks()
                .first()
                .ok_or_else(|| SwitchError::StackMissing { stack: self.stack.clone() })?;
            let parameters = stack
                .parameters()
                .iter()
                .filter_map(|p| Some((p.parameter_key()?.to_string(), p.parameter_value()?.to_string())))
                .collect();
            let outputs = stack
                .outputs()
                .iter()
                .filter_map(|o| Some((o.output_key()?.to_string(), o.output_value()?.to_string())))
                .collect();
            Ok(Snapshot::Stack(StackView { stack: self.stack.clone(), parameters, outputs }))
        })
    }
    fn describe(&self) -> String {
        format!("CloudFormation stack {}", self.stack)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn role(name: &str, key: &str, role_type: RoleType) -> RoleDef {
        RoleDef {
            name: name.into(),
            name_template: name.into(),
            role_type,
            key: key.into(),
            display_name: None,
            description: None,
            defined_in: "t".into(),
            policies: 0,
            plan_actions: Vec::new(),
        }
    }

    fn stack(params: &[(&str, &str)], outputs: &[(&str, &str)]) -> Snapshot {
        Snapshot::Stack(StackView {
            stack: "install-stack".into(),
            parameters: params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            outputs: outputs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        })
    }

    #[test]
    fn stack_parameters_and_outputs_decide() {
        let m = role("inst-1-maintenance", "Maintenance", RoleType::Maintenance);
        let arn = "arn:aws:iam::123456789012:role/inst-1-maintenance";
        let on = stack(&[("EnableMaintenanceRole", "true")], &[("MaintenanceRoleArn", arn)]).switch_for(&m);
        assert!(on.enabled && on.arn.as_deref() == Some(arn) && on.how_to_enable.is_none(), "{on:?}");
        let off = stack(&[("EnableMaintenanceRole", "false")], &[("MaintenanceRoleArn", arn)]).switch_for(&m);
        assert!(!off.enabled && !off.missing);
        assert!(off.source.contains("EnableMaintenanceRole=false"), "{}", off.source);
        assert!(off.how_to_enable.unwrap().contains("EnableMaintenanceRole=true"));
        // No parameter: the ARN's presence is the switch (the stack creates only enabled roles).
        assert!(stack(&[], &[("X", arn)]).switch_for(&m).enabled);
        let absent = stack(&[], &[]).switch_for(&m);
        assert!(!absent.enabled && absent.missing, "{absent:?}");
        // Switched on but the stack has no ARN for it: not usable.
        assert!(!stack(&[("EnableMaintenanceRole", "true")], &[]).switch_for(&m).enabled);
        // An ARN for a similarly named role is not this role's ARN.
        let other = "arn:aws:iam::123456789012:role/inst-1-maintenance-old";
        assert!(!stack(&[], &[("X", other)]).switch_for(&m).enabled);
        let with_path = "arn:aws:iam::123456789012:role/byoc/inst-1-maintenance";
        assert_eq!(stack(&[], &[("X", with_path)]).switch_for(&m).arn.as_deref(), Some(with_path));
    }

    #[test]
    fn break_glass_is_off_unless_switched_on() {
        let bg = role("inst-1-bg", "Bg", RoleType::BreakGlass);
        let arn = "arn:aws:iam::123456789012:role/inst-1-bg";
        let s = stack(&[], &[("BgRoleArn", arn)]).switch_for(&bg);
        assert!(!s.enabled && s.source.contains("off unless"), "{s:?}");
        assert!(stack(&[("EnableBgRole", "true")], &[("BgRoleArn", arn)]).switch_for(&bg).enabled);
        assert!(!stack(&[("EnableBgRole", "false")], &[("BgRoleArn", arn)]).switch_for(&bg).enabled);
    }

    #[tokio::test]
    async fn the_switches_file_is_read_strictly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("roles.toml");
        std::fs::write(
            &path,
            "[[role]]\nname = \"inst-1-maintenance\"\narn = \"arn:aws:iam::1:role/inst-1-maintenance\"\nenabled = true\n",
        )
        .unwrap();
        let source = FileSource { path: path.clone() };
        let m = role("inst-1-maintenance", "Maintenance", RoleType::Maintenance);
        assert!(source.read().await.unwrap().switch_for(&m).enabled);
        std::fs::write(&path, "[[role]]\nname = \"x\"\nenabled = true\nsurprise = 1\n").unwrap();
        let e = source.read().await.unwrap_err().to_string();
        assert!(e.contains("surprise") && e.contains("roles.toml"), "{e}");
        std::fs::remove_file(&path).unwrap();
        assert!(source.read().await.is_err());
    }

    #[test]
    fn file_switches_and_no_source() {
        let m = role("inst-1-maintenance", "Maintenance", RoleType::Maintenance);
        let file = SwitchFile {
            role: vec![FileRole {
                name: "inst-1-maintenance".into(),
                arn: Some("arn:aws:iam::1:role/x".into()),
                enabled: true,
            }],
        };
        let snap = Snapshot::File { path: "/etc/byoc-runner/roles.toml".into(), file };
        assert!(snap.switch_for(&m).enabled);
        let p = role("inst-1-provision", "Provision", RoleType::Provision);
        let s = snap.switch_for(&p);
        assert!(!s.enabled && s.missing && s.source.contains("not listed"), "{s:?}");
        assert!(!Snapshot::None.switch_for(&m).enabled);
    }
}
