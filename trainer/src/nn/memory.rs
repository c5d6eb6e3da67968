//! How much memory an update step needs, and fitting the micro-batches to a budget
//! (`[train] max_memory`). Built without libtorch: the estimate needs only the model's
//! shape, so a run that cannot fit fails before any weight is loaded or step taken.
//!
//! The peak of a micro-batch's forward and backward ([`super::train`]) is
//!
//! ```text
//! peak   = static + t · kept + max(head, t · layer)
//! static = weights + gradients + optimizer state + runtime   (at least what the process
//!          holds before the first step, plus the gradients to come, on CPU)
//! head   = HEAD_COPIES · min(logprob_chunk, n) · vocab · 4 + 2 · n · d · e
//! kept   = e · (L · saved + 2 · d)        layer = e · saved          no recompute
//!        = e · (L · d + 2 · d)                  = 2 · e · saved      recompute
//! ```
//!
//! (`t · kept` and `t · layer` times `ACTIVATION_OVERHEAD`.) The trunk's forward keeps
//! `kept` per token until its backward; the head (final norm, `lm_head`, log-softmax
//! over `logprob_chunk` rows at a time) runs in between, and one layer's backward (with
//! recompute: that layer run again) after it, so only the larger of the two adds.
//!
//! with `e` the bytes of the model dtype, `L` layers, `d` the hidden size, `t` the
//! tokens computed (their sum when packed, `[train] packing`; sequences × the longest
//! when right-padded), `n` the loss tokens, and `saved` the elements per token one
//! layer keeps for its backward — counted from the code of [`super::model`]:
//!
//! | tensor | elements per token |
//! |---|---|
//! | layer input, the normed input to q/k/v (and, when the norm's weight trains, the normalized value before the weight) | 2 · d (3 · d) |
//! | q and k after RoPE, v (k and v repeated to every head when grouped) | q + 2 · kv_rep |
//! | attention output and its `[t, heads·head_dim]` copy for `o_proj` | 2 · q |
//! | the residual after attention, the normed input to the MLP (and the normalized value) | 2 · d (3 · d) |
//! | gate, SiLU(gate), up, and their product for `down_proj` | 4 · f |
//! | LoRA: `A x` of each adapted projection | Σ r |
//!
//! (`q` = heads · head_dim, `kv_rep` = `q` when key/value heads are repeated, else
//! kv-heads · head_dim.) `ACTIVATION_OVERHEAD` covers what the allocator holds beyond
//! the live tensors (with glibc's mmap threshold fixed, see `main.rs`, about nothing)
//! and a margin;
//! it and `HEAD_COPIES` are measured: `tapline-trainer bench-update --seq-lens` prints
//! the estimate beside the measured peak, and BENCHMARKS.md keeps the table.
//!
//! Fitting ([`fit`]): a micro-batch whose estimate exceeds the budget is split (its
//! sequences packed again, longest first, into pieces that fit; the loss and the
//! gradient do not depend on the split, see `schedule`); a sequence that does not fit
//! alone runs with recompute; one that does not fit even then is an error naming its
//! length, the estimate and the budget.

use serde::Serialize;

use super::config::TransformerConfig;
use super::options::LoraOptions;
use crate::batch::{MicroBatch, MiniBatch};

/// Multiplies the counted activation bytes: what the allocator holds beyond the live
/// tensors, and a margin. Measured on SmolLM2-135M (BENCHMARKS.md), the count alone was
/// 0–6% above the peak with LoRA and 10–13% above it for a full fine-tune.
pub const ACTIVATION_OVERHEAD: f64 = 1.05;
/// `[rows, vocab]` fp32 tensors alive at once while the head runs a chunk (logits,
/// log-softmax, its exponential and their product; in the backward, the gradients).
pub const HEAD_COPIES: u64 = 4;
/// What the process holds besides tensors: libtorch's code and thread pools on CPU, the
/// CUDA context on a GPU.
pub const RUNTIME_BYTES: u64 = 512 << 20;
/// The default budget's share of the memory the process can have (see
/// [`default_budget`]).
pub const DEFAULT_SHARE: f64 = 0.8;

