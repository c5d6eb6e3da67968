//! AdamW with fp32 moments and fp32 master weights whatever the parameters' dtype, its
//! state on disk, the learning-rate schedule, and gradient clipping that reports the norm.
//!
//! Mixed precision as mixed-precision trainers do it: the model computes in its dtype
//! (bf16 on GPUs), and for every parameter that is not fp32 the optimizer keeps an fp32
//! master copy; the step updates the master and copies the rounded value into the
//! parameter. Without it an update below half a bf16 spacing (about `|w| / 256`) is
//! rounded away: at lr 1e-6 every weight above about 3e-4 in magnitude would never move.
//! tch's own AdamW keeps even the moments in the parameter dtype.
//!
//! The state is saved beside a checkpoint as `optimizer.safetensors` (for each parameter
//! `NAME.exp_avg`, `NAME.exp_avg_sq` and, for non-fp32 parameters, `NAME.master`, all
//! fp32) and `optimizer.json` (format, step count, hyper-parameters, the parameters'
//! names, shapes and dtypes, and the SHA-256 of the tensors file), so that a chain of
//! runs is one continuous optimization.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::weights::{self, Checkpoint, WeightsError};

pub use super::options::{LrSchedule, learning_rate};

/// File of the optimizer's tensors, beside a checkpoint.
pub const STATE_TENSORS: &str = "optimizer.safetensors";
/// File of the optimizer's step count and layout, beside a checkpoint.
pub const STATE_INFO: &str = "optimizer.json";
/// Format name in [`STATE_INFO`].
pub const STATE_FORMAT: &str = "tapline.optimizer.v1";

/// Elements updated at once (16 MB of fp32): temporaries stay below glibc's largest
/// mmap threshold (32 MB) and are reused from the heap.
const CHUNK: i64 = 1 << 22;

/// One parameter's state.
#[derive(Debug)]
struct Slot {
    name: String,
    param: Tensor,
    /// fp32 copy of a parameter that is not fp32.
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
}

/// AdamW state for a fixed list of named parameters.
#[derive(Debug)]
pub struct AdamW {
    slots: Vec<Slot>,
    steps: u64,
    /// `β1`.
    pub beta1: f64,
    /// `β2`.
    pub beta2: f64,
    /// `ε`.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Communication of its gradient all-reduces (distributed runs).
    pub(crate) comm: super::comm::Comm,
}

/// Why an optimizer state could not be saved or resumed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// A file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The state is malformed or does not belong to the parameters being trained.
    #[error("{path}: {message}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What does not fit, and what to do.
        message: String,
    },
    /// The tensors file is not valid safetensors.
    #[error(transparent)]
    Weights(#[from] WeightsError),
}

/// One parameter in [`STATE_INFO`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StateParameter {
    /// Its name (HF or PEFT).
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its dtype in the model (`Float`, `BFloat16`, …).
    pub dtype: String,
    /// Whether the state holds an fp32 master copy.
    pub master: bool,
}

/// The contents of [`STATE_INFO`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StateInfo {
    /// [`STATE_FORMAT`].
    pub format: String,
    /// Optimizer steps taken (bias correction continues from it).
    pub step: u64,
    /// `β1` of the run that saved it.
    pub beta1: f64,
    /// `β2`.
    pub beta2: f64,
    /// `ε`.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// SHA-256 of [`STATE_TENSORS`].
    pub tensors_sha256: String,
    /// Every parameter, in order.
    pub parameters: Vec<StateParameter>,
}

/// Whether `dir` holds an optimizer state.
pub fn has_state(dir: &Path) -> bool {
    dir.join(STATE_INFO).is_file() && dir.join(STATE_TENSORS).is_file()
}

/// The constants of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hyper {
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    lr: f64,
    /// `1 − β1^t`.
    bc1: f64,
    /// `1 − β2^t`.
    bc2: f64,
}

impl Hyper {
    /// For step `steps` (1-based, after counting this one).
    pub(crate) fn new(
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        lr: f64,
        steps: u64,
    ) -> Self {
        let t = i32::try_from(steps).unwrap_or(i32::MAX);
        Hyper {
            beta1,
            beta2,
            eps,
            weight_decay,
            lr,
            bc1: 1.0 - beta1.powi(t),
            bc2: 1.0 - beta2.powi(t),
        }
    }
}

