//! Report episodes and rewards from an agent harness to its tapline sidecar.
//!
//! A harness keeps its own loop; tapline only needs to know where an episode starts and
//! ends and what it earned. Start an episode, hand its [`Episode::base_url`] to the LLM
//! client (every call through it is attributed to the episode), report rewards, end it:
//!
//! ```
//! use tapline_sdk::{Client, EndStatus, EpisodeOptions};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tapline_sdk::Error> {
//! // In a harness: `Client::from_env()?` (TAPLINE_SIDECAR_URL, default http://127.0.0.1:4100).
//! // Here no sidecar runs, and fail-open (the default) keeps the harness going anyway.
//! let client = Client::builder().url("http://127.0.0.1:9").build()?;
//! let episode = client
//!     .start_episode("task-42", EpisodeOptions { group_id: Some("batch-7".into()), ..Default::default() })
//!     .await?;
//! let base_url = episode.base_url(); // give this to the OpenAI client
//! # let _ = base_url;
//! episode.reward_component("tests_passed", 0.8).await?;
//! episode.reward(1.0).await?;
//! episode.end(EndStatus::Succeeded).await?;
//! # Ok(())
//! # }
//! ```
//!
//! - Values must be finite: NaN and infinities are refused with [`Error::InvalidValue`]
//!   before anything is sent.
//! - Fail-open (the default): when the sidecar cannot be reached, calls log a warning and
//!   succeed, so a reward call never takes the harness down. A request the sidecar
//!   refuses (a bug in the harness) is still an error. [`ClientBuilder::fail_open`] turns
//!   this off.
//! - [`Episode::guard`] ends the episode as aborted if it is dropped without being ended.
//! - [`blocking`] wraps the same API for code without an async runtime.

#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

pub mod blocking;

/// Default sidecar address.
pub const DEFAULT_URL: &str = "http://127.0.0.1:4100";

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A reward value is NaN or infinite.
    #[error("reward value must be a finite number, got {value}")]
    InvalidValue {
        /// The refused value.
        value: f64,
    },
    /// An argument cannot be sent (empty task id, bad URL, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The sidecar could not be reached (fail-closed mode only).
    #[error("tapline sidecar at {url} is unreachable: {source}")]
    Unavailable {
        /// The sidecar URL.
        url: String,
        /// The transport error.
        source: reqwest::Error,
    },
    /// The sidecar refused the request.
    #[error("tapline sidecar refused the request ({status}, {code}): {message}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// Error code from the sidecar (e.g. `invalid_value`).
        code: String,
        /// The sidecar's explanation.
        message: String,
    },
}

/// How an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndStatus {
    /// The harness finished the task (whatever the reward).
    Succeeded,
    /// The harness gave up or hit an error.
    Failed,
    /// The harness ran out of time or turns.
    TimedOut,
    /// The episode was abandoned.
    Aborted,
}

impl EndStatus {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EndStatus::Succeeded => "succeeded",
            EndStatus::Failed => "failed",
            EndStatus::TimedOut => "timed_out",
            EndStatus::Aborted => "aborted",
        }
    }
}

/// Options of a new episode.
#[derive(Debug, Clone, Default)]
pub struct EpisodeOptions {
    /// Episodes of one task with the same group id are compared with each other.
    pub group_id: Option<String>,
    /// Free-form metadata (recorded with the episode's start).
    pub metadata: BTreeMap<String, Value>,
    /// Attribute every call through this sidecar to this episode, also those made with
    /// the sidecar's plain base URL (for harnesses whose base URL is fixed).
    pub bind: bool,
}

/// A reward with every option.
#[derive(Debug, Clone, Default)]
pub struct Reward {
    /// The value; must be finite.
    pub value: f64,
    /// Component name (e.g. `format_ok`); `None` for the final scalar reward.
    pub name: Option<String>,
    /// The call this reward is for (the `x-tapline-span-id` response header); `None`
    /// for the whole episode.
    pub span_id: Option<String>,
    /// Free-form tags.
    pub tags: BTreeMap<String, String>,
}