/// The shape of an update, as far as memory goes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryModel {
    /// Layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Query width (heads × head_dim).
    pub q: u64,
    /// Key/value width as attention sees it (repeated to every head when grouped).
    pub kv_rep: u64,
    /// MLP width.
    pub intermediate: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Σ rank over the adapted projections of one layer (0 for a full fine-tune).
    pub lora_rank_sum: u64,
    /// Bytes of one element of the model dtype.
    pub elem: u64,
    /// Parameters of the model.
    pub parameters: u64,
    /// Parameters the optimizer updates.
    pub trainable: u64,
    /// Bytes of one trainable element (fp32 adapters; the model dtype otherwise).
    pub trainable_elem: u64,
    /// Rows of the head computed at once.
    pub logprob_chunk: u64,
    /// What the process was measured to hold before the first step, plus what it will
    /// allocate whatever the tokens (the gradients): [`Self::static_bytes`] is at least
    /// this. It counts what the formula does not: the records read, the tokenizer.
    pub measured_static: Option<u64>,
    /// Whether micro-batches run packed (`[train] packing`, the default): then a
    /// micro-batch computes its tokens, else `sequences × longest`.
    pub packed: bool,
}

impl MemoryModel {
    /// The model of `config` in a dtype of `elem` bytes, with `lora` when an adapter is
    /// trained.
    pub fn new(
        config: &TransformerConfig,
        lora: Option<&LoraOptions>,
        elem: u64,
        logprob_chunk: usize,
    ) -> Self {
        let u = |x: i64| x.max(0) as u64;
        let (d, h, kv, hd) = (
            u(config.hidden_size),
            u(config.num_attention_heads),
            u(config.num_key_value_heads),
            u(config.head_dim),
        );
        let f = u(config.intermediate_size);
        let q = h * hd;
        let kv_rep = if kv > 0 && h / kv > 1 { q } else { kv * hd };
        let (lora_rank_sum, trainable) = match lora {
            None => (0, u(config.parameters())),
            Some(l) => {
                let r = u(l.rank);
                let mut ranks = 0;
                let mut params = 0;
                for t in &l.target_modules {
                    let (out, inp) = match t.as_str() {
                        "q_proj" => (q, d),
                        "k_proj" | "v_proj" => (kv * hd, d),
                        "o_proj" => (d, q),
                        "gate_proj" | "up_proj" => (f, d),
                        "down_proj" => (d, f),
                        _ => continue,
                    };
                    ranks += r;
                    params += r * (out + inp);
                }
                (ranks, params * u(config.num_hidden_layers))
            }
        };
        MemoryModel {
            layers: u(config.num_hidden_layers),
            hidden: d,
            q,
            kv_rep,
            intermediate: f,
            vocab: u(config.vocab_size),
            lora_rank_sum,
            elem,
            parameters: u(config.parameters()),
            trainable,
            trainable_elem: if lora.is_some() { 4 } else { elem },
            logprob_chunk: logprob_chunk.max(1) as u64,
            measured_static: None,
            packed: true,
        }
    }

    /// Elements per token one layer keeps for its backward (the table above; the
    /// normalized values only when the norms' weights are trained).
    pub fn saved_per_layer(&self) -> u64 {
        let norms = if self.lora_rank_sum > 0 { 0 } else { 2 };
        (4 + norms) * self.hidden
            + 3 * self.q
            + 2 * self.kv_rep
            + 4 * self.intermediate
            + self.lora_rank_sum
    }

    /// Bytes per token kept from the trunk's forward to its backward: every layer's
    /// saved tensors, or with recompute each layer's input; plus the trunk's output and
    /// its gradient.
    fn kept_per_token(&self, recompute: bool) -> u64 {
        let kept = if recompute {
            self.layers * self.hidden
        } else {
            self.layers * self.saved_per_layer()
        };
        kept * self.elem + 2 * self.hidden * self.elem
    }

    /// Bytes per token of one layer's backward beside what is kept: with recompute its
    /// saved tensors and their gradients, else the gradients of its intermediates.
    fn layer_per_token(&self, recompute: bool) -> u64 {
        self.saved_per_layer() * self.elem * if recompute { 2 } else { 1 }
    }

