//! The admission webhook: turns a pod's `gpufrac.io/*` annotations into `gpufrac.io/gpu`
//! shares and the shim's `GPUFRAC_*` settings (docs/kubernetes.md).
//!
//! - [`review`] / [`try_review`] (`review.rs`): the pure AdmissionReview → answer logic
//!   on kube's admission types ([`admit`]: `AdmissionRequest` → `AdmissionResponse`),
//!   with the annotations read in `settings.rs` and the JSON Patch built in `patch.rs`.
//! - [`try_validate`] / [`validate`] (`validate.rs`): the same for `POST /validate`,
//!   which refuses a DRA claim, claim template or device class whose `gpu.gpufrac.io`
//!   configuration the kubelet plugin would refuse, naming the field.
//! - [`load_tls`] (`tls.rs`): the rustls configuration from PEM files.
//! - [`serve`] (`server.rs`): HTTPS, `POST /mutate`, `POST /validate` and `GET /healthz`, on a listener
//!   the caller bound, until the caller's shutdown future completes.
//!
//! `gpufrac-device-plugin webhook --listen ADDR --tls-cert FILE --tls-key FILE` is
//! [`load_tls`], a bind, and [`serve`].

use std::path::PathBuf;

mod owned;
mod patch;
mod review;
mod server;
mod settings;
mod tls;
mod validate;

pub use review::{admit, review, try_review, BadReview, API_VERSION};
pub use server::{
    serve, HANDSHAKE_TIMEOUT, MAX_BODY_BYTES, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER, REQUEST_TIMEOUT,
};
pub use tls::load_tls;
pub use validate::{try_validate, validate, GROUP, VERSIONS};

/// Why the webhook's TLS files cannot be used; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The file does not exist.
    #[error("{what} {} does not exist", path.display())]
    Missing {
        /// Which file: the TLS certificate or the TLS private key.
        what: &'static str,
        /// The path given.
        path: PathBuf,
    },
    /// The file exists but cannot be read.
    #[error("cannot read {what} {}", path.display())]
    Unreadable {
        /// Which file: the TLS certificate or the TLS private key.
        what: &'static str,
        /// The path given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid PEM.
    #[error("{what} {} is not valid PEM", path.display())]
    NotPem {
        /// Which file: the TLS certificate or the TLS private key.
        what: &'static str,
        /// The path given.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The certificate file holds no `CERTIFICATE` block.
    #[error("no certificate in TLS certificate {}{hint}", path.display())]
    NoCertificate {
        /// The path given.
        path: PathBuf,
        /// A hint for the user, or empty.
        hint: &'static str,
    },
    /// The key file holds no private key block.
    #[error("no private key in TLS private key {}{hint}", path.display())]
    NoPrivateKey {
        /// The path given.
        path: PathBuf,
        /// A hint for the user, or empty.
        hint: &'static str,
    },
    /// The private key is not the certificate's.
    #[error(
        "TLS private key {} does not match TLS certificate {}",
        key.display(),
        cert.display()
    )]
    Mismatched {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// rustls refused the certificate or the key (an unsupported key type, a certificate
    /// it cannot parse).
    #[error(
        "cannot use TLS certificate {} with TLS private key {}",
        cert.display(),
        key.display()
    )]
    Rejected {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why.
        #[source]
        source: rustls::Error,
    },
}
