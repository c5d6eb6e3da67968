//! The settings of an update, without libtorch: the `[train]` section of the run
//! configuration (with `[train.lora]`), the learning-rate schedule and the loss
//! settings. `config` reads and checks them in every build; the modules that use them
//! with tensors (`train`, `optim`, `loss`, `lora`, `model`) re-export them.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The projections a LoRA adapter can target, by PEFT's leaf names, with the module
/// that holds them.
pub const LORA_TARGETS: &[(&str, &str)] = &[
    ("q_proj", "self_attn"),
    ("k_proj", "self_attn"),
    ("v_proj", "self_attn"),
    ("o_proj", "self_attn"),
    ("gate_proj", "mlp"),
    ("up_proj", "mlp"),
    ("down_proj", "mlp"),
];

/// The shape of the learning rate over steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// Linear warmup, then the peak rate.
    Constant,
    /// Linear warmup, then cosine decay to `min_lr_ratio · lr` at `total_steps`.
    Cosine,
}

/// Learning rate at optimizer step `step` (0-based), as transformers'
/// `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup` (with a floor).
pub fn learning_rate(
    schedule: LrSchedule,
    peak: f64,
    warmup_steps: u64,
    total_steps: u64,
    min_lr_ratio: f64,
    step: u64,
) -> f64 {
    if step < warmup_steps {
        return peak * (step + 1) as f64 / warmup_steps as f64;
    }
    match schedule {
        LrSchedule::Constant => peak,
        LrSchedule::Cosine => {
            let span = total_steps.saturating_sub(warmup_steps).max(1);
            let progress = ((step - warmup_steps) as f64 / span as f64).min(1.0);
            let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
            peak * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
        }
    }
}

/// Which ratio the surrogate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyLoss {
    /// Token-level ratio (PPO / GRPO / DAPO).
    Ppo,
    /// Sequence-level ratio (GSPO).
    Gspo,
}

/// Settings of the loss (section `[train]`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossOptions {
    /// Token or sequence ratio.
    pub policy_loss: PolicyLoss,
    /// `ε_low`.
    pub clip_ratio_low: f64,
    /// `ε_high`.
    pub clip_ratio_high: f64,
    /// Dual-clip constant `c` (> 1), or none.
    pub dual_clip: Option<f64>,
    /// Truncated importance sampling cap `C`, or none to ignore inference log-probs.
    pub tis_cap: Option<f64>,
    /// `β` of the KL penalty to the starting weights (0: none).
    pub kl_coef: f64,
}

/// The settings of a LoRA run (section `[train.lora]` of the run configuration); also
/// what an adapter directory's `adapter_config.json` says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraOptions {
    /// Rank `r`.
    pub rank: i64,
    /// `lora_alpha`: the adapter's output is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapter's input; only 0 is supported for training.
    pub dropout: f64,
    /// Projections that get an adapter, by leaf name: `q_proj k_proj v_proj o_proj
    /// gate_proj up_proj down_proj` (the default is all of them).
    pub target_modules: Vec<String>,
    /// rsLoRA: scale by `alpha / √rank` instead.
    pub use_rslora: bool,
}

impl Default for LoraOptions {
    fn default() -> Self {
        LoraOptions {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            target_modules: LORA_TARGETS.iter().map(|(l, _)| (*l).to_owned()).collect(),
            use_rslora: false,
        }
    }
}

impl LoraOptions {
    /// Checks every value for training; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if self.rank < 1 {
            return Err(format!(
                "train.lora.rank must be at least 1, not {}",
                self.rank
            ));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!(
                "train.lora.alpha must be positive and finite, not {}",
                self.alpha
            ));
        }
        if self.dropout != 0.0 {
            return Err(format!(
                "train.lora.dropout = {}: only 0 is supported (RL updates of LoRA adapters rarely use dropout)",
                self.dropout
            ));
        }
        check_targets(&self.target_modules).map_err(|m| format!("train.lora.target_modules: {m}"))
    }

    /// The factor of the adapter's output.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// `adapter_config.json` as PEFT writes it for these settings.
    pub fn peft_config(&self, base_model: &str) -> Value {
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "bias": "none",
            "target_modules": self.target_modules,
            "fan_in_fan_out": false,
            "inference_mode": true,
            "modules_to_save": null,
            "use_rslora": self.use_rslora,
            "use_dora": false,
            "init_lora_weights": true,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        })
    }
}

