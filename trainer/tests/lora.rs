//! LoRA against PEFT (the reference, run from `TAPLINE_PYTHON` through
//! `hf_reference.py`): log-probabilities with an adapter, one step's adapter gradients,
//! adapters the trainer writes loaded by `PeftModel`, `merge-lora` against
//! `merge_and_unload`, and bad adapter directories named.

mod common;

use std::path::Path;

use common::cli::{score_with, trainer};
use common::reference::*;
use serde_json::{Value, json};
use tapline_trainer::nn::Transformer;
use tapline_trainer::nn::lora::{self, LoraOptions};
use tapline_trainer::nn::train::{self, TrainOptions, gather, micro_step};
use tapline_trainer::nn::weights::{self, Checkpoint};
use tapline_trainer::pipeline::TrainSequence;
use tch::{Device, Kind, Tensor};

/// A random adapter written by PEFT (`A` and `B` both random).
fn peft_random(model: &Path, rank: u32, alpha: f64, extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let (rank, alpha) = (rank.to_string(), alpha.to_string());
    let mut args = vec![
        "peft-random",
        "--model",
        model.to_str().unwrap(),
        "--out",
        dir.path().to_str().unwrap(),
        "--rank",
        &rank,
        "--alpha",
        &alpha,
    ];
    args.extend_from_slice(extra);
    run_python(&args, None);
    dir
}

fn peft_logprobs(model: &Path, adapter: &Path, sequences: &[Vec<u32>]) -> Vec<Vec<f64>> {
    let v = run_python(
        &[
            "peft-logprobs",
            "--model",
            model.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
        ],
        Some(&json!({ "sequences": sequences })),
    );
    serde_json::from_value(v["logprobs"].clone()).unwrap()
}

fn with_adapter(base: &Path, adapter: &Path) -> Transformer {
    lora::load_with_adapter(base, adapter, Device::Cpu, Kind::Float)
        .unwrap()
        .0
}

#[test]
fn adapters_give_the_log_probs_of_peft() {
    let smollm2 = common::smollm2();
    let tiny_qwen2 = tiny("qwen2", 21, &[]);
    let tiny_qwen3 = tiny("qwen3", 22, &["--tie"]);
    let cases: Vec<(&str, &Path, u32, f64, Vec<&str>)> = vec![
        ("SmolLM2, r 8, all projections", &smollm2, 8, 16.0, vec![]),
        (
            "qwen2 (biases), r 4, rsLoRA, three projections",
            tiny_qwen2.path(),
            4,
            8.0,
            vec!["--targets", "q_proj,v_proj,down_proj", "--rslora"],
        ),
        ("qwen3 (q/k norm, tied)", tiny_qwen3.path(), 4, 4.0, vec![]),
    ];
    for (name, base, rank, alpha, extra) in cases {
        let adapter = peft_random(base, rank, alpha, &extra);
        let model = with_adapter(base, adapter.path());
        let vocab = model.config.vocab_size as u32;
        let sequences = vec![random_ids(48, vocab, 1), random_ids(17, vocab, 2)];
        let expected = peft_logprobs(base, adapter.path(), &sequences);
        let plain = Transformer::load(base, Device::Cpu, Kind::Float).unwrap();
        for (ids, exp) in sequences.iter().zip(&expected) {
            let ours = model.sequence_logprobs(ids, 16).unwrap();
            let diff = max_diff(&ours, exp);
            assert!(diff <= TOLERANCE, "{name}: max |Δ| = {diff:e}");
            let without = plain.sequence_logprobs(ids, 16).unwrap();
            let moved = max_diff(&without, exp);
            assert!(
                moved > 1e-3,
                "{name}: the adapter changes nothing ({moved:e}), the test proves nothing"
            );
        }
    }
}

/// `c[t - 1] = w_t · A_t` on loss tokens: at the first step (ratio 1, no TIS) the
/// surrogate's gradient is that of `-Σ c · log p`.
fn coefficients(s: &TrainSequence) -> Vec<f64> {
    (1..s.sequence.len())
        .map(|t| {
            if s.sequence.loss_mask[t] == 1 {
                s.weights[t] * s.advantages[t]
            } else {
                0.0
            }
        })
        .collect()
}

