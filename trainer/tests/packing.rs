//! Packed micro-batches (`[train] packing`, `nn::packing`) against padded ones: the same
//! loss, per-token log-probs and gradients for very uneven lengths, on Llama, Qwen2 and
//! Qwen3 shapes, full fine-tune and LoRA, with and without recompute, in fp32 and bf16;
//! a token never sees another sequence; whole updates end at the same weights.

mod common;

use common::reference::{mini, random_ids, seq};
use tapline_trainer::nn::bench::preset;
use tapline_trainer::nn::config::Arch;
use tapline_trainer::nn::lora::{self, LoraOptions};
use tapline_trainer::nn::options::PolicyLoss;
use tapline_trainer::nn::train::{self, TrainOptions, gather, micro_logprobs, micro_step_with};
use tapline_trainer::nn::{Transformer, TransformerConfig};
use tapline_trainer::pipeline::{MicroBatch, TrainSequence};
use tch::{Device, Kind, Tensor};

/// Lengths far apart: the padded layout computes 6 × 97 = 582 tokens for 224 real ones.
const LENGTHS: &[usize] = &[97, 3, 41, 2, 64, 17];

fn config(arch: Arch) -> TransformerConfig {
    let mut c = preset("tiny").unwrap();
    c.arch = arch;
    c.qkv_bias = arch == Arch::Qwen2;
    c.qk_norm = arch == Arch::Qwen3;
    c
}

fn model(arch: Arch, kind: Kind, with_lora: bool) -> Transformer {
    // `random` seeds libtorch's generator, which the tests running at once share: one
    // model at a time, so the same arguments give the same weights.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut m = Transformer::random(config(arch), Device::Cpu, kind, 7);
    if with_lora {
        lora::attach_new(&mut m, &LoraOptions::default(), 3);
        // A new adapter's B is 0, which would leave A without a gradient.
        tch::no_grad(|| {
            for (name, mut t) in m.named_adapters() {
                if name.contains("lora_B") {
                    // Deterministic (tests share libtorch's generator across threads).
                    let n = t.numel() as i64;
                    let values = Tensor::arange(n, (Kind::Float, Device::Cpu)).sin() * 0.02;
                    t.copy_(&values.view(t.size().as_slice()));
                }
            }
        });
    }
    m
}

fn micro_batch(vocab: u32, lengths: &[usize], seed: u64) -> MicroBatch {
    let total: usize = lengths.iter().map(|n| n - n / 2).sum();
    let sequences: Vec<TrainSequence> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let a = if i % 2 == 0 { 1.0 } else { -0.5 };
            seq(
                &random_ids(n, vocab, seed + i as u64),
                a,
                1.0 / total as f64,
            )
        })
        .collect();
    MicroBatch {
        sequences,
        recompute: false,
    }
}

/// One micro-step: the loss, the old log-probs it used and every trainable gradient.
fn step(
    model: &Transformer,
    micro: &MicroBatch,
    options: &TrainOptions,
) -> (f64, Vec<f32>, Vec<(String, Tensor)>) {
    for (_, mut t) in model.trainable_parameters() {
        t.zero_grad();
    }
    let g = gather(micro, Device::Cpu, options.packing);
    let mut old = Vec::new();
    let (stats, _) = micro_step_with(model, &g, None, options, |lp| {
        old = Vec::<f32>::try_from(lp.to_kind(Kind::Float)).unwrap();
    });
    let grads = model
        .trainable_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.grad().to_kind(Kind::Float).copy()))
        .collect();
    (stats.loss, old, grads)
}