/// torch.optim.AdamW's rule on flat 1-D views: `target` (the fp32 master, or the
/// parameter itself) is updated in place with `grad` and the fp32 moments `m`, `v`;
/// `rounded` (the parameter when `target` is its master) receives the new value.
///
/// Every operation is in place but the fp32 gradient, its square and the denominator,
/// and those are made [`CHUNK`] elements at a time: a step allocates a few 16 MB
/// buffers, which the allocator reuses, instead of copies of the largest parameter (an
/// embedding is 100 MB to 2.5 GB in fp32), which the C allocator maps and unmaps on
/// every step (on the CPU, page faults then cost more than the step).
pub(crate) fn update(
    target: &Tensor,
    rounded: Option<&Tensor>,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &Hyper,
) {
    let n = target.numel() as i64;
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        let part = |t: &Tensor| t.narrow(0, start, len);
        let mut target = part(target);
        // For an fp32 gradient this is the gradient itself: read, never written.
        let g = part(grad).to_kind(Kind::Float);
        let mut m = part(m);
        let _ = m.f_lerp_(&g, 1.0 - h.beta1);
        let _ = part(v).f_lerp_(&g.square(), 1.0 - h.beta2);
        if h.weight_decay != 0.0 {
            let _ = target.f_mul_scalar_(1.0 - h.lr * h.weight_decay);
        }
        if h.lr > 0.0 {
            // param += m / d with d = -(√v / √bc2 + ε) · bc1 / lr.
            let mut d = part(v).sqrt();
            let _ = d.f_div_scalar_(h.bc2.sqrt());
            let _ = d.f_add_scalar_(h.eps);
            let _ = d.f_mul_scalar_(-h.bc1 / h.lr);
            let _ = target.f_addcdiv_(&m, &d);
        }
        if let Some(rounded) = rounded {
            // copy_ converts with round-to-nearest-even, as to_kind does.
            let _ = part(rounded).f_copy_(&target);
        }
        start += len;
    }
}

impl AdamW {
    /// State for `params` (moments zero, fp32, on each parameter's device; an fp32
    /// master copy of each parameter that is not fp32).
    pub fn new(
        params: Vec<(String, Tensor)>,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    ) -> Self {
        let zeros = |p: &Tensor| Tensor::zeros(p.size(), (Kind::Float, p.device()));
        let slots = params
            .into_iter()
            .map(|(name, param)| Slot {
                master: (param.kind() != Kind::Float)
                    .then(|| tch::no_grad(|| param.detach().to_kind(Kind::Float))),
                m: zeros(&param),
                v: zeros(&param),
                name,
                param,
            })
            .collect();
        AdamW {
            slots,
            steps: 0,
            beta1,
            beta2,
            eps,
            weight_decay,
            comm: Default::default(),
        }
    }

