//! Who may call `kvasir.v1.Indexer`: a shared bearer token.
//!
//! With `--grpc-token-file` every call (Pick, Report, PoolState, Session)
//! must carry the metadata `authorization: Bearer <token>`, the token being
//! the file's content with surrounding whitespace trimmed (Envoy injects it
//! with its credential injector on the indexer cluster). Anything else is
//! `UNAUTHENTICATED` and counted. `grpc.health.v1` stays open: probes and
//! Envoy's health checks carry no credentials.
//!
//! Tokens are compared as SHA-256 digests, byte by byte without an early
//! exit, so the time a check takes says nothing about how much of a guess
//! was right. The file is re-read every [`RELOAD_INTERVAL`] (a mounted
//! Kubernetes Secret is rotated in place); a file that turns empty or
//! unreadable keeps the last good token and logs why.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::metrics::Counter;

/// How often the token file is re-read.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file could not be read.
    #[error("reading gRPC token file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file holds only whitespace.
    #[error("gRPC token file {0} is empty")]
    Empty(PathBuf),
}

type TokenDigest = [u8; 32];

fn digest(token: &[u8]) -> TokenDigest {
    Sha256::digest(token).into()
}

/// Equality without an early exit.
fn same(a: &TokenDigest, b: &TokenDigest) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn read_token(path: &Path) -> Result<TokenDigest, TokenError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenError::Empty(path.to_path_buf()));
    }
    Ok(digest(token.as_bytes()))
}

/// The expected token (as its digest), kept in step with its file.
#[derive(Debug)]
pub struct TokenAuth {
    path: PathBuf,
    expected: RwLock<TokenDigest>,
}

impl TokenAuth {
    /// Reads the token file; an unreadable or empty file is an error (the
    /// indexer does not start).
    pub fn load(path: &Path) -> Result<Self, TokenError> {
        Ok(TokenAuth {
            path: path.to_path_buf(),
            expected: RwLock::new(read_token(path)?),
        })
    }

    /// Re-reads the file. True when the token changed; on error the last
    /// good token stays.
    pub fn reload(&self) -> Result<bool, TokenError> {
        let d = read_token(&self.path)?;
        let mut g = self.expected.write();
        let changed = !same(&g, &d);
        *g = d;
        Ok(changed)
    }

    /// Whether `token` is the expected one.
    pub fn accepts(&self, token: &str) -> bool {
        same(&self.expected.read(), &digest(token.as_bytes()))
    }

    /// Re-reads the file every [`RELOAD_INTERVAL`] until `cancel`; logs
    /// changes and failures (a failure is logged once until it clears).
    pub async fn reload_loop(self: Arc<Self>, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(RELOAD_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.reload() {
                Ok(changed) => {
                    if changed {
                        tracing::info!(file = %self.path.display(), "gRPC token reloaded");
                    }
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        tracing::error!(error = %e, "gRPC token file unusable; keeping the last good token");
                    }
                    failing = true;
                }
            }
        }
    }
}

/// Unauthenticated calls refused, by reason.
#[derive(Debug, Default)]
pub struct AuthMetrics {
    /// No `authorization: Bearer ...` metadata.
    pub missing: Counter,
    /// A token that is not the expected one.
    pub invalid: Counter,
}

/// The tonic interceptor in front of `kvasir.v1.Indexer`: checks the
/// bearer token when there is one to check (none: every call passes).
#[derive(Debug, Clone)]
pub struct Authenticator {
    auth: Option<Arc<TokenAuth>>,
    metrics: Arc<AuthMetrics>,
}

impl Authenticator {
    /// An interceptor checking against `auth` (none: open), counting into
    /// `metrics`.
    pub fn new(auth: Option<Arc<TokenAuth>>, metrics: Arc<AuthMetrics>) -> Self {
        Authenticator { auth, metrics }
    }

    /// Checks a call's metadata.
    pub fn check(&self, md: &tonic::metadata::MetadataMap) -> Result<(), tonic::Status> {
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        let token = md
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, rest) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            });
        match token {
            None => {
                self.metrics.missing.inc();
                Err(tonic::Status::unauthenticated(
                    "authorization: the indexer needs `authorization: Bearer <token>` metadata (see --grpc-token-file)",
                ))
            }
            Some(t) if auth.accepts(t) => Ok(()),
            Some(_) => {
                self.metrics.invalid.inc();
                Err(tonic::Status::unauthenticated(
                    "authorization: the bearer token is not valid",
                ))
            }
        }
    }
}

impl tonic::service::Interceptor for Authenticator {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        self.check(req.metadata())?;
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataMap;

    fn md(value: Option<&str>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(v) = value {
            m.insert("authorization", v.parse().unwrap());
        }
        m
    }

    #[test]
    fn bearer_token_is_checked_and_refusals_counted() {
        let dir = std::env::temp_dir().join(format!("kvasir-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "  s3cret\n").unwrap();
        let metrics = Arc::new(AuthMetrics::default());
        let auth = Arc::new(TokenAuth::load(&file).unwrap());
        let a = Authenticator::new(Some(Arc::clone(&auth)), Arc::clone(&metrics));
        assert!(a.check(&md(Some("Bearer s3cret"))).is_ok());
        assert!(a.check(&md(Some("bearer  s3cret "))).is_ok());
        let e = a.check(&md(None)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("Bearer"), "{}", e.message());
        for bad in ["Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"] {
            assert!(a.check(&md(Some(bad))).is_err(), "{bad}");
        }
        assert_eq!((metrics.missing.get(), metrics.invalid.get()), (3, 2));

        // Rotation: the new token replaces the old; an empty or missing
        // file keeps the last good one.
        std::fs::write(&file, "n3w").unwrap();
        assert!(auth.reload().unwrap());
        assert!(a.check(&md(Some("Bearer n3w"))).is_ok());
        assert!(a.check(&md(Some("Bearer s3cret"))).is_err());
        std::fs::write(&file, " \n").unwrap();
        assert!(matches!(auth.reload(), Err(TokenError::Empty(_))));
        std::fs::remove_file(&file).unwrap();
        assert!(matches!(auth.reload(), Err(TokenError::Read { .. })));
        assert!(a.check(&md(Some("Bearer n3w"))).is_ok());
        assert!(TokenAuth::load(&file).is_err(), "no file, no start");
        let _ = std::fs::remove_dir_all(&dir);

        let open = Authenticator::new(None, metrics);
        assert!(open.check(&md(None)).is_ok());
    }
}
