//! `tapline-trainer publish`: a trained LoRA adapter goes live on the inference servers
//! under a new policy version, then is announced to the sidecars.
//!
//! 1. The next version N is one above every version claimed or announced so far; the
//!    served name is `NAME@vN` (`tapline_proto::policy`).
//! 2. N is claimed with a create-only put of `{prefix}/policies/NAME/v{N:020}.json`
//!    (`PutMode::Create`: `If-None-Match: *` on S3, a hard link on a local disk): of two
//!    publishers only one gets N, and the other stops before touching any server.
//! 3. Every server loads the adapter under the served name: vLLM `POST
//!    /v1/load_lora_adapter` (started with `--enable-lora` and
//!    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), SGLang `POST /load_lora_adapter`, both
//!    `{"lora_name", "lora_path"}`. A server that fails is named, the servers that had
//!    loaded it unload it again, and nothing is announced (N stays claimed and is
//!    skipped: versions increase strictly, not always by one).
//! 4. N is marked live (`v{N:020}.live.json`), then the announcement
//!    `{prefix}/policies/NAME.json` is brought to the highest live version: read it, list
//!    the live marks, overwrite it with the highest one's announcement if it is older, and
//!    check again after every write. The local disk has no compare-and-swap
//!    (`PutMode::Update` is S3-only), so it is this loop that keeps two racing publishers
//!    from leaving an older version announced: whoever writes last checks afterwards, and
//!    a mark made after that check belongs to a publisher whose own loop runs later. A
//!    version overtaken before it was announced is "superseded" and never announced.
//! 5. Live versions below the K newest live ones (`--keep-loaded K`, default 2) are
//!    unloaded, so calls in flight on the previous version finish on it; a superseded N
//!    is among them when K newer versions are live. Versions claimed but not live are
//!    left to their publisher (it may be loading them now) unless the claim is older
//!    than [`ABANDONED_AFTER`] (a publisher that died mid-way).
//!
//! Full checkpoints are not published live: vLLM loads new full weights on a restart, and
//! SGLang's `POST /update_weights_from_disk {"model_path"}` pauses serving while it loads;
//! adapters are the supported live path (examples/deploy/README.md).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use object_store::{ObjectStore, PutMode, PutOptions};
use tapline_proto::policy::{self, Announcement};
use tapline_proto::store::StoreLocation;

/// Which inference server API the servers speak.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ServerKind {
    /// vLLM's runtime LoRA API (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`);
    /// also what `tapline-policy-server` speaks.
    Vllm,
    /// SGLang's (`/load_lora_adapter`, `/unload_lora_adapter`).
    Sglang,
}

impl ServerKind {
    fn load_path(self) -> &'static str {
        match self {
            ServerKind::Vllm => "/v1/load_lora_adapter",
            ServerKind::Sglang => "/load_lora_adapter",
        }
    }

    fn unload_path(self) -> &'static str {
        match self {
            ServerKind::Vllm => "/v1/unload_lora_adapter",
            ServerKind::Sglang => "/unload_lora_adapter",
        }
    }
}

/// Section `[publish]` of the run configuration: `train` publishes the adapter it wrote
/// when the section is present (LoRA runs only).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishConfig {
    /// Policy name (the sidecars' `--policy`).
    pub policy: String,
    /// Base URLs of the inference servers.
    pub servers: Vec<String>,
    /// Their API (default `vllm`).
    #[serde(default = "default_kind")]
    pub server_kind: ServerKind,
    /// The output directory as the servers see it; `{out_name}` is replaced by the
    /// name of `--out` (default: `--out`, absolute).
    #[serde(default)]
    pub path_on_server: Option<String>,
    /// Versions kept loaded (default 2).
    #[serde(default = "default_keep")]
    pub keep_loaded: u64,
}

fn default_kind() -> ServerKind {
    ServerKind::Vllm
}

fn default_keep() -> u64 {
    2
}

