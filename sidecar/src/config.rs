//! Sidecar configuration: flags, `TAPLINE_*` environment variables and an optional TOML
//! file, merged in that order of precedence and validated once, at start.
//!
//! [`RawConfig`] holds what the user wrote (every field optional); [`RawConfig::validate`]
//! turns it into a [`Config`] without doing IO, with errors that name the bad setting.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// Which kind of server the sidecar forwards to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamKind {
    /// Any OpenAI- or Anthropic-compatible API; nothing is injected into requests.
    Openai,
    /// vLLM: the sidecar asks for token ids and logprobs and strips them from responses
    /// when the harness did not ask for them.
    Vllm,
    /// SGLang: like vLLM, except that chat streams cannot return token ids.
    Sglang,
}

impl UpstreamKind {
    /// The lower-case name used in flags and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamKind::Openai => "openai",
            UpstreamKind::Vllm => "vllm",
            UpstreamKind::Sglang => "sglang",
        }
    }
}

/// Settings as written by the user; `None` means "not given here".
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawConfig {
    /// Address to listen on [default: 127.0.0.1:4100].
    #[arg(long, env = "TAPLINE_LISTEN")]
    pub listen: Option<String>,
    /// Base URL of the inference server, e.g. http://127.0.0.1:8000 (request paths are
    /// appended to it unchanged).
    #[arg(long, env = "TAPLINE_UPSTREAM")]
    pub upstream: Option<String>,
    /// openai (inject nothing), vllm or sglang (record exact token ids) [default: openai].
    #[arg(long, env = "TAPLINE_UPSTREAM_KIND", value_enum)]
    pub upstream_kind: Option<UpstreamKind>,
    /// Where records go: file:///dir, s3://bucket/prefix, gs://, az://, memory://, or a
    /// directory [default: ./tapline-data/store].
    #[arg(long, env = "TAPLINE_STORE")]
    pub store: Option<String>,
    /// Local directory for records not yet in the store [default: ./tapline-data/spool].
    #[arg(long, env = "TAPLINE_SPOOL_DIR")]
    pub spool_dir: Option<PathBuf>,
    /// Name of this sidecar in records and segment keys [default: the host name].
    #[arg(long, env = "TAPLINE_SIDECAR_ID")]
    pub sidecar_id: Option<String>,
    /// Bearer token required on the control API (/tapline/v1/*) [default: none].
    #[arg(long, env = "TAPLINE_CONTROL_TOKEN")]
    pub control_token: Option<String>,
    /// Largest request or response body kept in a record, in bytes; larger bodies pass
    /// through whole and the record keeps a prefix [default: 33554432].
    #[arg(long, env = "TAPLINE_CAPTURE_CAP_BYTES")]
    pub capture_cap_bytes: Option<usize>,
    /// Bytes of captured bodies all calls in flight and the segment builder may hold at
    /// once. A call that would go over it is still proxied unchanged; its record keeps
    /// what fitted and says the capture was cut (`capture_warnings`). Set it to the
    /// container's memory limit minus about 96 MiB [default: 167772160, for the
    /// shipped pod's 256Mi].
    #[arg(long, alias = "memory-budget", env = "TAPLINE_MEMORY_BUDGET_BYTES")]
    pub memory_budget_bytes: Option<u64>,
    /// Extra header names to record (comma-separated), besides the default allow-list.
    #[arg(long, env = "TAPLINE_RECORD_HEADERS", value_delimiter = ',')]
    pub record_headers: Option<Vec<String>>,
    /// Seconds to wait for a TCP/TLS connection to the upstream [default: 10].
    #[arg(long, env = "TAPLINE_CONNECT_TIMEOUT_SECS")]
    pub connect_timeout_secs: Option<f64>,
    /// Seconds to wait for the upstream's response head (status line and headers) [default: 600].
    #[arg(long, env = "TAPLINE_RESPONSE_TIMEOUT_SECS")]
    pub response_timeout_secs: Option<f64>,
    /// Seconds of silence allowed between two chunks of a response body [default: 600].
    #[arg(long, env = "TAPLINE_IDLE_TIMEOUT_SECS")]
    pub idle_timeout_secs: Option<f64>,
    /// Records per uploaded segment before it is cut [default: 100000].
    #[arg(long, env = "TAPLINE_SEGMENT_MAX_RECORDS")]
    pub segment_max_records: Option<usize>,
    /// Uncompressed bytes per segment before it is cut [default: 8388608].
    #[arg(long, env = "TAPLINE_SEGMENT_MAX_BYTES")]
    pub segment_max_bytes: Option<u64>,
    /// Hard cap of the spool's size on disk, in bytes [default: 1073741824].
    #[arg(long, env = "TAPLINE_SPOOL_MAX_BYTES")]
    pub spool_max_bytes: Option<u64>,
    /// When the spool is full: `drop` the new record and flag its episode (never holds
    /// back traffic), or `block` responses until uploads free space [default: drop].
    #[arg(long, env = "TAPLINE_SPOOL_FULL_POLICY", value_enum)]
    pub spool_full_policy: Option<crate::sink::FullPolicy>,
    /// Milliseconds between fsyncs of the spool [default: 100].
    #[arg(long, env = "TAPLINE_FSYNC_INTERVAL_MS")]
    pub fsync_interval_ms: Option<u64>,
    /// Seconds a segment may stay open before it is cut [default: 10].
    #[arg(long, env = "TAPLINE_SEGMENT_MAX_AGE_SECS")]
    pub segment_max_age_secs: Option<f64>,
    /// zstd level of segments [default: 3].
    #[arg(long, env = "TAPLINE_ZSTD_LEVEL")]
    pub zstd_level: Option<i32>,
    /// Segment format version written: 2 (header and trailer are zstd skippable frames,
    /// so `zstd -dc` reads a segment) or 1, for trainers and dumps older than tapline 0.2
    /// during an upgrade; readers read both [default: 2].
    #[arg(long, env = "TAPLINE_SEGMENT_FORMAT")]
    pub segment_format: Option<u8>,
    /// Most client connections served at once; a connection beyond it gets a 503
    /// (`Retry-After: 1`) and is closed. At start the soft open-files limit is raised
    /// to the hard one, and a maximum it cannot hold (two files per connection plus 256)
    /// stops the start with an error [default: 1024].
    #[arg(long, env = "TAPLINE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Seconds a client may take to send a request head (also how long an idle
    /// keep-alive connection stays open); must be shorter than --drain-secs, so a client
    /// that never finishes its head cannot hold a shutdown [default: 10].
    #[arg(long, env = "TAPLINE_HEADER_READ_TIMEOUT_SECS")]
    pub header_read_timeout_secs: Option<f64>,
    /// Follow this policy's announcements (`policies/NAME.json` in the store): calls for
    /// the model named by --policy-alias go to the announced `NAME@vN` and are recorded
    /// with `policy_version = N` [default: none, requests pass unchanged].
    #[arg(long, env = "TAPLINE_POLICY")]
    pub policy: Option<String>,
    /// The model name harnesses ask for when they mean the policy [default: the policy
    /// name].
    #[arg(long, env = "TAPLINE_POLICY_ALIAS")]
    pub policy_alias: Option<String>,
    /// Seconds between two reads of the policy's announcement [default: 2].
    #[arg(long, env = "TAPLINE_POLICY_POLL_SECS")]
    pub policy_poll_secs: Option<f64>,
    /// Seconds an open episode may go without a call, a reward or an end before the
    /// sidecar ends it as `timed_out` (recorded so, with `ended_by = tapline-sidecar`);
    /// below the trainer's `grace_period_secs` (3600), so the trainer sees the end
    /// rather than dropping the episode as `never_ended` [default: 3000].
    #[arg(long, alias = "episode-ttl", env = "TAPLINE_EPISODE_TTL_SECS")]
    pub episode_ttl_secs: Option<f64>,
}

