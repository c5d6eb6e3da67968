//! Following a policy (`--policy NAME`): the sidecar reads the policy's announcement
//! (`{prefix}/policies/NAME.json`, see `tapline_proto::policy`) every poll interval, with a
//! conditional GET on the ETag it last saw, and keeps the version announced last. The
//! proxy asks [`PolicyFollower::route`] for each call: a call whose model is the alias goes
//! to the served name of the current version and is recorded with that version.
//!
//! Versions only go up: an announcement of an older version than the one followed is
//! ignored (with a warning). Until the first announcement, calls pass unchanged. A store
//! that cannot be read keeps the current version (and shows in `/tapline/v1/health`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use object_store::path::Path;
use object_store::{GetOptions, ObjectStore};
use tapline_proto::policy::{Announcement, announcement_path};

use crate::config::PolicyConfig;

/// The version calls for the policy go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Current {
    /// Announced version.
    pub version: u64,
    /// Model name the inference servers serve it under.
    pub served_model: String,
}

/// Reads a policy's announcements and answers which version a call goes to.
#[derive(Debug)]
pub struct PolicyFollower {
    config: PolicyConfig,
    store: Arc<dyn ObjectStore>,
    path: Path,
    current: RwLock<Option<Current>>,
    etag: Mutex<Option<String>>,
    last_error: Mutex<Option<String>>,
    /// Calls sent to the current version instead of the alias.
    pub rewrites: AtomicU64,
    /// Requests refused because their body was over the capture cap, so their model
    /// could not be read (413 while a version is followed).
    pub refused_too_large: AtomicU64,
}

impl PolicyFollower {
    /// A follower of `config.name` in the store under `prefix`; nothing is read yet.
    pub fn new(config: PolicyConfig, store: Arc<dyn ObjectStore>, prefix: &Path) -> Self {
        let path = announcement_path(prefix, &config.name);
        PolicyFollower {
            config,
            store,
            path,
            current: RwLock::new(None),
            etag: Mutex::new(None),
            last_error: Mutex::new(None),
            rewrites: AtomicU64::new(0),
            refused_too_large: AtomicU64::new(0),
        }
    }

    /// The policy's settings.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// The version calls for the policy go to now, if one was announced.
    pub fn current(&self) -> Option<Current> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The last error reading the announcement, if the last read failed.
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Where a call asking for `model` goes: the current version when `model` is the
    /// alias and a version was announced.
    pub fn route(&self, model: &str) -> Option<Current> {
        if model == self.config.alias {
            self.current()
        } else {
            None
        }
    }

    /// Reads the announcement once (conditionally on the last ETag). Returns whether the
    /// version followed changed.
    pub async fn poll(&self) -> bool {
        let etag = self.etag.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let options = GetOptions {
            if_none_match: etag,
            ..Default::default()
        };
        let read = async {
            let got = self.store.get_opts(&self.path, options).await?;
            let tag = got.meta.e_tag.clone();
            Ok::<_, object_store::Error>((tag, got.bytes().await?))
        };
        let (tag, bytes) = match read.await {
            Ok(read) => read,
            Err(object_store::Error::NotModified { .. }) => {
                self.set_error(None);
                return false;
            }
            Err(object_store::Error::NotFound { .. }) => {
                // Not announced yet: calls pass unchanged.
                self.set_error(None);
                return false;
            }
            Err(e) => {
                self.set_error(Some(format!("cannot read {}: {e}", self.path)));
                return false;
            }
        };
        let announcement = match Announcement::parse(&bytes, &self.config.name) {
            Ok(a) => a,
            Err(e) => {
                // Read it again next time: a fixed object gets a new ETag anyway.
                self.set_error(Some(e));
                return false;
            }
        };
        *self.etag.lock().unwrap_or_else(|p| p.into_inner()) = tag;
        self.set_error(None);
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        if let Some(now) = current.as_ref()
            && announcement.version <= now.version
        {
            if announcement.version < now.version {
                tracing::warn!(
                    policy = %self.config.name,
                    followed = now.version,
                    announced = announcement.version,
                    "the announced version is older than the one followed; keeping it (versions only go up)"
                );
            }
            return false;
        }
        tracing::info!(
            policy = %self.config.name,
            version = announcement.version,
            served_model = %announcement.served_model,
            "following a new policy version"
        );
        *current = Some(Current {
            version: announcement.version,
            served_model: announcement.served_model,
        });
        true
    }

