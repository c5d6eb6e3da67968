//! The same API for code without an async runtime. Each client owns a small
//! single-threaded Tokio runtime; do not call these methods from inside async code.
//!
//! ```
//! use tapline_sdk::EndStatus;
//! use tapline_sdk::blocking::Client;
//!
//! let client = Client::builder().url("http://127.0.0.1:9").build()?; // fail-open: no sidecar needed
//! let episode = client.start_episode("task-1", Default::default())?.guard();
//! episode.reward(0.5)?;
//! episode.end(EndStatus::Succeeded)?;
//! # Ok::<(), tapline_sdk::Error>(())
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;
use tokio::runtime::Runtime;

use crate::{EndStatus, EpisodeOptions, Error, Reward};

fn runtime() -> Result<Arc<Runtime>, Error> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|e| Error::InvalidArgument(format!("cannot start the SDK's runtime: {e}")))
}

/// Builds a blocking [`Client`].
#[derive(Debug, Clone, Default)]
pub struct ClientBuilder(crate::ClientBuilder);

impl ClientBuilder {
    /// See [`crate::ClientBuilder::url`].
    pub fn url(self, url: impl Into<String>) -> Self {
        ClientBuilder(self.0.url(url))
    }

    /// See [`crate::ClientBuilder::token`].
    pub fn token(self, token: impl Into<String>) -> Self {
        ClientBuilder(self.0.token(token))
    }

    /// See [`crate::ClientBuilder::fail_open`].
    pub fn fail_open(self, fail_open: bool) -> Self {
        ClientBuilder(self.0.fail_open(fail_open))
    }

    /// See [`crate::ClientBuilder::timeout`].
    pub fn timeout(self, timeout: std::time::Duration) -> Self {
        ClientBuilder(self.0.timeout(timeout))
    }

    /// Builds the client.
    pub fn build(self) -> Result<Client, Error> {
        Ok(Client {
            inner: self.0.build()?,
            runtime: runtime()?,
        })
    }
}

/// A blocking client of one sidecar.
#[derive(Debug, Clone)]
pub struct Client {
    inner: crate::Client,
    runtime: Arc<Runtime>,
}

impl Client {
    /// See [`crate::Client::from_env`].
    pub fn from_env() -> Result<Client, Error> {
        ClientBuilder::default().build()
    }

    /// See [`crate::Client::new`].
    pub fn new(url: impl Into<String>) -> Result<Client, Error> {
        ClientBuilder::default().url(url).build()
    }

    /// A builder for other settings.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// See [`crate::Client::start_episode`].
    pub fn start_episode(&self, task_id: &str, options: EpisodeOptions) -> Result<Episode, Error> {
        let inner = self
            .runtime
            .block_on(self.inner.start_episode(task_id, options))?;
        Ok(Episode {
            inner,
            runtime: self.runtime.clone(),
        })
    }
}

/// A blocking handle of an episode.
#[derive(Debug)]
pub struct Episode {
    inner: crate::Episode,
    runtime: Arc<Runtime>,
}

impl Episode {
    /// See [`crate::Episode::id`].
    pub fn id(&self) -> Option<&str> {
        self.inner.id()
    }

    /// See [`crate::Episode::base_url`].
    pub fn base_url(&self) -> &str {
        self.inner.base_url()
    }

    /// See [`crate::Episode::anthropic_base_url`].
    pub fn anthropic_base_url(&self) -> &str {
        self.inner.anthropic_base_url()
    }

    /// See [`crate::Episode::reward`].
    pub fn reward(&self, value: f64) -> Result<(), Error> {
        self.runtime.block_on(self.inner.reward(value))
    }

    /// See [`crate::Episode::reward_component`].
    pub fn reward_component(&self, name: &str, value: f64) -> Result<(), Error> {
        self.runtime
            .block_on(self.inner.reward_component(name, value))
    }

    /// See [`crate::Episode::reward_call`].
    pub fn reward_call(&self, span_id: &str, value: f64) -> Result<(), Error> {
        self.runtime
            .block_on(self.inner.reward_call(span_id, value))
    }

    /// See [`crate::Episode::reward_with`].
    pub fn reward_with(&self, reward: Reward) -> Result<(), Error> {
        self.runtime.block_on(self.inner.reward_with(reward))
    }

    /// See [`crate::Episode::end`].
    pub fn end(&self, status: EndStatus) -> Result<(), Error> {
        self.runtime.block_on(self.inner.end(status))
    }

    /// See [`crate::Episode::end_with`].
    pub fn end_with(
        &self,
        status: EndStatus,
        metadata: BTreeMap<String, Value>,
    ) -> Result<(), Error> {
        self.runtime.block_on(self.inner.end_with(status, metadata))
    }

    /// Ends the episode as aborted if it is dropped without being ended.
    pub fn guard(self) -> EpisodeGuard {
        EpisodeGuard {
            episode: Some(self),
        }
    }
}

/// Ends its episode as aborted when dropped unless it was ended. Derefs to [`Episode`].
#[derive(Debug)]
pub struct EpisodeGuard {
    episode: Option<Episode>,
}

impl std::ops::Deref for EpisodeGuard {
    type Target = Episode;

    fn deref(&self) -> &Episode {
        self.episode.as_ref().expect("present until drop")
    }
}

impl Drop for EpisodeGuard {
    fn drop(&mut self) {
        if let Some(episode) = self.episode.take()
            && !episode.inner.is_ended()
            && episode.inner.id().is_some()
            && let Err(error) = episode.end(EndStatus::Aborted)
        {
            tracing::warn!(%error, "could not end the dropped episode as aborted");
        }
    }
}
