//! The credentials the limiter shows Redis and the CA it checks Redis with, as the flags name
//! them ([`RedisSecurity`]): the files read and checked, the password carried as a [`Secret`],
//! and both merged with the URL into a Redis client.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use redis::{ClientTlsConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates};
use rustls::pki_types::PrivateKeyDer;

use super::pem::{certificates, config_error, install_crypto_provider, private_key_of, read};
use super::redact::redact_url;
use super::REDACTED;
use crate::store::StoreError;

/// Flag of the CA file.
pub const CA_FLAG: &str = "--redis-ca";
/// Flag of the client certificate file.
pub const CLIENT_CERT_FLAG: &str = "--redis-client-cert";
/// Flag of the client key file.
pub const CLIENT_KEY_FLAG: &str = "--redis-client-key";
/// Flag of the ACL user name.
pub const USERNAME_FLAG: &str = "--redis-username";
/// Flag of the password file.
pub const PASSWORD_FILE_FLAG: &str = "--redis-password-file";
/// The environment variable that may hold the password itself.
pub const PASSWORD_ENV: &str = "TOLLGATE_REDIS_PASSWORD";

/// A secret value (a password). `Debug` and `Display` print `<redacted>`; only
/// [`Secret::expose`] gives the bytes, at the one place that hands them to the Redis client.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(value: impl Into<Vec<u8>>) -> Self {
        Self(value.into())
    }

    /// The secret's bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

/// TLS and ACL settings for reaching Redis, as the flags give them (paths, not contents). The
/// default is none of them: plain TCP without authentication, or whatever the URL says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisSecurity {
    /// CA certificate(s) (PEM) that Redis' certificate must chain to; without it, the
    /// system's trust store.
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for Redis' `tls-auth-clients`.
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub client_key: Option<PathBuf>,
    /// ACL user name (`AUTH <username> <password>`).
    pub username: Option<String>,
    /// The password itself ([`PASSWORD_ENV`]).
    pub password: Option<Secret>,
    /// A file holding the password (trailing newlines trimmed).
    pub password_file: Option<PathBuf>,
}

/// The files read and checked: what a Redis client is built with.
#[derive(Default)]
struct Loaded {
    tls: Option<TlsCertificates>,
    username: Option<String>,
    password: Option<String>,
}