/// Builds a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    url: Option<String>,
    token: Option<String>,
    fail_open: bool,
    timeout: Duration,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        ClientBuilder {
            url: None,
            token: None,
            fail_open: true,
            timeout: Duration::from_secs(5),
        }
    }
}

impl ClientBuilder {
    /// The sidecar's URL [default: `TAPLINE_SIDECAR_URL`, else `http://127.0.0.1:4100`].
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// The sidecar's control token [default: `TAPLINE_CONTROL_TOKEN`, if set].
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Whether an unreachable sidecar is logged and ignored (true, the default) or an
    /// error.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.fail_open = fail_open;
        self
    }

    /// Timeout of each request [default: 5 s].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Builds the client.
    pub fn build(self) -> Result<Client, Error> {
        let url = self
            .url
            .or_else(|| std::env::var("TAPLINE_SIDECAR_URL").ok())
            .unwrap_or_else(|| DEFAULT_URL.to_owned());
        let url = url.trim_end_matches('/').to_owned();
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(Error::InvalidArgument(format!(
                "sidecar URL {url:?} must start with http:// or https://"
            )));
        }
        let token = self
            .token
            .or_else(|| std::env::var("TAPLINE_CONTROL_TOKEN").ok())
            .filter(|t| !t.is_empty());
        let http = reqwest::Client::builder()
            .timeout(self.timeout)
            .build()
            .map_err(|e| Error::InvalidArgument(format!("cannot build HTTP client: {e}")))?;
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                url,
                token,
                fail_open: self.fail_open,
            }),
        })
    }
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    url: String,
    token: Option<String>,
    fail_open: bool,
}

/// A client of one sidecar's control API. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// A client configured from the environment (`TAPLINE_SIDECAR_URL`,
    /// `TAPLINE_CONTROL_TOKEN`), fail-open.
    pub fn from_env() -> Result<Client, Error> {
        ClientBuilder::default().build()
    }

    /// A client of the sidecar at `url`, fail-open.
    pub fn new(url: impl Into<String>) -> Result<Client, Error> {
        ClientBuilder::default().url(url).build()
    }

    /// A builder for other settings.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// The sidecar's URL.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// Sends one control request. `Ok(None)` means the sidecar was unreachable and the
    /// client is fail-open.
    async fn call(&self, path: &str, body: Value) -> Result<Option<Value>, Error> {
        let url = format!("{}/tapline/v1/{path}", self.inner.url);
        let mut request = self.inner.http.post(&url).json(&body);
        if let Some(token) = &self.inner.token {
            request = request.bearer_auth(token);
        }
        let response = match request.send().await {
            Ok(response) => response,
            Err(source) => {
                if self.inner.fail_open {
                    tracing::warn!(url = %self.inner.url, error = %source, "tapline sidecar unreachable; continuing without it (fail-open)");
                    return Ok(None);
                }
                return Err(Error::Unavailable {
                    url: self.inner.url.clone(),
                    source,
                });
            }
        };
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(Some(body));
        }
        let text = |key: &str| body["error"][key].as_str().unwrap_or_default().to_owned();
        Err(Error::Rejected {
            status: status.as_u16(),
            code: text("code"),
            message: text("message"),
        })
    }

    /// Starts an episode of `task_id`.
    pub async fn start_episode(
        &self,
        task_id: &str,
        options: EpisodeOptions,
    ) -> Result<Episode, Error> {
        if task_id.trim().is_empty() {
            return Err(Error::InvalidArgument("task_id must not be empty".into()));
        }
        let mut body =
            json!({"task_id": task_id, "metadata": options.metadata, "bind": options.bind});
        if let Some(group) = &options.group_id {
            body["group_id"] = json!(group);
        }
        let reply = self.call("episodes", body).await?;
        let (id, base_url) = match reply {
            Some(reply) => {
                let id = reply["episode_id"].as_str().unwrap_or_default().to_owned();
                let base = reply["base_url"]
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("{}/e/{id}/v1", self.inner.url));
                (Some(id), base)
            }
            // Fail-open: no episode, and the plain sidecar URL still proxies the calls.
            None => (None, format!("{}/v1", self.inner.url)),
        };
        Ok(Episode {
            client: self.clone(),
            id,
            base_url,
            ended: AtomicBool::new(false),
        })
    }
}

