//! Update throughput on random weights of a real model's shape: tokens/s and model
//! FLOPs utilization (MFU). `tapline-trainer bench-update` runs it; `cargo xtask
//! gpu-check` runs it on CUDA with a Qwen model of 0.5–2B parameters.
//!
//! Model FLOPs per trained token follow PaLM (appendix B): `6·N + 12·L·H·Q·T`, with `N`
//! the parameters outside the embedding lookup (the LM head counts), `L` layers, `H`
//! heads, `Q` head width and `T` the sequence length (with mixed lengths, each token's
//! own, averaged over the tokens). The update really does a little
//! more (with GSPO the head runs twice, see `nn::train`), which MFU does not credit.

use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind};

use super::config::{Arch, TransformerConfig};
use super::model::Transformer;
use super::train::{self, TrainOptions};
use crate::batch::{MicroBatch, MiniBatch, TrainSequence};
use crate::merge::{CallSpan, Sequence};
use crate::schedule::Normalizer;

/// Named model shapes.
pub const PRESETS: &[&str] = &[
    "tiny",
    "smollm2-135m",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "qwen2.5-1.5b",
    "qwen3-1.7b",
    "qwen2.5-7b",
    "qwen3-8b",
];

/// The configuration of a preset (the real models' `config.json` values).
pub fn preset(name: &str) -> Option<TransformerConfig> {
    #[allow(clippy::type_complexity)]
    let (arch, v, d, f, l, h, kv, hd, theta, tie): (
        Arch,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        f64,
        bool,
    ) = match name {
        "tiny" => (Arch::Qwen3, 1024, 128, 256, 2, 4, 2, 32, 1e6, true),
        "smollm2-135m" => (Arch::Llama, 49152, 576, 1536, 30, 9, 3, 64, 1e5, true),
        "qwen2.5-0.5b" => (Arch::Qwen2, 151936, 896, 4864, 24, 14, 2, 64, 1e6, true),
        "qwen3-0.6b" => (Arch::Qwen3, 151936, 1024, 3072, 28, 16, 8, 128, 1e6, true),
        "qwen2.5-1.5b" => (Arch::Qwen2, 151936, 1536, 8960, 28, 12, 2, 128, 1e6, true),
        "qwen3-1.7b" => (Arch::Qwen3, 151936, 2048, 6144, 28, 16, 8, 128, 1e6, true),
        "qwen2.5-7b" => (Arch::Qwen2, 152064, 3584, 18944, 28, 28, 4, 128, 1e6, false),
        "qwen3-8b" => (Arch::Qwen3, 151936, 4096, 12288, 36, 32, 8, 128, 1e6, false),
        _ => return None,
    };
    Some(TransformerConfig {
        arch,
        vocab_size: v,
        hidden_size: d,
        intermediate_size: f,
        num_hidden_layers: l,
        num_attention_heads: h,
        num_key_value_heads: kv,
        head_dim: hd,
        rms_norm_eps: 1e-6,
        rope_theta: theta,
        rope_llama3: None,
        tie_word_embeddings: tie,
        qkv_bias: arch == Arch::Qwen2,
        o_bias: false,
        qk_norm: arch == Arch::Qwen3,
        max_position_embeddings: 32768,
        dtype: None,
    })
}

/// Peak dense bf16 FLOP/s of known GPUs, by a substring of their name.
pub fn peak_flops(device_name: &str) -> Option<f64> {
    let table: &[(&str, f64)] = &[
        ("H200", 989e12),
        ("H100", 989e12),
        ("H800", 989e12),
        ("GH200", 989e12),
        ("B200", 2250e12),
        ("A100", 312e12),
        ("A800", 312e12),
        ("L40S", 362e12),
        ("L40", 181e12),
        ("L4", 121e12),
        ("A10G", 70e12),
        ("A10", 125e12),
        ("4090", 165e12),
    ];
    table
        .iter()
        .find(|(k, _)| device_name.contains(k))
        .map(|(_, v)| *v)
}

