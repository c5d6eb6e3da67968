//! The inference thread: it owns the model (tch tensors are not `Sync`) and serves
//! [`Job`]s one at a time from a channel: generations, whose [`Event`]s go back on a
//! channel per request, and reloads, which swap the weights between two generations.
//!
//! A generation renders the prompt with the trainer's own template code
//! ([`tapline_trainer::tokenize::prompt_ids`], so the ids equal the trainer's), prefills
//! it into a KV cache, then runs one token per step: sample ([`crate::sampling`]), report
//! the token's log-probability under the unmodified distribution, decode the visible
//! text ([`crate::text`]), stop on a stop token, a stop string or the token limit. It
//! stops early when the client has gone (its event receiver is dropped).
//!
//! Adapters loaded by name (`/v1/load_lora_adapter`, as vLLM's runtime LoRA) are kept
//! beside the base weights, each a model of its own (base + adapter: simple and exact,
//! at the memory of one model per adapter); a request whose `model` names one is served
//! by it, one naming the served model (or none) by the base weights, and any other name
//! is a 404 as in vLLM.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use http::StatusCode;
use serde_json::Map;
use tapline_trainer::nn::model::KvCache;
use tapline_trainer::nn::{Transformer, lora};
use tapline_trainer::{Model, ModelOptions, tokenize};
use tch::{Device, Kind, Tensor};
use tokio::sync::{mpsc, oneshot};

use crate::api::{ApiError, ChatParams, tokenize_error};
use crate::sampling::{self, Rng};
use crate::text::TextTracker;

/// What is loaded now (shared with the HTTP side for `/health` and `/v1/models`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// The checkpoint directory (canonical when it could be resolved).
    pub dir: PathBuf,
    /// The policy version: the checkpoint directory's name, or `initial`.
    pub version: String,
    /// The model's context length.
    pub max_model_len: i64,
}

/// The version of the model a server starts with: `initial`, unless the directory is a
/// finished training checkpoint (it holds `manifest.json`), which is named by its
/// directory.
pub fn initial_version(dir: &Path) -> String {
    if dir.join("manifest.json").is_file() {
        version_of(dir)
    } else {
        "initial".to_owned()
    }
}

/// The version of a checkpoint loaded later: its directory's name.
pub fn version_of(dir: &Path) -> String {
    let canonical = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    canonical.file_name().map_or_else(
        || canonical.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// How the engine runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the weights live.
    pub device: Device,
    /// Their dtype.
    pub kind: Kind,
    /// `max_tokens` when a request gives none (capped by the context left).
    pub max_tokens_default: u32,
    /// Seed of requests that bring none, with a counter.
    pub seed: u64,
    /// Base model of LoRA adapter directories [default: the adapter's
    /// `base_model_name_or_path`].
    pub base_model: Option<PathBuf>,
}

/// The end of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// `stop` (stop token or stop string) or `length`.
    pub reason: &'static str,
    /// The stop string that ended it, if one did (vLLM's `stop_reason`).
    pub stop_reason: Option<String>,
    /// The whole content.
    pub content: String,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (a final stop token included).
    pub completion_tokens: usize,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// Its id.
    pub id: u32,
    /// Its log-probability under the unmodified distribution.
    pub logprob: f64,
    /// Its text (the tokenizer's decode of it alone); empty unless logprobs were asked for.
    pub token: String,
    /// Content that became stable with it.
    pub delta: String,
    /// Set on the last token.
    pub finish: Option<Finish>,
}

/// What a generation sends back.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt is accepted; tokens follow.
    Started {
        /// The policy version that serves it.
        version: String,
        /// The prompt's ids.
        prompt_ids: Vec<u32>,
    },
    /// One token.
    Token(TokenEvent),
    /// The request failed (before `Started`: nothing was generated).
    Failed(ApiError),
}