    /// Bytes per computed token of a micro-batch's activations, the head left out.
    pub fn per_token(&self, recompute: bool) -> u64 {
        let bytes = self.kept_per_token(recompute) + self.layer_per_token(recompute);
        (bytes as f64 * ACTIVATION_OVERHEAD) as u64
    }

    /// Weights, gradients, optimizer state (fp32 moments, and fp32 masters of non-fp32
    /// weights) and the runtime: what every step holds whatever its tokens.
    pub fn static_bytes(&self) -> u64 {
        // Adapters are fp32 beside the weights; a full fine-tune trains the weights.
        let adapters = if self.lora_rank_sum > 0 {
            self.trainable * 4
        } else {
            0
        };
        let weights = self.parameters * self.elem + adapters;
        let grads = self.trainable * self.trainable_elem;
        // fp32 moments, and an fp32 master of each non-fp32 trainable weight.
        let masters = if self.trainable_elem == 4 { 0 } else { 4 };
        let optimizer = self.trainable * (8 + masters);
        (weights + grads + optimizer + RUNTIME_BYTES).max(self.measured_static.unwrap_or(0))
    }

    /// Bytes of the head for a micro-batch with `loss_tokens`: a chunk's fp32 logits,
    /// and the hidden states of every loss token with their gradient.
    pub fn head_bytes(&self, loss_tokens: u64) -> u64 {
        HEAD_COPIES * self.logprob_chunk.min(loss_tokens.max(1)) * self.vocab * 4
            + 2 * loss_tokens * self.hidden * self.elem
    }

    /// What one micro-batch adds to [`Self::static_bytes`] at its peak. The head runs
    /// between the trunk's forward and its backward, so the peak is what is kept plus
    /// the larger of the head and one layer's backward.
    pub fn micro_batch_bytes(&self, shape: Shape, recompute: bool) -> u64 {
        let t = shape.computed(self.packed) as f64 * ACTIVATION_OVERHEAD;
        let kept = t * self.kept_per_token(recompute) as f64;
        let layer = t * self.layer_per_token(recompute) as f64;
        (kept + layer.max(self.head_bytes(shape.loss_tokens) as f64)) as u64
    }
}

/// The size of a micro-batch as memory sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Shape {
    /// Sequences.
    pub sequences: u64,
    /// The longest sequence (every row is padded to it when not packed).
    pub longest: u64,
    /// Tokens of all its sequences.
    pub tokens: u64,
    /// Loss tokens.
    pub loss_tokens: u64,
}

impl Shape {
    /// Of a micro-batch.
    pub fn of(mb: &MicroBatch) -> Self {
        Shape {
            sequences: mb.sequences.len() as u64,
            longest: mb
                .sequences
                .iter()
                .map(|s| s.sequence.len() as u64)
                .max()
                .unwrap_or(0),
            tokens: mb.sequences.iter().map(|s| s.sequence.len() as u64).sum(),
            loss_tokens: mb
                .sequences
                .iter()
                .map(|s| s.sequence.loss_tokens() as u64)
                .sum(),
        }
    }

    /// Tokens the model runs when the rows are padded.
    pub fn padded(self) -> u64 {
        self.sequences * self.longest.max(1)
    }

    /// Tokens the model runs, `packed` (`[train] packing`) or padded.
    pub fn computed(self, packed: bool) -> u64 {
        if packed {
            self.tokens.max(1)
        } else {
            self.padded()
        }
    }
}

/// Why the micro-batches cannot fit the budget.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum FitError {
    /// The weights, gradients and optimizer state alone exceed it.
    #[error(
        "train.max_memory = {budget} is below what the weights, gradients and optimizer state alone need ({needed}, estimated): raise max_memory, train a LoRA adapter instead of every weight, or use a machine with more memory"
    )]
    Static {
        /// The budget.
        budget: Size,
        /// The estimate.
        needed: Size,
    },
    /// One sequence does not fit even with recompute.
    #[error(
        "a sequence of {tokens} tokens (episode {episode}) needs an estimated {needed} even with recompute, above train.max_memory = {budget} (of which the weights, gradients and optimizer state take {fixed}): raise max_memory, or drop such sequences with a lower clean.max_seq_len"
    )]
    Sequence {
        /// Its length.
        tokens: u64,
        /// Its episode.
        episode: String,
        /// The estimate of its step's peak.
        needed: Size,
        /// The budget.
        budget: Size,
        /// The static part of the estimate.
        fixed: Size,
    },
}