#[test]
fn adapter_gradients_equal_peft_and_do_not_depend_on_the_split() {
    for (arch, flags, extra) in [
        ("qwen3", vec![], vec![]),
        (
            "qwen2",
            vec!["--tie"],
            vec!["--targets", "k_proj,o_proj,gate_proj,up_proj"],
        ),
    ] {
        let base = tiny(arch, 31, &flags);
        let adapter = peft_random(base.path(), 4, 8.0, &extra);
        let mut model = with_adapter(base.path(), adapter.path());
        model.set_requires_grad(true);
        let sequences: Vec<TrainSequence> = [(20, 1.0), (13, -0.5), (31, 0.25), (8, -1.5)]
            .iter()
            .enumerate()
            .map(|(i, (n, a))| seq(&random_ids(*n, 320, 50 + i as u64), *a, 1.0 / 40.0))
            .collect();
        let reference = run_python(
            &[
                "peft-grads",
                "--model",
                base.path().to_str().unwrap(),
                "--adapter",
                adapter.path().to_str().unwrap(),
            ],
            Some(&json!({
                "sequences": sequences.iter().map(|s| s.sequence.token_ids.clone()).collect::<Vec<_>>(),
                "coefficients": sequences.iter().map(coefficients).collect::<Vec<_>>(),
            })),
        );
        let options = TrainOptions {
            tis_cap: 0.0,
            ..TrainOptions::default()
        };
        zero_grads(&model);
        micro_step(
            &model,
            &gather(&micro(sequences.clone()), Device::Cpu, true),
            None,
            &options,
        );
        let whole = grads(&model);
        assert_eq!(
            whole.len(),
            reference["grads"].as_object().unwrap().len(),
            "{arch}: adapter tensors"
        );
        let mut largest = 0.0f32;
        for (name, ours) in &whole {
            let theirs: Vec<f64> = serde_json::from_value(reference["grads"][name].clone())
                .unwrap_or_else(|e| panic!("{arch}: PEFT has no gradient for {name}: {e}"));
            let diff = max_diff(ours, &theirs);
            assert!(diff <= 1e-5, "{arch}: {name} differs from PEFT by {diff:e}");
            largest = largest.max(ours.iter().map(|x| x.abs()).fold(0.0, f32::max));
        }
        assert!(largest > 1e-3, "{arch}: gradients are all ~0 ({largest:e})");
        // The base weights are frozen: no gradient reaches them.
        for (name, t) in model.named_parameters() {
            assert!(!t.grad().defined(), "{arch}: {name} got a gradient");
        }
        // The same gradients from any split into micro-batches, with or without
        // recomputation.
        for options in [
            options.clone(),
            TrainOptions {
                recompute: true,
                logprob_chunk: 5,
                ..options.clone()
            },
        ] {
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
            for ((name, w), (_, p)) in whole.iter().zip(grads(&model)) {
                let diff = w
                    .iter()
                    .zip(&p)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(
                    diff <= 1e-5,
                    "{arch} recompute {}: {name} differs by {diff:e}",
                    options.recompute
                );
            }
        }
    }
}