/// Work for the inference thread.
#[derive(Debug)]
pub enum Job {
    /// Generate a completion.
    Generate {
        /// The checked request.
        params: Box<ChatParams>,
        /// Where the events go; generation stops when it is closed.
        events: mpsc::UnboundedSender<Event>,
    },
    /// Load a LoRA adapter directory and serve it to requests for `name` (vLLM's
    /// runtime LoRA loading); the base weights keep serving the served model name.
    LoadAdapter {
        /// The name requests select it by.
        name: String,
        /// The adapter directory.
        dir: PathBuf,
        /// Result: why loading failed, if it did.
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Stop serving the adapter `name`.
    UnloadAdapter {
        /// Its name.
        name: String,
        /// Result: an error when no adapter has that name.
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Load another checkpoint; the old one keeps serving when this fails.
    Reload {
        /// The directory.
        dir: PathBuf,
        /// Result: what is loaded now, or why loading failed.
        reply: oneshot::Sender<Result<Loaded, String>>,
    },
}

/// The handle the HTTP side holds.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    /// Jobs in.
    pub jobs: mpsc::Sender<Job>,
    /// What is loaded.
    pub loaded: Arc<RwLock<Loaded>>,
    /// Adapters loaded by name (for `/v1/models`).
    pub adapters: Arc<RwLock<std::collections::BTreeMap<String, Loaded>>>,
}

impl EngineHandle {
    /// What is loaded now.
    pub fn loaded(&self) -> Loaded {
        self.loaded
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// A model that can serve: tokenizer and template, and weights.
struct Policy {
    model: Model,
    net: Transformer,
    info: Loaded,
}

impl Policy {
    fn load(dir: &Path, version: String, settings: &Settings) -> Result<Policy, String> {
        let started = Instant::now();
        let model = Model::load(dir, &ModelOptions::default()).map_err(|e| e.to_string())?;
        let net = if lora::is_adapter_dir(dir) {
            // A LoRA adapter (a PEFT directory, as a LoRA training run writes it) on its
            // base model; the adapter directory carries the tokenizer and template.
            let base = settings
                .base_model
                .clone()
                .or_else(|| lora::base_model_of(dir))
                .ok_or_else(|| {
                    format!(
                        "adapter directory {}: its adapter_config.json names no base model; pass --base-model",
                        dir.display()
                    )
                })?;
            lora::load_with_adapter(&base, dir, settings.device, settings.kind)
                .map_err(|e| format!("adapter directory {}: {e}", dir.display()))?
                .0
        } else {
            Transformer::load(dir, settings.device, settings.kind)
                .map_err(|e| format!("model directory {}: {e}", dir.display()))?
        };
        let info = Loaded {
            dir: std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()),
            version,
            max_model_len: net.config.max_position_embeddings,
        };
        tracing::debug!(dir = %dir.display(), version = %info.version, secs = started.elapsed().as_secs_f64(), "model loaded");
        Ok(Policy { model, net, info })
    }
}

/// Starts the inference thread with the model in `dir` loaded; returns once it is
/// loaded (or failed to load).
pub fn start(
    dir: &Path,
    settings: Settings,
) -> anyhow::Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(256);
    let dir = dir.to_path_buf();
    let thread = std::thread::Builder::new()
        .name("inference".into())
        .spawn(move || {
            let policy = match Policy::load(&dir, initial_version(&dir), &settings) {
                Ok(policy) => policy,
                Err(message) => {
                    let _ = ready_tx.send(Err(message));
                    return;
                }
            };
            let loaded = Arc::new(RwLock::new(policy.info.clone()));
            let adapters: Arc<RwLock<std::collections::BTreeMap<String, Loaded>>> = Arc::default();
            let _ = ready_tx.send(Ok((loaded.clone(), adapters.clone())));
            let mut engine = Engine {
                policy,
                adapters: Default::default(),
                adapter_list: adapters,
                settings,
                loaded,
                served: 0,
            };
            engine.run(jobs_rx);
        })?;
    let (loaded, adapters) = ready_rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the inference thread died while loading the model"))?
        .map_err(|message| anyhow::anyhow!("cannot load the model: {message}"))?;
    Ok((
        EngineHandle {
            jobs: jobs_tx,
            loaded,
            adapters,
        },
        thread,
    ))
}

struct Engine {
    policy: Policy,
    /// Adapters by the name requests select them with.
    adapters: std::collections::BTreeMap<String, Policy>,
    /// What `/v1/models` lists of them.
    adapter_list: Arc<RwLock<std::collections::BTreeMap<String, Loaded>>>,
    settings: Settings,
    loaded: Arc<RwLock<Loaded>>,
    /// Generation requests served, for seeds.
    served: u64,
}

/// A panic's message.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "unknown panic".into())
}

