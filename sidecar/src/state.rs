//! [`AppState`]: what every request handler (the proxy, the control API, `/metrics`)
//! shares. Built once, when a sidecar starts (`Sidecar::start`).

use std::sync::Arc;
use std::time::Duration;

use crate::budget::MemoryBudget;
use crate::config::Config;
use crate::episodes::Episodes;
use crate::metrics::Metrics;
use crate::policy::PolicyFollower;
use crate::sink::{RecordSink, Recorder};
use crate::upstream::Upstream;

/// Everything a request handler needs.
#[derive(Debug)]
pub struct AppState {
    /// Validated settings.
    pub config: Config,
    /// Upstream base URL without a trailing slash; request paths are appended to it.
    pub upstream_base: String,
    /// Store URL, safe to log.
    pub store_display: String,
    /// Connections to the upstream.
    pub upstream: Arc<Upstream>,
    /// Where records go.
    pub sink: Arc<dyn RecordSink>,
    /// The recorder behind `sink` (store health).
    pub recorder: Option<Arc<Recorder>>,
    /// How long a response's last byte may wait for its record to reach the spool
    /// (`None`: as long as it takes, the `block` policy).
    pub ack_wait: Option<Duration>,
    /// Open episodes and the binding.
    pub episodes: Episodes,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// What captures may hold in total (`--memory-budget-bytes`), shared with the
    /// segment builder.
    pub budget: Arc<MemoryBudget>,
    /// The policy followed (`--policy`), if any.
    pub policy: Option<Arc<PolicyFollower>>,
}