/// A byte count shown with a binary unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Size(pub u64);

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0 as f64;
        const UNITS: [(&str, f64); 4] = [
            ("TiB", (1u64 << 40) as f64),
            ("GiB", (1u64 << 30) as f64),
            ("MiB", (1u64 << 20) as f64),
            ("KiB", 1024.0),
        ];
        for (unit, scale) in UNITS {
            if b >= scale {
                return write!(f, "{:.2} {unit}", b / scale);
            }
        }
        write!(f, "{} B", self.0)
    }
}

/// What [`fit`] decided, for the manifest.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FitReport {
    /// The budget.
    pub budget_bytes: u64,
    /// Where it came from (`train.max_memory`, `--max-memory`, or the default's rule).
    pub budget_source: String,
    /// Weights, gradients, optimizer state and runtime.
    pub static_bytes: u64,
    /// Activation bytes per computed token without recompute.
    pub bytes_per_token: u64,
    /// With recompute.
    pub bytes_per_token_recompute: u64,
    /// The largest estimated peak of a micro-batch as it will run.
    pub estimated_peak_bytes: u64,
    /// Micro-batches as the schedule made them.
    pub micro_batches_scheduled: u64,
    /// Micro-batches after splitting.
    pub micro_batches: u64,
    /// Scheduled micro-batches that were split to fit.
    pub split: u64,
    /// Micro-batches that run with recompute (all of them when `train.recompute`).
    pub recompute: u64,
}

/// Fits every micro-batch to `budget` bytes (see the module documentation); sets each
/// micro-batch's `recompute` and splits those that do not fit. `recompute_all` is
/// `train.recompute`. Deterministic: the same batches and budget give the same split on
/// every rank.
pub fn fit(
    model: &MemoryModel,
    mini_batches: &mut [MiniBatch],
    budget: u64,
    recompute_all: bool,
) -> Result<FitReport, FitError> {
    let fixed = model.static_bytes();
    let mut report = FitReport {
        budget_bytes: budget,
        static_bytes: fixed,
        bytes_per_token: model.per_token(false),
        bytes_per_token_recompute: model.per_token(true),
        ..Default::default()
    };
    if fixed >= budget {
        return Err(FitError::Static {
            budget: Size(budget),
            needed: Size(fixed),
        });
    }
    let room = budget - fixed;
    let fits = |s: Shape, recompute: bool| model.micro_batch_bytes(s, recompute) <= room;
    for mb in mini_batches.iter_mut() {
        report.micro_batches_scheduled += mb.micro_batches.len() as u64;
        let mut out: Vec<MicroBatch> = Vec::with_capacity(mb.micro_batches.len());
        for micro in std::mem::take(&mut mb.micro_batches) {
            let shape = Shape::of(&micro);
            if fits(shape, recompute_all) {
                out.push(MicroBatch {
                    recompute: recompute_all,
                    ..micro
                });
                continue;
            }
            // Longest first: each sequence runs without recompute if it fits alone so
            // (recompute costs a forward pass; a split costs only batching), and goes
            // into the first piece of its kind it fits in beside the others.
            let mut sequences = micro.sequences;
            sequences.sort_by_key(|s| std::cmp::Reverse(s.sequence.len()));
            let mut pieces: Vec<(Shape, MicroBatch)> = Vec::new();
            for s in sequences {
                let alone = Shape {
                    sequences: 1,
                    longest: s.sequence.len() as u64,
                    tokens: s.sequence.len() as u64,
                    loss_tokens: s.sequence.loss_tokens() as u64,
                };
                let recompute = if fits(alone, recompute_all) {
                    recompute_all
                } else if fits(alone, true) {
                    true
                } else {
                    return Err(FitError::Sequence {
                        tokens: alone.longest,
                        episode: s.episode_id.clone(),
                        needed: Size(fixed + model.micro_batch_bytes(alone, true)),
                        budget: Size(budget),
                        fixed: Size(fixed),
                    });
                };
                let joined = |p: &Shape| Shape {
                    sequences: p.sequences + 1,
                    longest: p.longest.max(alone.longest),
                    tokens: p.tokens + alone.tokens,
                    loss_tokens: p.loss_tokens + alone.loss_tokens,
                };
                match pieces
                    .iter_mut()
                    .find(|(shape, p)| p.recompute == recompute && fits(joined(shape), recompute))
                {
                    Some((shape, p)) => {
                        *shape = joined(shape);
                        p.sequences.push(s);
                    }
                    None => pieces.push((
                        alone,
                        MicroBatch {
                            sequences: vec![s],
                            recompute,
                        },
                    )),
                }
            }
            report.split += u64::from(pieces.len() > 1);
            out.extend(pieces.into_iter().map(|(_, p)| p));
        }
        for micro in &out {
            let shape = Shape::of(micro);
            report.estimated_peak_bytes = report
                .estimated_peak_bytes
                .max(fixed + model.micro_batch_bytes(shape, micro.recompute));
            report.recompute += u64::from(micro.recompute);
        }
        report.micro_batches += out.len() as u64;
        mb.micro_batches = out;
    }
    Ok(report)
}