impl PublishConfig {
    /// The options to publish `out` with.
    pub fn options(&self, out: &Path) -> PublishOptions {
        let out_name = out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        PublishOptions {
            policy: self.policy.clone(),
            from: out.to_owned(),
            servers: self.servers.clone(),
            server_kind: self.server_kind,
            path_on_server: self
                .path_on_server
                .as_ref()
                .map(|p| p.replace("{out_name}", &out_name)),
            keep_loaded: self.keep_loaded,
            timeout: Duration::from_secs(120),
        }
    }
}

/// What to publish where.
#[derive(Debug, Clone)]
pub struct PublishOptions {
    /// Policy name.
    pub policy: String,
    /// The adapter directory the trainer wrote.
    pub from: PathBuf,
    /// Base URLs of the inference servers.
    pub servers: Vec<String>,
    /// Their API.
    pub server_kind: ServerKind,
    /// The adapter directory as the servers see it (default: `from`, absolute).
    pub path_on_server: Option<String>,
    /// Versions kept loaded (the new one included); older ones are unloaded.
    pub keep_loaded: u64,
    /// Time allowed for one server request (loading an adapter reads it from disk).
    pub timeout: Duration,
}

/// What was published.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Published {
    /// This version's announcement (what `policies/NAME.json` says unless superseded).
    pub announcement: Announcement,
    /// A newer version that another publisher made live before this one was announced:
    /// this one was loaded but is not announced (and unloaded when `keep_loaded` says so).
    pub superseded_by: Option<u64>,
    /// Served names unloaded because they were older than `keep_loaded` allows.
    pub unloaded: Vec<String>,
}

/// Path of the object that claims version `version` of `name`.
fn claim_path(location: &StoreLocation, name: &str, version: u64) -> object_store::path::Path {
    location
        .prefix
        .child(policy::POLICIES_DIR)
        .child(name)
        .child(format!("v{version:020}.json"))
}

/// Path of the object that marks version `version` of `name` live (every server loaded
/// it); it holds the version's announcement.
fn live_path(location: &StoreLocation, name: &str, version: u64) -> object_store::path::Path {
    location
        .prefix
        .child(policy::POLICIES_DIR)
        .child(name)
        .child(format!("v{version:020}.live.json"))
}

/// The announced version of `name`, if any.
pub async fn announced(
    location: &StoreLocation,
    name: &str,
) -> anyhow::Result<Option<Announcement>> {
    let path = policy::announcement_path(&location.prefix, name);
    match location.store.get(&path).await {
        Ok(got) => {
            let bytes = got
                .bytes()
                .await
                .with_context(|| format!("reading {path}"))?;
            Ok(Some(
                Announcement::parse(&bytes, name).map_err(anyhow::Error::msg)?,
            ))
        }
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {path} in {location}")),
    }
}

async fn call(
    http: &reqwest::Client,
    server: &str,
    path: &str,
    body: serde_json::Value,
) -> anyhow::Result<()> {
    let url = format!("{}{path}", server.trim_end_matches('/'));
    let resp = http
        .post(&url)
        .json(&body)
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        bail!("POST {url} answered {status}: {}", text.trim());
    }
    Ok(())
}