/// The one private key in `bytes`.
fn private_key(path: &Path, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, StoreError> {
    private_key_of(CLIENT_KEY_FLAG, path, bytes)
}

impl RedisSecurity {
    /// Whether any TLS file is given.
    pub fn has_tls_files(&self) -> bool {
        self.ca.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }

    /// Reads and checks every file: PEM that parses, a key that belongs to its certificate,
    /// one password source, a user name only with a password.
    fn load(&self) -> Result<Loaded, StoreError> {
        let mut loaded = Loaded {
            username: self.username.clone(),
            ..Loaded::default()
        };
        if let Some(name) = &self.username {
            if name.is_empty() {
                return Err(config_error(format!("{USERNAME_FLAG} is empty")));
            }
        }
        loaded.password = self.load_password()?;
        if self.has_tls_files() {
            loaded.tls = Some(self.load_tls()?);
        }
        Ok(loaded)
    }

    fn load_password(&self) -> Result<Option<String>, StoreError> {
        let secret = match (&self.password, &self.password_file) {
            (Some(_), Some(file)) => {
                return Err(config_error(format!(
                    "both {PASSWORD_ENV} and {PASSWORD_FILE_FLAG} {} give the Redis password; \
                     give one",
                    file.display()
                )))
            }
            (Some(secret), None) => {
                if secret.is_empty() {
                    return Err(config_error(format!("{PASSWORD_ENV} is empty")));
                }
                String::from_utf8(secret.expose().to_vec())
                    .map_err(|_| config_error(format!("{PASSWORD_ENV} is not UTF-8")))?
            }
            (None, Some(file)) => {
                let bytes = read(PASSWORD_FILE_FLAG, file)?;
                let text = String::from_utf8(bytes).map_err(|_| {
                    config_error(format!(
                        "{PASSWORD_FILE_FLAG} {}: not UTF-8 text",
                        file.display()
                    ))
                })?;
                let password = text.trim_end_matches(['\n', '\r']);
                if password.is_empty() {
                    return Err(config_error(format!(
                        "{PASSWORD_FILE_FLAG} {}: the file is empty",
                        file.display()
                    )));
                }
                password.to_owned()
            }
            (None, None) => return Ok(None),
        };
        Ok(Some(secret))
    }

    fn load_tls(&self) -> Result<TlsCertificates, StoreError> {
        install_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        let root_cert = match &self.ca {
            Some(path) => {
                let bytes = read(CA_FLAG, path)?;
                for cert in certificates(CA_FLAG, path, &bytes)? {
                    roots.add(cert).map_err(|e| {
                        config_error(format!(
                            "{CA_FLAG} {}: not a usable CA certificate: {e}",
                            path.display()
                        ))
                    })?;
                }
                Some(bytes)
            }
            None => None,
        };
        let client_tls = match (&self.client_cert, &self.client_key) {
            (Some(cert_path), Some(key_path)) => {
                let cert_pem = read(CLIENT_CERT_FLAG, cert_path)?;
                let key_pem = read(CLIENT_KEY_FLAG, key_path)?;
                let chain = certificates(CLIENT_CERT_FLAG, cert_path, &cert_pem)?;
                let key = private_key(key_path, &key_pem)?;
                // What the Redis client will do at every connection, done once here so a key
                // of another certificate fails at start, naming both files.
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| config_error(format!("TLS for Redis: {e}")))?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key)
                .map_err(|e| {
                    config_error(format!(
                        "{CLIENT_KEY_FLAG} {} is not the key of {CLIENT_CERT_FLAG} {}: {e}",
                        key_path.display(),
                        cert_path.display()
                    ))
                })?;
                Some(ClientTlsConfig {
                    client_cert: cert_pem,
                    client_key: key_pem,
                })
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(config_error(format!(
                    "{CLIENT_CERT_FLAG} and {CLIENT_KEY_FLAG} go together: give both or neither"
                )))
            }
            (None, None) => None,
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert,
        })
    }

    /// `url` as a connection to open with these settings: the URL parsed, the TLS scheme
    /// checked against the files, the user name and password merged in.
    fn connection(&self, url: &str, loaded: &Loaded) -> Result<ConnectionInfo, StoreError> {
        let shown = redact_url(url);
        let info = url
            .into_connection_info()
            .map_err(|e| config_error(format!("redis URL `{shown}`: {e}")))?;
        match info.addr() {
            ConnectionAddr::TcpTls { insecure: true, .. } => {
                return Err(config_error(format!(
                    "redis URL `{shown}`: #insecure (no certificate checks) is not supported"
                )))
            }
            ConnectionAddr::TcpTls { .. } => {}
            ConnectionAddr::Tcp(..) | ConnectionAddr::Unix(_) if self.has_tls_files() => {
                return Err(config_error(format!(
                    "{CA_FLAG}, {CLIENT_CERT_FLAG} and {CLIENT_KEY_FLAG} are for TLS, but \
                     `{shown}` is not a TLS URL: use rediss://"
                )))
            }
            _ => {}
        }
        let mut redis = info.redis_settings().clone();
        if redis.password().is_some() {
            if loaded.password.is_some() {
                return Err(config_error(format!(
                    "redis URL `{shown}` has a password, and so has {PASSWORD_FILE_FLAG} or \
                     {PASSWORD_ENV}: give one"
                )));
            }
            warn_url_password();
        }
        if let (Some(theirs), Some(ours)) = (redis.username(), &loaded.username) {
            if theirs != ours {
                return Err(config_error(format!(
                    "redis URL `{shown}` names user `{theirs}`, {USERNAME_FLAG} names `{ours}`"
                )));
            }
        }
        if let Some(name) = &loaded.username {
            redis = redis.set_username(name);
        }
        if let Some(password) = &loaded.password {
            redis = redis.set_password(password);
        }
        if redis.username().is_some() && redis.password().is_none() {
            return Err(config_error(format!(
                "a Redis user name without a password: give it with {PASSWORD_FILE_FLAG} or \
                 {PASSWORD_ENV}"
            )));
        }
        Ok(info.set_redis_settings(redis))
    }

    /// A client for one Redis server at `url`.
    pub(crate) fn client(&self, url: &str) -> Result<redis::Client, StoreError> {
        install_crypto_provider();
        let loaded = self.load()?;
        let info = self.connection(url, &loaded)?;
        let shown = redact_url(url);
        match loaded.tls {
            Some(certs) => redis::Client::build_with_tls(info, certs),
            None => redis::Client::open(info),
        }
        .map_err(|e| config_error(format!("redis URL `{shown}`: {e}")))
    }

    /// A Redis Cluster client builder for the start-up `urls` (all TLS or all plain).
    pub(crate) fn cluster_builder(
        &self,
        urls: &[String],
    ) -> Result<redis::cluster::ClusterClientBuilder, StoreError> {
        install_crypto_provider();
        let loaded = self.load()?;
        let infos = urls
            .iter()
            .map(|url| self.connection(url, &loaded))
            .collect::<Result<Vec<_>, _>>()?;
        let mut builder = redis::cluster::ClusterClientBuilder::new(infos);
        if let Some(certs) = loaded.tls {
            builder = builder.certs(certs);
        }
        Ok(builder)
    }
}