/// Headers recorded by default (lower-case). Credentials are never recorded, whatever
/// the allow-list says.
pub const DEFAULT_RECORDED_HEADERS: &[&str] = &[
    "content-type",
    "content-encoding",
    "content-length",
    "accept",
    "user-agent",
    "openai-organization",
    "openai-project",
    "openai-version",
    "openai-processing-ms",
    "openai-beta",
    "anthropic-version",
    "anthropic-beta",
    "x-request-id",
    "request-id",
    "x-stainless-lang",
    "x-stainless-package-version",
    "x-stainless-retry-count",
];

/// Headers that are never recorded.
pub const NEVER_RECORDED: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "set-cookie",
];

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Upstream base URL (scheme, authority and an optional path prefix without a
    /// trailing slash).
    pub upstream: http::Uri,
    /// Kind of upstream.
    pub upstream_kind: UpstreamKind,
    /// Store URL.
    pub store: String,
    /// Spool directory.
    pub spool_dir: PathBuf,
    /// Sidecar id.
    pub sidecar_id: String,
    /// Control token, if any.
    pub control_token: Option<String>,
    /// Capture cap in bytes.
    pub capture_cap_bytes: usize,
    /// Memory budget for captured bodies, in bytes.
    pub memory_budget_bytes: u64,
    /// Lower-case header names to record.
    pub recorded_headers: Vec<String>,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Response head timeout.
    pub response_timeout: Duration,
    /// Body idle timeout.
    pub idle_timeout: Duration,
    /// Records per segment.
    pub segment_max_records: usize,
    /// Uncompressed bytes per segment.
    pub segment_max_bytes: u64,
    /// Spool size cap.
    pub spool_max_bytes: u64,
    /// Full-spool policy.
    pub spool_full_policy: crate::sink::FullPolicy,
    /// fsync interval.
    pub fsync_interval: Duration,
    /// Segment age limit.
    pub segment_max_age: Duration,
    /// zstd level.
    pub zstd_level: i32,
    /// Segment format version written.
    pub segment_format: u8,
    /// Most client connections served at once.
    pub max_connections: usize,
    /// Time allowed for a request head, and for an idle keep-alive connection.
    pub header_read_timeout: Duration,
    /// The policy to follow, if any.
    pub policy: Option<PolicyConfig>,
    /// How long an open episode may stay idle before the sidecar ends it `timed_out`.
    pub episode_ttl: Duration,
}

