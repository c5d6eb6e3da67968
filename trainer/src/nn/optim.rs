//! AdamW with fp32 moments whatever the parameters' dtype (tch's own keeps them in the
//! parameter dtype, which loses small updates in bf16), the learning-rate schedule, and
//! gradient clipping that reports the norm.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

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

/// AdamW state for a fixed list of parameters.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    steps: i32,
    /// `β1`.
    pub beta1: f64,
    /// `β2`.
    pub beta2: f64,
    /// `ε`.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl AdamW {
    /// State for `params` (moments zero, fp32, on each parameter's device).
    pub fn new(params: Vec<Tensor>, beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> Self {
        let zeros = |p: &Tensor| Tensor::zeros(p.size(), (Kind::Float, p.device()));
        AdamW {
            m: params.iter().map(zeros).collect(),
            v: params.iter().map(zeros).collect(),
            params,
            steps: 0,
            beta1,
            beta2,
            eps,
            weight_decay,
        }
    }

    /// Clears every gradient.
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.zero_grad();
        }
    }

    /// L2 norm of all gradients together, in fp32 (0 for parameters without one).
    pub fn grad_norm(&self) -> f64 {
        tch::no_grad(|| {
            let mut total = 0.0f64;
            for p in &self.params {
                let g = p.grad();
                if g.defined() {
                    total += g
                        .to_kind(Kind::Float)
                        .pow_tensor_scalar(2)
                        .sum(Kind::Float)
                        .double_value(&[]);
                }
            }
            total.sqrt()
        })
    }

    /// Scales every gradient so that their norm is at most `max_norm` (as
    /// `torch.nn.utils.clip_grad_norm_`); returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let norm = self.grad_norm();
        if max_norm > 0.0 && norm.is_finite() && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            tch::no_grad(|| {
                for p in &self.params {
                    let mut g = p.grad();
                    if g.defined() {
                        let _ = g.f_mul_scalar_(scale);
                    }
                }
            });
        }
        norm
    }

    /// One AdamW step at learning rate `lr`.
    pub fn step(&mut self, lr: f64) {
        self.steps += 1;
        let bc1 = 1.0 - self.beta1.powi(self.steps);
        let bc2 = 1.0 - self.beta2.powi(self.steps);
        tch::no_grad(|| {
            for ((p, m), v) in self.params.iter_mut().zip(&mut self.m).zip(&mut self.v) {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let g = g.to_kind(Kind::Float);
                let _ = m.f_mul_scalar_(self.beta1);
                let _ = m.f_add_(&(&g * (1.0 - self.beta1)));
                let _ = v.f_mul_scalar_(self.beta2);
                let _ = v.f_add_(&(g.square() * (1.0 - self.beta2)));
                let denom = (&*v / bc2).sqrt() + self.eps;
                let update = (&*m / bc1) / denom;
                let mut master = p.to_kind(Kind::Float);
                if self.weight_decay != 0.0 {
                    master *= 1.0 - lr * self.weight_decay;
                }
                let new = master - update * lr;
                let _ = p.f_copy_(&new.to_kind(p.kind()));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_warm_up_then_hold_or_decay() {
        let lr = |s, step| learning_rate(s, 1.0, 2, 10, 0.1, step);
        assert_eq!(lr(LrSchedule::Constant, 0), 0.5);
        assert_eq!(lr(LrSchedule::Constant, 1), 1.0);
        assert_eq!(lr(LrSchedule::Constant, 9), 1.0);
        assert_eq!(lr(LrSchedule::Cosine, 2), 1.0);
        assert!((lr(LrSchedule::Cosine, 6) - 0.55).abs() < 1e-12);
        assert!((lr(LrSchedule::Cosine, 10) - 0.1).abs() < 1e-12);
        assert!((lr(LrSchedule::Cosine, 50) - 0.1).abs() < 1e-12);
    }

    /// Against the update rule written out by hand (torch.optim.AdamW's).
    #[test]
    fn adamw_matches_the_reference_rule() {
        let p = Tensor::from_slice(&[1.0f32, -2.0, 0.5]).set_requires_grad(true);
        let mut opt = AdamW::new(vec![p.shallow_clone()], 0.9, 0.999, 1e-8, 0.1);
        let (mut m, mut v) = ([0f64; 3], [0f64; 3]);
        let mut expected = [1.0f64, -2.0, 0.5];
        for step in 1..=3 {
            opt.zero_grad();
            let loss = (&p * &p * step as f64).sum(Kind::Float);
            loss.backward();
            opt.step(0.01);
            for i in 0..3 {
                let g = 2.0 * step as f64 * expected[i];
                m[i] = 0.9 * m[i] + 0.1 * g;
                v[i] = 0.999 * v[i] + 0.001 * g * g;
                let mh = m[i] / (1.0 - 0.9f64.powi(step));
                let vh = v[i] / (1.0 - 0.999f64.powi(step));
                expected[i] = expected[i] * (1.0 - 0.01 * 0.1) - 0.01 * mh / (vh.sqrt() + 1e-8);
            }
        }
        let got = Vec::<f32>::try_from(&p.detach()).unwrap();
        for (g, e) in got.iter().zip(expected) {
            assert!((f64::from(*g) - e).abs() < 1e-6, "{got:?} vs {expected:?}");
        }
    }

    #[test]
    fn clipping_reports_the_norm_and_scales() {
        let p = Tensor::from_slice(&[3.0f32, 4.0]).set_requires_grad(true);
        let mut opt = AdamW::new(vec![p.shallow_clone()], 0.9, 0.999, 1e-8, 0.0);
        (&p * &p * 0.5).sum(Kind::Float).backward();
        let norm = opt.clip_grad_norm(1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((opt.grad_norm() - 1.0).abs() < 1e-5);
    }
}