    /// Adds the policy's metrics to a `/metrics` scrape.
    pub fn expose(&self, out: &mut crate::metrics::Exposition) {
        let name = self.config.name.clone();
        let labels = || vec![("policy", name.clone())];
        out.gauge(
            "tapline_policy_version",
            "Version of the followed policy that calls for its alias go to (0: none announced yet).",
            vec![(
                labels(),
                crate::metrics::Gauge::Int(self.current().map_or(0, |c| c.version)),
            )],
        );
        out.counter(
            "tapline_policy_rewrites_total",
            "Calls sent to the followed policy version instead of the alias.",
            vec![(labels(), self.rewrites.load(Ordering::Relaxed))],
        );
        out.counter(
            "tapline_policy_refused_too_large_total",
            "Requests refused (413) because their body was over the capture cap, so their model could not be read.",
            vec![(labels(), self.refused_too_large.load(Ordering::Relaxed))],
        );
    }

    /// What `/tapline/v1/health` says about the policy.
    pub fn health(&self) -> serde_json::Value {
        let current = self.current();
        serde_json::json!({
            "name": self.config.name,
            "alias": self.config.alias,
            "version": current.as_ref().map(|c| c.version),
            "served_model": current.map(|c| c.served_model),
            "rewrites": self.rewrites.load(Ordering::Relaxed),
            "refused_too_large": self.refused_too_large.load(Ordering::Relaxed),
            "error": self.last_error(),
        })
    }

    fn set_error(&self, error: Option<String>) {
        if let Some(e) = &error {
            tracing::warn!(policy = %self.config.name, error = %e, "policy announcement unreadable");
        }
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = error;
    }

    /// Polls every interval until `stop` says so.
    pub async fn run(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.config.poll) => {}
                _ = stop.changed() => return,
            }
            self.poll().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::PutPayload;
    use object_store::memory::InMemory;
    use std::time::Duration;
    use tapline_proto::policy::{FORMAT, served_model};

    fn announcement(version: u64) -> PutPayload {
        let a = Announcement {
            format: FORMAT.into(),
            name: "coder".into(),
            version,
            served_model: served_model("coder", version),
            adapter: Some(format!("/adapters/coder/v{version}")),
            checkpoint: None,
            run: "r".into(),
            manifest_sha256: String::new(),
            time: String::new(),
        };
        serde_json::to_vec(&a).unwrap().into()
    }

    #[tokio::test]
    async fn follows_announcements_up_and_only_up() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let prefix = Path::from("p");
        let f = PolicyFollower::new(
            PolicyConfig {
                name: "coder".into(),
                alias: "policy".into(),
                poll: Duration::from_secs(1),
            },
            store.clone(),
            &prefix,
        );
        assert!(!f.poll().await, "nothing announced");
        assert_eq!(f.route("policy"), None);
        assert_eq!(f.last_error(), None);
        let path = announcement_path(&prefix, "coder");
        store.put(&path, announcement(1)).await.unwrap();
        assert!(f.poll().await);
        assert_eq!(
            f.route("policy"),
            Some(Current {
                version: 1,
                served_model: "coder@v1".into()
            })
        );
        assert_eq!(f.route("coder"), None, "only the alias is routed");
        assert!(!f.poll().await, "unchanged: not modified");
        store.put(&path, announcement(3)).await.unwrap();
        assert!(f.poll().await);
        assert_eq!(f.current().unwrap().version, 3);
        store.put(&path, announcement(2)).await.unwrap();
        assert!(!f.poll().await, "an older version is not followed");
        assert_eq!(f.current().unwrap().version, 3);
        store
            .put(&path, PutPayload::from_static(b"{not json"))
            .await
            .unwrap();
        assert!(!f.poll().await);
        assert!(f.last_error().unwrap().contains("not valid JSON"));
        assert_eq!(
            f.current().unwrap().version,
            3,
            "a bad object keeps the version"
        );
        store.put(&path, announcement(4)).await.unwrap();
        assert!(f.poll().await);
        assert_eq!(f.last_error(), None);
    }
}
