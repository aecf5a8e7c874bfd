//! The vendor's app config carried in a signed job (role files, break-glass roles, the
//! operation-role matrix, policy declarations, the customer's secrets), through the
//! parsers that decide roles, policies and where secrets may go from it.
#![no_main]

use byoc_runner::roles::template::InstallState;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(app) = serde_json::from_slice::<byoc_protocol::AppConfig>(data) else { return };
    let install = InstallState::new("inst-1", Some("acme"), Some("us-east-1"), Some("123456789012"));
    let _ = byoc_runner::roles::model::AppRoles::parse(&app, &install);
    if let Ok(declared) = byoc_runner::app_policies::parse(&app) {
        for kind in ["terraform", "helm", "kubernetes"] {
            let _ = byoc_runner::app_policies::for_job(&app, kind, "component", "api");
        }
        let _ = declared.len();
    }
    let _ = byoc_runner::app_policies::cluster_policies(&app);
    if let Ok(secrets) = byoc_runner::secrets::declare::declared(&app, &install) {
        // A parsed declaration is one the runner can check uses against.
        assert!(secrets.iter().all(|s| byoc_job_executors::secrets::valid_name(&s.name)));
    }
});