/// Largest difference of the loss, the log-probs and the gradients, packed vs padded,
/// and the largest gradient element (to show the gradients are not all zero).
fn packed_vs_padded(model: &mut Transformer, options: &TrainOptions) -> (f64, f64, f64, f64) {
    model.set_requires_grad(true);
    let micro = micro_batch(model.config.vocab_size as u32, LENGTHS, 11);
    let (loss_p, lp_p, g_p) = step(
        model,
        &micro,
        &TrainOptions {
            packing: true,
            ..options.clone()
        },
    );
    let (loss_d, lp_d, g_d) = step(
        model,
        &micro,
        &TrainOptions {
            packing: false,
            ..options.clone()
        },
    );
    model.set_requires_grad(false);
    assert_eq!(lp_p.len(), lp_d.len());
    let lp = lp_p
        .iter()
        .zip(&lp_d)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max);
    let (mut grad, mut largest) = (0.0f64, 0.0f64);
    for ((name, a), (_, b)) in g_p.iter().zip(&g_d) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d.is_finite(), "{name}");
        grad = grad.max(d);
        largest = largest.max(a.abs().max().double_value(&[]));
    }
    ((loss_p - loss_d).abs(), lp, grad, largest)
}

#[test]
fn packed_equals_padded_in_fp32() {
    let base = TrainOptions {
        // The dual clip and KL take part too.
        dual_clip: 3.0,
        kl_coef: 0.05,
        ..TrainOptions::default()
    };
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        for with_lora in [false, true] {
            for recompute in [false, true] {
                for policy_loss in [PolicyLoss::Ppo, PolicyLoss::Gspo] {
                    let options = TrainOptions {
                        recompute,
                        policy_loss,
                        ..base.clone()
                    };
                    let mut m = model(arch, Kind::Float, with_lora);
                    let (loss, lp, grad, largest) = packed_vs_padded(&mut m, &options);
                    let what =
                        format!("{arch:?} lora={with_lora} recompute={recompute} {policy_loss:?}");
                    eprintln!(
                        "{what}: |Δ loss| {loss:.1e}, |Δ log p| {lp:.1e}, |Δ grad| {grad:.1e} (largest {largest:.1e})"
                    );
                    assert!(largest > 1e-5, "{what}: no gradient");
                    assert!(loss <= 1e-5, "{what}: loss {loss}");
                    assert!(lp <= 1e-5, "{what}: log-probs {lp}");
                    // Within 1e-5, and within 1e-4 of the largest gradient (the
                    // tiny model's gradients are small).
                    assert!(grad <= 1e-5, "{what}: gradients {grad}");
                    assert!(
                        grad <= 1e-4 * largest,
                        "{what}: gradients {grad} of {largest}"
                    );
                }
            }
        }
    }
}

/// bf16 weights (the CUDA path's dtype, its fp32 masters in the optimizer): packed and
/// padded round differently (other matrix shapes), so they agree to bf16's precision.
#[test]
fn packed_equals_padded_in_bf16() {
    for with_lora in [false, true] {
        let mut m = model(Arch::Qwen3, Kind::BFloat16, with_lora);
        let (loss, lp, grad, largest) = packed_vs_padded(&mut m, &TrainOptions::default());
        eprintln!(
            "bf16 lora={with_lora}: |Δ loss| {loss:.1e}, |Δ log p| {lp:.1e}, |Δ grad| {grad:.1e} (largest {largest:.1e})"
        );
        assert!(largest > 1e-5);
        assert!(loss <= 1e-2, "loss {loss}");
        assert!(lp <= 5e-2, "log-probs {lp}");
        assert!(grad <= 0.05 * largest, "gradients {grad} of {largest}");
    }
}

/// Changing every token of one sequence leaves the log-probs of the others in the same
/// packed row bit for bit as they were.
#[test]
fn a_token_never_sees_another_sequence() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let m = model(arch, Kind::Float, false);
        let vocab = m.config.vocab_size as u32;
        let micro = micro_batch(vocab, LENGTHS, 21);
        let mut changed = micro.clone();
        let victim = 2;
        let n = changed.sequences[victim].sequence.token_ids.len();
        changed.sequences[victim].sequence.token_ids = random_ids(n, vocab, 999);
        let logprobs = |mb: &MicroBatch| {
            let g = gather(mb, Device::Cpu, true);
            assert_eq!(g.ids.size(), [1, LENGTHS.iter().sum::<usize>() as i64]);
            let lp = micro_logprobs(&m, &g, 1024);
            let all = Vec::<f32>::try_from(lp).unwrap();
            // Split per sequence: its loss tokens, in order.
            let mut out = Vec::new();
            let mut rest = all.as_slice();
            for s in &mb.sequences {
                let k = s
                    .sequence
                    .loss_mask
                    .iter()
                    .skip(1)
                    .filter(|x| **x != 0)
                    .count();
                let (mine, after) = rest.split_at(k);
                out.push(mine.to_vec());
                rest = after;
            }
            out
        };
        let before = logprobs(&micro);
        let after = logprobs(&changed);
        for (i, (a, b)) in before.iter().zip(&after).enumerate() {
            if i == victim {
                assert_ne!(a, b, "{arch:?}: the changed sequence's log-probs moved");
            } else {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{arch:?}: sequence {i} saw the change of sequence {victim}"
                );
            }
        }
    }
}

