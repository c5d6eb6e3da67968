//! Data parallelism over a c10d process group ([`tapline_c10d`]): which micro-batches
//! each rank runs, gradients summed across ranks, and AdamW with its state sharded
//! across ranks (ZeRO-1/2).
//!
//! Every rank prepares the same mini-batches (prepare is deterministic on the same
//! records); [`assign`] gives each rank a share of every mini-batch's micro-batches,
//! balanced by tokens. The pipeline's loss weights already normalize over the whole
//! mini-batch, so the sum of the ranks' gradients is the single-process gradient.
//!
//! Two optimizers implement [`Optimizer`]:
//! - [`AdamW`] (replicated, as DDP): each rank keeps the whole state; gradients are
//!   all-reduced in buckets of [`BUCKET`] elements, then every rank takes the same step;
//! - [`ShardedAdamW`]: the trainable parameters are laid end to end in one flat space,
//!   split into `world` contiguous shards; rank `r` keeps only shard `r`'s AdamW moments
//!   and fp32 masters, receives only that shard's summed gradient (reduce-scatter),
//!   updates it, and the new values are all-gathered into every rank's parameters.
//!   Optimizer memory per rank is `1/world` of the replicated one. Its saved state is
//!   gathered into the single-process format, so a run resumes on any number of ranks.

use tapline_c10d::{Group, ReduceOp};
use tch::{Device, Kind, Tensor};

pub use super::comm::Comm;
use super::optim::{self, AdamW, Hyper, StateEntry, StateError, StateInfo};

/// Elements moved per collective call (32 MB of fp32): bounds the temporary buffers.
pub const BUCKET: i64 = 1 << 23;