/// The memory this process can have now, and the machine's (or container's) total:
/// `MemAvailable` plus this process's resident memory, capped by the cgroup's limit less
/// its other usage. `None` where `/proc/meminfo` is unreadable.
pub fn available_memory() -> Option<(u64, u64)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        meminfo.lines().find_map(|l| {
            l.strip_prefix(name)?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
                .map(|kb| kb * 1024)
        })
    };
    let total = field("MemTotal:")?;
    let available = field("MemAvailable:").unwrap_or(total);
    let own = own_rss();
    let mut can_have = available + own;
    let mut machine = total;
    // cgroup v2 (a container's limit): memory.max and memory.current of this cgroup.
    if let Some((limit, current)) = cgroup_memory() {
        machine = machine.min(limit);
        can_have = can_have.min(limit.saturating_sub(current) + own);
    }
    Some((can_have.min(machine), machine))
}

/// This process's resident memory (`VmRSS`).
pub fn own_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn cgroup_memory() -> Option<(u64, u64)> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let limit = std::fs::read_to_string(dir.join("memory.max")).ok()?;
    let limit: u64 = limit.trim().parse().ok()?; // "max": no limit
    let current: u64 = std::fs::read_to_string(dir.join("memory.current"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some((limit, current))
}

/// The budget when none is set: [`DEFAULT_SHARE`] of `total`, with the rule in words.
pub fn default_budget(total: u64, what: &str) -> (u64, String) {
    (
        (total as f64 * DEFAULT_SHARE) as u64,
        format!(
            "default: {:.0}% of {what} ({})",
            DEFAULT_SHARE * 100.0,
            Size(total)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::TrainSequence;
    use crate::merge::Sequence;

    fn smollm2() -> TransformerConfig {
        TransformerConfig::from_json(&serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": true,
            "max_position_embeddings": 8192
        }))
        .expect("a supported config")
    }

    fn seq(episode: &str, len: usize) -> TrainSequence {
        TrainSequence {
            episode_id: episode.into(),
            task_id: "t".into(),
            group_id: String::new(),
            reward: 0.0,
            sequence: Sequence {
                token_ids: vec![1; len],
                logprobs: vec![None; len],
                loss_mask: (0..len).map(|i| u8::from(i >= len / 2)).collect(),
                spans: Vec::new(),
            },
            advantages: vec![0.0; len],
            weights: vec![0.0; len],
        }
    }

    fn batch(lengths: &[usize]) -> Vec<MiniBatch> {
        vec![MiniBatch {
            micro_batches: vec![MicroBatch {
                sequences: lengths
                    .iter()
                    .enumerate()
                    .map(|(i, l)| seq(&format!("e{i}"), *l))
                    .collect(),
                recompute: false,
            }],
            normalizer: crate::schedule::Normalizer {
                loss_tokens: 0,
                sequences: 0,
                episodes: 0,
                constant: 1.0,
            },
        }]
    }

    fn lora_model() -> MemoryModel {
        MemoryModel::new(&smollm2(), Some(&LoraOptions::default()), 4, 1024)
    }

    #[test]
    fn recompute_keeps_a_fraction_of_the_activations() {
        let m = lora_model();
        assert!(m.per_token(true) * 4 < m.per_token(false), "{m:?}");
        // LoRA trains a few million parameters: the static part is the weights.
        let full = MemoryModel::new(&smollm2(), None, 4, 1024);
        assert!(full.static_bytes() > 3 * (m.static_bytes() - RUNTIME_BYTES));
    }

    #[test]
    fn a_batch_that_fits_is_left_alone() {
        let m = lora_model();
        let mut b = batch(&[1000, 900, 800]);
        let before = b.clone();
        let r = fit(&m, &mut b, 64 << 30, false).unwrap();
        assert_eq!(b, before);
        assert_eq!((r.micro_batches, r.split, r.recompute), (1, 0, 0));
    }

    #[test]
    fn an_oversized_micro_batch_is_split_before_recompute() {
        let m = lora_model();
        // Room for about 5000 padded tokens without recompute.
        let budget = m.static_bytes() + m.head_bytes(1024) + 5000 * m.per_token(false);
        let mut b = batch(&[4000, 3000, 2000, 1000, 500]);
        let tokens_before: Vec<usize> = b[0].micro_batches[0]
            .sequences
            .iter()
            .map(|s| s.sequence.len())
            .collect();
        let r = fit(&m, &mut b, budget, false).unwrap();
        assert_eq!(r.split, 1);
        assert_eq!(
            r.recompute, 0,
            "every sequence fits alone without recompute"
        );
        let mut after: Vec<usize> = b[0]
            .micro_batches
            .iter()
            .flat_map(|mb| mb.sequences.iter().map(|s| s.sequence.len()))
            .collect();
        after.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(after, tokens_before, "every sequence once");
        for mb in &b[0].micro_batches {
            assert!(m.micro_batch_bytes(Shape::of(mb), false) + m.static_bytes() <= budget);
        }
        assert!(r.estimated_peak_bytes <= budget);
    }

    #[test]
    fn a_long_sequence_gets_recompute_and_a_longer_one_an_error() {
        let m = lora_model();
        let budget = m.static_bytes() + m.head_bytes(1024) + 2000 * m.per_token(false);
        let mut b = batch(&[6000, 1000]);
        let r = fit(&m, &mut b, budget, false).unwrap();
        let flags: Vec<(usize, bool)> = b[0]
            .micro_batches
            .iter()
            .map(|mb| (mb.sequences[0].sequence.len(), mb.recompute))
            .collect();
        assert_eq!(flags, [(6000, true), (1000, false)]);
        assert_eq!(r.recompute, 1);

        let too_long = (budget - m.static_bytes()) / m.per_token(true) + 10;
        let mut b = batch(&[too_long as usize]);
        let e = fit(&m, &mut b, budget, false).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&format!("{too_long} tokens")) && text.contains("episode e0"),
            "{text}"
        );
        assert!(matches!(e, FitError::Sequence { .. }));
    }

    #[test]
    fn a_budget_below_the_weights_is_refused() {
        let m = MemoryModel::new(&smollm2(), None, 4, 1024);
        let e = fit(&m, &mut batch(&[10]), 1 << 30, false).unwrap_err();
        assert!(matches!(e, FitError::Static { .. }), "{e}");
        assert!(e.to_string().contains("1.00 GiB"), "{e}");
    }

    #[test]
    fn recompute_everywhere_is_kept() {
        let m = lora_model();
        let mut b = batch(&[100, 100]);
        let r = fit(&m, &mut b, 64 << 30, true).unwrap();
        assert_eq!(r.recompute, 1);
        assert!(b[0].micro_batches[0].recompute);
    }
}