static URL_PASSWORD_WARNED: AtomicBool = AtomicBool::new(false);

/// Warns (once per process) that a password in the URL is readable by others.
fn warn_url_password() {
    if !URL_PASSWORD_WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "the Redis URL carries a password: anyone who can list processes (or read this \
             one's environment) can read it; give it with {PASSWORD_FILE_FLAG} or \
             {PASSWORD_ENV} instead"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-security-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s}"), "<redacted>");
        assert_eq!(format!("{s:?}"), "<redacted>");
        let security = RedisSecurity {
            password: Some(s),
            ..RedisSecurity::default()
        };
        assert!(!format!("{security:?}").contains("hunter2"));
    }

    #[test]
    fn password_sources() {
        let dir = temp_dir("password");
        let file = dir.join("password");
        std::fs::write(&file, "from-file\n").unwrap();
        let from_file = RedisSecurity {
            password_file: Some(file.clone()),
            ..RedisSecurity::default()
        };
        assert_eq!(
            from_file.load_password().unwrap().as_deref(),
            Some("from-file")
        );
        std::fs::write(&file, "crlf\r\n").unwrap();
        assert_eq!(from_file.load_password().unwrap().as_deref(), Some("crlf"));

        let from_env = RedisSecurity {
            password: Some(Secret::new("from-env")),
            ..RedisSecurity::default()
        };
        assert_eq!(
            from_env.load_password().unwrap().as_deref(),
            Some("from-env")
        );

        let both = RedisSecurity {
            password: Some(Secret::new("from-env")),
            password_file: Some(file.clone()),
            ..RedisSecurity::default()
        };
        let e = both.load_password().unwrap_err().to_string();
        assert!(
            e.contains(PASSWORD_ENV) && e.contains(PASSWORD_FILE_FLAG),
            "{e}"
        );
        assert!(!e.contains("from-env") && !e.contains("crlf"), "{e}");

        std::fs::write(&file, "\n").unwrap();
        let e = from_file.load_password().unwrap_err().to_string();
        assert!(e.contains("empty") && e.contains(PASSWORD_FILE_FLAG), "{e}");

        let missing = RedisSecurity {
            password_file: Some(dir.join("nope")),
            ..RedisSecurity::default()
        };
        let e = missing.load_password().unwrap_err().to_string();
        assert!(e.contains(PASSWORD_FILE_FLAG) && e.contains("nope"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn file_errors_name_the_flag_and_the_path_not_the_contents() {
        let dir = temp_dir("files");
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n").unwrap();
        let ca = RedisSecurity {
            ca: Some(junk.clone()),
            ..RedisSecurity::default()
        };
        let e = ca.load().err().expect("a bad CA").to_string();
        assert!(e.contains(CA_FLAG) && e.contains("junk.pem"), "{e}");
        assert!(!e.contains("not base64"), "{e}");

        let missing = RedisSecurity {
            ca: Some(dir.join("absent.crt")),
            ..RedisSecurity::default()
        };
        let e = missing.load().err().expect("a missing CA").to_string();
        assert!(e.contains(CA_FLAG) && e.contains("absent.crt"), "{e}");

        let half = RedisSecurity {
            client_cert: Some(junk.clone()),
            ..RedisSecurity::default()
        };
        let e = half.load().err().expect("a cert without a key").to_string();
        assert!(
            e.contains(CLIENT_CERT_FLAG) && e.contains(CLIENT_KEY_FLAG),
            "{e}"
        );
        let half = RedisSecurity {
            client_key: Some(junk.clone()),
            ..RedisSecurity::default()
        };
        let e = half.load().err().expect("a key without a cert").to_string();
        assert!(
            e.contains(CLIENT_CERT_FLAG) && e.contains(CLIENT_KEY_FLAG),
            "{e}"
        );

        let key = dir.join("key.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let bad_key = RedisSecurity {
            client_cert: Some(junk.clone()),
            client_key: Some(key.clone()),
            ..RedisSecurity::default()
        };
        let e = bad_key.load().err().expect("bad files").to_string();
        assert!(!e.contains("c2VjcmV0"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn client_certificates_load_and_a_key_of_another_one_is_refused() {
        let dir = temp_dir("keys");
        let ca = tollgate_e2e::pki::TestCa::new("unit CA");
        let one = ca.client(&dir, "one", None);
        let two = ca.client(&dir, "two", None);
        let good = RedisSecurity {
            ca: Some(ca.write_cert(&dir, "ca.crt")),
            client_cert: Some(one.cert.clone()),
            client_key: Some(one.key.clone()),
            ..RedisSecurity::default()
        };
        let loaded = good.load().expect("matching files load");
        let tls = loaded.tls.expect("TLS settings");
        assert!(tls.root_cert.is_some() && tls.client_tls.is_some());
        assert!(good.client("rediss://127.0.0.1:6380").is_ok());
        let e = good
            .client("redis://127.0.0.1:6379")
            .expect_err("TLS files with redis://")
            .to_string();
        assert!(e.contains("use rediss://"), "{e}");

        let mismatched = RedisSecurity {
            client_key: Some(two.key.clone()),
            ..good
        };
        let e = mismatched.load().err().expect("another key").to_string();
        assert!(
            e.contains(CLIENT_KEY_FLAG) && e.contains(CLIENT_CERT_FLAG),
            "{e}"
        );
        assert!(e.contains("two.key") && e.contains("one.crt"), "{e}");
        for line in two.key_pem.lines().chain(one.key_pem.lines()) {
            assert!(!e.contains(line), "key material in {e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tls_files_need_a_tls_url_and_credentials_one_source() {
        let tls = RedisSecurity {
            ca: Some(PathBuf::from("/nonexistent/ca.crt")),
            ..RedisSecurity::default()
        };
        // The scheme is checked against the settings, whatever the files hold.
        let e = tls
            .connection("redis://127.0.0.1:6379", &Loaded::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("use rediss://"), "{e}");
        assert!(tls
            .connection("rediss://127.0.0.1:6379", &Loaded::default())
            .is_ok());
        let e = tls
            .connection("rediss://127.0.0.1:6379/#insecure", &Loaded::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("#insecure"), "{e}");

        let plain = RedisSecurity::default();
        let with_password = Loaded {
            password: Some("pw2".into()),
            ..Loaded::default()
        };
        let e = plain
            .connection("redis://u:pw1@127.0.0.1:6379", &with_password)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("give one") && !e.contains("pw1") && !e.contains("pw2"),
            "{e}"
        );
        let info = plain
            .connection("redis://u:pw1@127.0.0.1:6379", &Loaded::default())
            .unwrap();
        assert_eq!(info.redis_settings().password(), Some("pw1"));

        let e = plain
            .connection(
                "redis://127.0.0.1:6379",
                &Loaded {
                    username: Some("alice".into()),
                    ..Loaded::default()
                },
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("without a password"), "{e}");
        let info = plain
            .connection(
                "redis://127.0.0.1:6379",
                &Loaded {
                    username: Some("alice".into()),
                    password: Some("pw".into()),
                    ..Loaded::default()
                },
            )
            .unwrap();
        assert_eq!(info.redis_settings().username(), Some("alice"));
        assert_eq!(info.redis_settings().password(), Some("pw"));
        let e = plain
            .connection(
                "redis://bob:pw@127.0.0.1:6379",
                &Loaded {
                    username: Some("alice".into()),
                    ..Loaded::default()
                },
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bob") && e.contains("alice") && !e.contains("pw@"),
            "{e}"
        );
    }
}