pub(crate) fn check_targets(targets: &[String]) -> Result<(), String> {
    if targets.is_empty() {
        return Err("empty: name at least one projection".into());
    }
    for t in targets {
        if !LORA_TARGETS.iter().any(|(l, _)| l == t) {
            let known: Vec<&str> = LORA_TARGETS.iter().map(|(l, _)| *l).collect();
            return Err(format!(
                "{t:?} is not a projection this model code can adapt (supported: {})",
                known.join(", ")
            ));
        }
    }
    Ok(())
}

/// Settings of the update (section `[train]` of the run configuration).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainOptions {
    /// Peak learning rate.
    pub lr: f64,
    /// `constant` or `cosine` after the warmup.
    pub lr_schedule: LrSchedule,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// Length of the cosine (default: the steps of this run).
    pub total_steps: Option<u64>,
    /// Floor of the cosine, as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// AdamW β1.
    pub beta1: f64,
    /// AdamW β2.
    pub beta2: f64,
    /// AdamW ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Gradient clipping by global norm (0: none; the norm is reported either way).
    pub max_grad_norm: f64,
    /// Passes over the mini-batches.
    pub epochs: u32,
    /// `ppo` (token ratio) or `gspo` (sequence ratio).
    pub policy_loss: PolicyLoss,
    /// `ε_low` of the clip.
    pub clip_ratio_low: f64,
    /// `ε_high` of the clip.
    pub clip_ratio_high: f64,
    /// Dual-clip constant `c` (> 1); 0 turns it off.
    pub dual_clip: f64,
    /// Truncated importance sampling cap against the inference log-probs; 0 turns it off.
    pub tis_cap: f64,
    /// KL penalty to the starting weights (0: none).
    pub kl_coef: f64,
    /// Rows of the head computed at once (bounds the fp32 logits to rows × vocab).
    pub logprob_chunk: usize,
    /// Recompute each layer in the backward pass instead of keeping its activations
    /// (everywhere; without it, the memory fit turns it on only for the micro-batches
    /// that need it).
    pub recompute: bool,
    /// Run each micro-batch as one row of its sequences end to end, positions restarting
    /// at each sequence and attention kept inside it, so the step computes the tokens
    /// trained and no padding (false: one right-padded row per sequence, compute growing
    /// with the longest). The loss and gradients are the same either way.
    pub packing: bool,
    /// The memory the update may use, with a unit (`"16GiB"`, `"20GB"`): before the
    /// first step every micro-batch's peak is estimated and fitted to it (split, or run
    /// with recompute), and a sequence that cannot fit is an error. Default: 80% of the
    /// memory the process can have when the run starts on CPU (the machine's or the
    /// container's), 80% of the GPU's on CUDA. See `nn::memory`.
    pub max_memory: Option<String>,
    /// `auto` (fp32 on CPU, bf16 on CUDA), `float32` or `bfloat16`.
    pub dtype: String,
    /// Seed of libtorch's generator (and of a new LoRA adapter's `A`).
    pub seed: u64,
    /// Train a LoRA adapter instead of every weight (section `[train.lora]`; absent:
    /// full fine-tune).
    pub lora: Option<LoraOptions>,
    /// Distributed runs (launched by torchrun / PyTorchJob): shard the AdamW state across
    /// the ranks (ZeRO-1/2: optimizer memory per rank falls as 1/world size); false keeps
    /// a whole copy on every rank (plain data parallel). No effect on one process.
    pub shard_optimizer: bool,
    /// The policy version announced when the run started (`[clean] policy`), from which
    /// the lag of each call's tokens is counted in [`TrainResult::importance_by_lag`].
    /// Not a setting: the run fills it in.
    #[serde(skip)]
    pub latest_policy_version: Option<u64>,
    /// When set, the update ends after the step during which it became true (`train
    /// --follow` on SIGTERM); the steps done are kept. Not a setting.
    #[serde(skip)]
    pub stop: Option<&'static std::sync::atomic::AtomicBool>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            lr: 1e-6,
            lr_schedule: LrSchedule::Constant,
            warmup_steps: 0,
            total_steps: None,
            min_lr_ratio: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            epochs: 1,
            policy_loss: PolicyLoss::Ppo,
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.28,
            dual_clip: 0.0,
            tis_cap: 2.0,
            kl_coef: 0.0,
            logprob_chunk: 1024,
            recompute: false,
            packing: true,
            max_memory: None,
            dtype: "auto".into(),
            seed: 0,
            lora: None,
            shard_optimizer: true,
            latest_policy_version: None,
            stop: None,
        }
    }
}