/// Three optimizer steps of micro-batches of uneven lengths, packed and padded, from the
/// same weights: the same weights after (AdamW normalizes the step, so a gradient
/// difference would show at the scale of the learning rate).
#[test]
fn whole_updates_end_at_the_same_weights() {
    let data: Vec<_> = (0..3)
        .map(|k| {
            let lens: Vec<usize> = LENGTHS.iter().map(|n| n + 3 * k).collect();
            let mut mb = mini(micro_batch(1024, &lens, 40 + k as u64).sequences);
            // Two micro-batches per step.
            let second = mb.micro_batches[0].sequences.split_off(3);
            mb.micro_batches.push(MicroBatch {
                sequences: second,
                recompute: false,
            });
            mb
        })
        .collect();
    let run = |packing: bool| {
        let mut m = model(Arch::Qwen3, Kind::Float, true);
        let options = TrainOptions {
            lr: 1e-3,
            packing,
            ..TrainOptions::default()
        };
        let mut opt = options.optimizer(&mut m);
        let result = train::train(&mut m, &mut opt, &data, &options, 0, |_| {}).unwrap();
        let weights: Vec<Tensor> = m
            .named_adapters()
            .into_iter()
            .map(|(_, t)| t.detach().copy())
            .collect();
        (result, weights)
    };
    let (packed, wp) = run(true);
    let (padded, wd) = run(false);
    assert_eq!(packed.tokens, padded.tokens);
    assert_eq!(
        packed.computed_tokens, packed.tokens,
        "packing computes the tokens trained"
    );
    // Each micro-batch padded to its longest.
    let expected: u64 = data
        .iter()
        .flat_map(|mb| &mb.micro_batches)
        .map(|m| {
            let longest = m.sequences.iter().map(|s| s.sequence.len()).max().unwrap();
            (m.sequences.len() * longest) as u64
        })
        .sum();
    assert_eq!(padded.computed_tokens, expected);
    assert!(padded.computed_tokens > padded.tokens * 4 / 3);
    for (a, b) in packed.steps.iter().zip(&padded.steps) {
        assert!((a.loss - b.loss).abs() < 1e-6, "{} vs {}", a.loss, b.loss);
        assert!((a.grad_norm - b.grad_norm).abs() < 1e-5 * a.grad_norm.max(1.0));
    }
    let diff = wp
        .iter()
        .zip(&wd)
        .map(|(a, b)| (a - b).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    assert!(diff < 1e-5, "adapters differ by {diff}");
}

/// A micro-batch with a sequence without any trained token, and one of a single token,
/// beside real ones: the loss and gradients are those of the real ones alone, finite.
#[test]
fn sequences_without_loss_tokens_change_nothing() {
    let mut m = model(Arch::Llama, Kind::Float, false);
    m.set_requires_grad(true);
    let vocab = m.config.vocab_size as u32;
    let real = micro_batch(vocab, &[12, 7], 5);
    let mut with_idle = real.clone();
    let mut idle = seq(&random_ids(9, vocab, 77), 1.0, 0.1);
    idle.sequence.loss_mask = vec![0; 9];
    idle.advantages = vec![0.0; 9];
    idle.weights = vec![0.0; 9];
    let mut one = seq(&random_ids(1, vocab, 78), 1.0, 0.1);
    one.sequence.loss_mask = vec![0];
    with_idle.sequences.insert(1, idle);
    with_idle.sequences.push(one);
    let options = TrainOptions::default();
    let (loss_a, lp_a, g_a) = step(&m, &real, &options);
    let (loss_b, lp_b, g_b) = step(&m, &with_idle, &options);
    assert!(loss_a.is_finite() && loss_b.is_finite());
    assert!((loss_a - loss_b).abs() < 1e-7);
    assert_eq!(lp_a.len(), lp_b.len());
    for ((n, a), (_, b)) in g_a.iter().zip(&g_b) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d < 1e-6, "{n}: {d}");
    }
    // Nothing to train at all: no loss, no NaN, no gradient.
    let none = MicroBatch {
        sequences: vec![with_idle.sequences[1].clone()],
        recompute: false,
    };
    let (loss, lp, _) = step(&m, &none, &options);
    assert_eq!((loss, lp.len()), (0.0, 0));
    let empty = MicroBatch {
        sequences: vec![],
        recompute: false,
    };
    let g = gather(&empty, Device::Cpu, true);
    assert_eq!((g.n, g.computed_tokens), (0, 1));
}