/// Which micro-batches each of `ranks` ranks runs, given each micro-batch's tokens:
/// longest first, each to the rank with the fewest tokens so far (ties to the lower
/// rank), so every rank computes the same assignment. A rank may get none.
pub fn assign(tokens: &[u64], ranks: usize) -> Vec<Vec<usize>> {
    let ranks = ranks.max(1);
    let mut order: Vec<usize> = (0..tokens.len()).collect();
    order.sort_by(|&a, &b| tokens[b].cmp(&tokens[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; ranks];
    let mut out = vec![Vec::new(); ranks];
    for i in order {
        let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += tokens[i];
        out[r].push(i);
    }
    for v in &mut out {
        v.sort_unstable();
    }
    out
}

/// What the update loop needs of an optimizer, single-process or distributed.
pub trait Optimizer {
    /// Clears every gradient.
    fn clear_grads(&mut self);
    /// Makes the gradients the sum over the group's ranks (nothing without a group),
    /// clips them to the global norm `max_norm` (0: no clipping) and returns the norm
    /// before clipping.
    fn reduce_and_clip(
        &mut self,
        max_norm: f64,
        group: Option<&Group>,
    ) -> Result<f64, tapline_c10d::Error>;
    /// One AdamW step at `lr`; every rank ends with the same parameters.
    fn apply(&mut self, lr: f64, group: Option<&Group>) -> Result<(), tapline_c10d::Error>;
    /// Bytes of optimizer state this rank holds.
    fn state_bytes(&self) -> u64;
    /// Communication so far.
    fn comm(&self) -> Comm;
}

/// Gives every parameter without a gradient a zero one (a rank that ran no micro-batch
/// still takes part in every collective with the same layout).
pub fn define_grads(params: &[Tensor]) {
    let missing: Vec<&Tensor> = params.iter().filter(|p| !p.grad().defined()).collect();
    if missing.is_empty() {
        return;
    }
    let zero = missing
        .iter()
        .map(|p| p.sum(Kind::Float) * 0.0)
        .reduce(|a, b| a + b);
    if let Some(zero) = zero {
        zero.backward();
    }
}

impl Optimizer for AdamW {
    fn clear_grads(&mut self) {
        self.zero_grad();
    }

    fn reduce_and_clip(
        &mut self,
        max_norm: f64,
        group: Option<&Group>,
    ) -> Result<f64, tapline_c10d::Error> {
        if let Some(group) = group.filter(|g| g.size() > 1) {
            let params: Vec<Tensor> = self.parameters().collect();
            define_grads(&params);
            let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            let mut comm = self.comm;
            all_reduce_buckets(group, &grads, &mut comm)?;
            self.comm = comm;
        }
        Ok(self.clip_grad_norm(max_norm))
    }

    fn apply(&mut self, lr: f64, _group: Option<&Group>) -> Result<(), tapline_c10d::Error> {
        self.step(lr);
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        AdamW::state_bytes(self)
    }

    fn comm(&self) -> Comm {
        self.comm
    }
}

/// Sums `tensors` over the group in place, [`BUCKET`] elements per call, in fp32.
fn all_reduce_buckets(
    group: &Group,
    tensors: &[Tensor],
    comm: &mut Comm,
) -> Result<(), tapline_c10d::Error> {
    tch::no_grad(|| {
        let mut start = 0;
        while start < tensors.len() {
            let mut end = start;
            let mut size = 0;
            while end < tensors.len()
                && (end == start || size + tensors[end].numel() as i64 <= BUCKET)
            {
                size += tensors[end].numel() as i64;
                end += 1;
            }
            let parts: Vec<Tensor> = tensors[start..end]
                .iter()
                .map(|t| t.reshape([-1]).to_kind(Kind::Float))
                .collect();
            let flat = Tensor::cat(&parts, 0);
            comm.time(size * 4, || group.all_reduce(&flat, ReduceOp::Sum))?;
            let mut offset = 0;
            for t in &tensors[start..end] {
                let n = t.numel() as i64;
                let _ = t.reshape([-1]).f_copy_(&flat.narrow(0, offset, n));
                offset += n;
            }
            start = end;
        }
        Ok(())
    })
}

/// Where one parameter's elements fall in this rank's shard.
#[derive(Debug, Clone, Copy)]
struct Piece {
    /// Index of the parameter.
    param: usize,
    /// First element in the flattened parameter.
    start: i64,
    /// First element in the shard.
    at: i64,
    /// Elements.
    len: i64,
}

/// AdamW whose state is split across the ranks of a group (see the module docs).
#[derive(Debug)]
pub struct ShardedAdamW {
    params: Vec<(String, Tensor)>,
    /// Start of each parameter in the flat space.
    offsets: Vec<i64>,
    /// Elements of all parameters.
    total: i64,
    /// Elements per shard (the last shard is padded).
    shard: i64,
    rank: usize,
    world: usize,
    pieces: Vec<Piece>,
    m: Tensor,
    v: Tensor,
    /// fp32 masters of the shard's non-fp32 elements (absent when every parameter is fp32).
    master: Option<Tensor>,
    /// This shard's summed gradient, fp32, between `reduce_and_clip` and `apply`.
    grad: Tensor,
    steps: u64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    comm: Comm,
}

impl ShardedAdamW {
    /// Shard `rank` of `world` for `params` (moments zero; masters from the parameters).
    pub fn new(
        params: Vec<(String, Tensor)>,
        [beta1, beta2, eps, weight_decay]: [f64; 4],
        rank: usize,
        world: usize,
    ) -> Self {
        let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
        let mut offsets = Vec::with_capacity(params.len());
        let mut total = 0i64;
        for (_, p) in &params {
            offsets.push(total);
            total += p.numel() as i64;
        }
        let world = world.max(1);
        let shard = (total + world as i64 - 1) / world as i64;
        let (lo, hi) = (rank as i64 * shard, ((rank as i64 + 1) * shard).min(total));
        let mut pieces = Vec::new();
        for (i, (_, p)) in params.iter().enumerate() {
            let (a, b) = (offsets[i], offsets[i] + p.numel() as i64);
            let (s, e) = (a.max(lo), b.min(hi));
            if s < e {
                pieces.push(Piece {
                    param: i,
                    start: s - a,
                    at: s - lo,
                    len: e - s,
                });
            }
        }
        let zeros = || Tensor::zeros([shard.max(1)], (Kind::Float, device));
        let master = params
            .iter()
            .any(|(_, p)| p.kind() != Kind::Float)
            .then(|| {
                let master = zeros();
                tch::no_grad(|| {
                    for piece in &pieces {
                        let p = &params[piece.param].1;
                        if p.kind() != Kind::Float {
                            let _ = master.narrow(0, piece.at, piece.len).f_copy_(
                                &p.detach().reshape([-1]).narrow(0, piece.start, piece.len),
                            );
                        }
                    }
                });
                master
            });
        ShardedAdamW {
            m: zeros(),
            v: zeros(),
            grad: zeros(),
            master,
            params,
            offsets,
            total,
            shard,
            rank,
            world,
            pieces,
            steps: 0,
            beta1,
            beta2,
            eps,
            weight_decay,
            comm: Comm::default(),
        }
    }

    /// Steps taken, counting those of a resumed state.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// `[start, start + len)` of the flat space: the parameters' elements (`grad`:
    /// their gradients) as fp32, zeros past the end.
    fn flat_range(&self, start: i64, len: i64, grad: bool) -> Tensor {
        let device = self.m.device();
        let mut parts = Vec::new();
        let end = start + len;
        for (i, (_, p)) in self.params.iter().enumerate() {
            let (a, b) = (self.offsets[i], self.offsets[i] + p.numel() as i64);
            let (s, e) = (a.max(start), b.min(end));
            if s >= e {
                continue;
            }
            let source = if grad { p.grad() } else { p.detach() };
            parts.push(if source.defined() {
                source
                    .reshape([-1])
                    .narrow(0, s - a, e - s)
                    .to_kind(Kind::Float)
            } else {
                Tensor::zeros([e - s], (Kind::Float, device))
            });
        }
        let covered = (end.min(self.total) - start).max(0);
        if covered < len {
            parts.push(Tensor::zeros([len - covered], (Kind::Float, device)));
        }
        Tensor::cat(&parts, 0)
    }

    /// Copies `values` (fp32) into the parameters' elements `[start, start + len)`.
    fn write_range(&self, start: i64, values: &Tensor) {
        let end = start + values.numel() as i64;
        for (i, (_, p)) in self.params.iter().enumerate() {
            let (a, b) = (self.offsets[i], self.offsets[i] + p.numel() as i64);
            let (s, e) = (a.max(start), b.min(end));
            if s < e {
                let _ = p
                    .detach()
                    .reshape([-1])
                    .narrow(0, s - a, e - s)
                    .f_copy_(&values.narrow(0, s - start, e - s));
            }
        }
    }

    /// Elements per bucket of one rank's part.
    fn bucket(&self) -> i64 {
        (BUCKET / self.world as i64).max(1)
    }

    /// Writes the whole state in the single-process format into `dir` on rank 0 (every
    /// rank must call it: the shards are gathered). `None` on other ranks.
    pub fn save_state(
        &mut self,
        dir: &std::path::Path,
        group: &Group,
    ) -> Result<Option<StateInfo>, DistStateError> {
        let full = |shard: &Tensor, comm: &mut Comm| -> Result<Tensor, tapline_c10d::Error> {
            let out = Tensor::zeros(
                [self.shard.max(1) * self.world as i64],
                (Kind::Float, shard.device()),
            );
            comm.time(self.shard * 4, || group.all_gather(&out, shard))?;
            Ok(out)
        };
        let mut comm = self.comm;
        let m = full(&self.m, &mut comm)?;
        let v = full(&self.v, &mut comm)?;
        let master = match &self.master {
            Some(master) => Some(full(master, &mut comm)?),
            None => None,
        };
        self.comm = comm;
        if self.rank != 0 {
            return Ok(None);
        }
        let entries: Vec<StateEntry> = self
            .params
            .iter()
            .enumerate()
            .map(|(i, (name, p))| {
                let (o, n) = (self.offsets[i], p.numel() as i64);
                let take = |t: &Tensor| t.narrow(0, o, n).view(p.size().as_slice());
                StateEntry {
                    name: name.clone(),
                    param: p.shallow_clone(),
                    m: take(&m),
                    v: take(&v),
                    master: master
                        .as_ref()
                        .filter(|_| p.kind() != Kind::Float)
                        .map(take),
                }
            })
            .collect();
        let info = optim::write_state(
            dir,
            self.steps,
            [self.beta1, self.beta2, self.eps, self.weight_decay],
            &entries,
        )?;
        Ok(Some(info))
    }

    /// Resumes this rank's shard from a state in the single-process format (saved by
    /// any number of ranks); every rank reads `dir`.
    pub fn load_state(&mut self, dir: &std::path::Path) -> Result<StateInfo, StateError> {
        let (info, loaded) = optim::read_state(dir, &self.params, Some(Device::Cpu))?;
        tch::no_grad(|| {
            for ((_, p), (_, _, master)) in self.params.iter().zip(&loaded) {
                if let Some(master) = master
                    && p.kind() == Kind::Float
                {
                    // A master saved for a parameter that is fp32 now: full precision again.
                    let _ = p.detach().f_copy_(master);
                }
            }
            let device = self.m.device();
            for piece in &self.pieces {
                let (m, v, master) = &loaded[piece.param];
                let part = |t: &Tensor| {
                    t.reshape([-1])
                        .narrow(0, piece.start, piece.len)
                        .to_device(device)
                };
                let _ = self.m.narrow(0, piece.at, piece.len).f_copy_(&part(m));
                let _ = self.v.narrow(0, piece.at, piece.len).f_copy_(&part(v));
                if let (Some(mine), Some(saved)) = (&self.master, master)
                    && self.params[piece.param].1.kind() != Kind::Float
                {
                    let _ = mine.narrow(0, piece.at, piece.len).f_copy_(&part(saved));
                }
            }
        });
        self.steps = info.step;
        Ok(info)
    }
}

/// Why a sharded optimizer state could not be saved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistStateError {
    /// Gathering the shards failed.
    #[error(transparent)]
    Comm(#[from] tapline_c10d::Error),
    /// Writing the state failed.
    #[error(transparent)]
    State(#[from] StateError),
}

impl Optimizer for ShardedAdamW {
    fn clear_grads(&mut self) {
        for (_, p) in &mut self.params {
            p.zero_grad();
        }
    }

    fn reduce_and_clip(
        &mut self,
        max_norm: f64,
        group: Option<&Group>,
    ) -> Result<f64, tapline_c10d::Error> {
        let b = self.bucket();
        let mut comm = self.comm;
        tch::no_grad(|| -> Result<(), tapline_c10d::Error> {
            let mut o = 0;
            while o < self.shard {
                let len = b.min(self.shard - o);
                let input = Tensor::cat(
                    &(0..self.world as i64)
                        .map(|r| self.flat_range(r * self.shard + o, len, true))
                        .collect::<Vec<_>>(),
                    0,
                );
                let mut out = self.grad.narrow(0, o, len);
                match group {
                    Some(g) => {
                        comm.time(input.numel() as i64 * 4, || g.reduce_scatter(&out, &input))?
                    }
                    None => {
                        let _ = out.f_copy_(&input);
                    }
                }
                o += len;
            }
            Ok(())
        })?;
        // ATen's fp32 norm (as `AdamW::grad_norm` takes it per parameter), squared and
        // summed over ranks in f64. (A `to_kind(Double).square().sum()` over the shard
        // took 10 s here, on 67M elements, one thread.)
        let local = tch::no_grad(|| self.grad.norm().double_value(&[]).powi(2));
        let total = Tensor::from_slice(&[local]);
        if let Some(g) = group {
            comm.time(8, || g.all_reduce(&total, ReduceOp::Sum))?;
        }
        self.comm = comm;
        let norm = total.double_value(&[0]).sqrt();
        if max_norm > 0.0 && norm.is_finite() && norm > max_norm {
            let _ = tch::no_grad(|| self.grad.f_mul_scalar_(max_norm / (norm + 1e-6)));
        }
        Ok(norm)
    }

    fn apply(&mut self, lr: f64, group: Option<&Group>) -> Result<(), tapline_c10d::Error> {
        self.steps += 1;
        let h = Hyper::new(
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            lr,
            self.steps,
        );
        tch::no_grad(|| {
            for piece in &self.pieces {
                let p = &self.params[piece.param].1;
                let param = p.detach().reshape([-1]).narrow(0, piece.start, piece.len);
                let part = |t: &Tensor| t.narrow(0, piece.at, piece.len);
                let master = self
                    .master
                    .as_ref()
                    .filter(|_| p.kind() != Kind::Float)
                    .map(part);
                optim::update(
                    master.as_ref().unwrap_or(&param),
                    master.is_some().then_some(&param),
                    &part(&self.grad),
                    &part(&self.m),
                    &part(&self.v),
                    &h,
                );
            }
        });
        let Some(group) = group else {
            return Ok(());
        };
        // Every rank's new shard into every rank's parameters.
        let b = self.bucket();
        let lo = self.rank as i64 * self.shard;
        let mut comm = self.comm;
        let result = tch::no_grad(|| -> Result<(), tapline_c10d::Error> {
            let mut o = 0;
            while o < self.shard {
                let len = b.min(self.shard - o);
                let mine = self.flat_range(lo + o, len, false);
                let all = Tensor::zeros([len * self.world as i64], (Kind::Float, mine.device()));
                comm.time(len * 4, || group.all_gather(&all, &mine))?;
                for r in 0..self.world as i64 {
                    if r != self.rank as i64 {
                        self.write_range(r * self.shard + o, &all.narrow(0, r * len, len));
                    }
                }
                o += len;
            }
            Ok(())
        });
        self.comm = comm;
        result
    }

    fn state_bytes(&self) -> u64 {
        let n = |t: &Tensor| t.numel() as u64 * 4;
        n(&self.m) + n(&self.v) + self.master.as_ref().map_or(0, n)
    }

    fn comm(&self) -> Comm {
        self.comm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignment_balances_tokens_and_is_deterministic() {
        let a = assign(&[100, 300, 200, 50, 50], 2);
        assert_eq!(a, vec![vec![1, 3], vec![0, 2, 4]]);
        // Fewer micro-batches than ranks: a rank gets none.
        assert_eq!(assign(&[10], 2), vec![vec![0], vec![]]);
        // Every micro-batch exactly once.
        let mut all: Vec<usize> = assign(&[5, 4, 3, 2, 1, 9, 7], 3).concat();
        all.sort_unstable();
        assert_eq!(all, (0..7).collect::<Vec<_>>());
    }

    /// Without a group (world 1), the sharded optimizer is AdamW exactly, bf16 masters
    /// included; its saved state resumes the plain one.
    #[test]
    fn one_shard_is_plain_adamw() {
        let make = || {
            (
                Tensor::from_slice(&[0.3f32, -1.2, 2.5])
                    .to_kind(Kind::BFloat16)
                    .set_requires_grad(true),
                Tensor::from_slice(&[0.7f32, 0.1]).set_requires_grad(true),
            )
        };
        let named = |a: &Tensor, b: &Tensor| {
            vec![
                ("a".to_owned(), a.shallow_clone()),
                ("b".to_owned(), b.shallow_clone()),
            ]
        };
        let loss = |a: &Tensor, b: &Tensor| {
            a.to_kind(Kind::Float).square().sum(Kind::Float) + (b * b * b).sum(Kind::Float)
        };
        let (a1, b1) = make();
        let mut plain = AdamW::new(named(&a1, &b1), 0.9, 0.999, 1e-8, 0.1);
        let (a2, b2) = make();
        let mut sharded = ShardedAdamW::new(named(&a2, &b2), [0.9, 0.999, 1e-8, 0.1], 0, 1);
        for _ in 0..4 {
            plain.clear_grads();
            loss(&a1, &b1).backward();
            let n1 = plain.reduce_and_clip(0.5, None).unwrap();
            plain.apply(1e-2, None).unwrap();
            sharded.clear_grads();
            loss(&a2, &b2).backward();
            let n2 = sharded.reduce_and_clip(0.5, None).unwrap();
            sharded.apply(1e-2, None).unwrap();
            assert!((n1 - n2).abs() < 1e-6, "{n1} {n2}");
        }
        assert!(a1.equal(&a2) && b1.equal(&b2), "{a1} {a2} {b1} {b2}");
    }
}
