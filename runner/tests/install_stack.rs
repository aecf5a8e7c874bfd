//! The CloudFormation install stack (`ami/install-stack.yaml`): cfn-lint clean, in step
//! with the user-data script it embeds, hardened as promised (checked on the template
//! itself, since moto does not model launch-template options), and created in moto with
//! the outputs the runner's stack reader uses: a real runner then gets the roles the
//! customer switched on and is refused the ones switched off.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use byoc_control_plane::moto::MotoServer;
use byoc_protocol::RejectReason;
use common::roles::*;
use common::*;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The template as JSON (it uses no YAML tags, so a plain YAML load is exact).
fn template() -> serde_json::Value {
    template_at(&repo().join("ami/install-stack.yaml"))
}

#[test]
fn cfn_lint_passes_and_the_template_embeds_the_current_user_data() {
    let lint = Command::new(venv_bin("cfn-lint"))
        .arg(repo().join("ami/install-stack.yaml"))
        .output()
        .expect("cfn-lint in the project's .venv (scripts/setup)");
    assert!(
        lint.status.success(),
        "cfn-lint: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    let check = Command::new(venv_bin("python"))
        .arg(repo().join("ami/render-install-stack"))
        .arg("--check")
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
}

/// Characters that are syntax in a shell or in TOML.
const SYNTAX: [char; 7] = ['\'', '"', '\\', '$', '`', '\n', '\r'];

/// Whether a string matching `pattern` (CloudFormation's AllowedPattern: the whole
/// value) can hold one of `SYNTAX`: every literal and class of its syntax tree checked.
fn pattern_admits_syntax(pattern: &str) -> bool {
    use regex_syntax::hir::{Class, Hir, HirKind};
    fn walk(h: &Hir) -> bool {
        match h.kind() {
            HirKind::Literal(l) => String::from_utf8_lossy(&l.0).chars().any(|c| SYNTAX.contains(&c)),
            HirKind::Class(Class::Unicode(u)) => {
                u.ranges().iter().any(|r| SYNTAX.iter().any(|&c| r.start() <= c && c <= r.end()))
            }
            HirKind::Class(Class::Bytes(b)) => b.ranges().iter().any(|r| {
                SYNTAX.iter().any(|&c| (c as u32) >= r.start() as u32 && (c as u32) <= r.end() as u32)
            }),
            HirKind::Repetition(r) => walk(&r.sub),
            HirKind::Capture(c) => walk(&c.sub),
            HirKind::Concat(v) | HirKind::Alternation(v) => v.iter().any(walk),
            HirKind::Empty | HirKind::Look(_) => false,
        }
    }
    walk(&regex_syntax::parse(pattern).unwrap_or_else(|e| panic!("{pattern}: {e}")))
}

/// CloudFormation parameters reach the instance as data: every parameter the UserData
/// names has a pattern (or a list of values) that admits no quote, backslash, dollar
/// sign, backtick or newline, and the names appear only inside the quoted
/// here-document the script reads as NAME=value lines.
#[test]
fn no_parameter_the_user_data_reads_can_carry_shell_or_toml_syntax() {
    let t = template();
    let lt = &t["Resources"]["RunnerLaunchTemplate"]["Properties"]["LaunchTemplateData"];
    let sub = lt["UserData"]["Fn::Base64"]["Fn::Sub"].as_str().unwrap();
    let (head, rest) = sub.split_once("<<'BYOC_PARAMS_END'\n").expect("a quoted here-document");
    let (params, script) = rest.split_once("\nBYOC_PARAMS_END\n").expect("its end");
    assert!(!head.contains("${") && !script.contains("${"), "a parameter outside the here-document");
    let mut checked = 0;
    for line in params.lines() {
        let (name, value) = line.split_once('=').unwrap_or_else(|| panic!("{line:?} is not NAME=value"));
        assert!(name.starts_with("BYOC_"), "{line}");
        for reference in value.split("${").skip(1) {
            let param = reference.split('}').next().unwrap().split('.').next().unwrap();
            if param.starts_with("AWS::") || t["Resources"].get(param).is_some() {
                continue; // the stack's own names and ARNs
            }
            let p = &t["Parameters"][param];
            assert!(p.is_object(), "{param} is not a parameter");
            if let Some(values) = p["AllowedValues"].as_array() {
                // (YAML reads `off` as a boolean: its text is what CloudFormation passes.)
                let text =
                    |v: &serde_json::Value| v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string());
                assert!(values.iter().all(|v| !text(v).contains(SYNTAX)), "{param}");
            } else {
                let pattern =
                    p["AllowedPattern"].as_str().unwrap_or_else(|| panic!("{param} has no AllowedPattern"));
                assert!(
                    !pattern_admits_syntax(pattern),
                    "{param}'s pattern {pattern} admits shell or TOML syntax"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 13, "only {checked} parameters found in the here-document");
    // The one the issue was found with, as Fn::Sub would substitute it.
    let url = regex_syntax::parse(&format!(
        "^(?:{})$",
        t["Parameters"]["ControlPlaneUrl"]["AllowedPattern"].as_str().unwrap()
    ))
    .unwrap();
    assert!(pattern_admits_syntax("https://.+"), "the checker sees the old pattern's hole");
    drop(url);
}

#[test]
fn the_template_is_hardened_as_promised() {
    let t = template();
    let r = &t["Resources"];
    let lt = &r["RunnerLaunchTemplate"]["Properties"]["LaunchTemplateData"];
    assert_eq!(lt["MetadataOptions"]["HttpTokens"], "required", "IMDSv2 only");
    assert_eq!(lt["MetadataOptions"]["HttpPutResponseHopLimit"], 1);
    assert_eq!(lt["BlockDeviceMappings"][0]["Ebs"]["Encrypted"], true);
    assert_eq!(lt["NetworkInterfaces"][0]["AssociatePublicIpAddress"], false);
    let sg = &r["RunnerSecurityGroup"]["Properties"];
    assert!(sg.get("SecurityGroupIngress").is_none(), "no inbound rule");
    let egress = sg["SecurityGroupEgress"].as_array().unwrap();
    assert_eq!(egress.len(), 1);
    assert_eq!((egress[0]["FromPort"].as_i64(), egress[0]["ToPort"].as_i64()), (Some(443), Some(443)));
    // The bootstrap token lives in Secrets Manager; user-data only names the secret.
    let user_data = lt["UserData"]["Fn::Base64"]["Fn::Sub"].as_str().unwrap();
    assert!(!user_data.contains("${BootstrapToken}"));
    assert!(user_data.contains("\nBYOC_BOOTSTRAP_SECRET=${BootstrapSecret}\n"));
    assert_eq!(r["BootstrapSecret"]["Properties"]["SecretString"]["Ref"], "BootstrapToken");
    assert_eq!(t["Parameters"]["BootstrapToken"]["NoEcho"], true);
    // The admin group is the customer's choice, root only by default, a plain name.
    assert_eq!(t["Parameters"]["AdminGroup"]["Default"], "");
    assert!(t["Parameters"]["AdminGroup"]["AllowedPattern"].as_str().is_some_and(|p| p.contains("a-z")));
    // One or two runners in an Auto Scaling group, each instance waited for (its
    // runner's signal) and held on termination until its runner has drained.
    assert_eq!(t["Parameters"]["RunnerCount"]["AllowedValues"], serde_json::json!([1, 2]));
    assert_eq!(t["Parameters"]["RunnerCount"]["Default"], 1);
    let group = &r["RunnerGroup"];
    assert_eq!(group["Type"], "AWS::AutoScaling::AutoScalingGroup");
    assert_eq!(group["CreationPolicy"]["ResourceSignal"]["Count"]["Ref"], "RunnerCount");
    assert_eq!(group["UpdatePolicy"]["AutoScalingRollingUpdate"]["WaitOnResourceSignals"], true);
    for size in ["MinSize", "MaxSize", "DesiredCapacity"] {
        assert_eq!(group["Properties"][size]["Ref"], "RunnerCount", "{size}");
    }
    let hook = &group["Properties"]["LifecycleHookSpecificationList"][0];
    assert_eq!(hook["LifecycleTransition"], "autoscaling:EC2_INSTANCE_TERMINATING");
    assert_eq!(hook["DefaultResult"], "CONTINUE");
    // The runner drains within the hook's wait (its own default, which user-data keeps).
    assert_eq!(hook["HeartbeatTimeout"], 300);
    assert!(
        user_data.contains(&format!("BYOC_LIFECYCLE_HOOK={}\n", hook["LifecycleHookName"].as_str().unwrap()))
    );
    assert!(user_data.contains("BYOC_AUTOSCALING_GROUP=${InstallId}-byoc-runners\n"));
    assert_eq!(group["Properties"]["AutoScalingGroupName"]["Fn::Sub"], "${InstallId}-byoc-runners");
    assert!(user_data.contains("BYOC_SIGNAL_RESOURCE=RunnerGroup\n"));
    // The subnet is the group's: a launch template's would conflict with it.
    assert!(lt["NetworkInterfaces"][0].get("SubnetId").is_none());
    assert!(group["Properties"]["VPCZoneIdentifier"][0].get("Fn::If").is_some());
    // The runner's identity: assume the install's roles, read its own stack and secret.
    let statements = r["RunnerInstanceRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
        .as_array()
        .unwrap()
        .clone();
    // The audit copy's statements exist only with a copy configured (Fn::If).
    let (conditional, statements): (Vec<_>, Vec<_>) =
        statements.into_iter().partition(|s| s.get("Fn::If").is_some());
    let actions_of = |s: &serde_json::Value| -> Vec<String> {
        s["Action"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect()
    };
    let actions: Vec<String> = statements.iter().flat_map(actions_of).collect();
    assert_eq!(
        actions,
        [
            "sts:AssumeRole",
            "sts:TagSession",
            "sts:SetSourceIdentity",
            "cloudformation:DescribeStacks",
            "cloudformation:SignalResource",
            "secretsmanager:GetSecretValue",
            "autoscaling:CompleteLifecycleAction"
        ]
    );
    assert_eq!(statements[1]["Resource"]["Ref"], "AWS::StackId");
    // Only its own group's lifecycle actions.
    assert!(
        statements[4]["Resource"]["Fn::Sub"]
            .as_str()
            .is_some_and(|arn| arn.ends_with(":autoScalingGroupName/${InstallId}-byoc-runners")),
        "{}",
        statements[4]
    );
    let audit: Vec<(String, Vec<String>)> = conditional
        .iter()
        .map(|s| {
            let branches = s["Fn::If"].as_array().unwrap();
            assert_eq!(branches[2]["Ref"], "AWS::NoValue", "nothing without the condition");
            let effect = branches[1]["Effect"].as_str().unwrap();
            (format!("{effect} {}", branches[0].as_str().unwrap()), actions_of(&branches[1]))
        })
        .collect();
    assert_eq!(
        audit,
        [
            ("Allow AuditToS3".to_string(), vec!["s3:PutObject".to_string(), "s3:GetObject".to_string()]),
            // Create-only (If-None-Match): nothing written can be replaced.
            ("Deny AuditToS3".to_string(), vec!["s3:PutObject".to_string()]),
            (
                "Allow CreateAuditBucket".to_string(),
                vec!["kms:GenerateDataKey".to_string(), "kms:Decrypt".to_string()]
            ),
            (
                "Allow AuditToLogs".to_string(),
                vec!["logs:CreateLogStream".to_string(), "logs:PutLogEvents".to_string()]
            ),
        ],
        "the copy is written, never deleted"
    );
    // The bucket the stack creates keeps every object for the retention, whoever asks.
    let bucket = &r["AuditBucketStore"];
    assert_eq!(bucket["Condition"], "CreateAuditBucket");
    assert_eq!(bucket["Properties"]["ObjectLockEnabled"], true);
    assert_eq!(
        bucket["Properties"]["ObjectLockConfiguration"]["Rule"]["DefaultRetention"]["Mode"],
        "COMPLIANCE"
    );
    assert_eq!(bucket["Properties"]["VersioningConfiguration"]["Status"], "Enabled");
    assert_eq!(
        bucket["Properties"]["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
            ["KMSMasterKeyID"]["Fn::GetAtt"][0],
        "AuditKey"
    );
    assert_eq!(bucket["DeletionPolicy"], "Retain");
    assert!(user_data.contains("BYOC_AUDIT_BUCKET=${AuditBucket}\n"));
    assert_eq!(t["Parameters"]["AuditBucket"]["Default"], "", "no copy unless the customer asks");
    // Every lifecycle role: created only when switched on, trusting only the runner's
    // role with the ExternalId, its ARN an output under the same condition.
    for (key, default) in [
        ("Provision", "true"),
        ("Maintenance", "true"),
        ("Deprovision", "false"),
        ("EksUpgrade", "false"),
        ("S3ObjectBreakGlass", "false"),
    ] {
        assert_eq!(t["Parameters"][format!("Enable{key}Role")]["Default"], default, "{key}");
        let role = &r[format!("{key}Role")];
        assert_eq!(role["Condition"], format!("{key}On"));
        let trust = &role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0];
        assert_eq!(trust["Principal"]["AWS"]["Fn::GetAtt"][0], "RunnerInstanceRole");
        assert_eq!(trust["Condition"]["StringEquals"]["sts:ExternalId"]["Ref"], "ExternalId");
        assert_eq!(t["Outputs"][format!("{key}RoleArn")]["Condition"], format!("{key}On"));
    }
    // Each role carries what the example app's role file gives it.
    let props = |key: &str| &r[format!("{key}Role")]["Properties"];
    assert_eq!(
        props("Provision")["ManagedPolicyArns"][0]["Fn::Sub"],
        "arn:${AWS::Partition}:iam::aws:policy/PowerUserAccess"
    );
    assert_eq!(props("Maintenance")["PermissionsBoundary"]["Ref"], "MaintenanceBoundary");
    assert_eq!(r["MaintenanceBoundary"]["Type"], "AWS::IAM::ManagedPolicy");
    assert_eq!(r["MaintenanceBoundary"]["Condition"], "MaintenanceOn");
    assert_eq!(props("Maintenance")["Policies"][0]["PolicyName"]["Fn::Sub"], "${InstallId}-ecr-push");
    // Besides what the app gives them, every lifecycle role may use its install's state.
    for key in ["Provision", "Maintenance", "Deprovision", "EksUpgrade", "S3ObjectBreakGlass"] {
        let managed = props(key)["ManagedPolicyArns"].as_array().unwrap();
        assert!(managed.iter().any(|m| m["Ref"] == "StateAccess"), "{key}: {managed:?}");
    }
    assert_eq!(props("Maintenance")["ManagedPolicyArns"].as_array().unwrap().len(), 1, "only StateAccess");
    assert!(props("EksUpgrade").get("PermissionsBoundary").is_none(), "no boundary in eks_upgrade.toml");
    assert_eq!(props("S3ObjectBreakGlass")["Policies"][0]["PolicyName"], "s3-object-operations");

    // The terraform state bucket: kept when the stack goes, versioned, encrypted, never
    // public, TLS only, its name an output the user-data writes into runner.toml.
    let bucket = &r["StateBucket"];
    assert_eq!(bucket["DeletionPolicy"], "Retain");
    let b = &bucket["Properties"];
    assert_eq!(b["VersioningConfiguration"]["Status"], "Enabled");
    assert_eq!(
        b["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]["SSEAlgorithm"],
        "AES256"
    );
    for k in ["BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets"] {
        assert_eq!(b["PublicAccessBlockConfiguration"][k], true, "{k}");
    }
    let tls = &r["StateBucketPolicy"]["Properties"]["PolicyDocument"]["Statement"][0];
    assert_eq!(
        (tls["Effect"].as_str(), tls["Condition"]["Bool"]["aws:SecureTransport"].as_str()),
        (Some("Deny"), Some("false"))
    );
    assert_eq!(t["Outputs"]["StateBucketName"]["Value"]["Ref"], "StateBucket");
    assert!(user_data.contains("BYOC_STATE_BUCKET=${StateBucket}\n"));
    // The roles reach only their install's keys.
    let access = &r["StateAccess"]["Properties"]["PolicyDocument"]["Statement"];
    assert_eq!(access[1]["Resource"]["Fn::Sub"], "${StateBucket.Arn}/${InstallId}/*");
}

fn render_stack(app: &Path, out: &Path) -> std::process::Output {
    Command::new(venv_bin("python"))
        .arg(repo().join("ami/render-install-stack"))
        .arg("--app")
        .arg(app)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

fn write_app(dir: &Path, files: &[(&str, &str)]) {
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

/// Another app's role files make another stack: its own switches, defaults, policies,
/// boundary and outputs, valid for cfn-lint and for CloudFormation (moto), with switch
/// parameters named exactly as the runner's stack reader looks them up.
#[tokio::test]
async fn the_install_stack_is_generated_from_the_apps_role_files() {
    let dir = tempfile::tempdir().unwrap();
    let app = dir.path().join("app");
    let names = [
        "{{ .nuon.install.id }}-operate",
        "{{.install.id}}-db-admin",
        "{{.install.id}}-rotate-keys",
        "{{.install.id}}-wipe-bucket-role",
    ];
    write_app(
        &app,
        &[
            (
                "permissions/maintenance.toml",
                &format!(
                    r#"type = "maintenance"
name = "{}"
display_name = "Operate"
description = "Day-2 changes"
permissions_boundary = "./boundary.json"

[[policies]]
managed_policy_name = "ReadOnlyAccess"

[[policies]]
name = "{{{{.install.id}}}}-logs"
contents = """
{{"Version": "2012-10-17", "Statement": [{{"Effect": "Allow", "Action": "s3:PutObject",
  "Resource": "arn:aws:s3:::{{{{.install.id}}}}-logs/${{aws:username}}/*",
  "Condition": {{"StringEquals": {{"aws:RequestedRegion": "{{{{.cloud_account.aws.region}}}}"}}}}}}]}}
"""
"#,
                    names[0]
                ),
            ),
            (
                "permissions/db_admin.toml",
                &format!(
                    "type = \"custom\"\nname = \"{}\"\n\n[[policies]]\nmanaged_policy_name = \"arn:aws:iam::aws:policy/AmazonRDSFullAccess\"\n",
                    names[1]
                ),
            ),
            (
                "break_glass.toml",
                &format!(
                    "[[role]]\nname = \"{}\"\n[[role.policies]]\nmanaged_policy_name = \"IAMFullAccess\"\n\n[[role]]\nname = \"{}\"\n[[role.policies]]\nmanaged_policy_name = \"AmazonS3FullAccess\"\n",
                    names[2], names[3]
                ),
            ),
            (
                "boundary.json",
                r#"{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}"#,
            ),
        ],
    );
    let out = dir.path().join("stack.yaml");
    let rendered = render_stack(&app, &out);
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let lint = Command::new(venv_bin("cfn-lint")).arg(&out).output().unwrap();
    assert!(lint.status.success(), "cfn-lint: {}", String::from_utf8_lossy(&lint.stdout));

    let t = template_at(&out);
    // Switches named as the runner derives them, with the promised defaults.
    let expected =
        [("Operate", "true"), ("DbAdmin", "false"), ("RotateKeys", "false"), ("WipeBucket", "false")];
    for (name, (key, default)) in names.iter().zip(expected) {
        assert_eq!(byoc_runner::roles::model::switch_key(name), key);
        assert_eq!(t["Parameters"][format!("Enable{key}Role")]["Default"], default, "{key}");
        assert_eq!(t["Outputs"][format!("{key}RoleArn")]["Condition"], format!("{key}On"));
    }
    assert!(t["Parameters"].get("EnableProvisionRole").is_none(), "this app has no provision role");
    let group = t["Metadata"]["AWS::CloudFormation::Interface"]["ParameterGroups"][4]["Parameters"].clone();
    assert_eq!(
        group,
        serde_json::json!([
            "AdminGroup",
            "RunnerUpdates",
            "EnableOperateRole",
            "EnableDbAdminRole",
            "EnableRotateKeysRole",
            "EnableWipeBucketRole"
        ])
    );
    let r = &t["Resources"];
    let operate = &r["OperateRole"]["Properties"];
    assert_eq!(operate["PermissionsBoundary"]["Ref"], "OperateBoundary");
    assert_eq!(r["OperateBoundary"]["Properties"]["PolicyDocument"]["Statement"][0]["Action"], "s3:*");
    let statement = &operate["Policies"][0]["PolicyDocument"]["Statement"][0];
    // Templates become Fn::Sub variables; the IAM policy variable stays literal.
    assert_eq!(statement["Resource"]["Fn::Sub"], "arn:aws:s3:::${InstallId}-logs/${!aws:username}/*");
    assert_eq!(statement["Condition"]["StringEquals"]["aws:RequestedRegion"]["Fn::Sub"], "${AWS::Region}");
    assert_eq!(operate["Policies"][0]["PolicyName"]["Fn::Sub"], "${InstallId}-logs");
    assert_eq!(
        r["DbAdminRole"]["Properties"]["ManagedPolicyArns"][0],
        "arn:aws:iam::aws:policy/AmazonRDSFullAccess"
    );

    // CloudFormation creates exactly the roles switched on.
    let moto = MotoServer::start().await;
    let described = create_stack(
        &moto,
        "byoc-generated",
        &t,
        "inst-gen",
        &[("EnableDbAdminRole", "true"), ("EnableWipeBucketRole", "true")],
    )
    .await;
    assert!(described.contains("CREATE_COMPLETE"), "{described}");
    for on in ["operate", "db-admin", "wipe-bucket-role"] {
        assert!(described.contains(&format!(":role/inst-gen-{on}<")), "{on} is switched on: {described}");
    }
    assert!(!described.contains(":role/inst-gen-rotate-keys<"), "rotate-keys is off by default");
}

/// Role files the stack cannot honour are refused with every problem named, and nothing
/// is written.
#[test]
fn role_files_the_stack_cannot_honour_are_refused_with_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let app = dir.path().join("app");
    write_app(
        &app,
        &[
            (
                "permissions/a.toml",
                "type = \"maintenance\"\nname = \"shared-maintenance\"\npermissions_boundary = \"./missing.json\"\n",
            ),
            (
                "permissions/b.toml",
                "type = \"custom\"\nname = \"{{.install.id}}-{{.install.public_domain}}-ops\"\n",
            ),
            (
                "permissions/c.toml",
                "type = \"custom\"\nname = \"{{.install.id}}-tools\"\n[[policies]]\nmanaged_policy_name = \"X\"\ncontents = \"{}\"\n",
            ),
            ("permissions/d.toml", "type = \"custom\"\nname = \"{{.install.id}}-ops-role\"\n"),
            ("permissions/e.toml", "type = \"owner\"\nname = \"{{.install.id}}-owner\"\n"),
            ("permissions/f.toml", "type = \"custom\"\nname = \"{{.install.id}}-{{ .x | upper }}-f\"\n"),
            (
                "permissions/g.toml",
                "type = \"custom\"\nname = \"g\"\n[[policies]]\nname = \"p\"\ncontents = \"../outside.json\"\n[[policies]]\nname = \"q\"\ncontents = \"./policies/missing.json\"\n",
            ),
            ("permissions.toml", "[maintenance_role]\nname = \"m\"\n"),
        ],
    );
    assert_refused(
        dir.path(),
        &app,
        &[
            "a.toml: permissions_boundary ./missing.json not found",
            "b.toml: name: template field .install.public_domain is not known to the stack",
            "c.toml: policies[0]: needs managed_policy_name, or name and contents",
            "d.toml: switch key Ops (parameter EnableOpsRole) is also used by",
            "e.toml: type must be one of",
            "f.toml: name: unsupported template in '{{.install.id}}-{{ .x | upper }}-f' (only field references)",
            "g.toml: policies[0].contents: '../outside.json' leaves the app's directory",
            "g.toml: policies[1].contents: './policies/missing.json' is not a file of the app",
            "permissions.toml and permissions/*.toml: use one layout, not both",
        ],
    );
}

/// The modelled system's single-file layout, policy documents kept in files, role names
/// without the install id and template fields the install link gives: the stack takes
/// them all, and the runner's identity may assume exactly the roles it defines.
#[tokio::test]
async fn a_single_file_app_with_free_role_names_makes_a_stack_that_creates() {
    let dir = tempfile::tempdir().unwrap();
    let app = dir.path().join("app");
    write_app(
        &app,
        &[
            (
                "permissions.toml",
                "[provision_role]\nname = \"{{.nuon.install.id}}-provision\"\n\n[maintenance_role]\nname = \"acme-{{.nuon.org.id}}-{{.nuon.install.name}}-ops\"\n[[maintenance_role.policies]]\nname = \"buckets\"\ncontents = \"./policies/buckets.json\"\n\n[deprovision_role]\nname = \"{{.install.id}}-teardown\"\n\n[[custom_roles]]\nname = \"db-admin-{{.app.id}}\"\n",
            ),
            (
                "policies/buckets.json",
                r#"{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::{{.install.id}}-*"}]}"#,
            ),
        ],
    );
    let out = dir.path().join("stack.yaml");
    let rendered = render_stack(&app, &out);
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let lint = Command::new(venv_bin("cfn-lint")).arg(&out).output().unwrap();
    assert!(lint.status.success(), "cfn-lint: {}", String::from_utf8_lossy(&lint.stdout));
    let t = template_at(&out);
    let p = &t["Parameters"];
    for name in ["InstallName", "OrgId", "AppId"] {
        assert_eq!(p[name]["AllowedPattern"], "[A-Za-z0-9_.-]{1,128}", "{name}");
    }
    let r = &t["Resources"];
    let ops = &r["AcmeOpsRole"]["Properties"];
    assert_eq!(ops["RoleName"]["Fn::Sub"], "acme-${OrgId}-${InstallName}-ops");
    assert_eq!(
        ops["Policies"][0]["PolicyDocument"]["Statement"][0]["Resource"]["Fn::Sub"],
        "arn:aws:s3:::${InstallId}-*"
    );
    // The runner's identity: exactly these roles' ARNs, no name prefix.
    let runner =
        r["RunnerInstanceRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"][0].clone();
    assert_eq!(runner["Sid"], "AssumeLifecycleRoles");
    let arns: Vec<String> = runner["Resource"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["Fn::Sub"].as_str().unwrap().rsplit(":role/").next().unwrap().to_string())
        .collect();
    assert_eq!(
        arns,
        [
            "${InstallId}-provision",
            "acme-${OrgId}-${InstallName}-ops",
            "${InstallId}-teardown",
            "db-admin-${AppId}"
        ]
    );
    let user_data = r["RunnerLaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"].to_string();
    for export in ["BYOC_INSTALL_NAME=${InstallName}", "BYOC_ORG_ID=${OrgId}", "BYOC_APP_ID=${AppId}"] {
        assert!(user_data.contains(export), "{export}");
    }
    let moto = MotoServer::start().await;
    let described = create_stack(
        &moto,
        "byoc-single",
        &t,
        "inst-one",
        &[("InstallName", "prod"), ("OrgId", "org7"), ("AppId", "app3")],
    )
    .await;
    assert!(described.contains("CREATE_COMPLETE"), "{described}");
    assert!(described.contains(":role/acme-org7-prod-ops<"), "{described}");
}

/// An app for another cloud is refused in one sentence that says what is supported.
#[test]
fn an_app_for_another_cloud_is_refused_in_one_sentence() {
    for (file, text, cloud) in [
        ("stack.toml", "type = \"azure-bicep\"\nname = \"x\"\n", "Azure (stack.toml type = 'azure-bicep')"),
        ("runner.toml", "runner_type = \"gcp\"\n", "Google Cloud (runner.toml runner_type = 'gcp')"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let app = dir.path().join("app");
        write_app(&app, &[(file, text), ("permissions/m.toml", "type = \"maintenance\"\nname = \"m\"\n")]);
        let out = dir.path().join("stack.yaml");
        let rendered = render_stack(&app, &out);
        let stderr = String::from_utf8_lossy(&rendered.stderr);
        assert!(!rendered.status.success());
        assert_eq!(
            stderr.trim(),
            format!(
                "render-install-stack: this app targets {cloud}; byoc-runner installs only into AWS accounts (a CloudFormation stack, IAM roles, Secrets Manager, ECR)"
            )
        );
        assert!(!out.exists());
    }
}

/// The generator refuses `app`: every one of `problems` is named, nothing is written.
fn assert_refused(dir: &Path, app: &Path, problems: &[&str]) {
    let out = dir.join("stack.yaml");
    let rendered = render_stack(app, &out);
    let stderr = String::from_utf8_lossy(&rendered.stderr);
    assert!(!rendered.status.success());
    for problem in problems {
        assert!(stderr.contains(problem), "missing {problem:?} in:\n{stderr}");
    }
    assert!(!out.exists(), "nothing is written");
}

/// An app's secrets (docs/SECRETS.md): a NoEcho parameter each, a Secrets Manager
/// secret encrypted with the install's key (generated when asked and left empty), and
/// read access for exactly the roles `read_by` names; the stack creates in moto.
#[tokio::test]
async fn the_apps_secrets_become_noecho_parameters_and_per_role_read_access() {
    let dir = tempfile::tempdir().unwrap();
    let app = dir.path().join("app");
    write_app(
        &app,
        &[
            ("permissions/operate.toml", "type = \"maintenance\"\nname = \"{{.install.id}}-operate\"\n"),
            ("permissions/db.toml", "type = \"custom\"\nname = \"{{.install.id}}-db-admin\"\n"),
            (
                "secrets.toml",
                "[[secret]]\nname = \"api_key\"\ndisplay_name = \"API key\"\ndescription = \"Of the billing provider\"\nrequired = true\nuser_configurable = true\nread_by = [\"{{ .nuon.install.id }}-db-admin\"]\n\n[[secret]]\nname = \"signing\"\nauto_generate = true\nformat = \"base64\"\n\n[[secret]]\nname = \"session\"\nauto_generate = true\nuser_configurable = false\n",
            ),
            ("secrets/ops/pager.toml", "name = \"pager\"\ndefault = \"none-configured\"\n"),
        ],
    );
    let out = dir.path().join("stack.yaml");
    let rendered = render_stack(&app, &out);
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let lint = Command::new(venv_bin("cfn-lint")).arg(&out).output().unwrap();
    assert!(lint.status.success(), "cfn-lint: {}", String::from_utf8_lossy(&lint.stdout));
    let t = template_at(&out);
    let p = &t["Parameters"];
    for key in ["SecretApiKey", "SecretSigning", "SecretPager"] {
        assert_eq!(p[key]["NoEcho"], true, "{key}");
    }
    assert_eq!(p["SecretApiKey"]["MinLength"], 1);
    assert!(p["SecretApiKey"]["Default"].is_null(), "a required secret has no default");
    assert_eq!(p["SecretPager"]["Default"], "none-configured");
    let r = &t["Resources"];
    assert_eq!(r["SecretsKey"]["Type"], "AWS::KMS::Key");
    assert_eq!(r["SecretsKey"]["Properties"]["EnableKeyRotation"], true);
    let api = &r["AppSecretApiKey"]["Properties"];
    assert_eq!(api["Name"]["Fn::Sub"], "${InstallId}/secrets/api_key");
    assert_eq!(api["KmsKeyId"], serde_json::json!({"Ref": "SecretsKey"}));
    assert_eq!(api["SecretString"], serde_json::json!({"Ref": "SecretApiKey"}));
    let signing = &r["AppSecretSigning"]["Properties"];
    assert_eq!(signing["GenerateSecretString"]["Fn::If"][2]["PasswordLength"], 32);
    assert!(r["AppSecretPager"]["Condition"].is_null(), "a default is always stored");
    // user_configurable = false: the stack asks nothing and always generates it.
    assert!(p["SecretSession"].is_null(), "not asked of the customer: {}", p["SecretSession"]);
    let session = &r["AppSecretSession"]["Properties"];
    assert_eq!(session["GenerateSecretString"]["PasswordLength"], 32);
    assert!(session["SecretString"].is_null() && r["AppSecretSession"]["Condition"].is_null());
    // Read access: db-admin reads api_key only (read_by names it); the maintenance role
    // the two with the default read_by; the runner's own role none.
    let readable = |role: &str| -> Vec<String> {
        let policies = r[role]["Properties"]["Policies"].as_array().cloned().unwrap_or_default();
        let reader = policies.iter().find(|p| p["PolicyName"] == "byoc-secrets-read");
        reader
            .map(|p| {
                p["PolicyDocument"]["Statement"][0]["Resource"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| r["Fn::Sub"].as_str().unwrap().rsplit('/').next().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(readable("DbAdminRole"), ["api_key-*"]);
    assert_eq!(readable("OperateRole"), ["signing-*", "session-*", "pager-*"]);
    assert!(
        !r["RunnerInstanceRole"].to_string().contains("/secrets/"),
        "the runner's own identity reads none"
    );
    let moto = MotoServer::start().await;
    let described =
        create_stack(&moto, "byoc-secrets", &t, "inst-sec", &[("SecretApiKey", "billing-key-0123")]).await;
    assert!(described.contains("CREATE_COMPLETE"), "{described}");
}

/// Secret declarations the stack cannot honour: every problem at once, nothing written.
#[test]
fn secret_declarations_the_stack_cannot_honour_are_refused_with_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let app = dir.path().join("app");
    write_app(
        &app,
        &[
            ("permissions/operate.toml", "type = \"maintenance\"\nname = \"{{.install.id}}-operate\"\n"),
            (
                "secrets.toml",
                "[[secret]]\nname = \"db_password\"\nrequired = true\nauto_generate = true\nvalue = \"inline!\"\n\n[[secret]]\nname = \"db-password\"\nformat = \"hex\"\nkubernetes_sync = true\nread_by = [\"operator\"]\n\n[[secret]]\nname = \"license\"\nrequired = true\nuser_configurable = false\n\n[[secret]]\nname = \"token\"\nuser_configurable = false\n\n[[kubernetes_sync_targets]]\nnamespaces = [\"app\"]\nname = \"x\"\nkey = \"y\"\n",
            ),
        ],
    );
    assert_refused(
        dir.path(),
        &app,
        &[
            "unknown field 'value'",
            "auto_generate and required cannot both be set",
            "format must be \"base64\" or empty",
            "kubernetes_secret_name and kubernetes_secret_namespace must be set",
            "parameter SecretDbPassword is also the parameter of",
            "read_by 'operator' is neither a role type",
            "required with user_configurable = false",
            "user_configurable = false needs auto_generate or a default",
            "[[kubernetes_sync_targets]] at the top level belongs to no secret",
        ],
    );
}

#[tokio::test]
async fn the_stacks_audit_bucket_and_log_group_take_the_runners_copy() {
    let moto = MotoServer::start().await;
    let described = create_stack(
        &moto,
        STACK,
        &template(),
        "inst-demo",
        &[("SecretDbPassword", "example-db-pw"), ("AuditBucket", "create"), ("AuditLogGroup", "create")],
    )
    .await;
    assert!(described.contains("CREATE_COMPLETE"), "{described}");
    assert!(described.contains("<OutputValue>inst-demo-audit-123456789012</OutputValue>"), "{described}");
    // The runner configured as user-data configures it for these parameters.
    let mut opts = role_options(&moto, "");
    opts.extra += "\n[audit.export.s3]\nbucket = \"inst-demo-audit-123456789012\"\n\
                   \n[audit.export.cloudwatch]\nlog_group = \"/byoc-runner/inst-demo/audit\"\n";
    let e = env_with(opts).await;
    let runner_id = e.cp.runners()[0].runner_id.clone();
    eventually("both sinks took the copy", async || {
        let st = byoc_runner::audit_export::status(&e.runner.state_dir);
        st.len() == 2 && st.iter().all(|s| s.delivered_records > 0 && s.failing_since_ms.is_none())
    })
    .await;
    let keys = moto.s3_keys("inst-demo-audit-123456789012").await;
    assert!(keys.contains(&format!("byoc-audit/{runner_id}/runner.pub")), "{keys:?}");
    assert!(!moto.log_messages("/byoc-runner/inst-demo/audit", &runner_id).await.is_empty());
}

#[tokio::test]
async fn the_stack_creates_and_the_runner_reads_its_switches_and_arns() {
    let moto = MotoServer::start().await;
    let described = create_stack(
        &moto,
        STACK,
        &template(),
        "inst-demo",
        // The example app's one required secret (docs/SECRETS.md).
        &[
            ("EnableMaintenanceRole", "true"),
            ("EnableDeprovisionRole", "false"),
            ("SecretDbPassword", "example-db-pw"),
            ("RunnerCount", "2"),
        ],
    )
    .await;
    assert!(described.contains("CREATE_COMPLETE"), "{described}");
    assert!(described.contains(":role/inst-demo-maintenance<"), "{described}");
    assert!(described.contains("<OutputKey>StateBucketName</OutputKey>"), "{described}");
    // Two runners: the group has two instances (moto does not model the lifecycle
    // hook, asserted on the template above).
    assert!(described.contains("<OutputValue>inst-demo-byoc-runners</OutputValue>"), "{described}");
    let groups = moto
        .query(
            "autoscaling",
            &[
                ("Action".into(), "DescribeAutoScalingGroups".into()),
                ("Version".into(), "2011-01-01".into()),
                ("AutoScalingGroupNames.member.1".into(), "inst-demo-byoc-runners".into()),
            ],
        )
        .await;
    assert_eq!(groups.matches("<InstanceId>").count(), 2, "{groups}");
    // The bucket exists (moto's CloudFormation does not model its versioning setting:
    // that is asserted on the template, above).
    assert!(moto.bucket_versioning("inst-demo-state-123456789012").await.is_some(), "no state bucket");
    assert!(described.contains(":role/inst-demo-provision<"));
    for off in ["deprovision", "eks-upgrade-role", "s3-object-break-glass"] {
        assert!(!described.contains(&format!(":role/inst-demo-{off}<")), "{off} must not exist");
    }

    // The runner, pointed at this stack, gets what is on and is refused what is off.
    let e = env_with(role_options(&moto, "")).await;
    let id =
        e.cp.enqueue(role_job(
            "component",
            "deploy",
            "inst-demo-maintenance",
            named("api"),
            "echo \"as $BYOC_ROLE_ARN\"",
        ))
        .unwrap();
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, byoc_protocol::JobStatus::Succeeded, "{}", e.runner.log());
    assert!(e.output(&id).contains("as arn:aws:iam::123456789012:role/inst-demo-maintenance"));
    let id =
        e.cp.enqueue(role_job("sandbox", "deprovision", "inst-demo-deprovision", named(""), "echo no"))
            .unwrap();
    let v = e.rejected(&id).await;
    assert_eq!(v.rejections[0].0, RejectReason::RoleDisabled, "{:?}", v.rejections);
    assert!(v.rejections[0].1.contains("EnableDeprovisionRole"), "{}", v.rejections[0].1);
    assert!(
        moto.calls_of("AssumeRole")
            .await
            .iter()
            .all(|c| c.params["RoleArn"].ends_with("/inst-demo-maintenance"))
    );
}

/// The Packer template as JSON (python-hcl2 from the project's .venv).
fn packer_template() -> serde_json::Value {
    let out = Command::new(venv_bin("python"))
        .args(["-c", "import hcl2, json, sys; print(json.dumps(hcl2.load(open(sys.argv[1]))))"])
        .arg(repo().join("ami/runner.pkr.hcl"))
        .output()
        .expect("the project's .venv (scripts/setup)");
    assert!(
        out.status.success(),
        "the Packer template does not parse: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_packer_template_parses_pins_versions_and_verifies_all_it_installs() {
    let t = packer_template();
    let plugin = &t["packer"][0]["required_plugins"][0]["amazon"]["version"];
    assert!(plugin.as_str().unwrap().starts_with("= "), "the plugin version is pinned: {plugin}");
    let vars: serde_json::Map<String, serde_json::Value> =
        t["variable"].as_array().unwrap().iter().flat_map(|v| v.as_object().unwrap().clone()).collect();
    // Versions and checksums are pinned in the template itself (provenance: ami/README.md).
    for (tool, checksum, hex_digits) in [
        ("terraform", "terraform_sha256", 64),
        ("helm", "helm_sha256", 64),
        ("kubectl", "kubectl_sha512", 128),
    ] {
        let version = vars[&format!("{tool}_version")]["default"].as_str().unwrap();
        assert!(
            version.split('.').count() == 3 && version.split('.').all(|p| p.parse::<u32>().is_ok()),
            "{tool} {version}"
        );
        let sum = &vars[checksum];
        let pinned = sum["default"].as_str().unwrap_or_else(|| panic!("{checksum} is pinned"));
        assert!(
            pinned.len() == hex_digits
                && pinned.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{checksum} = {pinned}"
        );
        let condition = sum["validation"][0]["condition"].as_str().unwrap();
        assert!(condition.contains(&format!("^[0-9a-f]{{{hex_digits}}}$")), "{condition}");
    }
    let source = &t["source"][0]["amazon-ebs"]["runner"];
    assert_eq!(source["metadata_options"][0]["http_tokens"], "required");
    assert_eq!(source["imds_support"], "v2.0");
    assert_eq!(source["encrypt_boot"], true);
    assert_eq!(source["launch_block_device_mappings"][0]["encrypted"], true);
    // Every download is checked against its pinned checksum before it is installed, and
    // the package's signature and checksum before dpkg sees it.
    let steps: Vec<String> = t["build"][0]["provisioner"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p.get("shell"))
        .flat_map(|s| s["inline"].as_array().unwrap().iter().map(|l| l.as_str().unwrap().to_string()))
        .collect();
    let pos = |needle: &str| {
        steps.iter().position(|l| l.contains(needle)).unwrap_or_else(|| panic!("no step with {needle}"))
    };
    assert!(pos("minisign -V") < pos("sha256sum -c --strict SHA256SUMS"));
    assert!(pos("sha256sum -c --strict SHA256SUMS") < pos("dpkg -i"));
    for (download, check, install) in [
        (
            "-o terraform.zip",
            "$TF_SHA256  terraform.zip\" | sha256sum -c --strict",
            "install -m 0755 terraform",
        ),
        (
            "-o helm.tgz",
            "$HELM_SHA256  helm.tgz\" | sha256sum -c --strict",
            "install -m 0755 linux-amd64/helm",
        ),
        (
            "-o kubernetes-client.tgz",
            "$KUBECTL_SHA512  kubernetes-client.tgz\" | sha512sum -c --strict",
            "install -m 0755 kubernetes/client/bin/kubectl",
        ),
    ] {
        assert!(pos(download) < pos(check) && pos(check) < pos(install), "{download}");
        assert!(steps[pos(download)].contains("--proto =https"));
    }
    assert!(steps.iter().any(|l| l.contains("user.max_user_namespaces")), "the sandbox's sysctl");
    assert!(steps.iter().any(|l| l.contains("mask ssh.service")), "no SSH in the image");
}

/// The compatibility corpus (`examples/compat/`): app configs in the modelled system's
/// formats. `byoc-runner app check` and the stack generator each conclude what the app's
/// `expect.toml` says, and where both accept it they agree on the stack's parameters.
#[test]
fn the_compatibility_corpus_is_judged_alike_by_app_check_and_the_stack() {
    let corpus = repo().join("examples/compat");
    let mut apps: Vec<PathBuf> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("expect.toml").is_file())
        .collect();
    apps.sort();
    assert!(apps.len() >= 4, "{apps:?}");
    for app in apps {
        let name = app.file_name().unwrap().to_string_lossy().into_owned();
        let expect: toml::Table =
            toml::from_str(&std::fs::read_to_string(app.join("expect.toml")).unwrap()).unwrap();
        let checked = Command::new(env!("CARGO_BIN_EXE_byoc-runner"))
            .args(["app", "check", "-o", "json"])
            .arg(&app)
            .output()
            .unwrap();
        let report: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
        let problems: Vec<&str> =
            report["problems"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        match &expect["app_check"] {
            toml::Value::String(s) if s == "ok" => {
                assert!(checked.status.success() && problems.is_empty(), "{name}: {problems:?}")
            }
            toml::Value::Array(wanted) => {
                assert_eq!(checked.status.code(), Some(1), "{name}");
                for w in wanted {
                    let w = w.as_str().unwrap();
                    assert!(problems.iter().any(|p| p.contains(w)), "{name}: {w:?} not in {problems:?}");
                }
            }
            other => panic!("{name}: app_check = {other}"),
        }

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("stack.yaml");
        let rendered = render_stack(&app, &out);
        let stderr = String::from_utf8_lossy(&rendered.stderr);
        match expect["stack"].as_str().unwrap() {
            "ok" => {
                assert!(rendered.status.success(), "{name}: {stderr}");
                let lint = Command::new(venv_bin("cfn-lint")).arg(&out).output().unwrap();
                assert!(lint.status.success(), "{name}: cfn-lint: {}", String::from_utf8_lossy(&lint.stdout));
                let t = template_at(&out);
                for p in report["stack_parameters"].as_array().unwrap() {
                    let p = p.as_str().unwrap();
                    assert!(
                        t["Parameters"].get(p).is_some(),
                        "{name}: app check names {p}, the stack has none"
                    );
                }
                // And the other way: every parameter the app adds, app check names.
                let named: Vec<&str> = report["stack_parameters"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p.as_str().unwrap())
                    .collect();
                for key in t["Parameters"].as_object().unwrap().keys() {
                    let from_app = (key.starts_with("Enable") && key.ends_with("Role"))
                        || key.starts_with("Secret")
                        || ["InstallName", "OrgId", "AppId"].contains(&key.as_str());
                    assert!(
                        !from_app || named.contains(&key.as_str()),
                        "{name}: the stack has {key}, app check does not"
                    );
                }
            }
            refusal => {
                assert!(!rendered.status.success() && stderr.contains(refusal), "{name}: {stderr}");
                assert!(!out.exists());
            }
        }
    }
}

// ---- an offline IAM evaluator for the rendered template ------------------------------

/// The template's expressions resolved as CloudFormation would for a stack with every
/// switch on (the audit bucket, key and log group made by the stack, every role and
/// secret present), in account 123456789012, eu-west-1, stack `install`.
struct Resolver<'a> {
    t: &'a serde_json::Value,
}

const ACCOUNT: &str = "123456789012";
const INSTALL: &str = "inst";

impl Resolver<'_> {
    fn reference(&self, name: &str) -> String {
        match name {
            "AWS::Partition" => "aws".into(),
            "AWS::AccountId" => ACCOUNT.into(),
            "AWS::Region" => "eu-west-1".into(),
            "AWS::StackName" => "install".into(),
            "AWS::StackId" => format!("arn:aws:cloudformation:eu-west-1:{ACCOUNT}:stack/install/1"),
            "InstallId" => INSTALL.into(),
            "AuditBucket" | "AuditLogGroup" => "create".into(),
            n if self.t["Parameters"].get(n).is_some() => format!("param-{n}"),
            n => self.arn(n),
        }
    }

    /// A resource's ARN (Ref of a managed policy or secret, GetAtt Arn of the rest).
    fn arn(&self, logical: &str) -> String {
        let r = &self.t["Resources"][logical];
        let props = &r["Properties"];
        match r["Type"].as_str().unwrap_or_else(|| panic!("no resource {logical}")) {
            "AWS::IAM::Role" => format!("arn:aws:iam::{ACCOUNT}:role/{}", self.string(&props["RoleName"])),
            "AWS::IAM::ManagedPolicy" => format!("arn:aws:iam::{ACCOUNT}:policy/install-{logical}-X"),
            "AWS::KMS::Key" => format!("arn:aws:kms:eu-west-1:{ACCOUNT}:key/{logical}"),
            "AWS::S3::Bucket" => format!("arn:aws:s3:::{}", self.string(&props["BucketName"])),
            "AWS::IAM::InstanceProfile" => {
                format!("arn:aws:iam::{ACCOUNT}:instance-profile/install-{logical}-X")
            }
            "AWS::SecretsManager::Secret" => {
                format!("arn:aws:secretsmanager:eu-west-1:{ACCOUNT}:secret:{logical}-X")
            }
            other => format!("arn:aws:{other}:{logical}"),
        }
    }

    fn string(&self, v: &serde_json::Value) -> String {
        match self.value(v) {
            Some(serde_json::Value::String(s)) => s,
            other => panic!("{v} is not a string: {other:?}"),
        }
    }

    fn sub(&self, text: &str, vars: &serde_json::Map<String, serde_json::Value>) -> String {
        let mut out = String::new();
        let mut rest = text;
        while let Some(i) = rest.find("${") {
            out.push_str(&rest[..i]);
            let end = rest[i..].find('}').unwrap() + i;
            let name = &rest[i + 2..end];
            out.push_str(&match name.strip_prefix('!') {
                Some(literal) => format!("${{{literal}}}"),
                None => match vars.get(name) {
                    Some(v) => self.string(v),
                    None => match name.split_once('.') {
                        Some((logical, "Arn")) => self.arn(logical),
                        _ => self.reference(name),
                    },
                },
            });
            rest = &rest[end + 1..];
        }
        out.push_str(rest);
        out
    }

    /// `None`: AWS::NoValue.
    fn value(&self, v: &serde_json::Value) -> Option<serde_json::Value> {
        use serde_json::Value;
        match v {
            Value::Object(m) if m.len() == 1 => {
                let (k, arg) = m.iter().next().unwrap();
                match k.as_str() {
                    "Ref" if arg == "AWS::NoValue" => None,
                    "Ref" => Some(Value::String(self.reference(arg.as_str().unwrap()))),
                    "Fn::GetAtt" => Some(Value::String(self.arn(arg[0].as_str().unwrap()))),
                    "Fn::Sub" => Some(Value::String(match arg {
                        Value::String(s) => self.sub(s, &serde_json::Map::new()),
                        _ => self.sub(arg[0].as_str().unwrap(), arg[1].as_object().unwrap()),
                    })),
                    // Every condition on: the stack made the audit copy, every role is on.
                    "Fn::If" => self.value(&arg[1]),
                    "Fn::Join" => Some(Value::String(
                        arg[1]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|p| self.string(p))
                            .collect::<Vec<_>>()
                            .join(arg[0].as_str().unwrap()),
                    )),
                    _ => Some(Value::Object(
                        m.iter().filter_map(|(k, v)| self.value(v).map(|v| (k.clone(), v))).collect(),
                    )),
                }
            }
            Value::Object(m) => Some(Value::Object(
                m.iter().filter_map(|(k, v)| self.value(v).map(|v| (k.clone(), v))).collect(),
            )),
            Value::Array(a) => Some(Value::Array(a.iter().filter_map(|v| self.value(v)).collect())),
            other => Some(other.clone()),
        }
    }
}

/// IAM's wildcard match (`*` any run, `?` one character), case-insensitive for actions.
fn wildcard(pattern: &str, text: &str) -> bool {
    fn go(p: &[u8], t: &[u8]) -> bool {
        match (p.first(), t.first()) {
            (None, None) => true,
            (Some(b'*'), _) => go(&p[1..], t) || (!t.is_empty() && go(p, &t[1..])),
            (Some(b'?'), Some(_)) => go(&p[1..], &t[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &t[1..]),
            _ => false,
        }
    }
    go(pattern.as_bytes(), text.as_bytes())
}

fn list(v: &serde_json::Value) -> Vec<String> {
    match v {
        serde_json::Value::String(s) => vec![s.clone()],
        serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
        _ => Vec::new(),
    }
}

/// Whether one of `statements` with `effect` covers the action on the resource.
/// Conditions are taken as met: for an Allow that only makes the check stricter.
fn covers(statements: &[serde_json::Value], effect: &str, action: &str, resource: &str) -> bool {
    statements.iter().any(|s| {
        s["Effect"] == effect
            && list(&s["Action"]).iter().any(|a| wildcard(&a.to_lowercase(), &action.to_lowercase()))
            && list(&s["Resource"]).iter().any(|r| wildcard(r, resource))
    })
}

/// Allow, Deny (explicit) or Implicit (not allowed) for a lifecycle role.
#[derive(Debug, PartialEq)]
enum Decision {
    Allow,
    ExplicitDeny,
    NotAllowed,
}

struct RolePolicies {
    identity: Vec<serde_json::Value>,
    boundary: Option<Vec<serde_json::Value>>,
}

impl RolePolicies {
    fn of(r: &Resolver<'_>, logical: &str) -> RolePolicies {
        let props = r.value(&r.t["Resources"][logical]["Properties"]).unwrap();
        let statements = |doc: &serde_json::Value| match &doc["Statement"] {
            serde_json::Value::Array(a) => a.clone(),
            other => vec![other.clone()],
        };
        let managed_doc = |arn: &str| -> Vec<serde_json::Value> {
            if arn.starts_with("arn:aws:iam::aws:policy/") {
                // An AWS managed policy: assume the worst, it allows everything.
                return vec![serde_json::json!({"Effect": "Allow", "Action": "*", "Resource": "*"})];
            }
            let logical =
                arn.rsplit('/').next().unwrap().trim_start_matches("install-").trim_end_matches("-X");
            let doc = r.value(&r.t["Resources"][logical]["Properties"]["PolicyDocument"]).unwrap();
            statements(&doc)
        };
        let mut identity = Vec::new();
        for p in props["Policies"].as_array().into_iter().flatten() {
            identity.extend(statements(&p["PolicyDocument"]));
        }
        for arn in list(&props["ManagedPolicyArns"]) {
            identity.extend(managed_doc(&arn));
        }
        let boundary = props["PermissionsBoundary"].as_str().map(managed_doc);
        RolePolicies { identity, boundary }
    }

    fn decide(&self, action: &str, resource: &str) -> Decision {
        let denied = covers(&self.identity, "Deny", action, resource)
            || self.boundary.as_ref().is_some_and(|b| covers(b, "Deny", action, resource));
        if denied {
            return Decision::ExplicitDeny;
        }
        let allowed = covers(&self.identity, "Allow", action, resource)
            && self.boundary.as_ref().is_none_or(|b| covers(b, "Allow", action, resource));
        if allowed { Decision::Allow } else { Decision::NotAllowed }
    }
}

/// Every lifecycle role (break-glass too), whatever the app grants it (an AWS managed
/// policy counts as allowing everything), is denied what would destroy or rewrite the
/// customer's audit copy, the install stack, or the identities and policies that bind
/// it; each role's boundary lets through what the stack itself grants it (its terraform
/// state, the secrets it reads). The key's own policy leaves its retirement to the
/// account's root user. Evaluated offline by the small evaluator above (explicit Deny
/// wins; otherwise identity Allow and boundary Allow), since moto enforces neither.
#[test]
fn no_lifecycle_role_can_destroy_the_audit_copy_and_the_stacks_grants_pass_their_boundaries() {
    let t = template();
    let r = Resolver { t: &t };
    let roles: Vec<&String> = t["Resources"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, v)| {
            v["Type"] == "AWS::IAM::Role" && v["Properties"]["Tags"][0]["Key"] == "byoc:role-type"
        })
        .map(|(k, _)| k)
        .collect();
    assert!(roles.len() >= 5, "{roles:?}");
    let key = r.arn("AuditKey");
    let bucket = format!("arn:aws:s3:::{INSTALL}-audit-{ACCOUNT}");
    let group = format!("arn:aws:logs:eu-west-1:{ACCOUNT}:log-group:/byoc-runner/{INSTALL}/audit");
    let stack = r.reference("AWS::StackId");
    let instance_role = r.arn("RunnerInstanceRole");
    let state_object = format!("arn:aws:s3:::{INSTALL}-state-{ACCOUNT}/{INSTALL}/terraform.tfstate");
    let mut boundaries_checked = 0;
    for role in &roles {
        let p = RolePolicies::of(&r, role);
        let own = r.arn(role);
        for (action, resource) in [
            ("kms:ScheduleKeyDeletion", key.as_str()),
            ("kms:DisableKey", key.as_str()),
            ("kms:PutKeyPolicy", key.as_str()),
            ("kms:Decrypt", key.as_str()),
            ("s3:PutBucketPolicy", bucket.as_str()),
            ("s3:DeleteBucket", bucket.as_str()),
            ("s3:PutObject", &format!("{bucket}/byoc-audit/rn-1/runner.pub")),
            ("s3:PutObject", &format!("{bucket}/byoc-audit/rn-2/log/0-100.jsonl")),
            ("s3:DeleteObject", &format!("{bucket}/byoc-audit/rn-1/runner.pub")),
            ("s3:PutObjectRetention", &format!("{bucket}/byoc-audit/rn-1/runner.pub")),
            ("logs:DeleteLogGroup", group.as_str()),
            ("logs:DeleteLogStream", &format!("{group}:log-stream:rn-1")),
            ("logs:PutRetentionPolicy", group.as_str()),
            ("cloudformation:DeleteStack", stack.as_str()),
            ("cloudformation:UpdateStack", stack.as_str()),
            ("iam:DeleteRolePolicy", own.as_str()),
            ("iam:PutRolePolicy", own.as_str()),
            ("iam:DeleteRolePermissionsBoundary", own.as_str()),
            ("iam:AttachRolePolicy", instance_role.as_str()),
            ("iam:PassRole", instance_role.as_str()),
            ("iam:RemoveRoleFromInstanceProfile", &r.arn("RunnerInstanceProfile")),
            ("iam:CreatePolicyVersion", &r.arn("StateAccess")),
        ] {
            assert_eq!(p.decide(action, resource), Decision::ExplicitDeny, "{role}: {action} on {resource}");
        }
        assert_eq!(p.decide("s3:PutObject", &state_object), Decision::Allow, "{role}: its terraform state");
        if p.boundary.is_some() {
            boundaries_checked += 1;
            // Every secret the role is granted passes its boundary too.
            for s in p.identity.iter().filter(|s| {
                s["Effect"] == "Allow"
                    && list(&s["Action"]).contains(&"secretsmanager:GetSecretValue".to_string())
            }) {
                for secret in list(&s["Resource"]) {
                    let arn = secret.replace('*', "AbCdEf");
                    assert_eq!(
                        p.decide("secretsmanager:GetSecretValue", &arn),
                        Decision::Allow,
                        "{role}: {arn}"
                    );
                }
                assert_eq!(
                    p.decide("kms:Decrypt", &r.arn("SecretsKey")),
                    Decision::Allow,
                    "{role}: the secrets' key"
                );
            }
        }
    }
    assert!(boundaries_checked >= 2, "the example app's roles with boundaries were not found");
    // The key's own policy: only the account's root user retires it or rewrites its policy.
    let policy = r.value(&t["Resources"]["AuditKey"]["Properties"]["KeyPolicy"]).unwrap();
    let deny =
        policy["Statement"].as_array().unwrap().iter().find(|s| s["Effect"] == "Deny").expect("a Deny");
    for action in ["kms:ScheduleKeyDeletion", "kms:DisableKey", "kms:PutKeyPolicy"] {
        assert!(list(&deny["Action"]).contains(&action.to_string()), "{action}");
    }
    assert_eq!(deny["Principal"]["AWS"], "*");
    assert_eq!(deny["Condition"]["ArnNotEquals"]["aws:PrincipalArn"], format!("arn:aws:iam::{ACCOUNT}:root"));
    // Resource-side, for any principal a lifecycle role could make (a new role, a user,
    // through an access point): the bucket's own policy leaves writing objects to the
    // runner's role and changing the bucket or removing objects to the root user.
    let bucket_policy =
        r.value(&t["Resources"]["AuditBucketPolicy"]["Properties"]["PolicyDocument"]).unwrap();
    let statements = bucket_policy["Statement"].as_array().unwrap();
    let attacker = format!("arn:aws:iam::{ACCOUNT}:role/made-by-a-lifecycle-role");
    let denies_for = |principal: &str, action: &str, resource: &str| {
        statements.iter().any(|s| {
            let exempt = list(&s["Condition"]["ArnNotEquals"]["aws:PrincipalArn"]);
            s["Effect"] == "Deny"
                && s["Condition"].get("Bool").is_none()
                && !exempt.is_empty()
                && !exempt.iter().any(|e| e == principal)
                && covers(std::slice::from_ref(s), "Deny", action, resource)
        })
    };
    let object = format!("{bucket}/byoc-audit/AROAEXAMPLE:i-1/rn-1/runner.pub");
    for (action, resource) in [
        ("s3:PutObject", object.as_str()),
        ("s3:DeleteObject", object.as_str()),
        ("s3:DeleteObjectVersion", object.as_str()),
        ("s3:PutObjectRetention", object.as_str()),
        ("s3:PutBucketPolicy", bucket.as_str()),
        ("s3:DeleteBucketPolicy", bucket.as_str()),
        ("s3:PutBucketObjectLockConfiguration", bucket.as_str()),
        ("s3:PutEncryptionConfiguration", bucket.as_str()),
        ("s3:PutLifecycleConfiguration", bucket.as_str()),
    ] {
        assert!(
            denies_for(&attacker, action, resource),
            "the bucket's policy lets another principal {action}"
        );
    }
    assert!(!denies_for(&instance_role, "s3:PutObject", &object), "the runner's role may write");
    assert!(denies_for(&instance_role, "s3:DeleteObject", &object), "the runner's role may not delete");
    assert!(denies_for(&instance_role, "s3:PutBucketPolicy", &bucket));
    assert!(!denies_for(&format!("arn:aws:iam::{ACCOUNT}:root"), "s3:PutBucketPolicy", &bucket));
    // The runner's own role writes create-only (If-None-Match): nothing it wrote, or
    // another runner wrote, can be replaced through it; and only under its instance's
    // own prefix (`${aws:userid}`: role-id:instance-id).
    let mut runner = RolePolicies::of(&r, "RunnerInstanceRole");
    let me = "AROAEXAMPLE:i-1";
    for s in &mut runner.identity {
        if let Some(resource) = s["Resource"].as_str() {
            s["Resource"] = resource.replace("${aws:userid}", me).into();
        }
    }
    let (others_copy, own_copy) = (
        format!("{bucket}/byoc-audit/AROAEXAMPLE:i-2/rn-2/log"),
        format!("{bucket}/byoc-audit/{me}/rn-1/log"),
    );
    assert!(covers(&runner.identity, "Allow", "s3:PutObject", &own_copy));
    assert!(!covers(&runner.identity, "Allow", "s3:PutObject", &others_copy), "another instance's prefix");
    let create_only =
        runner.identity.iter().find(|s| s["Sid"] == "NeverOverwriteAuditCopy").expect("create-only");
    assert_eq!(create_only["Effect"], "Deny");
    assert_eq!(create_only["Condition"]["Null"]["s3:if-none-match"], "true");
    assert!(covers(
        std::slice::from_ref(create_only),
        "Deny",
        "s3:PutObject",
        &format!("{bucket}/byoc-audit/rn-1/runner.pub")
    ));
}