/// The head's one pass (token-level losses) against its two passes (GSPO): with one loss
/// token per sequence GSPO's sequence ratio is the token's ratio, so the two losses are
/// the same function and give the same loss, log-probs and gradients, across chunks of
/// 2 rows, with the dual clip, the KL term and truncated importance sampling.
#[test]
fn the_heads_one_pass_equals_its_two_passes() {
    let mut m = model(Arch::Qwen3, Kind::Float, false);
    m.set_requires_grad(true);
    let vocab = m.config.vocab_size as u32;
    let mut micro = micro_batch(vocab, &[30, 9, 17, 4, 22], 61);
    for s in &mut micro.sequences {
        let n = s.sequence.len();
        s.sequence.loss_mask = (0..n).map(|j| u8::from(j == n - 1)).collect();
        s.advantages = s
            .sequence
            .loss_mask
            .iter()
            .map(|&x| f64::from(x) * s.reward)
            .collect();
        s.weights = s
            .sequence
            .loss_mask
            .iter()
            .map(|&x| f64::from(x) * 0.2)
            .collect();
    }
    // Old log-probs a little off the current ones, so ratios, clips and KL are not trivial.
    let g = gather(&micro, Device::Cpu, true);
    let old = micro_logprobs(&m, &g, 1024) + Tensor::from_slice(&[0.3f32, -0.25, 0.1, -0.4, 0.2]);
    let run = |policy_loss| {
        for (_, mut t) in m.trainable_parameters() {
            t.zero_grad();
        }
        let options = TrainOptions {
            policy_loss,
            logprob_chunk: 2,
            dual_clip: 3.0,
            kl_coef: 0.1,
            ..TrainOptions::default()
        };
        let (stats, entropy) = micro_step_with(&m, &g, Some(&old), &options, |_| {});
        let grads: Vec<Tensor> = m
            .trainable_parameters()
            .into_iter()
            .map(|(_, t)| t.grad().copy())
            .collect();
        (stats, entropy, grads)
    };
    let (ppo, e_ppo, g_ppo) = run(PolicyLoss::Ppo);
    let (gspo, e_gspo, g_gspo) = run(PolicyLoss::Gspo);
    assert_eq!(ppo.tokens, 5.0);
    assert!(
        (ppo.loss - gspo.loss).abs() < 1e-7,
        "{} vs {}",
        ppo.loss,
        gspo.loss
    );
    assert!((e_ppo - e_gspo).abs() < 1e-4, "{e_ppo} vs {e_gspo}");
    assert!(ppo.clipped > 0.0 || ppo.ratio_max > 1.0, "{ppo:?}");
    assert_eq!(ppo.clipped, gspo.clipped);
    assert!((ppo.kl_sum - gspo.kl_sum).abs() < 1e-7);
    let mut largest = 0.0f64;
    for (a, b) in g_ppo.iter().zip(&g_gspo) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-7, "gradients differ by {d}");
        largest = largest.max(a.abs().max().double_value(&[]));
    }
    assert!(largest > 1e-5);
}
