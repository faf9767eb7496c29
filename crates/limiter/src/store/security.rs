//! How the limiter proves who it is to Redis and checks who Redis is: TLS (`rediss://`) with a
//! private CA and a client certificate, and ACL authentication (a user name and a password).
//!
//! The flags name files ([`RedisSecurity`]); the files are read when a store is created, so a
//! missing or malformed one stops the limiter at start with an error naming the flag and the
//! path — never the file's contents. The password is never a flag value (a process list shows
//! those): it comes from a file or from `TOLLGATE_REDIS_PASSWORD`, and is carried as a
//! [`Secret`], which prints as `<redacted>`. A password inside the URL still works, with a
//! warning; the URL is only ever printed through [`redact_url`].
//!
//! Credentials Redis refuses (a certificate it does not trust, one we do not trust, a wrong
//! password) are not transient: the same attempt fails the same way until someone changes a
//! file or an ACL. `Refusals` makes a store stop dialing Redis for a while after one, so
//! every call (and `/readyz`) answers at once with the specific reason instead of a fresh
//! handshake per call.
//!
//! - `credentials`: the flags, [`Secret`] and [`RedisSecurity`] (the files read and checked,
//!   and merged with the URL into a client);
//! - `pem`: reading the PEM files a flag names (also the regional limiter's parent TLS);
//! - `redact`: URLs fit to print;
//! - `classify`: which Redis errors are refused credentials;
//! - `refusals`: holding a store back after a refusal (`Refusals`).

mod classify;
mod credentials;
mod pem;
mod redact;
mod refusals;

pub(crate) use classify::credential_error;
pub use credentials::{
    RedisSecurity, Secret, CA_FLAG, CLIENT_CERT_FLAG, CLIENT_KEY_FLAG, PASSWORD_ENV,
    PASSWORD_FILE_FLAG, USERNAME_FLAG,
};
pub use pem::install_crypto_provider;
pub(crate) use pem::{certificates, private_key_of, read};
pub use redact::redact_url;
pub(crate) use refusals::{Attempt, Refusals};
pub use refusals::{PROBE_TIMEOUT, REFUSED_PAUSE_MAX, REFUSED_PAUSE_MIN};

/// What a secret prints as, everywhere.
const REDACTED: &str = "<redacted>";
