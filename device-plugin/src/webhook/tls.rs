//! The webhook's TLS server configuration, read from PEM files, with errors that name the
//! file and say what is wrong with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

use super::WebhookError;

/// Which of the two files, in messages.
const CERT: &str = "TLS certificate";
/// Which of the two files, in messages.
const KEY: &str = "TLS private key";

/// Reads the certificate chain (`cert`, PEM, the server's certificate first) and its
/// private key (`key`, PEM: PKCS#8, PKCS#1 or SEC1) into a rustls server configuration
/// (ring provider, TLS 1.2 and 1.3, no client authentication, ALPN `http/1.1`).
///
/// Errors name the file: missing, unreadable, not PEM, no certificate, no private key, a
/// key that does not match the certificate, or a certificate or key rustls refuses.
pub fn load_tls(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, WebhookError> {
    let cert_pem = read(CERT, cert)?;
    let key_pem = read(KEY, key)?;

    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| not_pem(CERT, cert, source))?;
    if chain.is_empty() {
        let hint = if PrivateKeyDer::from_pem_slice(&cert_pem).is_ok() {
            " (it holds a private key: are the certificate and key files swapped?)"
        } else {
            ""
        };
        return Err(WebhookError::NoCertificate { path: cert.to_path_buf(), hint });
    }
    let private_key = match PrivateKeyDer::from_pem_slice(&key_pem) {
        Ok(private_key) => private_key,
        Err(pem::Error::NoItemsFound) => {
            let hint = if CertificateDer::pem_slice_iter(&key_pem).any(|c| c.is_ok()) {
                " (it holds a certificate: are the certificate and key files swapped?)"
            } else {
                ""
            };
            return Err(WebhookError::NoPrivateKey { path: key.to_path_buf(), hint });
        }
        Err(source) => return Err(not_pem(KEY, key, source)),
    };

    let rejected =
        |source| WebhookError::Rejected { cert: cert.to_path_buf(), key: key.to_path_buf(), source };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(rejected)?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(|source| match source {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                WebhookError::Mismatched { cert: cert.to_path_buf(), key: key.to_path_buf() }
            }
            other => rejected(other),
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The bytes of `path`, or the error naming it.
fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, WebhookError> {
    std::fs::read(path).map_err(|source| {
        let path = PathBuf::from(path);
        if source.kind() == std::io::ErrorKind::NotFound {
            WebhookError::Missing { what, path }
        } else {
            WebhookError::Unreadable { what, path, source }
        }
    })
}

fn not_pem(what: &'static str, path: &Path, source: pem::Error) -> WebhookError {
    WebhookError::NotPem { what, path: path.to_path_buf(), source }
}
