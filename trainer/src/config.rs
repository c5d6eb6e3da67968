//! The run configuration: one serde struct, read from an optional TOML file (unknown keys
//! are refused) with command-line flags over it, validated once before anything runs.
//!
//! Every field has a default; a complete file with the defaults:
//!
//! ```toml
//! run = "default"              # cursor name: runs with the same name share progress
//!
//! [ingest]
//! lookback_hours = 24          # how late a segment may be uploaded and still be read
//! skip_unreadable_segments = false
//! concurrent_reads = 32        # segments fetched and decoded at once (--concurrent-reads)
//!
//! [clean]
//! grace_period_secs = 3600     # unended episodes older than this are dropped
//! max_seq_len = 32768          # longer sequences are dropped (`over_length`)
//! drop_zero_variance_groups = true
//! # policy = "coder"           # the policy whose versions calls record (sidecar --policy)
//! # max_policy_lag = 4         # drop episodes served > 4 versions before the announced one
//!
//! [tokenize]
//! use_recorded_ids = true
//! measure_drift = true
//! chat_template_kwargs = {}    # server-side defaults, e.g. { enable_thinking = false }
//!
//! [rewards]
//! final_reward_weight = 1.0
//! reward_weights = {}          # e.g. { tests_passed = 0.5, style = 0.1 }
//!
//! [advantages]
//! estimator = "grpo"           # grpo | dr_grpo | rloo | reinforce_plus_plus_baseline
//! group_by = "task_and_group"  # or "task"
//! epsilon = 1e-6
//! std = "sample"               # or "population"
//! per_call_rewards = false
//! per_call_discount = 1.0
//! per_call_weight = 1.0
//!
//! [schedule]
//! loss_agg_mode = "token-mean" # token-mean | seq-mean-token-sum | seq-mean-token-mean
//!                              # | seq-mean-token-sum-norm | episode-mean
//! # norm_constant = 32768      # C of seq-mean-token-sum-norm; default max_seq_len
//! micro_batch_tokens = 65536
//! mini_batch_episodes = 0      # 0: one mini-batch
//! seed = 0
//!
//! [train]                      # `tapline-trainer train` only
//! lr = 1e-6
//! lr_schedule = "constant"     # or "cosine" (to min_lr_ratio · lr at total_steps)
//! warmup_steps = 0
//! # total_steps = 100          # cosine length; default: the steps of this run
//! min_lr_ratio = 0.0
//! beta1 = 0.9
//! beta2 = 0.999
//! eps = 1e-8
//! weight_decay = 0.01
//! max_grad_norm = 1.0          # 0: no clipping (the norm is reported either way)
//! epochs = 1                   # passes over the mini-batches
//! policy_loss = "ppo"          # or "gspo" (sequence-level ratio; clip about 3e-4 / 4e-4)
//! clip_ratio_low = 0.2
//! clip_ratio_high = 0.28       # DAPO's asymmetric clip
//! dual_clip = 0.0              # c > 1 turns the dual clip on (e.g. 3.0)
//! tis_cap = 2.0                # truncated importance sampling cap; 0: off
//! kl_coef = 0.0                # KL penalty to the starting weights
//! logprob_chunk = 1024         # rows of [rows, vocab] fp32 logits at once
//! recompute = false            # recompute layers in the backward pass (everywhere)
//! packing = true               # each micro-batch as one row of its sequences end to
//!                              # end (attention kept inside each): no padding computed
//! # max_memory = "16GiB"       # the update's memory; micro-batches are split or
//!                              # recomputed to fit it, or the run fails before a step
//!                              # (default: 80% of what the process can have, of the
//!                              # GPU's on CUDA; --max-memory)
//! dtype = "auto"               # fp32 on CPU, bf16 on CUDA; or float32 / bfloat16
//!                              # (non-fp32 weights get fp32 master copies in the optimizer)
//! seed = 0
//! shard_optimizer = true       # under torchrun: AdamW state split across the ranks
//!
//! # [train.lora]               # present: train a LoRA adapter, not every weight
//! # rank = 16
//! # alpha = 32.0               # the adapter's output is scaled by alpha / rank
//! # dropout = 0.0              # only 0 is supported
//! # target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
//! # use_rslora = false         # scale by alpha / sqrt(rank) instead
//!
//! [track]                      # `train` only: what the run writes while it trains
//! jsonl = true                 # metrics.jsonl: one JSON object per step and run event
//! tensorboard = false          # events.out.tfevents.* for `tensorboard --logdir`
//!                              # (--tensorboard)
//! # dir = "runs/coder"         # default: --out (train), the --out root (train
//!                              # --follow); --track-dir
//!
//! # [track.mlflow]             # present: a run per training run on this server
//! # uri = "http://mlflow:5000" # default: MLFLOW_TRACKING_URI
//! # experiment = "coder"       # default: MLFLOW_EXPERIMENT_NAME, else "tapline"
//! # timeout_secs = 10.0        # per request; a slow server never slows training
//!
//! # [publish]                  # present (LoRA only): `train` publishes its adapter
//! # policy = "coder"           # announced as coder@vN in policies/coder.json
//! # servers = ["http://vllm:8000"]
//! # server_kind = "vllm"       # or "sglang"
//! # path_on_server = "/adapters/{out_name}"   # default: --out, absolute
//! # keep_loaded = 2
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::advantages::{AdvantageOptions, RewardOptions};
use crate::clean::CleanOptions;
use crate::ingest::{IngestOptions, validate_run_name};
use crate::nn::options::TrainOptions;
use crate::schedule::ScheduleOptions;
use crate::tokenize::TokenizeOptions;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this struct.
    #[error("config file {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's error (names the key).
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("config: {0}")]
    Invalid(String),
}