    /// The parameters, in order.
    pub fn parameters(&self) -> impl Iterator<Item = Tensor> + '_ {
        self.slots.iter().map(|s| s.param.shallow_clone())
    }

    /// Steps taken, counting those of a resumed state.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The fp32 master copy of a parameter that is not fp32.
    pub fn master(&self, name: &str) -> Option<&Tensor> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.master.as_ref())
    }

    /// Bytes of optimizer state (moments and masters).
    pub fn state_bytes(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| {
                let n = s.param.numel() as u64 * 4;
                n * if s.master.is_some() { 3 } else { 2 }
            })
            .sum()
    }

    /// Clears every gradient.
    pub fn zero_grad(&mut self) {
        for s in &mut self.slots {
            s.param.zero_grad();
        }
    }

    /// L2 norm of all gradients together, in fp32 (0 for parameters without one).
    pub fn grad_norm(&self) -> f64 {
        tch::no_grad(|| {
            let mut total = 0.0f64;
            for s in &self.slots {
                let g = s.param.grad();
                if g.defined() {
                    total += g.to_kind(Kind::Float).norm().double_value(&[]).powi(2);
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
                for s in &self.slots {
                    let mut g = s.param.grad();
                    if g.defined() {
                        let _ = g.f_mul_scalar_(scale);
                    }
                }
            });
        }
        norm
    }

    /// One AdamW step at learning rate `lr` (torch.optim.AdamW's rule, see [`update`]),
    /// on the fp32 master where there is one, then copied (rounded) into the parameter.
    pub fn step(&mut self, lr: f64) {
        self.steps += 1;
        let hyper = Hyper::new(
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            lr,
            self.steps,
        );
        tch::no_grad(|| {
            for s in &mut self.slots {
                let grad = s.param.grad();
                if !grad.defined() {
                    continue;
                }
                let n = s.param.numel() as i64;
                let flat = |t: &Tensor| t.view([n]);
                let param = flat(&s.param);
                let master = s.master.as_ref().map(flat);
                update(
                    master.as_ref().unwrap_or(&param),
                    master.is_some().then_some(&param),
                    &flat(&grad),
                    &flat(&s.m),
                    &flat(&s.v),
                    &hyper,
                );
            }
        });
    }

    /// Writes [`STATE_TENSORS`] and [`STATE_INFO`] into `dir`; returns the info written.
    pub fn save_state(&self, dir: &Path) -> Result<StateInfo, StateError> {
        let entries: Vec<StateEntry> = self
            .slots
            .iter()
            .map(|s| StateEntry {
                name: s.name.clone(),
                param: s.param.shallow_clone(),
                m: s.m.shallow_clone(),
                v: s.v.shallow_clone(),
                master: s.master.as_ref().map(Tensor::shallow_clone),
            })
            .collect();
        write_state(
            dir,
            self.steps,
            [self.beta1, self.beta2, self.eps, self.weight_decay],
            &entries,
        )
    }

    /// Resumes from the state in `dir`: moments, masters and step count. The state must
    /// hold exactly these parameters with these shapes, and each master must round to
    /// the parameter it shadows (else it belongs to other weights). A master saved for a
    /// parameter that is fp32 now replaces that parameter (full precision again).
    pub fn load_state(&mut self, dir: &Path) -> Result<StateInfo, StateError> {
        let params: Vec<(String, Tensor)> = self
            .slots
            .iter()
            .map(|s| (s.name.clone(), s.param.shallow_clone()))
            .collect();
        let (info, loaded) = read_state(dir, &params, None)?;
        tch::no_grad(|| {
            for (s, (m, v, master)) in self.slots.iter_mut().zip(loaded) {
                s.m = m;
                s.v = v;
                match (s.master.as_mut(), master) {
                    (Some(mine), Some(saved)) => *mine = saved,
                    (None, Some(saved)) => {
                        let _ = s.param.f_copy_(&saved);
                    }
                    _ => {}
                }
            }
        });
        self.steps = info.step;
        Ok(info)
    }
}

/// One parameter's optimizer state, whole (however it is kept while training).
#[derive(Debug)]
pub(crate) struct StateEntry {
    pub(crate) name: String,
    pub(crate) param: Tensor,
    pub(crate) m: Tensor,
    pub(crate) v: Tensor,
    pub(crate) master: Option<Tensor>,
}

/// Writes [`STATE_TENSORS`] and [`STATE_INFO`] for `entries` into `dir`.
pub(crate) fn write_state(
    dir: &Path,
    steps: u64,
    [beta1, beta2, eps, weight_decay]: [f64; 4],
    entries: &[StateEntry],
) -> Result<StateInfo, StateError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StateError::Io { path, source }
    };
    let mut tensors = Vec::with_capacity(entries.len() * 3);
    let mut parameters = Vec::with_capacity(entries.len());
    for s in entries {
        tensors.push((format!("{}.exp_avg", s.name), s.m.shallow_clone()));
        tensors.push((format!("{}.exp_avg_sq", s.name), s.v.shallow_clone()));
        if let Some(master) = &s.master {
            tensors.push((format!("{}.master", s.name), master.shallow_clone()));
        }
        parameters.push(StateParameter {
            name: s.name.clone(),
            shape: s.param.size(),
            dtype: format!("{:?}", s.param.kind()),
            master: s.master.is_some(),
        });
    }
    let tensors_path = dir.join(STATE_TENSORS);
    weights::save(&tensors_path, &tensors)?;
    let bytes = std::fs::read(&tensors_path).map_err(io(&tensors_path))?;
    let info = StateInfo {
        format: STATE_FORMAT.into(),
        step: steps,
        beta1,
        beta2,
        eps,
        weight_decay,
        tensors_sha256: crate::ingest::sha256_hex(&bytes),
        parameters,
    };
    let info_path = dir.join(STATE_INFO);
    let text = serde_json::to_vec_pretty(&info).unwrap_or_default();
    std::fs::write(&info_path, text).map_err(io(&info_path))?;
    Ok(info)
}