/// Publishes the adapter in `options.from` as the next version of `options.policy`.
pub async fn publish(
    location: &StoreLocation,
    options: &PublishOptions,
) -> anyhow::Result<Published> {
    policy::validate_name(&options.policy).map_err(anyhow::Error::msg)?;
    if options.servers.is_empty() {
        bail!("give at least one --server: the inference servers that serve the policy");
    }
    if options.keep_loaded == 0 {
        bail!("--keep-loaded must be at least 1 (the version being published)");
    }
    let from = &options.from;
    if !from.join("adapter_config.json").is_file() {
        if from.join("config.json").is_file() {
            bail!(
                "{} is a full checkpoint; only LoRA adapters are published live (vLLM loads full weights on a restart, SGLang with POST /update_weights_from_disk; see examples/deploy/README.md)",
                from.display()
            );
        }
        bail!(
            "{} is not an adapter directory (no adapter_config.json)",
            from.display()
        );
    }
    let lora_path = match &options.path_on_server {
        Some(p) => p.clone(),
        None => std::path::absolute(from)
            .with_context(|| format!("absolute path of {}", from.display()))?
            .display()
            .to_string(),
    };
    let manifest_sha256 = match std::fs::read(from.join("manifest.json")) {
        Ok(bytes) => crate::ingest::sha256_hex(&bytes),
        Err(_) => String::new(),
    };
    let run = read_run(from);

    let name = &options.policy;
    let claimed = list_versions(location, name).await?.claims;
    let announced_version = announced(location, name).await?.map_or(0, |a| a.version);
    let version = claimed.last().map_or(0, |c| c.0).max(announced_version) + 1;
    let served = policy::served_model(name, version);
    let announcement = Announcement {
        format: policy::FORMAT.into(),
        name: name.clone(),
        version,
        served_model: served.clone(),
        adapter: Some(lora_path.clone()),
        checkpoint: None,
        run,
        manifest_sha256,
        time: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    };
    let bytes = serde_json::to_vec_pretty(&announcement)?;

    // Claim the version before any server is touched: of two publishers, one gets it and
    // the other stops here, having loaded nothing.
    let claim = claim_path(location, name, version);
    let created = location
        .store
        .put_opts(
            &claim,
            bytes.clone().into(),
            PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            },
        )
        .await;
    match created {
        Ok(_) => {}
        Err(object_store::Error::AlreadyExists { .. }) => bail!(
            "another publisher claimed version {version} of policy {name} first; nothing was loaded or announced (publish again for the next version)"
        ),
        Err(e) => {
            return Err(e)
                .with_context(|| format!("claiming version {version} ({claim}) in {location}"));
        }
    }

    // Every server loads it, or none keeps it.
    let http = reqwest::Client::builder()
        .timeout(options.timeout)
        .build()
        .context("HTTP client")?;
    let mut loaded: Vec<&str> = Vec::new();
    for server in &options.servers {
        let body = serde_json::json!({"lora_name": served, "lora_path": lora_path});
        if let Err(e) = call(&http, server, options.server_kind.load_path(), body).await {
            unload_from(&http, &loaded, options.server_kind, &served, true).await;
            return Err(e.context(format!(
                "server {server} did not load {served}; nothing was announced{} (version {version} stays claimed and is skipped)",
                if loaded.is_empty() {
                    String::new()
                } else {
                    format!(", and the servers that had loaded it unloaded it again ({})", loaded.join(", "))
                }
            )));
        }
        loaded.push(server);
    }

    let live = live_path(location, name, version);
    location
        .store
        .put(&live, bytes.into())
        .await
        .with_context(|| format!("marking version {version} live ({live}) in {location}"))?;
    let now_announced = converge(location, name).await?;
    let superseded_by = (now_announced > version).then_some(now_announced);

    // Live versions below the `keep_loaded` newest live ones go (counted in live
    // versions, not version numbers: failed publishes burn numbers), once calls on the
    // previous one had time to finish; the last few such are unloaded again each time
    // (so one a failed request left loaded goes too). Claims whose publisher died
    // mid-way go as well; claims still being loaded by another publisher never do.
    let mut unloaded = Vec::new();
    let servers: Vec<&str> = options.servers.iter().map(String::as_str).collect();
    let versions = list_versions(location, name).await?;
    let keep = usize::try_from(options.keep_loaded).unwrap_or(usize::MAX);
    let old_live = &versions.live[..versions.live.len().saturating_sub(keep)];
    let newest_old = old_live.last().copied();
    for &old in old_live.iter().rev().take(UNLOAD_WINDOW).rev() {
        let old_name = policy::served_model(name, old);
        unload_from(
            &http,
            &servers,
            options.server_kind,
            &old_name,
            Some(old) == newest_old || old == version,
        )
        .await;
        unloaded.push(old_name);
    }
    let abandoned_before = chrono::Utc::now() - ABANDONED_AFTER;
    let newest_live = versions.live.last().copied().unwrap_or(version);
    let abandoned: Vec<u64> = versions
        .claims
        .iter()
        .filter(|(v, at)| {
            *v < newest_live && *at <= abandoned_before && versions.live.binary_search(v).is_err()
        })
        .map(|(v, _)| *v)
        .collect();
    for &old in abandoned.iter().rev().take(UNLOAD_WINDOW).rev() {
        let old_name = policy::served_model(name, old);
        unload_from(&http, &servers, options.server_kind, &old_name, false).await;
        unloaded.push(old_name);
    }
    Ok(Published {
        announcement,
        superseded_by,
        unloaded,
    })
}