/// An episode started on the sidecar.
#[derive(Debug)]
pub struct Episode {
    client: Client,
    id: Option<String>,
    base_url: String,
    ended: AtomicBool,
}

impl Episode {
    /// The episode id; `None` when the sidecar was unreachable (fail-open).
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The base URL for OpenAI-style clients (`.../e/{id}/v1`).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The base URL for Anthropic clients, which append `/v1/messages` themselves.
    pub fn anthropic_base_url(&self) -> &str {
        self.base_url.strip_suffix("/v1").unwrap_or(&self.base_url)
    }

    /// Reports the episode's final scalar reward.
    pub async fn reward(&self, value: f64) -> Result<(), Error> {
        self.reward_with(Reward {
            value,
            ..Default::default()
        })
        .await
    }

    /// Reports a named reward component (combined by the trainer's weights).
    pub async fn reward_component(&self, name: &str, value: f64) -> Result<(), Error> {
        self.reward_with(Reward {
            value,
            name: Some(name.to_owned()),
            ..Default::default()
        })
        .await
    }

    /// Reports a reward for one call, by the span id the sidecar returned in
    /// `x-tapline-span-id`.
    pub async fn reward_call(&self, span_id: &str, value: f64) -> Result<(), Error> {
        self.reward_with(Reward {
            value,
            span_id: Some(span_id.to_owned()),
            ..Default::default()
        })
        .await
    }

    /// Reports a reward with every option.
    ///
    /// Rewards come before [`Episode::end`]: the sidecar refuses a reward for an ended
    /// episode (409 `episode_ended`, returned as an error) and records nothing.
    pub async fn reward_with(&self, reward: Reward) -> Result<(), Error> {
        if !reward.value.is_finite() {
            return Err(Error::InvalidValue {
                value: reward.value,
            });
        }
        let Some(id) = &self.id else { return Ok(()) };
        let mut body = json!({"value": reward.value, "tags": reward.tags});
        if let Some(name) = reward.name {
            body["name"] = json!(name);
        }
        if let Some(span) = reward.span_id {
            body["span_id"] = json!(span);
        }
        self.client
            .call(&format!("episodes/{id}/rewards"), body)
            .await?;
        Ok(())
    }

    /// Ends the episode. Ending twice is an error.
    pub async fn end(&self, status: EndStatus) -> Result<(), Error> {
        self.end_with(status, BTreeMap::new()).await
    }

    /// Ends the episode with metadata.
    pub async fn end_with(
        &self,
        status: EndStatus,
        metadata: BTreeMap<String, Value>,
    ) -> Result<(), Error> {
        if self.ended.swap(true, Ordering::SeqCst) {
            return Err(Error::InvalidArgument(
                "the episode was already ended".into(),
            ));
        }
        let Some(id) = &self.id else { return Ok(()) };
        self.client
            .call(
                &format!("episodes/{id}/end"),
                json!({"status": status.as_str(), "metadata": metadata}),
            )
            .await?;
        Ok(())
    }

    /// Whether [`Episode::end`] was called.
    pub fn is_ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// Wraps the episode so that it ends as aborted if dropped without being ended
    /// (a panic, an early `?` return). Needs a Tokio runtime when dropped.
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
        let Some(episode) = self.episode.take() else {
            return;
        };
        if episode.is_ended() || episode.id.is_none() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if let Err(error) = episode.end(EndStatus::Aborted).await {
                        tracing::warn!(%error, "could not end the dropped episode as aborted");
                    }
                });
            }
            Err(_) => {
                // No runtime here: end it from a short-lived one on another thread.
                let _ = std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build();
                    if let Ok(runtime) = runtime
                        && let Err(error) = runtime.block_on(episode.end(EndStatus::Aborted))
                    {
                        tracing::warn!(%error, "could not end the dropped episode as aborted");
                    }
                })
                .join();
            }
        }
    }
}