/// `--policy`, `--policy-alias`, `--policy-poll-secs`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Policy name (a valid key part).
    pub name: String,
    /// Model name that selects the policy in requests.
    pub alias: String,
    /// Time between two reads of the announcement.
    pub poll: Duration,
}

/// A setting that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting `{setting}`: {problem}")]
pub struct ConfigError {
    /// The flag name (also `TAPLINE_<NAME>` and the TOML key).
    pub setting: &'static str,
    /// What is wrong and what to do.
    pub problem: String,
}

fn bad(setting: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        setting,
        problem: problem.into(),
    }
}

impl RawConfig {
    /// Reads a TOML file whose keys are the flag names (`upstream-kind = "vllm"`).
    pub fn from_toml_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("config", format!("cannot read {}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| bad("config", format!("{}: {e}", path.display())))
    }

    /// Fills every field not set here from `fallback`.
    pub fn or(self, fallback: RawConfig) -> RawConfig {
        RawConfig {
            listen: self.listen.or(fallback.listen),
            upstream: self.upstream.or(fallback.upstream),
            upstream_kind: self.upstream_kind.or(fallback.upstream_kind),
            store: self.store.or(fallback.store),
            spool_dir: self.spool_dir.or(fallback.spool_dir),
            sidecar_id: self.sidecar_id.or(fallback.sidecar_id),
            control_token: self.control_token.or(fallback.control_token),
            capture_cap_bytes: self.capture_cap_bytes.or(fallback.capture_cap_bytes),
            memory_budget_bytes: self.memory_budget_bytes.or(fallback.memory_budget_bytes),
            record_headers: self.record_headers.or(fallback.record_headers),
            connect_timeout_secs: self.connect_timeout_secs.or(fallback.connect_timeout_secs),
            response_timeout_secs: self
                .response_timeout_secs
                .or(fallback.response_timeout_secs),
            idle_timeout_secs: self.idle_timeout_secs.or(fallback.idle_timeout_secs),
            segment_max_records: self.segment_max_records.or(fallback.segment_max_records),
            segment_max_bytes: self.segment_max_bytes.or(fallback.segment_max_bytes),
            spool_max_bytes: self.spool_max_bytes.or(fallback.spool_max_bytes),
            spool_full_policy: self.spool_full_policy.or(fallback.spool_full_policy),
            fsync_interval_ms: self.fsync_interval_ms.or(fallback.fsync_interval_ms),
            segment_max_age_secs: self.segment_max_age_secs.or(fallback.segment_max_age_secs),
            zstd_level: self.zstd_level.or(fallback.zstd_level),
            segment_format: self.segment_format.or(fallback.segment_format),
            max_connections: self.max_connections.or(fallback.max_connections),
            header_read_timeout_secs: self
                .header_read_timeout_secs
                .or(fallback.header_read_timeout_secs),
            policy: self.policy.or(fallback.policy),
            policy_alias: self.policy_alias.or(fallback.policy_alias),
            policy_poll_secs: self.policy_poll_secs.or(fallback.policy_poll_secs),
            episode_ttl_secs: self.episode_ttl_secs.or(fallback.episode_ttl_secs),
        }
    }

    /// Checks every setting and applies defaults. Does no IO.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let listen = self.listen.as_deref().unwrap_or("127.0.0.1:4100");
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| bad("listen", format!("{listen:?} is not IP:PORT ({e})")))?;
        let upstream_text = self.upstream.ok_or_else(|| {
            bad(
                "upstream",
                "missing: give --upstream URL, TAPLINE_UPSTREAM, or `upstream` in the config file (e.g. http://127.0.0.1:8000)",
            )
        })?;
        let upstream: http::Uri = upstream_text
            .trim_end_matches('/')
            .parse()
            .map_err(|e| bad("upstream", format!("{upstream_text:?} is not a URL ({e})")))?;
        match upstream.scheme_str() {
            Some("http" | "https") => {}
            _ => {
                return Err(bad(
                    "upstream",
                    format!("{upstream_text:?} must start with http:// or https://"),
                ));
            }
        }
        if upstream.authority().is_none() {
            return Err(bad("upstream", format!("{upstream_text:?} names no host")));
        }
        if upstream.query().is_some() {
            return Err(bad(
                "upstream",
                format!("{upstream_text:?} must not have a query string"),
            ));
        }
        let sidecar_id = match self.sidecar_id {
            Some(id) => id,
            None => default_sidecar_id(),
        };
        tapline_proto::keys::validate_sidecar_id(&sidecar_id)
            .map_err(|e| bad("sidecar-id", e.to_string()))?;
        if let Some(token) = &self.control_token
            && (token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(bad(
                "control-token",
                "must be non-empty, without spaces or control characters",
            ));
        }
        let capture_cap_bytes = self.capture_cap_bytes.unwrap_or(32 << 20);
        if capture_cap_bytes == 0 {
            return Err(bad("capture-cap-bytes", "must be at least 1"));
        }
        let memory_budget_bytes = self
            .memory_budget_bytes
            .unwrap_or(crate::budget::DEFAULT_BYTES);
        if memory_budget_bytes < 1 << 20 {
            return Err(bad(
                "memory-budget-bytes",
                format!(
                    "{memory_budget_bytes} is below 1048576 (1 MiB): most calls' captures would be cut; give the sidecar more memory and set it to that limit minus about 96 MiB"
                ),
            ));
        }
        let mut recorded_headers: Vec<String> = DEFAULT_RECORDED_HEADERS
            .iter()
            .map(|h| (*h).to_owned())
            .collect();
        for name in self.record_headers.unwrap_or_default() {
            let name = name.trim().to_ascii_lowercase();
            if name.is_empty() {
                continue;
            }
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(bad(
                    "record-headers",
                    format!("{name:?} is not a header name"),
                ));
            }
            if NEVER_RECORDED.contains(&name.as_str()) {
                return Err(bad(
                    "record-headers",
                    format!("{name:?} carries credentials and is never recorded"),
                ));
            }
            if !recorded_headers.contains(&name) {
                recorded_headers.push(name);
            }
        }
        let secs = |setting: &'static str,
                    v: Option<f64>,
                    default: f64|
         -> Result<Duration, ConfigError> {
            let v = v.unwrap_or(default);
            if v.is_finite() && v > 0.0 && v < 1e9 {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(bad(
                    setting,
                    format!("{v} is not a positive number of seconds"),
                ))
            }
        };
        let segment_max_records = self.segment_max_records.unwrap_or(100_000);
        if segment_max_records == 0 {
            return Err(bad("segment-max-records", "must be at least 1"));
        }
        let segment_max_bytes = self.segment_max_bytes.unwrap_or(8 << 20);
        if segment_max_bytes == 0 {
            return Err(bad("segment-max-bytes", "must be at least 1"));
        }
        let spool_max_bytes = self.spool_max_bytes.unwrap_or(1 << 30);
        if spool_max_bytes < 4096 {
            return Err(bad(
                "spool-max-bytes",
                format!("{spool_max_bytes} is too small; use at least 4096"),
            ));
        }
        let fsync_interval_ms = self.fsync_interval_ms.unwrap_or(100);
        if fsync_interval_ms == 0 {
            return Err(bad("fsync-interval-ms", "must be at least 1"));
        }
        let zstd_level = self
            .zstd_level
            .unwrap_or(tapline_proto::segment::DEFAULT_LEVEL);
        if !(1..=22).contains(&zstd_level) {
            return Err(bad("zstd-level", format!("{zstd_level} is outside 1..=22")));
        }
        let segment_format = self
            .segment_format
            .unwrap_or(tapline_proto::segment::VERSION);
        let formats = tapline_proto::segment::OLDEST_VERSION..=tapline_proto::segment::VERSION;
        if !formats.contains(&segment_format) {
            return Err(bad(
                "segment-format",
                format!(
                    "{segment_format} is not a segment format this sidecar writes: use {} or {}",
                    formats.start(),
                    formats.end()
                ),
            ));
        }
        let max_connections = self.max_connections.unwrap_or(1024);
        if max_connections == 0 {
            return Err(bad("max-connections", "must be at least 1"));
        }
        let header_read_timeout = secs(
            "header-read-timeout-secs",
            self.header_read_timeout_secs,
            10.0,
        )?;
        let policy = match self.policy {
            None => {
                if self.policy_alias.is_some() {
                    return Err(bad("policy-alias", "needs --policy (the policy it names)"));
                }
                None
            }
            Some(name) => {
                tapline_proto::policy::validate_name(&name).map_err(|e| bad("policy", e))?;
                let alias = self.policy_alias.unwrap_or_else(|| name.clone());
                if alias.is_empty() || alias.len() > 256 {
                    return Err(bad("policy-alias", "must be 1 to 256 bytes"));
                }
                Some(PolicyConfig {
                    poll: secs("policy-poll-secs", self.policy_poll_secs, 2.0)?,
                    name,
                    alias,
                })
            }
        };
        Ok(Config {
            listen,
            upstream,
            upstream_kind: self.upstream_kind.unwrap_or(UpstreamKind::Openai),
            store: self
                .store
                .unwrap_or_else(|| "tapline-data/store".to_owned()),
            spool_dir: self
                .spool_dir
                .unwrap_or_else(|| PathBuf::from("tapline-data/spool")),
            sidecar_id,
            control_token: self.control_token,
            capture_cap_bytes,
            memory_budget_bytes,
            recorded_headers,
            connect_timeout: secs("connect-timeout-secs", self.connect_timeout_secs, 10.0)?,
            response_timeout: secs("response-timeout-secs", self.response_timeout_secs, 600.0)?,
            idle_timeout: secs("idle-timeout-secs", self.idle_timeout_secs, 600.0)?,
            segment_max_records,
            segment_max_bytes,
            spool_max_bytes,
            spool_full_policy: self
                .spool_full_policy
                .unwrap_or(crate::sink::FullPolicy::Drop),
            fsync_interval: Duration::from_millis(fsync_interval_ms),
            segment_max_age: secs("segment-max-age-secs", self.segment_max_age_secs, 10.0)?,
            zstd_level,
            segment_format,
            max_connections,
            header_read_timeout,
            policy,
            episode_ttl: secs("episode-ttl-secs", self.episode_ttl_secs, 3000.0)?,
        })
    }
}