fn tensors(path: &Path) -> Vec<(String, Tensor)> {
    let file = Checkpoint::open_file(path).unwrap();
    file.names()
        .map(|n| {
            let shape = file.shape(n).unwrap().to_vec();
            (
                n.to_owned(),
                file.load(n, &shape, Kind::Float, Device::Cpu).unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_trained_adapter_loads_in_peft_and_merges_as_peft_does() {
    let base = tiny("llama", 41, &["--tie"]);
    let mut model = Transformer::load(base.path(), Device::Cpu, Kind::Float).unwrap();
    let before: Vec<(String, Tensor)> = model
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    let settings = LoraOptions {
        rank: 4,
        alpha: 8.0,
        ..LoraOptions::default()
    };
    lora::attach_new(&mut model, &settings, 7);
    let ids = random_ids(40, 320, 12);
    let base_lp = hf_logprobs(base.path(), std::slice::from_ref(&ids));
    // A new adapter (B = 0) is the base model.
    let fresh = model.sequence_logprobs(&ids, 64).unwrap();
    assert!(max_diff(&fresh, &base_lp[0]) <= TOLERANCE);
    let options = TrainOptions {
        lr: 1e-2,
        lora: Some(settings.clone()),
        ..TrainOptions::default()
    };
    let mut optimizer = options.optimizer(&mut model);
    let s = seq(&random_ids(30, 320, 9), 1.0, 1.0 / 15.0);
    train::train(
        &mut model,
        &mut optimizer,
        &[mini(vec![s.clone()]), mini(vec![s])],
        &options,
        0,
        |_| {},
    )
    .unwrap();
    for ((name, after), (_, was)) in model.named_parameters().iter().zip(&before) {
        assert!(after.equal(was), "base weight {name} changed");
    }
    let out = tempfile::tempdir().unwrap();
    let sha = lora::save(
        &model,
        &settings,
        &base.path().display().to_string(),
        out.path(),
    )
    .unwrap();
    assert_eq!(sha.len(), 64);
    let config: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("adapter_config.json")).unwrap())
            .unwrap();
    for (field, value) in [
        ("peft_type", json!("LORA")),
        ("task_type", json!("CAUSAL_LM")),
        ("r", json!(4)),
        ("lora_alpha", json!(8.0)),
        ("bias", json!("none")),
        ("fan_in_fan_out", json!(false)),
        ("inference_mode", json!(true)),
    ] {
        assert_eq!(config[field], value, "{field}");
    }
    let ours = model.sequence_logprobs(&ids, 64).unwrap();
    assert!(
        max_diff(&ours, &base_lp[0]) > 1e-3,
        "training changed nothing"
    );
    let theirs = peft_logprobs(base.path(), out.path(), std::slice::from_ref(&ids));
    let diff = max_diff(&ours, &theirs[0]);
    assert!(diff <= TOLERANCE, "PeftModel differs by {diff:e}");
    let cli = score_with(base.path(), Some(out.path()), &ids);
    let diff = max_diff(&ours, &cli);
    assert!(diff <= 1e-6, "score --adapter differs by {diff:e}");

    // merge-lora against merge_and_unload, tensor by tensor, and as a model.
    let work = tempfile::tempdir().unwrap();
    let merged = work.path().join("merged");
    let status = trainer()
        .args(["merge-lora", "--model"])
        .arg(base.path())
        .arg("--adapter")
        .arg(out.path())
        .arg("--out")
        .arg(&merged)
        .status()
        .unwrap();
    assert!(status.success());
    let peft_merged = work.path().join("peft-merged");
    run_python(
        &[
            "peft-merge",
            "--model",
            base.path().to_str().unwrap(),
            "--adapter",
            out.path().to_str().unwrap(),
            "--out",
            peft_merged.to_str().unwrap(),
        ],
        None,
    );
    let mine = tensors(&merged.join("model.safetensors"));
    let reference = tensors(&peft_merged.join("model.safetensors"));
    assert_eq!(
        mine.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        reference.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for ((name, a), (_, b)) in mine.iter().zip(&reference) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= TOLERANCE, "merged {name} differs by {diff:e}");
    }
    let merged_lp = hf_logprobs(&merged, std::slice::from_ref(&ids));
    let diff = max_diff(&ours, &merged_lp[0]);
    assert!(diff <= TOLERANCE, "merged model differs by {diff:e}");
    assert!(merged.join("manifest.json").is_file());
    assert!(merged.join("config.json").is_file());
}

/// `load_with_adapter`'s error for `adapter` on `base`.
fn adapter_err(base: &Path, adapter: &Path) -> String {
    match lora::load_with_adapter(base, adapter, Device::Cpu, Kind::Float) {
        Ok(_) => panic!("{} loaded", adapter.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_adapter_directories_are_named() {
    let base = tiny("qwen2", 51, &[]);
    let good = peft_random(base.path(), 4, 8.0, &[]);
    with_adapter(base.path(), good.path());
    let copy = || {
        let d = tempfile::tempdir().unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(good.path().join(f), d.path().join(f)).unwrap();
        }
        d
    };
    let edit_config = |dir: &Path, f: &dyn Fn(&mut Value)| {
        let path = dir.join("adapter_config.json");
        let mut c: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        f(&mut c);
        std::fs::write(&path, c.to_string()).unwrap();
    };
    let check = |dir: &Path, needles: &[&str]| {
        let e = adapter_err(base.path(), dir);
        for n in needles {
            assert!(e.contains(n), "expected {n:?} in: {e}");
        }
    };

    let d = copy();
    edit_config(d.path(), &|c| c["r"] = json!(8));
    check(
        d.path(),
        &[
            "adapter_model.safetensors",
            "lora_A.weight",
            "r = 8",
            "[4, 64]",
        ],
    );

    let d = copy();
    let path = d.path().join("adapter_model.safetensors");
    let kept: Vec<(String, Tensor)> = tensors(&path)
        .into_iter()
        .filter(|(n, _)| !n.contains("layers.1.mlp.up_proj.lora_B"))
        .collect();
    weights::save(&path, &kept).unwrap();
    check(
        d.path(),
        &[
            "adapter_model.safetensors",
            "no tensor base_model.model.model.layers.1.mlp.up_proj.lora_B.weight",
        ],
    );

    let d = copy();
    edit_config(d.path(), &|c| {
        c["target_modules"] = json!(["q_proj", "lm_head"])
    });
    check(
        d.path(),
        &["adapter_config.json", "`target_modules`", "\"lm_head\""],
    );

    let d = copy();
    edit_config(d.path(), &|c| c["target_modules"] = json!(".*proj"));
    check(
        d.path(),
        &[
            "adapter_config.json",
            "`target_modules`",
            "regular expression",
        ],
    );

    let d = copy();
    edit_config(d.path(), &|c| c["use_dora"] = json!(true));
    check(d.path(), &["adapter_config.json", "`use_dora`"]);

    let d = copy();
    edit_config(d.path(), &|c| c["peft_type"] = json!("IA3"));
    check(d.path(), &["adapter_config.json", "`peft_type`", "IA3"]);

    let d = copy();
    std::fs::remove_file(d.path().join("adapter_model.safetensors")).unwrap();
    check(d.path(), &["adapter_model.safetensors", "missing"]);

    let d = copy();
    std::fs::write(d.path().join("adapter_config.json"), "{not json").unwrap();
    check(d.path(), &["adapter_config.json", "not JSON"]);

    // An adapter of another base model: qwen3 has head_dim 32 (q_proj is [128, 64]) and
    // a third layer.
    let other = tiny("qwen3", 52, &[]);
    let e = adapter_err(other.path(), good.path());
    assert!(
        e.contains("adapter_model.safetensors") && e.contains("q_proj") && e.contains("shape"),
        "{e}"
    );
    // An adapter with a layer the base lacks: the extra tensor is named.
    let d = copy();
    let path = d.path().join("adapter_model.safetensors");
    let mut all = tensors(&path);
    all.push((
        "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight".into(),
        Tensor::zeros([4, 64], (Kind::Float, Device::Cpu)),
    ));
    weights::save(&path, &all).unwrap();
    check(
        d.path(),
        &[
            "adapter_model.safetensors",
            "layers.2.self_attn.q_proj.lora_A.weight",
            "not an adapter of this model",
        ],
    );
    // Training refuses dropout it does not implement, naming the key.
    let bad = LoraOptions {
        dropout: 0.1,
        ..LoraOptions::default()
    };
    assert!(bad.validate().unwrap_err().contains("train.lora.dropout"));
}
