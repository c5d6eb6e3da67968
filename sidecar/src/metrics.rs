//! Counters of the sidecar, served at `/metrics` in the OpenMetrics text format that
//! Prometheus scrapes, encoded by the `prometheus-client` crate ([`Exposition`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tapline_proto::{Api, Outcome};

const APIS: [Api; 5] = [
    Api::ChatCompletions,
    Api::Completions,
    Api::Responses,
    Api::AnthropicMessages,
    Api::Other,
];
const OUTCOMES: [Outcome; 5] = [
    Outcome::Ok,
    Outcome::UpstreamError,
    Outcome::UpstreamUnreachable,
    Outcome::Timeout,
    Outcome::ClientAborted,
];
/// Upper bounds (seconds) of the added-latency histogram buckets.
const LATENCY_BUCKETS: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
];

/// All counters. Cheap to update from any thread.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: [AtomicU64; 6],
    outcomes: [AtomicU64; 6],
    /// Request body bytes received from clients.
    pub request_bytes: AtomicU64,
    /// Response body bytes sent to clients.
    pub response_bytes: AtomicU64,
    /// Control API requests.
    pub control_requests: AtomicU64,
    /// Control API requests refused with 4xx.
    pub control_errors: AtomicU64,
    /// Records written to the spool (captured).
    pub records_spooled: AtomicU64,
    /// Records dropped (spool full or failing, queue full, shutting down).
    pub records_dropped: AtomicU64,
    /// Bytes of spool files (gauge).
    pub spool_bytes: AtomicU64,
    /// Records in the spool not yet acknowledged by the store (gauge).
    pub spool_records: AtomicU64,
    /// `written_unix_nanos` of the oldest unacknowledged record, 0 if none (gauge).
    pub oldest_unacked_nanos: AtomicU64,
    /// Spool files found torn by a crash at start.
    pub spool_torn_files: AtomicU64,
    /// Bytes cut off torn spool files at start.
    pub spool_torn_bytes: AtomicU64,
    /// Uncompressed body bytes of uploaded segments.
    pub uncompressed_bytes: AtomicU64,
    /// Upload attempts that retried a failed one.
    pub upload_retries: AtomicU64,
    /// Upload failures that retrying will not fix (credentials, missing bucket).
    pub upload_permanent_errors: AtomicU64,
    /// Records in uploaded segments.
    pub records_stored: AtomicU64,
    /// Segments uploaded.
    pub segments_uploaded: AtomicU64,
    /// Bytes of uploaded segments.
    pub stored_bytes: AtomicU64,
    /// Failed upload attempts.
    pub upload_failures: AtomicU64,
    /// Calls whose completion could not be fully rebuilt (warnings in the record);
    /// counted when the call's segment is built.
    pub capture_warnings: AtomicU64,
    /// Calls answered with a 2xx status whose body or stream reported an error (their
    /// records say `upstream_error`); counted when the call's segment is built.
    pub body_errors: AtomicU64,
    /// Calls that could not be recorded at all.
    pub capture_failures: AtomicU64,
    /// Sealed spool files moved aside because segments could not be built from them
    /// (unreadable, or the process died building them twice).
    pub spool_files_set_aside: AtomicU64,
    /// Client connections being served (gauge).
    pub connections_open: AtomicU64,
    /// Client connections turned away by `--max-connections`.
    pub connections_refused: AtomicU64,
    /// Episodes the sidecar ended as `timed_out` (`--episode-ttl-secs`).
    pub episodes_timed_out: AtomicU64,
    /// Open episodes restored from the journal at start.
    pub episodes_restored: AtomicU64,
    /// Failed writes of the episode journal (copied from it by the episode keeper).
    pub episode_journal_errors: AtomicU64,
    latency_buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    latency_count: AtomicU64,
    latency_sum_nanos: AtomicU64,
}