impl Engine {
    fn run(&mut self, mut jobs: mpsc::Receiver<Job>) {
        let _no_grad = tch::no_grad_guard();
        while let Some(job) = jobs.blocking_recv() {
            match job {
                Job::Generate { params, events } => {
                    let seed = params
                        .seed
                        .unwrap_or_else(|| sampling::derived_seed(self.settings.seed, self.served));
                    self.served += 1;
                    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        self.generate(&params, seed, &events)
                    }));
                    let error = match outcome {
                        Ok(Ok(())) => None,
                        Ok(Err(error)) => Some(error),
                        Err(panic) => {
                            let message = panic_message(panic.as_ref());
                            tracing::error!(%message, "generation failed");
                            Some(ApiError::new(
                                StatusCode::INTERNAL_SERVER_ERROR,
                                format!("generation failed: {message}"),
                            ))
                        }
                    };
                    if let Some(error) = error {
                        let _ = events.send(Event::Failed(error));
                    }
                }
                Job::Reload { dir, reply } => {
                    let result = self.reload(&dir);
                    let _ = reply.send(result);
                }
                Job::LoadAdapter { name, dir, reply } => {
                    let result = self.load_adapter(name, &dir);
                    let _ = reply.send(result);
                }
                Job::UnloadAdapter { name, reply } => {
                    let result = match self.adapters.remove(&name) {
                        Some(_) => {
                            self.publish_adapters();
                            tracing::info!(%name, "adapter unloaded");
                            Ok(())
                        }
                        None => Err(format!("no adapter named {name:?} is loaded")),
                    };
                    let _ = reply.send(result);
                }
            }
        }
        tracing::debug!("inference thread stopped");
    }

    fn load_adapter(&mut self, name: String, dir: &Path) -> Result<(), String> {
        if self.adapters.contains_key(&name) {
            // vLLM's answer without `load_inplace`: a name is loaded once.
            return Err(format!(
                "an adapter named {name:?} is already loaded; unload it first or use a new name"
            ));
        }
        if !lora::is_adapter_dir(dir) {
            return Err(format!(
                "{} is not a LoRA adapter directory (no adapter_config.json)",
                dir.display()
            ));
        }
        let loaded = std::panic::catch_unwind(AssertUnwindSafe(|| {
            Policy::load(dir, name.clone(), &self.settings)
        }))
        .unwrap_or_else(|panic| Err(panic_message(panic.as_ref())))?;
        tracing::info!(%name, dir = %dir.display(), "adapter loaded");
        self.adapters.insert(name, loaded);
        self.publish_adapters();
        Ok(())
    }

    fn publish_adapters(&self) {
        *self
            .adapter_list
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = self
            .adapters
            .iter()
            .map(|(name, policy)| (name.clone(), policy.info.clone()))
            .collect();
    }

    /// The weights that serve a request for `model`: the base weights for `None` (the
    /// HTTP side maps the served name to `None`), else the adapter loaded under that
    /// name. One unloaded since the HTTP side looked is a 404, as an unknown name is:
    /// a call never runs on weights other than the ones it named.
    fn policy_for(&self, model: Option<&str>) -> Result<&Policy, ApiError> {
        match model {
            None => Ok(&self.policy),
            Some(m) => self.adapters.get(m).ok_or_else(|| model_not_found(m)),
        }
    }

    fn reload(&mut self, dir: &Path) -> Result<Loaded, String> {
        let version = version_of(dir);
        let loaded = std::panic::catch_unwind(AssertUnwindSafe(|| {
            Policy::load(dir, version.clone(), &self.settings)
        }))
        .unwrap_or_else(|panic| Err(panic_message(panic.as_ref())));
        match loaded {
            Ok(policy) => {
                let info = policy.info.clone();
                self.policy = policy;
                *self
                    .loaded
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = info.clone();
                tracing::info!(dir = %info.dir.display(), version = %info.version, "checkpoint loaded");
                Ok(info)
            }
            Err(message) => {
                tracing::warn!(dir = %dir.display(), %message, "checkpoint not loaded; the old one keeps serving");
                Err(message)
            }
        }
    }

    /// Last row of `hidden` (`[1, t, d]`) → logits on the host.
    fn next_logits(net: &Transformer, hidden: &Tensor) -> Result<Vec<f32>, ApiError> {
        let t = hidden.size()[1];
        let last = hidden.select(1, t - 1);
        let logits = net.logits(&last).view([-1]).to_device(Device::Cpu);
        Vec::<f32>::try_from(logits).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading logits: {e}"),
            )
        })
    }

    fn generate(
        &self,
        params: &ChatParams,
        seed: u64,
        events: &mpsc::UnboundedSender<Event>,
    ) -> Result<(), ApiError> {
        let started = Instant::now();
        let Policy { model, net, info } = self.policy_for(params.model.as_deref())?;
        let prompt_ids = tokenize::prompt_ids(model, &params.request, &Map::new())
            .map_err(|e| tokenize_error(&e))?;
        if prompt_ids.is_empty() {
            return Err(ApiError::field(
                "messages",
                "the chat template rendered an empty prompt from `messages`",
            ));
        }
        net.check_ids(&prompt_ids)
            .map_err(|m| ApiError::field("messages", format!("`messages`: {m}")))?;
        let context = info.max_model_len;
        let prompt_len = prompt_ids.len() as i64;
        let room = context - prompt_len;
        if room <= 0 {
            return Err(ApiError::field(
                "messages",
                format!(
                    "this model's maximum context length is {context} tokens, but `messages` render to {prompt_len} tokens"
                ),
            ));
        }
        let max_tokens = match params.max_tokens {
            Some(n) if i64::from(n) > room => {
                return Err(ApiError::field(
                    "max_tokens",
                    format!(
                        "this model's maximum context length is {context} tokens; the prompt has {prompt_len}, so at most {room} can be generated, but `max_tokens` asks for {n}"
                    ),
                ));
            }
            Some(n) => n as usize,
            None => room.min(i64::from(self.settings.max_tokens_default)) as usize,
        };
        if events
            .send(Event::Started {
                version: info.version.clone(),
                prompt_ids: prompt_ids.clone(),
            })
            .is_err()
        {
            return Ok(());
        }

        let device = net.device();
        let mut rng = Rng::new(seed);
        let mut cache = KvCache::default();
        let ids: Vec<i64> = prompt_ids.iter().map(|&i| i64::from(i)).collect();
        let mut input = Tensor::from_slice(&ids).to_device(device).unsqueeze(0);
        let mut tracker = TextTracker::new(params.stop.clone());
        let mut visible: Vec<u32> = Vec::new();
        let mut decoded = String::new();
        let mut generated = 0usize;
        let prefill_started = Instant::now();
        let mut prefill_secs = 0.0;
        loop {
            let hidden = net.forward_cached(&input, &mut cache);
            let logits = Self::next_logits(net, &hidden)?;
            if generated == 0 {
                prefill_secs = prefill_started.elapsed().as_secs_f64();
            }
            let index = sampling::sample(&logits, params.temperature, params.top_p, &mut rng)
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the model produced no finite logit (NaN or overflow in the weights?)",
                    )
                })?;
            let id = u32::try_from(index).unwrap_or(u32::MAX);
            let logprob = sampling::logprob(&logits, index);
            generated += 1;
            let stop_token = model.is_stop(id);
            if !stop_token && !model.is_special(id) {
                visible.push(id);
                decoded = model.decode(&visible);
            }
            let at_limit = generated >= max_tokens;
            let delta = tracker.step(&decoded, stop_token || at_limit);
            let reason = if delta.stop.is_some() || stop_token {
                Some("stop")
            } else if at_limit {
                Some("length")
            } else {
                None
            };
            let finish = reason.map(|reason| Finish {
                reason,
                stop_reason: delta.stop.clone(),
                content: tracker.final_text().unwrap_or_default().to_owned(),
                prompt_tokens: prompt_ids.len(),
                completion_tokens: generated,
            });
            let done = finish.is_some();
            let token = if params.logprobs {
                model.decode(&[id])
            } else {
                String::new()
            };
            let event = Event::Token(TokenEvent {
                id,
                logprob,
                token,
                delta: delta.text,
                finish,
            });
            if events.send(event).is_err() {
                tracing::info!(generated, "client went away; generation stopped");
                return Ok(());
            }
            if done {
                break;
            }
            input = Tensor::from_slice(&[i64::from(id)])
                .to_device(device)
                .unsqueeze(0);
        }
        let secs = started.elapsed().as_secs_f64();
        let decode_secs = (secs - prefill_secs).max(1e-9);
        tracing::info!(
            prompt_tokens = prompt_ids.len(),
            completion_tokens = generated,
            prefill_secs,
            tokens_per_sec = (generated.saturating_sub(1)) as f64 / decode_secs,
            secs,
            "completion"
        );
        Ok(())
    }
}

/// vLLM's answer to a `model` it does not serve (404 `NotFoundError`).
pub fn model_not_found(model: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("The model `{model}` does not exist."),
    )
}