/// The host name made safe for a key, or `sidecar` when there is none.
fn default_sidecar_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    let id: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(tapline_proto::keys::MAX_SIDECAR_ID_LEN)
        .collect();
    let id = id.trim_start_matches('.').to_owned();
    if id.is_empty() {
        "sidecar".to_owned()
    } else {
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(upstream: &str) -> RawConfig {
        RawConfig {
            upstream: Some(upstream.to_owned()),
            sidecar_id: Some("t".into()),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_apply() {
        let c = raw("http://127.0.0.1:8000/").validate().unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:4100");
        assert_eq!(c.upstream.to_string(), "http://127.0.0.1:8000/");
        assert_eq!(c.upstream_kind, UpstreamKind::Openai);
        assert!(c.recorded_headers.contains(&"content-type".to_owned()));
    }

    #[test]
    fn errors_name_the_setting() {
        let cases: Vec<(RawConfig, &str)> = vec![
            (RawConfig::default(), "upstream"),
            (raw("ftp://x"), "upstream"),
            (
                RawConfig {
                    memory_budget_bytes: Some(4096),
                    ..raw("http://x")
                },
                "memory-budget-bytes",
            ),
            (
                RawConfig {
                    listen: Some("nope".into()),
                    ..raw("http://x")
                },
                "listen",
            ),
            (
                RawConfig {
                    sidecar_id: Some("a/b".into()),
                    ..raw("http://x")
                },
                "sidecar-id",
            ),
            (
                RawConfig {
                    record_headers: Some(vec!["Authorization".into()]),
                    ..raw("http://x")
                },
                "record-headers",
            ),
            (
                RawConfig {
                    idle_timeout_secs: Some(f64::NAN),
                    ..raw("http://x")
                },
                "idle-timeout-secs",
            ),
            (
                RawConfig {
                    segment_format: Some(3),
                    ..raw("http://x")
                },
                "segment-format",
            ),
            (
                RawConfig {
                    zstd_level: Some(40),
                    ..raw("http://x")
                },
                "zstd-level",
            ),
        ];
        for (cfg, setting) in cases {
            let err = cfg.validate().unwrap_err();
            assert_eq!(err.setting, setting, "{err}");
            assert!(err.to_string().contains(setting));
        }
    }

    #[test]
    fn toml_keys_are_flag_names_and_unknown_keys_are_refused() {
        let c: RawConfig =
            toml::from_str("upstream = \"http://h:1\"\nupstream-kind = \"vllm\"\n").unwrap();
        assert_eq!(c.upstream_kind, Some(UpstreamKind::Vllm));
        let err = toml::from_str::<RawConfig>("upstrem = \"x\"").unwrap_err();
        assert!(err.to_string().contains("upstrem"), "{err}");
    }

    #[test]
    fn flags_win_over_the_file() {
        let flags = RawConfig {
            listen: Some("127.0.0.1:9".into()),
            ..Default::default()
        };
        let file = RawConfig {
            listen: Some("127.0.0.1:8".into()),
            upstream: Some("http://h".into()),
            ..Default::default()
        };
        let merged = flags.or(file);
        assert_eq!(merged.listen.as_deref(), Some("127.0.0.1:9"));
        assert_eq!(merged.upstream.as_deref(), Some("http://h"));
    }
}
