//! A throwaway certificate authority and server certificate for TLS tests: the runner
//! trusts the CA through `control_plane.ca_bundle`, exactly as a customer behind a
//! TLS-inspecting proxy would.

use std::sync::Arc;

pub struct TestPki {
    pub ca_pem: String,
    pub server: Arc<rustls::ServerConfig>,
    /// The server certificate and key as PEM (for servers configured from files).
    pub server_cert_pem: String,
    pub server_key_pem: String,
}

#[derive(Debug, thiserror::Error)]
#[error("generating test certificates: {0}")]
pub struct PkiError(String);

/// A CA and a server certificate for `localhost` and 127.0.0.1 signed by it.
pub fn test_pki() -> Result<TestPki, PkiError> {
    test_pki_for(&["localhost", "127.0.0.1"])
}

/// A CA and a server certificate for `names` (host names or IP addresses) signed by it.
pub fn test_pki_for(names: &[&str]) -> Result<TestPki, PkiError> {
    let err = |e: &dyn std::fmt::Display| PkiError(e.to_string());
    let ca_key = rcgen::KeyPair::generate().map_err(|e| err(&e))?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| err(&e))?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "byoc test CA");
    let ca_cert = ca_params.self_signed(&ca_key).map_err(|e| err(&e))?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);

    let server_key = rcgen::KeyPair::generate().map_err(|e| err(&e))?;
    let params = rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .map_err(|e| err(&e))?;
    let server_cert = params.signed_by(&server_key, &issuer).map_err(|e| err(&e))?;

    let key = rustls::pki_types::PrivateKeyDer::try_from(server_key.serialize_der()).map_err(|e| err(&e))?;
    let server_key_pem = server_key.serialize_pem();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err(&e))?
        .with_no_client_auth()
        .with_single_cert(vec![server_cert.der().clone()], key)
        .map_err(|e| err(&e))?;
    Ok(TestPki {
        ca_pem: ca_cert.pem(),
        server: Arc::new(server),
        server_cert_pem: server_cert.pem(),
        server_key_pem,
    })
}