/// Everything a `prepare` run is configured by.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Name of the run's cursor in the store (default `default`).
    pub run: String,
    /// Ingest settings.
    pub ingest: IngestOptions,
    /// Cleaning settings.
    pub clean: CleanOptions,
    /// Tokenization settings.
    pub tokenize: TokenizeOptions,
    /// Reward combination.
    pub rewards: RewardOptions,
    /// Advantage estimation.
    pub advantages: AdvantageOptions,
    /// Loss normalization and batching.
    pub schedule: ScheduleOptions,
    /// The policy-gradient update (`train` only).
    pub train: TrainOptions,
    /// What `train` writes while it runs (see `crate::track`).
    pub track: crate::track::TrackOptions,
    /// Publishing the trained adapter (`train` only, LoRA runs; see `crate::publish`).
    pub publish: Option<crate::publish::PublishConfig>,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            run: "default".into(),
            ingest: IngestOptions::default(),
            clean: CleanOptions::default(),
            tokenize: TokenizeOptions::default(),
            rewards: RewardOptions::default(),
            advantages: AdvantageOptions::default(),
            schedule: ScheduleOptions::default(),
            train: TrainOptions::default(),
            track: crate::track::TrackOptions::default(),
            publish: None,
        }
    }
}

impl RunConfig {
    /// Reads a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })
    }

    /// `C` of `seq-mean-token-sum-norm`.
    pub fn norm_constant(&self) -> f64 {
        self.schedule
            .norm_constant
            .unwrap_or(self.clean.max_seq_len as f64)
    }

    /// Checks every value; no IO.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        validate_run_name(&self.run).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if let Some(policy) = &self.clean.policy {
            tapline_proto::policy::validate_name(policy)
                .map_err(|e| ConfigError::Invalid(format!("clean.policy: {e}")))?;
        } else if self.clean.max_policy_lag.is_some() {
            return bad(
                "clean.max_policy_lag needs clean.policy: the policy whose announced version the lag is counted from".into(),
            );
        }
        if self.ingest.concurrent_reads == 0 {
            return bad(
                "ingest.concurrent_reads must be at least 1 (segments fetched at once)".into(),
            );
        }
        if self.clean.max_seq_len == 0 {
            return bad("clean.max_seq_len must be at least 1".into());
        }
        if self.schedule.micro_batch_tokens < self.clean.max_seq_len {
            return bad(format!(
                "schedule.micro_batch_tokens ({}) must be at least clean.max_seq_len ({}) so that every sequence fits a micro-batch",
                self.schedule.micro_batch_tokens, self.clean.max_seq_len
            ));
        }
        let c = self.norm_constant();
        if !(c.is_finite() && c > 0.0) {
            return bad(format!(
                "schedule.norm_constant must be positive and finite, not {c}"
            ));
        }
        let a = &self.advantages;
        if !(a.epsilon.is_finite() && a.epsilon > 0.0) {
            return bad(format!(
                "advantages.epsilon must be positive and finite, not {}",
                a.epsilon
            ));
        }
        if !(0.0..=1.0).contains(&a.per_call_discount) {
            return bad(format!(
                "advantages.per_call_discount must be in [0, 1], not {}",
                a.per_call_discount
            ));
        }
        if !a.per_call_weight.is_finite() {
            return bad("advantages.per_call_weight must be finite".into());
        }
        if !self.rewards.final_reward_weight.is_finite() {
            return bad("rewards.final_reward_weight must be finite".into());
        }
        self.train.validate().map_err(ConfigError::Invalid)?;
        self.track.validate().map_err(ConfigError::Invalid)?;
        if let Some(p) = &self.publish {
            tapline_proto::policy::validate_name(&p.policy)
                .map_err(|e| ConfigError::Invalid(format!("publish.policy: {e}")))?;
            if p.servers.is_empty() {
                return bad("publish.servers must name at least one inference server".into());
            }
            if p.keep_loaded == 0 {
                return bad("publish.keep_loaded must be at least 1".into());
            }
            if self.train.lora.is_none() {
                return bad("[publish] needs [train.lora]: only adapters are published live (full checkpoints need a server restart)".into());
            }
        }
        if let Some((name, w)) = self
            .rewards
            .reward_weights
            .iter()
            .find(|(_, w)| !w.is_finite())
        {
            return bad(format!(
                "rewards.reward_weights.{name} must be finite, not {w}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantages::Estimator;
    use crate::schedule::LossAggMode;

    #[test]
    fn the_documented_file_is_the_default() {
        let doc = include_str!("config.rs");
        let toml_text: String = doc
            .lines()
            .skip_while(|l| !l.starts_with("//! ```toml"))
            .skip(1)
            .take_while(|l| !l.starts_with("//! ```"))
            .map(|l| l.strip_prefix("//!").unwrap_or(l).trim_start_matches(' '))
            .collect::<Vec<_>>()
            .join("\n");
        let parsed: RunConfig = toml::from_str(&toml_text).unwrap();
        let default = RunConfig::default();
        assert_eq!(
            serde_json::to_value(&parsed).unwrap(),
            serde_json::to_value(&default).unwrap()
        );
        default.validate().unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let err = toml::from_str::<RunConfig>("[clean]\nmax_seq_length = 3").unwrap_err();
        assert!(err.to_string().contains("max_seq_length"), "{err}");
        let cfg: RunConfig = toml::from_str(
            "[advantages]\nestimator = \"rloo\"\n[schedule]\nloss_agg_mode = \"episode-mean\"\nmicro_batch_tokens = 10",
        )
        .unwrap();
        assert_eq!(cfg.advantages.estimator, Estimator::Rloo);
        assert_eq!(cfg.schedule.loss_agg_mode, LossAggMode::EpisodeMean);
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("micro_batch_tokens"), "{err}");
        let cfg: RunConfig = toml::from_str("[ingest]\nconcurrent_reads = 0").unwrap();
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("ingest.concurrent_reads"), "{err}");
        let cfg: RunConfig = toml::from_str("[train]\nmax_memory = \"16 gigs\"").unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("train.max_memory")
                && err.contains("\"16 gigs\"")
                && err.contains("16GiB"),
            "{err}"
        );
        let cfg: RunConfig = toml::from_str("[train]\nmax_memory = \"16GiB\"").unwrap();
        assert_eq!(cfg.train.max_memory_bytes(), Ok(Some(16 << 30)));
    }

    #[test]
    fn policy_settings_are_checked() {
        let check = |text: &str| {
            toml::from_str::<RunConfig>(text)
                .map_err(|e| e.to_string())
                .and_then(|c| c.validate().map_err(|e| e.to_string()))
        };
        let publish = "[publish]\npolicy = \"coder\"\nservers = [\"http://v:8000\"]\n";
        let lora = "[train.lora]\nrank = 8\nalpha = 16\n";
        assert!(check(&format!("{publish}{lora}")).is_ok());
        let err = check(publish).unwrap_err();
        assert!(err.contains("[train.lora]"), "{err}");
        let err = check(&format!(
            "{lora}[publish]\npolicy = \"a/b\"\nservers = [\"x\"]\n"
        ))
        .unwrap_err();
        assert!(err.contains("publish.policy"), "{err}");
        let err = check(&format!("{lora}[publish]\npolicy = \"c\"\nservers = []\n")).unwrap_err();
        assert!(err.contains("publish.servers"), "{err}");
        let err = check("[clean]\nmax_policy_lag = 2\n").unwrap_err();
        assert!(err.contains("clean.policy"), "{err}");
        let cfg: RunConfig = toml::from_str(&format!(
            "[clean]\npolicy = \"coder\"\nmax_policy_lag = 2\n{publish}{lora}"
        ))
        .unwrap();
        assert_eq!(cfg.publish.as_ref().unwrap().keep_loaded, 2);
        assert_eq!(cfg.clean.max_policy_lag, Some(2));
    }
}
