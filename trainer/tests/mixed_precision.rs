//! bf16 training on SmolLM2-135M-Instruct, on the CPU, by the path CUDA runs: fp32
//! master weights keep updates far below one bf16 spacing, and a saved optimizer state
//! makes two runs one optimization.

mod common;

use std::path::Path;

use common::reference::{mini, random_ids, seq};
use tapline_trainer::nn::optim::AdamW;
use tapline_trainer::nn::train::{self, TrainOptions};
use tapline_trainer::nn::weights::Checkpoint;
use tapline_trainer::nn::{Transformer, checkpoint};
use tapline_trainer::pipeline::MiniBatch;
use tch::{Device, Kind, Tensor};

/// `n` mini-batches of one 24-token sequence each (loss on its second half), advantages
/// alternating in sign.
fn batches(n: usize) -> Vec<MiniBatch> {
    (0..n)
        .map(|i| {
            let a = if i % 2 == 0 { 1.0 } else { -1.0 };
            mini(vec![seq(
                &random_ids(24, 49152, 100 + i as u64),
                a,
                1.0 / 12.0,
            )])
        })
        .collect()
}

fn options() -> TrainOptions {
    TrainOptions {
        lr: 1e-6,
        ..TrainOptions::default()
    }
}

fn run(model: &mut Transformer, optimizer: &mut AdamW, data: &[MiniBatch], first_step: u64) {
    let result = train::train(model, optimizer, data, &options(), first_step, |_| {}).unwrap();
    assert_eq!(result.steps.len(), data.len());
    assert!(result.steps.iter().all(|s| !s.skipped && s.grad_norm > 0.0));
}

fn load(dir: &Path, kind: Kind) -> Transformer {
    Transformer::load(dir, Device::Cpu, kind).unwrap()
}

/// Elements of `a` and `b` (same shapes) that differ, and elements in all.
fn differing(a: &Tensor, b: &Tensor) -> (i64, i64) {
    let ne = a.ne_tensor(b).sum(Kind::Int64).int64_value(&[]);
    (ne, a.numel() as i64)
}

/// With the same gradients (the fp32 run's, rounded to bf16 as a bf16 backward pass
/// stores them), 20 AdamW steps at lr 1e-6 leave the bf16 weights equal to the fp32
/// run's weights rounded to bf16, up to one-ulp differences in a small fraction of
/// elements, and move the fp32 masters of every element.
#[test]
fn bf16_updates_follow_the_fp32_run_through_fp32_masters() {
    let dir = common::smollm2();
    let data = batches(20);
    // The fp32 run starts from the same (bf16-representable) weights.
    let mut full = load(&dir, Kind::Float);
    tch::no_grad(|| {
        for (_, mut t) in full.named_parameters() {
            let rounded = t.to_kind(Kind::BFloat16).to_kind(Kind::Float);
            t.copy_(&rounded);
        }
    });
    let mut half = load(&dir, Kind::BFloat16);
    let initial: Vec<(String, Tensor)> = half
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    let options = options();
    let mut opt_full = options.optimizer(&mut full);
    let mut opt_half = options.optimizer(&mut half);
    for batch in &data {
        opt_full.zero_grad();
        opt_half.zero_grad();
        for micro in &batch.micro_batches {
            train::micro_step(
                &full,
                &train::gather(micro, Device::Cpu, options.packing),
                None,
                &options,
            );
        }
        // The bf16 parameters' gradients: the fp32 ones, rounded.
        let mut carry = Tensor::zeros([], (Kind::Float, Device::Cpu));
        for ((_, h), (_, f)) in half.named_parameters().iter().zip(full.named_parameters()) {
            carry += (h.to_kind(Kind::Float) * f.grad()).sum(Kind::Float);
        }
        carry.backward();
        opt_full.step(options.lr);
        opt_half.step(options.lr);
    }

    let (mut off, mut beyond_ulp, mut total, mut master_gap) = (0i64, 0i64, 0i64, 0.0f64);
    let (mut moved_master, mut moved_weight, mut moved_rounded, mut matrix_total) =
        (0i64, 0i64, 0i64, 0i64);
    for (((name, h), (_, f)), (_, start)) in half
        .named_parameters()
        .iter()
        .zip(full.named_parameters())
        .zip(&initial)
    {
        assert_eq!(h.kind(), Kind::BFloat16, "{name}");
        let rounded = f.to_kind(Kind::BFloat16);
        let (ne, n) = differing(h, &rounded);
        off += ne;
        total += n;
        let within = h
            .eq_tensor(&rounded)
            .logical_or(&h.eq_tensor(&rounded.nextafter(h)));
        beyond_ulp += within.logical_not().sum(Kind::Int64).int64_value(&[]);
        let master = opt_half
            .master(name)
            .expect("a bf16 parameter has a master");
        master_gap = master_gap.max((master - &f).abs().max().double_value(&[]));
        if h.dim() == 2 && name.contains(".layers.") {
            moved_master += differing(master, &start.to_kind(Kind::Float)).0;
            moved_weight += differing(h, start).0;
            moved_rounded += differing(&rounded, start).0;
            matrix_total += n;
        }
    }
    let off_fraction = off as f64 / total as f64;
    let master_fraction = moved_master as f64 / matrix_total as f64;
    let weight_fraction = moved_weight as f64 / matrix_total as f64;
    let rounded_fraction = moved_rounded as f64 / matrix_total as f64;
    eprintln!(
        "bf16 vs fp32 rounded after 20 steps at lr 1e-6: {off} of {total} elements differ ({off_fraction:.2e}), {beyond_ulp} by more than one ulp (masters within {master_gap:.1e} of the fp32 weights); matrices' elements changed: masters {master_fraction:.4}, bf16 weights {weight_fraction:.4} (fp32 run rounded: {rounded_fraction:.4})"
    );
    assert!(off_fraction < 2e-3, "{off_fraction}");
    // The masters follow the fp32 weights to a few percent of the largest possible
    // movement (20 · lr = 2e-5): bf16 gradients are the fp32 ones to 2^-9, and an fp32
    // ulp of the largest weights (norms near 3) is 2.4e-7. A difference of more than
    // one bf16 ulp needs a bf16 ulp below that, i.e. a weight below ~1e-4.
    assert!(master_gap < 2.5e-2 * 20.0 * options.lr, "{master_gap}");
    assert!(
        (beyond_ulp as f64) < 1e-3 * total as f64,
        "{beyond_ulp} elements more than one ulp away"
    );
    // Every element moves in the masters; an update applied to the bf16 weights
    // directly would move only those below ~3e-4 in magnitude (each step's 1e-6 is
    // under half their spacing) ...
    assert!(master_fraction > 0.99, "{master_fraction}");
    // ... while with the masters the bf16 weights change wherever the accumulated
    // update crosses a rounding boundary, as the fp32 run's rounded weights do.
    assert!(
        (weight_fraction - rounded_fraction).abs() < 0.1 * rounded_fraction,
        "{weight_fraction} vs {rounded_fraction}"
    );
    assert!(weight_fraction > 1e-3, "{weight_fraction}");
}