/// Brings `policies/NAME.json` up to the highest live version (module docs, step 4);
/// returns the version it announces.
async fn converge(location: &StoreLocation, name: &str) -> anyhow::Result<u64> {
    let path = policy::announcement_path(&location.prefix, name);
    // Each write is followed by a check; publishers racing for longer than this are
    // not a thing a trainer fleet does, and a live mark that announces another version
    // than its name says (written by hand) must not spin forever.
    for _ in 0..64 {
        let highest = list_versions(location, name)
            .await?
            .live
            .last()
            .copied()
            .unwrap_or(0);
        let current = announced(location, name).await?.map_or(0, |a| a.version);
        if current >= highest {
            return Ok(current);
        }
        let mark = live_path(location, name, highest);
        let bytes = location
            .store
            .get(&mark)
            .await
            .with_context(|| format!("reading {mark} in {location}"))?
            .bytes()
            .await
            .with_context(|| format!("reading {mark} in {location}"))?;
        let announced = Announcement::parse(&bytes, name).map_err(anyhow::Error::msg)?;
        if announced.version != highest {
            bail!(
                "{mark} announces version {} instead of {highest}; remove it or fix it",
                announced.version
            );
        }
        location
            .store
            .put(&path, bytes.into())
            .await
            .with_context(|| format!("writing {path} in {location}"))?;
    }
    bail!("{path} kept changing while it was being brought to the highest live version")
}

/// How long a claimed version may stay not live before it is taken for abandoned (its
/// publisher died between the claim and the announcement) and unloaded with the others.
pub const ABANDONED_AFTER: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// How many old live versions (and abandoned claims) are unloaded again on each publish
/// (so a version that a failed request left loaded goes too).
const UNLOAD_WINDOW: usize = 8;

/// The versions of a policy in the store.
struct Versions {
    /// Claimed versions and when they were claimed, ascending.
    claims: Vec<(u64, chrono::DateTime<chrono::Utc>)>,
    /// Live versions (every server loaded them), ascending.
    live: Vec<u64>,
}

async fn list_versions(location: &StoreLocation, name: &str) -> anyhow::Result<Versions> {
    use futures::TryStreamExt;
    let dir = location.prefix.child(policy::POLICIES_DIR).child(name);
    let metas: Vec<_> = location
        .store
        .list(Some(&dir))
        .try_collect()
        .await
        .with_context(|| format!("listing {dir} in {location}"))?;
    let version = |f: &str, suffix: &str| -> Option<u64> {
        f.strip_prefix('v')?.strip_suffix(suffix)?.parse().ok()
    };
    let mut claims: Vec<_> = metas
        .iter()
        .filter_map(|m| Some((version(m.location.filename()?, ".json")?, m.last_modified)))
        .collect();
    claims.sort_unstable();
    let mut live: Vec<u64> = metas
        .iter()
        .filter_map(|m| version(m.location.filename()?, ".live.json"))
        .collect();
    live.sort_unstable();
    Ok(Versions { claims, live })
}

async fn unload_from(
    http: &reqwest::Client,
    servers: &[&str],
    kind: ServerKind,
    served: &str,
    expected: bool,
) {
    for server in servers {
        let body = serde_json::json!({"lora_name": served});
        if let Err(e) = call(http, server, kind.unload_path(), body).await {
            if expected {
                tracing::warn!(server, served, error = %format!("{e:#}"), "could not unload an adapter");
            } else {
                tracing::debug!(server, served, error = %format!("{e:#}"), "could not unload an adapter");
            }
        }
    }
}

/// The run that wrote `dir`, from its manifest (empty when unknown).
fn read_run(dir: &Path) -> String {
    std::fs::read(dir.join("manifest.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["run"].as_str().map(str::to_owned))
        .unwrap_or_default()
}