/// Model FLOPs to train one token of a `seq_len` sequence. With `lora` the frozen
/// weights get no weight gradient: `4·N` instead of `6·N` (the adapters' own FLOPs,
/// under 1% at the ranks used, are not counted).
pub fn flops_per_token(c: &TransformerConfig, seq_len: i64, lora: bool) -> f64 {
    // The embedding lookup costs nothing; the LM head is a matmul (with the embedding's
    // weights when tied, which `parameters` then counts once).
    let lookup = if c.tie_word_embeddings {
        0
    } else {
        c.vocab_size * c.hidden_size
    };
    let n = (c.parameters() - lookup) as f64;
    let attention = 12.0
        * c.num_hidden_layers as f64
        * c.num_attention_heads as f64
        * c.head_dim as f64
        * seq_len as f64;
    (if lora { 4.0 } else { 6.0 }) * n + attention
}

/// What the benchmark measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// Preset.
    pub preset: String,
    /// Parameters.
    pub parameters: i64,
    /// Device name.
    pub device: String,
    /// dtype.
    pub dtype: String,
    /// Tokens per optimizer step.
    pub tokens_per_step: u64,
    /// Tokens computed per step, padding included.
    pub computed_tokens_per_step: u64,
    /// Whether micro-batches ran packed.
    pub packed: bool,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Seconds of each measured step.
    pub step_seconds: Vec<f64>,
    /// Median tokens/s over the measured steps.
    pub tokens_per_second: f64,
    /// Model FLOPs per token.
    pub flops_per_token: f64,
    /// Achieved model FLOP/s.
    pub model_flops: f64,
    /// `model_flops / peak`, when the peak is known.
    pub mfu: Option<f64>,
    /// Peak resident memory of the process.
    pub peak_rss_bytes: u64,
    /// Parameters the optimizer updates (the adapters under LoRA).
    pub trainable_parameters: i64,
    /// Bytes of optimizer state (fp32 moments, and fp32 masters of non-fp32 weights).
    pub optimizer_state_bytes: u64,
    /// `lora` or `full`.
    pub mode: String,
    /// Peak memory (GPU memory on CUDA when sampled, else the process's peak RSS) per
    /// model parameter.
    pub bytes_per_parameter: f64,
    /// Peak GPU memory sampled with `nvidia-smi` (CUDA only).
    pub gpu_peak_memory_bytes_sampled: Option<u64>,
    /// Ranks (1: one process; more under torchrun).
    pub world_size: usize,
    /// Distributed: `gloo` or `nccl`, and whether the optimizer state is sharded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Distributed: whether the AdamW state is sharded across the ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard_optimizer: Option<bool>,
    /// Distributed: bytes rank 0 sent into collectives per measured step (median).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_bytes_per_step: Option<u64>,
    /// Distributed: seconds rank 0 spent in collectives per measured step (median),
    /// waiting for the slowest rank included.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_seconds_per_step: Option<f64>,
    /// The peak measured: GPU memory sampled on CUDA, else the process's peak RSS.
    pub peak_bytes: u64,
    /// The trainer's estimate of that peak (`nn::memory`), made before the first step.
    pub estimated_peak_bytes: u64,
    /// What the process held before the first step, plus the gradients to come: the
    /// static part of the estimate.
    pub static_bytes: u64,
    /// `(peak − static) / tokens of a micro-batch`: what one more token costs, head
    /// included, as measured.
    pub bytes_per_token: f64,
    /// The same from the estimate.
    pub estimated_bytes_per_token: f64,
}

/// A built-in length mix shaped like agent traces, scaled to what a CPU step runs in
/// seconds: a few long multi-turn episodes beside many short ones (2,048 tokens in 16
/// sequences, 40 to 512; real traces run 8–30k beside a few hundred, where padding costs
/// more).
pub const AGENT_MIX: &[usize] = &[
    512, 320, 224, 160, 128, 112, 96, 80, 64, 64, 64, 48, 48, 48, 40, 40,
];