/// Moments and master (if saved) of one parameter, as read.
pub(crate) type LoadedState = (Tensor, Tensor, Option<Tensor>);

/// Reads and checks the state in `dir` for `params` (see [`AdamW::load_state`]), each
/// tensor on `device` (default: its parameter's).
pub(crate) fn read_state(
    dir: &Path,
    params: &[(String, Tensor)],
    device: Option<tch::Device>,
) -> Result<(StateInfo, Vec<LoadedState>), StateError> {
    let info_path = dir.join(STATE_INFO);
    let tensors_path = dir.join(STATE_TENSORS);
    let mismatch = |path: &Path, message: String| StateError::Mismatch {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(&info_path).map_err(|source| StateError::Io {
        path: info_path.clone(),
        source,
    })?;
    let info: StateInfo = serde_json::from_str(&text)
        .map_err(|e| mismatch(&info_path, format!("not an optimizer state: {e}")))?;
    if info.format != STATE_FORMAT {
        return Err(mismatch(
            &info_path,
            format!("format {:?}, expected {STATE_FORMAT:?}", info.format),
        ));
    }
    let bytes = std::fs::read(&tensors_path).map_err(|source| StateError::Io {
        path: tensors_path.clone(),
        source,
    })?;
    let sha = crate::ingest::sha256_hex(&bytes);
    if sha != info.tensors_sha256 {
        return Err(mismatch(
            &tensors_path,
            format!(
                "SHA-256 {sha} is not the {} that {STATE_INFO} names: the two files are not from the same save",
                info.tensors_sha256
            ),
        ));
    }
    drop(bytes);
    let file = Checkpoint::open_file(&tensors_path)?;
    let hint =
        "(the state is from another model or mode; pass --fresh-optimizer to start a new one)";
    let mut expected = std::collections::BTreeSet::new();
    let mut loaded = Vec::with_capacity(params.len());
    for (name, param) in params {
        let shape = param.size();
        let device = device.unwrap_or_else(|| param.device());
        let mut get = |suffix: &str| -> Result<Option<Tensor>, StateError> {
            let key = format!("{name}.{suffix}");
            expected.insert(key.clone());
            match file.shape(&key) {
                None => Ok(None),
                Some(found) if found != shape.as_slice() => Err(mismatch(
                    &tensors_path,
                    format!("{key} has shape {found:?} but the parameter is {shape:?} {hint}"),
                )),
                Some(_) => Ok(Some(file.load(&key, &shape, Kind::Float, device)?)),
            }
        };
        let m = get("exp_avg")?;
        let v = get("exp_avg_sq")?;
        let master = get("master")?;
        let (Some(m), Some(v)) = (m, v) else {
            return Err(mismatch(
                &tensors_path,
                format!("no moments for parameter {name} {hint}"),
            ));
        };
        if let Some(master) = &master {
            let rounded = master.to_kind(param.kind());
            let same = if param.kind() == Kind::Float {
                // An fp32 parameter saved from a bf16 run: it is the rounded master.
                master.to_kind(Kind::BFloat16).to_kind(Kind::Float)
            } else {
                rounded
            };
            let agrees = tch::no_grad(|| {
                let p = param.detach().to_device(device);
                let p = if param.kind() == Kind::Float {
                    p.to_kind(Kind::BFloat16).to_kind(Kind::Float)
                } else {
                    p
                };
                bool::try_from(same.eq_tensor(&p).all()).unwrap_or(false)
            });
            if !agrees {
                return Err(mismatch(
                    &tensors_path,
                    format!(
                        "the fp32 master of {name} does not round to the weights being trained: the state belongs to other weights (resume from the directory that holds both, or pass --fresh-optimizer)"
                    ),
                ));
            }
        }
        loaded.push((m, v, master));
    }
    if let Some(extra) = file.names().find(|n| !expected.contains(*n)) {
        return Err(mismatch(
            &tensors_path,
            format!("{extra} is not the state of any parameter being trained {hint}"),
        ));
    }
    Ok((info, loaded))
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
        let mut opt = AdamW::new(vec![("p".into(), p.shallow_clone())], 0.9, 0.999, 1e-8, 0.1);
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
        let mut opt = AdamW::new(vec![("p".into(), p.shallow_clone())], 0.9, 0.999, 1e-8, 0.0);
        (&p * &p * 0.5).sum(Kind::Float).backward();
        let norm = opt.clip_grad_norm(1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((opt.grad_norm() - 1.0).abs() < 1e-5);
    }

    /// An update far below half a bf16 spacing accumulates in the master and reaches the
    /// bf16 weight once it adds up; applied to the bf16 weight directly it would vanish.
    #[test]
    fn bf16_updates_below_half_a_spacing_accumulate_in_the_master() {
        let p = Tensor::from_slice(&[1.0f32, -0.5])
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true);
        let mut opt = AdamW::new(vec![("p".into(), p.shallow_clone())], 0.9, 0.999, 1e-8, 0.0);
        for _ in 0..100 {
            opt.zero_grad();
            // A constant gradient of +1: Adam moves each weight down by lr per step.
            p.sum(Kind::Float).backward();
            opt.step(1e-4);
        }
        let master = Vec::<f32>::try_from(opt.master("p").unwrap()).unwrap();
        assert!((master[0] - 0.99).abs() < 1e-5, "{master:?}");
        assert!((master[1] + 0.51).abs() < 1e-5, "{master:?}");
        // Below 1.0 bf16 has a spacing of 2^-8: 0.99 rounds to 0.98828125.
        let weights = Vec::<f32>::try_from(p.detach().to_kind(Kind::Float)).unwrap();
        assert_eq!(weights, vec![0.98828125, -0.51171875]);
    }

    #[test]
    fn a_saved_state_resumes_bit_for_bit() {
        let make = || {
            let a = Tensor::from_slice(&[0.3f32, -1.2, 2.5])
                .to_kind(Kind::BFloat16)
                .set_requires_grad(true);
            let b = Tensor::from_slice(&[0.7f32, 0.1]).set_requires_grad(true);
            (a, b)
        };
        let steps = |opt: &mut AdamW, a: &Tensor, b: &Tensor, n: usize| {
            for _ in 0..n {
                opt.zero_grad();
                (a.to_kind(Kind::Float).square().sum(Kind::Float) + (b * b * b).sum(Kind::Float))
                    .backward();
                opt.step(1e-3);
            }
        };
        let named = |a: &Tensor, b: &Tensor| {
            vec![
                ("a".to_owned(), a.shallow_clone()),
                ("b".to_owned(), b.shallow_clone()),
            ]
        };
        let (a1, b1) = make();
        let mut one = AdamW::new(named(&a1, &b1), 0.9, 0.999, 1e-8, 0.1);
        steps(&mut one, &a1, &b1, 6);

        let dir = tempfile::tempdir().unwrap();
        let (a2, b2) = make();
        let mut first = AdamW::new(named(&a2, &b2), 0.9, 0.999, 1e-8, 0.1);
        steps(&mut first, &a2, &b2, 3);
        let info = first.save_state(dir.path()).unwrap();
        assert_eq!((info.step, info.parameters.len()), (3, 2));
        assert!(info.parameters[0].master && !info.parameters[1].master);
        let (a3, b3) = (
            a2.detach().copy().set_requires_grad(true),
            b2.detach().copy().set_requires_grad(true),
        );
        let mut second = AdamW::new(named(&a3, &b3), 0.9, 0.999, 1e-8, 0.1);
        second.load_state(dir.path()).unwrap();
        steps(&mut second, &a3, &b3, 3);
        assert_eq!(second.steps(), 6);
        assert!(a3.equal(&a1) && b3.equal(&b1));
        assert!(second.master("a").unwrap().equal(one.master("a").unwrap()));

        // Another parameter list is refused, naming the parameter.
        let c = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        let mut other = AdamW::new(vec![("c".into(), c)], 0.9, 0.999, 1e-8, 0.1);
        let e = other.load_state(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no moments for parameter c"), "{e}");
    }
}