impl TrainOptions {
    /// Checks every value; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("train.lr", self.lr),
            ("train.eps", self.eps),
            ("train.clip_ratio_low", self.clip_ratio_low),
            ("train.clip_ratio_high", self.clip_ratio_high),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be positive and finite, not {v}"));
            }
        }
        let non_negative = [
            ("train.weight_decay", self.weight_decay),
            ("train.max_grad_norm", self.max_grad_norm),
            ("train.kl_coef", self.kl_coef),
            ("train.tis_cap", self.tis_cap),
            ("train.min_lr_ratio", self.min_lr_ratio),
        ];
        for (name, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be a finite number >= 0, not {v}"));
            }
        }
        for (name, v) in [("train.beta1", self.beta1), ("train.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(format!("{name} must be in [0, 1), not {v}"));
            }
        }
        if self.clip_ratio_low >= 1.0 {
            return Err(format!(
                "train.clip_ratio_low must be below 1, not {}",
                self.clip_ratio_low
            ));
        }
        if self.dual_clip != 0.0 && !(self.dual_clip.is_finite() && self.dual_clip > 1.0) {
            return Err(format!(
                "train.dual_clip must be 0 (off) or greater than 1, not {}",
                self.dual_clip
            ));
        }
        if self.epochs == 0 {
            return Err("train.epochs must be at least 1".into());
        }
        if self.logprob_chunk == 0 {
            return Err("train.logprob_chunk must be at least 1".into());
        }
        if !["auto", "float32", "fp32", "bfloat16", "bf16"].contains(&self.dtype.as_str()) {
            return Err(format!(
                "train.dtype must be auto, float32 or bfloat16, not {:?}",
                self.dtype
            ));
        }
        if let Some(lora) = &self.lora {
            lora.validate()?;
        }
        self.max_memory_bytes()?;
        Ok(())
    }

    /// `max_memory` in bytes, when set.
    pub fn max_memory_bytes(&self) -> Result<Option<u64>, String> {
        self.max_memory
            .as_deref()
            .map(|m| super::size::parse_size(m).map_err(|e| format!("train.max_memory = {e}")))
            .transpose()
    }

    /// The AdamW hyper-parameters `[β1, β2, ε, weight decay]`.
    pub fn adamw(&self) -> [f64; 4] {
        [self.beta1, self.beta2, self.eps, self.weight_decay]
    }

    /// The loss settings.
    pub fn loss(&self) -> LossOptions {
        LossOptions {
            policy_loss: self.policy_loss,
            clip_ratio_low: self.clip_ratio_low,
            clip_ratio_high: self.clip_ratio_high,
            dual_clip: (self.dual_clip > 0.0).then_some(self.dual_clip),
            tis_cap: (self.tis_cap > 0.0).then_some(self.tis_cap),
            kl_coef: self.kl_coef,
        }
    }
}