/// Two runs of 10 steps, the second resumed from the first's checkpoint and optimizer
/// state on disk, end bit for bit where one optimizer carried through the same two
/// calls in memory ends; a second run with a new optimizer state does not.
///
/// (A single `train` call over all 20 mini-batches scores the old log-probs of every
/// mini-batch before its first step, where a second run scores its own after the first
/// ten; that changes the PPO ratios, and the weights differ in a few elements in a
/// thousand whatever the optimizer state.)
#[test]
fn two_resumed_runs_give_the_weights_of_one_run() {
    let dir = common::smollm2();
    let data = batches(20);
    let mut one = load(&dir, Kind::BFloat16);
    let initial: Vec<Tensor> = one
        .named_parameters()
        .into_iter()
        .map(|(_, t)| t.copy())
        .collect();
    let mut opt_one = options().optimizer(&mut one);
    run(&mut one, &mut opt_one, &data[..10], 0);
    let saved = tempfile::tempdir().unwrap();
    checkpoint::save(&one, &dir, saved.path(), 10).unwrap();
    let info = opt_one.save_state(saved.path()).unwrap();
    assert_eq!(info.step, 10);
    run(&mut one, &mut opt_one, &data[10..], 10);

    let mut second = load(saved.path(), Kind::BFloat16);
    let mut opt = options().optimizer(&mut second);
    // A new optimizer state has the bf16 weights as masters: ten steps of sub-ulp
    // updates are gone from them.
    let lost: i64 = second
        .named_parameters()
        .iter()
        .map(|(name, _)| {
            let saved = Checkpoint::open_file(&saved.path().join("optimizer.safetensors"))
                .unwrap()
                .load(
                    &format!("{name}.master"),
                    &opt.master(name).unwrap().size(),
                    Kind::Float,
                    Device::Cpu,
                )
                .unwrap();
            differing(opt.master(name).unwrap(), &saved).0
        })
        .sum();
    let info = opt.load_state(saved.path()).unwrap();
    assert_eq!(info.step, 10);
    let first_step = checkpoint::global_step(saved.path());
    assert_eq!(first_step, 10);
    run(&mut second, &mut opt, &data[10..], first_step);
    assert_eq!(opt.steps(), 20);
    let (mut off, mut total, mut gap, mut changed) = (0i64, 0i64, 0.0f64, 0i64);
    for (((name, a), (_, b)), start) in second
        .named_parameters()
        .iter()
        .zip(one.named_parameters())
        .zip(&initial)
    {
        let (ne, n) = differing(a, &b);
        off += ne;
        total += n;
        changed += differing(a, start).0;
        let (ma, mb) = (opt.master(name).unwrap(), opt_one.master(name).unwrap());
        gap = gap.max((ma - mb).abs().max().double_value(&[]));
    }
    eprintln!(
        "10 + 10 steps: {off} of {total} bf16 weights differ from one optimizer's (masters within {gap:e}); a new state would have lost the masters of {lost} elements; {changed} bf16 weights changed over the 20 steps"
    );
    assert_eq!(off, 0);
    assert_eq!(gap, 0.0);
    assert!(lost > total / 2, "{lost}");
    assert!(changed > total / 1000, "{changed}");
}

#[test]
fn a_state_that_belongs_to_other_weights_is_refused() {
    let dir = common::smollm2();
    let data = batches(2);
    let mut model = load(&dir, Kind::BFloat16);
    let mut opt = options().optimizer(&mut model);
    run(&mut model, &mut opt, &data, 0);
    let saved = tempfile::tempdir().unwrap();
    opt.save_state(saved.path()).unwrap();
    // The original weights (not the ones the state was saved with).
    let mut other = load(&dir, Kind::BFloat16);
    let mut opt_other = options().optimizer(&mut other);
    let e = opt_other.load_state(saved.path()).unwrap_err().to_string();
    assert!(
        e.contains("optimizer.safetensors")
            && e.contains("does not round")
            && e.contains("--fresh-optimizer"),
        "{e}"
    );
    // A tensors file that is not the one optimizer.json names.
    let tensors = saved.path().join("optimizer.safetensors");
    let mut bytes = std::fs::read(&tensors).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&tensors, bytes).unwrap();
    let mut opt = options().optimizer(&mut model);
    let e = opt.load_state(saved.path()).unwrap_err().to_string();
    assert!(e.contains("SHA-256") && e.contains("optimizer.json"), "{e}");
}