/// Lengths from `--lengths`: a comma-separated list, or `agent` ([`AGENT_MIX`]).
pub fn parse_lengths(spec: &str) -> Result<Vec<usize>, String> {
    if spec.trim() == "agent" {
        return Ok(AGENT_MIX.to_vec());
    }
    let lengths = spec
        .split(',')
        .map(|p| {
            p.trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n >= 2)
                .ok_or_else(|| {
                    format!("--lengths: {p:?} is not a length of at least 2 tokens (give e.g. 4096,512,128 or agent)")
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if lengths.is_empty() {
        return Err("--lengths: give at least one length".into());
    }
    Ok(lengths)
}

/// Random sequences of `seq_len` tokens with loss on their second half.
pub fn synthetic_batch(vocab: i64, sequences: usize, seq_len: usize, seed: u64) -> MiniBatch {
    synthetic_lengths(vocab, &vec![seq_len; sequences], None, seed)
}

/// Random sequences of `lengths` with loss on their second half, in micro-batches of at
/// most `micro_batch_tokens` (the scheduler's packing, `schedule::pack`: longest first,
/// first fit), or one sequence per micro-batch.
pub fn synthetic_lengths(
    vocab: i64,
    lengths: &[usize],
    micro_batch_tokens: Option<usize>,
    seed: u64,
) -> MiniBatch {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let sequences = lengths.len();
    let total_loss = lengths.iter().map(|n| n - n / 2).sum::<usize>() as f64;
    let seqs = (0..sequences)
        .map(|i| {
            let seq_len = lengths[i];
            let ids: Vec<u32> = (0..seq_len)
                .map(|_| (next() % vocab as u64) as u32)
                .collect();
            let mask: Vec<u8> = (0..seq_len).map(|t| u8::from(t >= seq_len / 2)).collect();
            let a = if i % 2 == 0 { 1.0 } else { -1.0 };
            TrainSequence {
                episode_id: format!("bench-{i}"),
                task_id: "bench".into(),
                group_id: String::new(),
                reward: a,
                advantages: mask.iter().map(|m| f64::from(*m) * a).collect(),
                weights: mask.iter().map(|m| f64::from(*m) / total_loss).collect(),
                sequence: Sequence {
                    token_ids: ids,
                    logprobs: vec![None; seq_len],
                    loss_mask: mask,
                    spans: vec![CallSpan {
                        span_id: format!("bench-{i}"),
                        call_index: 0,
                        start: seq_len / 2,
                        end: seq_len,
                        policy_version: String::new(),
                    }],
                },
            }
        })
        .collect::<Vec<_>>();
    let groups = match micro_batch_tokens {
        Some(budget) => crate::schedule::pack(lengths, budget),
        None => (0..sequences).map(|i| vec![i]).collect(),
    };
    MiniBatch {
        micro_batches: groups
            .into_iter()
            .map(|g| MicroBatch {
                sequences: g.into_iter().map(|i| seqs[i].clone()).collect(),
                recompute: false,
            })
            .collect(),
        normalizer: Normalizer {
            loss_tokens: total_loss as u64,
            sequences: sequences as u64,
            episodes: sequences as u64,
            constant: 1.0,
        },
    }
}

/// Runs `warmup + steps` optimizer steps of sequences of `lengths` each, in
/// micro-batches of `micro_batch_tokens` (one sequence per micro-batch when `None`; on
/// a group, the ranks share the micro-batches of each step, so the tokens per step are
/// the same at every world size).
#[allow(clippy::too_many_arguments)]
pub fn run(
    preset_name: &str,
    device: Device,
    kind: Kind,
    lengths: &[usize],
    micro_batch_tokens: Option<usize>,
    warmup: usize,
    steps: usize,
    options: &TrainOptions,
    peak: Option<f64>,
    group: Option<&tapline_c10d::Group>,
    mut on_step: impl FnMut(usize, f64),
) -> Result<BenchResult, String> {
    let config = preset(preset_name).ok_or_else(|| {
        format!(
            "unknown preset {preset_name:?} (known: {})",
            PRESETS.join(", ")
        )
    })?;
    let parameters = config.parameters();
    // Attention FLOPs grow with each token's own sequence: the token-weighted mean.
    let tokens = lengths.iter().sum::<usize>() as u64;
    let fpt = lengths
        .iter()
        .map(|&n| n as f64 * flops_per_token(&config, n as i64, options.lora.is_some()))
        .sum::<f64>()
        / tokens.max(1) as f64;
    let mut model = Transformer::random(config, device, kind, options.seed);
    if let Some(lora) = &options.lora {
        lora.validate()?;
        super::lora::attach_new(&mut model, lora, options.seed);
    }
    let group = group.filter(|g| g.size() > 1);
    let mut optimizer: Box<dyn super::dist::Optimizer> = match group {
        Some(g) if options.shard_optimizer => {
            model.set_requires_grad(true);
            Box::new(super::dist::ShardedAdamW::new(
                model.trainable_parameters(),
                options.adamw(),
                g.rank(),
                g.size(),
            ))
        }
        _ => Box::new(options.optimizer(&mut model)),
    };
    let trainable: i64 = model
        .trainable_parameters()
        .iter()
        .map(|(_, t)| t.numel() as i64)
        .sum();
    let batch = synthetic_lengths(
        model.config.vocab_size,
        lengths,
        micro_batch_tokens,
        options.seed + 1,
    );
    // The estimate the trainer makes before a run's first step, for the largest
    // micro-batch.
    let mut estimate = super::memory::MemoryModel::new(
        &model.config,
        options.lora.as_ref(),
        if kind == Kind::Float { 4 } else { 2 },
        options.logprob_chunk,
    );
    estimate.packed = options.packing;
    if !device.is_cuda() {
        estimate.measured_static =
            Some(super::memory::own_rss() + estimate.trainable * estimate.trainable_elem);
    }
    let micro_shape = batch
        .micro_batches
        .iter()
        .map(super::memory::Shape::of)
        .max_by_key(|s| s.computed(options.packing))
        .unwrap_or_default();
    let micro_estimate = estimate.micro_batch_bytes(micro_shape, options.recompute);
    let static_bytes = estimate.static_bytes();
    let gpu_memory = super::manifest::GpuMemorySampler::start(device);
    let mut times = Vec::new();
    let (mut comm_bytes, mut comm_seconds) = (Vec::new(), Vec::new());
    for i in 0..warmup + steps {
        let started = Instant::now();
        let mut comm = None;
        train::train_with(
            &mut model,
            optimizer.as_mut(),
            std::slice::from_ref(&batch),
            options,
            i as u64,
            group,
            |m| comm = m.comm,
        )
        .map_err(|e| e.to_string())?;
        if let Device::Cuda(_) = device {
            tch::Cuda::synchronize(0);
        }
        let secs = started.elapsed().as_secs_f64();
        on_step(i, secs);
        if i >= warmup {
            times.push(secs);
            if let Some(c) = comm {
                comm_bytes.push(c.bytes);
                comm_seconds.push(c.seconds);
            }
        }
    }
    let gpu_peak = gpu_memory.finish();
    let median_step = median(&times).unwrap_or(f64::NAN);
    let tps = tokens as f64 / median_step;
    let device_name = super::manifest::device_name(device);
    let peak_rss = super::manifest::peak_rss_bytes();
    let peak = peak.or_else(|| peak_flops(&device_name).filter(|_| device.is_cuda()));
    let peak_bytes = gpu_peak.unwrap_or(peak_rss);
    let micro_tokens = micro_shape.computed(options.packing) as f64;
    Ok(BenchResult {
        peak_bytes,
        estimated_peak_bytes: static_bytes + micro_estimate,
        static_bytes,
        bytes_per_token: peak_bytes.saturating_sub(static_bytes) as f64 / micro_tokens,
        estimated_bytes_per_token: micro_estimate as f64 / micro_tokens,
        preset: preset_name.into(),
        parameters,
        device: device_name,
        dtype: format!("{kind:?}"),
        tokens_per_step: tokens,
        computed_tokens_per_step: batch
            .micro_batches
            .iter()
            .map(|m| {
                super::packing::computed(
                    m.sequences.iter().map(|s| s.sequence.len()),
                    options.packing,
                )
            })
            .sum(),
        packed: options.packing,
        micro_batches: batch.micro_batches.len(),
        step_seconds: times,
        tokens_per_second: tps,
        flops_per_token: fpt,
        model_flops: tps * fpt,
        mfu: peak.map(|p| tps * fpt / p),
        peak_rss_bytes: peak_rss,
        trainable_parameters: trainable,
        optimizer_state_bytes: optimizer.state_bytes(),
        mode: if options.lora.is_some() {
            "lora"
        } else {
            "full"
        }
        .into(),
        bytes_per_parameter: gpu_peak.unwrap_or(peak_rss) as f64 / parameters as f64,
        gpu_peak_memory_bytes_sampled: gpu_peak,
        world_size: group.map_or(1, |g| g.size()),
        backend: group.map(|g| g.backend().name().into()),
        shard_optimizer: group.map(|_| options.shard_optimizer),
        comm_bytes_per_step: median(&comm_bytes),
        comm_seconds_per_step: median(&comm_seconds),
    })
}

/// The middle value (upper middle of an even count); `None` when empty.
fn median<T: Copy + PartialOrd>(values: &[T]) -> Option<T> {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    sorted.get(sorted.len() / 2).copied()
}