impl Metrics {
    /// Counts one proxied request.
    pub fn request(&self, api: Api) {
        self.requests[api as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts how one proxied call ended.
    pub fn outcome(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Records the latency the sidecar added to one call.
    pub fn added_latency(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.latency_buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_nanos
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Adds every metric to `out`.
    pub fn expose(&self, open_episodes: usize, out: &mut Exposition) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.counter(
            "tapline_requests_total",
            "LLM API requests proxied, by API.",
            APIS.iter()
                .map(|api| {
                    let name = api
                        .as_str_name()
                        .trim_start_matches("API_")
                        .to_ascii_lowercase();
                    (vec![("api", name)], get(&self.requests[*api as usize]))
                })
                .collect(),
        );
        out.counter(
            "tapline_calls_total",
            "Proxied calls by outcome (errors are every outcome but ok).",
            OUTCOMES
                .iter()
                .map(|outcome| {
                    let name = outcome
                        .as_str_name()
                        .trim_start_matches("OUTCOME_")
                        .to_ascii_lowercase();
                    (
                        vec![("outcome", name)],
                        get(&self.outcomes[*outcome as usize]),
                    )
                })
                .collect(),
        );
        let errors: u64 = OUTCOMES[1..]
            .iter()
            .map(|o| get(&self.outcomes[*o as usize]))
            .sum();
        let counters: [(&'static str, &str, u64); 24] = [
            (
                "tapline_errors_total",
                "Proxied calls that did not end ok.",
                errors,
            ),
            (
                "tapline_request_bytes_total",
                "Request body bytes received from clients.",
                get(&self.request_bytes),
            ),
            (
                "tapline_response_bytes_total",
                "Response body bytes sent to clients.",
                get(&self.response_bytes),
            ),
            (
                "tapline_control_requests_total",
                "Control API requests.",
                get(&self.control_requests),
            ),
            (
                "tapline_control_errors_total",
                "Control API requests refused.",
                get(&self.control_errors),
            ),
            (
                "tapline_records_total",
                "Records captured (written to the spool).",
                get(&self.records_spooled),
            ),
            (
                "tapline_records_dropped_total",
                "Records dropped before reaching the spool.",
                get(&self.records_dropped),
            ),
            (
                "tapline_records_stored_total",
                "Records in segments acknowledged by the store.",
                get(&self.records_stored),
            ),
            (
                "tapline_segments_uploaded_total",
                "Segments acknowledged by the store.",
                get(&self.segments_uploaded),
            ),
            (
                "tapline_stored_bytes_total",
                "Compressed bytes acknowledged by the store.",
                get(&self.stored_bytes),
            ),
            (
                "tapline_uncompressed_bytes_total",
                "Uncompressed bytes of segments acknowledged by the store.",
                get(&self.uncompressed_bytes),
            ),
            (
                "tapline_upload_failures_total",
                "Failed segment upload attempts.",
                get(&self.upload_failures),
            ),
            (
                "tapline_upload_retries_total",
                "Upload attempts that retried a failed one.",
                get(&self.upload_retries),
            ),
            (
                "tapline_upload_permanent_errors_total",
                "Upload failures retries will not fix (credentials, bucket).",
                get(&self.upload_permanent_errors),
            ),
            (
                "tapline_spool_torn_files_total",
                "Spool files found torn by a crash at start.",
                get(&self.spool_torn_files),
            ),
            (
                "tapline_spool_torn_bytes_total",
                "Bytes cut off torn spool files at start.",
                get(&self.spool_torn_bytes),
            ),
            (
                "tapline_capture_warnings_total",
                "Calls whose completion could not be fully rebuilt (counted when the segment is built).",
                get(&self.capture_warnings),
            ),
            (
                "tapline_body_errors_total",
                "Calls with a 2xx status whose body reported an error (counted when the segment is built; tapline_calls_total counts them by status).",
                get(&self.body_errors),
            ),
            (
                "tapline_capture_failures_total",
                "Calls that could not be recorded.",
                get(&self.capture_failures),
            ),
            (
                "tapline_spool_files_set_aside_total",
                "Sealed spool files moved aside (.corrupt: unreadable; .unbuildable: the sidecar died twice building their segment), so the rest of the spool uploads.",
                get(&self.spool_files_set_aside),
            ),
            (
                "tapline_connections_refused_total",
                "Client connections answered 503 or closed because --max-connections were open.",
                get(&self.connections_refused),
            ),
            (
                "tapline_episodes_timed_out_total",
                "Open episodes the sidecar ended as timed_out after --episode-ttl-secs without activity.",
                get(&self.episodes_timed_out),
            ),
            (
                "tapline_episodes_restored_total",
                "Open episodes restored from the episode journal at start.",
                get(&self.episodes_restored),
            ),
            (
                "tapline_episode_journal_errors_total",
                "Failed writes of the episode journal (a restart would forget changes since).",
                get(&self.episode_journal_errors),
            ),
        ];
        for (name, help, value) in counters {
            out.counter(name, help, vec![(vec![], value)]);
        }
        let oldest = get(&self.oldest_unacked_nanos);
        let age = if oldest == 0 {
            0.0
        } else {
            (crate::clock::now_nanos().max(0) as u64).saturating_sub(oldest) as f64 / 1e9
        };
        let gauges: [(&'static str, &str, Gauge); 5] = [
            (
                "tapline_connections_open",
                "Client connections being served.",
                Gauge::Int(get(&self.connections_open)),
            ),
            (
                "tapline_open_episodes",
                "Episodes created and not yet ended.",
                Gauge::Int(open_episodes as u64),
            ),
            (
                "tapline_spool_bytes",
                "Bytes of spool files on disk.",
                Gauge::Int(get(&self.spool_bytes)),
            ),
            (
                "tapline_spool_records",
                "Records in the spool not yet acknowledged by the store.",
                Gauge::Int(get(&self.spool_records)),
            ),
            (
                "tapline_oldest_unacked_age_seconds",
                "Age of the oldest record not yet acknowledged by the store.",
                Gauge::Float(age),
            ),
        ];
        for (name, help, value) in gauges {
            out.gauge(name, help, vec![(vec![], value)]);
        }
        // Stored cumulative (each observation counts in every bucket above it).
        let cumulative: Vec<u64> = self.latency_buckets.iter().map(get).collect();
        out.histogram(
            "tapline_added_latency_seconds",
            "Time the sidecar adds before the response head reaches the client.",
            &LATENCY_BUCKETS,
            &cumulative,
            get(&self.latency_count),
            get(&self.latency_sum_nanos) as f64 / 1e9,
        );
    }
}

/// A gauge's value.
#[derive(Debug, Clone, Copy)]
pub enum Gauge {
    /// A count.
    Int(u64),
    /// A measure.
    Float(f64),
}

/// Label pairs of one sample.
pub type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
enum Samples {
    Counter(Vec<(Labels, u64)>),
    Gauge(Vec<(Labels, Gauge)>),
    Histogram {
        /// `(upper bound, observations in this bucket only)`, `f64::MAX` for `+Inf`.
        buckets: Vec<(f64, u64)>,
        count: u64,
        sum: f64,
    },
}

#[derive(Debug)]
struct Family {
    name: &'static str,
    help: String,
    samples: Samples,
}

/// The metrics of one scrape, encoded by `prometheus-client` in the OpenMetrics text
/// format (what Prometheus scrapes; `# HELP`, `# TYPE`, `_total` on counter samples,
/// histogram buckets, `# EOF`). The values live in plain atomics that the hot path
/// updates; a scrape reads them into one of these.
#[derive(Debug, Default)]
pub struct Exposition(Vec<Family>);

/// The media type of [`Exposition::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl Exposition {
    /// A counter family; `name` ends in `_total`, as its samples are named.
    pub fn counter(&mut self, name: &'static str, help: &str, samples: Vec<(Labels, u64)>) {
        self.0.push(Family {
            name: name.strip_suffix("_total").unwrap_or(name),
            help: help.to_owned(),
            samples: Samples::Counter(samples),
        });
    }

    /// A gauge family.
    pub fn gauge(&mut self, name: &'static str, help: &str, samples: Vec<(Labels, Gauge)>) {
        self.0.push(Family {
            name,
            help: help.to_owned(),
            samples: Samples::Gauge(samples),
        });
    }

    /// A histogram from cumulative bucket counts (one per bound; `count` is `+Inf`).
    pub fn histogram(
        &mut self,
        name: &'static str,
        help: &str,
        bounds: &[f64],
        cumulative: &[u64],
        count: u64,
        sum: f64,
    ) {
        let mut buckets = Vec::with_capacity(bounds.len() + 1);
        let mut below = 0;
        for (bound, c) in bounds.iter().zip(cumulative) {
            buckets.push((*bound, c.saturating_sub(below)));
            below = below.max(*c);
        }
        buckets.push((f64::MAX, count.saturating_sub(below)));
        self.0.push(Family {
            name,
            help: help.to_owned(),
            samples: Samples::Histogram {
                buckets,
                count,
                sum,
            },
        });
    }

    /// The OpenMetrics text.
    pub fn encode(self) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::with_capacity(8192);
        // Writing to a String cannot fail, and every name and label here is valid.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

impl prometheus_client::collector::Collector for Exposition {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::NoLabelSet;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::exemplar::Exemplar;
        for family in &self.0 {
            match &family.samples {
                Samples::Counter(samples) => {
                    let mut metric = encoder.encode_descriptor(
                        family.name,
                        &family.help,
                        None,
                        MetricType::Counter,
                    )?;
                    for (labels, value) in samples {
                        let none = None::<&Exemplar<NoLabelSet, u64>>;
                        if labels.is_empty() {
                            metric.encode_counter(value, none)?;
                        } else {
                            metric.encode_family(labels)?.encode_counter(value, none)?;
                        }
                    }
                }
                Samples::Gauge(samples) => {
                    let mut metric = encoder.encode_descriptor(
                        family.name,
                        &family.help,
                        None,
                        MetricType::Gauge,
                    )?;
                    for (labels, value) in samples {
                        match (labels.is_empty(), value) {
                            (true, Gauge::Int(v)) => metric.encode_gauge(v)?,
                            (true, Gauge::Float(v)) => metric.encode_gauge(v)?,
                            (false, Gauge::Int(v)) => {
                                metric.encode_family(labels)?.encode_gauge(v)?
                            }
                            (false, Gauge::Float(v)) => {
                                metric.encode_family(labels)?.encode_gauge(v)?
                            }
                        }
                    }
                }
                Samples::Histogram {
                    buckets,
                    count,
                    sum,
                } => {
                    let mut metric = encoder.encode_descriptor(
                        family.name,
                        &family.help,
                        None,
                        MetricType::Histogram,
                    )?;
                    metric.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None)?;
                }
            }
        }
        Ok(())
    }
}
