//! `bench-update`: the update step timed, and with `--seq-lens` its peak memory measured
//! against the estimate.

use anyhow::Context as _;
use serde_json::Value;
use tapline_trainer::nn::{self};

use crate::cli::*;

pub(crate) fn bench_update(args: &BenchArgs) -> anyhow::Result<()> {
    if !args.seq_lens.is_empty() {
        return bench_memory_table(args);
    }
    let lengths = match &args.lengths {
        Some(spec) => nn::bench::parse_lengths(spec).map_err(|e| anyhow::anyhow!(e))?,
        None => vec![args.seq_len; args.sequences],
    };
    let micro_batch_tokens = args.lengths.is_some().then_some(args.micro_batch_tokens);
    let packing = match args.layout.as_deref() {
        None if args.lengths.is_some() => return bench_layouts(args, &lengths),
        None | Some("packed") => true,
        Some("padded") => false,
        Some(other) => anyhow::bail!("--layout must be packed or padded, not {other:?}"),
    };
    let device = nn::parse_device(&args.device)?;
    let kind = nn::parse_dtype(&args.dtype, device)?;
    anyhow::ensure!(args.seq_len >= 2, "--seq-len must be at least 2");
    anyhow::ensure!(
        args.sequences >= 1 && args.steps >= 1,
        "--sequences and --steps must be at least 1"
    );
    let launch = tapline_c10d::Launch::from_env()?.filter(|l| l.world_size > 1);
    let device = match (&launch, args.device.as_str()) {
        (Some(l), "cuda") => nn::parse_device(&format!("cuda:{}", l.local_rank))?,
        _ => device,
    };
    let group = match &launch {
        Some(l) => Some(tapline_c10d::Group::connect(
            l,
            if device.is_cuda() {
                tapline_c10d::Backend::Nccl
            } else {
                tapline_c10d::Backend::Gloo
            },
            std::time::Duration::from_secs(600),
        )?),
        None => None,
    };
    let rank = group.as_ref().map_or(0, |g| g.rank());
    let options = nn::train::TrainOptions {
        shard_optimizer: !args.replicate_optimizer,
        recompute: args.recompute,
        packing,
        lora: args.lora.then(|| nn::lora::LoraOptions {
            rank: args.lora_rank,
            alpha: 2.0 * args.lora_rank as f64,
            ..Default::default()
        }),
        ..Default::default()
    };
    if rank != 0 {
        // Rank 0 reports; the others only take part.
        nn::bench::run(
            &args.preset,
            device,
            kind,
            &lengths,
            micro_batch_tokens,
            args.warmup,
            args.steps,
            &options,
            None,
            group.as_ref(),
            |_, _| {},
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        return Ok(());
    }
    let tokens: usize = lengths.iter().sum();
    println!(
        "bench-update: {} {} on {} ({kind:?}), {} per step, {}, {} warmup + {} measured steps{}",
        args.preset,
        if args.lora {
            format!("LoRA r {}", args.lora_rank)
        } else {
            "full".into()
        },
        nn::manifest::device_name(device),
        match &args.lengths {
            Some(_) => format!(
                "{} sequences of {tokens} tokens in micro-batches of {} tokens",
                lengths.len(),
                args.micro_batch_tokens
            ),
            None => format!("{} x {} tokens", args.sequences, args.seq_len),
        },
        if packing { "packed" } else { "padded" },
        args.warmup,
        args.steps,
        if args.recompute { ", recompute" } else { "" }
    );
    let result = nn::bench::run(
        &args.preset,
        device,
        kind,
        &lengths,
        micro_batch_tokens,
        args.warmup,
        args.steps,
        &options,
        args.peak_tflops.map(|t| t * 1e12),
        group.as_ref(),
        |i, secs| {
            let tag = if i < args.warmup { "warmup" } else { "step" };
            println!(
                "  {tag} {i}: {secs:.2}s ({:.0} tok/s)",
                tokens as f64 / secs
            );
        },
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    println!(
        "bench-update: {:.0}M parameters ({:.2}M trainable), median {:.0} tokens/s, {:.1} TFLOP/s model FLOPs, MFU {}, peak RSS {:.2} GiB, {:.1} bytes/parameter",
        result.parameters as f64 / 1e6,
        result.trainable_parameters as f64 / 1e6,
        result.tokens_per_second,
        result.model_flops / 1e12,
        result.mfu.map_or(
            "n/a (unknown peak; pass --peak-tflops)".into(),
            |m| format!("{:.1}%", m * 100.0)
        ),
        result.peak_rss_bytes as f64 / (1u64 << 30) as f64,
        result.bytes_per_parameter,
    );
    println!(
        "bench-update: peak memory {:.2} GiB ({}), estimated {:.2} GiB before the first step: {:.3} MiB per token measured, {:.3} estimated (static {:.2} GiB)",
        result.peak_bytes as f64 / (1u64 << 30) as f64,
        if result.gpu_peak_memory_bytes_sampled.is_some() {
            "GPU memory used, sampled"
        } else {
            "peak RSS"
        },
        result.estimated_peak_bytes as f64 / (1u64 << 30) as f64,
        result.bytes_per_token / (1u64 << 20) as f64,
        result.estimated_bytes_per_token / (1u64 << 20) as f64,
        result.static_bytes as f64 / (1u64 << 30) as f64,
    );
    if let (Some(bytes), Some(secs)) = (result.comm_bytes_per_step, result.comm_seconds_per_step) {
        println!(
            "bench-update: {} ranks ({}, optimizer {}), rank 0 sent {:.1} MB per step into collectives in {:.3}s (median), optimizer state {:.1} MB per rank",
            result.world_size,
            result.backend.as_deref().unwrap_or(""),
            if options.shard_optimizer {
                "sharded"
            } else {
                "replicated"
            },
            bytes as f64 / 1e6,
            secs,
            result.optimizer_state_bytes as f64 / 1e6,
        );
    }
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// `bench-update --lengths` without `--layout`: the step padded, then packed, each in a
/// child process (a peak is a process's), and a table of both.
fn bench_layouts(args: &BenchArgs, lengths: &[usize]) -> anyhow::Result<()> {
    let tokens: usize = lengths.iter().sum();
    println!(
        "bench-update: {} {} {}, {} sequences of {tokens} tokens (longest {}) in micro-batches of {} tokens, {} warmup + {} measured steps, padded and packed",
        args.preset,
        if args.lora { "LoRA" } else { "full" },
        args.dtype,
        lengths.len(),
        lengths.iter().max().unwrap_or(&0),
        args.micro_batch_tokens,
        args.warmup,
        args.steps,
    );
    let mut rows = Vec::new();
    for layout in ["padded", "packed"] {
        let list: Vec<String> = lengths.iter().map(usize::to_string).collect();
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(["bench-update", "--preset", &args.preset])
            .args(["--device", &args.device, "--dtype", &args.dtype])
            .args(["--lengths", &list.join(",")])
            .args(["--micro-batch-tokens", &args.micro_batch_tokens.to_string()])
            .args(["--layout", layout])
            .args(["--warmup", &args.warmup.to_string()])
            .args(["--steps", &args.steps.to_string()])
            .args(["--lora-rank", &args.lora_rank.to_string()]);
        if args.lora {
            cmd.arg("--lora");
        }
        if args.recompute {
            cmd.arg("--recompute");
        }
        let out = cmd.stderr(std::process::Stdio::inherit()).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines().filter(|l| l.starts_with("  ")) {
            println!("  {layout}:{line}");
        }
        let result: Value = text
            .lines()
            .last()
            .and_then(|l| serde_json::from_str(l).ok())
            .filter(|_| out.status.success())
            .with_context(|| format!("the {layout} run failed ({}): {text}", out.status))?;
        rows.push((layout, result));
    }
    println!(
        "| layout | micro-batches | computed / real tokens | median step | tokens/s | peak memory | estimated peak |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let median_step = |r: &Value| {
        let mut t: Vec<f64> = r["step_seconds"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
    };
    for (layout, r) in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {layout} | {} | {:.3} | {:.2} s | {:.0} | {} | {} |",
            r["micro_batches"],
            f("computed_tokens_per_step") / f("tokens_per_step"),
            median_step(r),
            f("tokens_per_second"),
            nn::memory::Size(f("peak_bytes") as u64),
            nn::memory::Size(f("estimated_peak_bytes") as u64),
        );
    }
    let (padded, packed) = (&rows[0].1, &rows[1].1);
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "bench-update: packed / padded: step time {:.3}, tokens/s {:.2}x, peak memory {:.2}",
        median_step(packed) / median_step(padded),
        f(packed, "tokens_per_second") / f(padded, "tokens_per_second"),
        f(packed, "peak_bytes") / f(padded, "peak_bytes"),
    );
    Ok(())
}

/// `bench-update --seq-lens`: one child process per length (peak memory is per
/// process), then a table of the measured and estimated peaks.
fn bench_memory_table(args: &BenchArgs) -> anyhow::Result<()> {
    use nn::memory::{MemoryModel, Shape, Size};
    let device = nn::parse_device(&args.device)?;
    let kind = nn::parse_dtype(&args.dtype, device)?;
    let config = nn::bench::preset(&args.preset).with_context(|| {
        format!(
            "unknown preset {:?} (known: {})",
            args.preset,
            nn::bench::PRESETS.join(", ")
        )
    })?;
    let lora = args.lora.then(|| nn::lora::LoraOptions {
        rank: args.lora_rank,
        alpha: 2.0 * args.lora_rank as f64,
        ..Default::default()
    });
    let elem = if kind == tch::Kind::Float { 4 } else { 2 };
    let estimate = MemoryModel::new(&config, lora.as_ref(), elem, 1024);
    let available = match device {
        tch::Device::Cuda(i) => nn::manifest::gpu_memory_total(i),
        _ => nn::memory::available_memory().map(|(can_have, _)| can_have),
    };
    let mib = |b: f64| b / (1u64 << 20) as f64;
    println!(
        "bench-update: peak memory of {} {} ({kind:?}){}, one sequence per micro-batch; measured: {}",
        args.preset,
        if args.lora { "LoRA" } else { "full" },
        if args.recompute { ", recompute" } else { "" },
        if device.is_cuda() {
            "GPU memory used, sampled by nvidia-smi"
        } else {
            "peak RSS"
        }
    );
    println!(
        "| tokens | measured peak | estimated peak | estimate / measured | MiB per token, measured | MiB per token, estimated |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for &len in &args.seq_lens {
        anyhow::ensure!(len >= 2, "--seq-lens: every length must be at least 2");
        let shape = Shape {
            sequences: 1,
            longest: len as u64,
            tokens: len as u64,
            loss_tokens: (len - len / 2) as u64,
        };
        let predicted = estimate.static_bytes() + estimate.micro_batch_bytes(shape, args.recompute);
        if let Some(avail) = available.filter(|a| predicted as f64 > *a as f64 * 0.9) {
            println!(
                "| {len} | not run | {} | | | {:.3} (over 90% of the {} available) |",
                Size(predicted),
                mib(estimate.per_token(args.recompute) as f64),
                Size(avail)
            );
            continue;
        }
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args([
            "bench-update",
            "--preset",
            &args.preset,
            "--device",
            &args.device,
        ])
        .args(["--dtype", &args.dtype, "--sequences", "1"])
        .args(["--seq-len", &len.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--lora-rank", &args.lora_rank.to_string()]);
        if args.lora {
            cmd.arg("--lora");
        }
        if args.recompute {
            cmd.arg("--recompute");
        }
        let out = cmd.stderr(std::process::Stdio::inherit()).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let result: Option<Value> = text
            .lines()
            .last()
            .and_then(|l| serde_json::from_str(l).ok());
        let Some(r) = result.filter(|_| out.status.success()) else {
            println!(
                "| {len} | failed ({}) | {} | | | |",
                out.status,
                Size(predicted)
            );
            continue;
        };
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {len} | {} | {} | {:.2} | {:.3} | {:.3} |",
            Size(f("peak_bytes") as u64),
            Size(f("estimated_peak_bytes") as u64),
            f("estimated_peak_bytes") / f("peak_bytes"),
            mib(f("bytes_per_token")),
            mib(f("estimated_bytes_per_token")),
        );
    }
    Ok(())
}
