//! torch.distributed's engine, c10d, from the libtorch that tch already links: a
//! `TCPStore` rendezvous and one process group — Gloo for CPU tensors, NCCL for CUDA
//! tensors — with the collectives a data-parallel trainer needs. tch binds none of c10d,
//! so this crate is a small C++ bridge (`cpp/bridge.cc`, through the `cxx` crate)
//! compiled against the same headers and ABI.
//!
//! The launch convention is torchrun's and Kubeflow PyTorchJob's: `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` ([`Launch::from_env`]);
//! under torchrun (`TORCHELASTIC_USE_AGENT_STORE`) the agent serves the store and every
//! rank joins it as a client under `/worker/attempt_N`, as torch.distributed does.
//!
//! Every call blocks until its collective finished on this rank, and fails — never hangs
//! — when a peer died or the group's timeout passed.
//!
//! This is the workspace's one crate with `unsafe`: cxx's glue, and handing tch tensors
//! to C++ as `at::Tensor*` (see [`Group::all_reduce`] for why that is sound).

use std::time::Duration;

use tch::Tensor;

#[cxx::bridge(namespace = "tapline_c10d")]
#[allow(unsafe_code, missing_debug_implementations)]
mod ffi {
    unsafe extern "C++" {
        include!("tapline-c10d/cpp/bridge.h");

        /// libtorch's tensor handle (what tch's `C_tensor` points at).
        #[namespace = "at"]
        type Tensor;
        /// A store and a process group.
        type Group;

        #[allow(clippy::too_many_arguments)]
        fn connect(
            backend: &str,
            host: &str,
            port: u16,
            agent_store: bool,
            prefix: &str,
            rank: i32,
            size: i32,
            local_rank: i32,
            timeout_ms: i64,
        ) -> Result<UniquePtr<Group>>;
        unsafe fn all_reduce(group: &Group, tensor: *const Tensor, op: u8) -> Result<()>;
        unsafe fn reduce_scatter(
            group: &Group,
            output: *const Tensor,
            input: *const Tensor,
        ) -> Result<()>;
        unsafe fn all_gather(
            group: &Group,
            output: *const Tensor,
            input: *const Tensor,
        ) -> Result<()>;
        unsafe fn broadcast(group: &Group, tensor: *const Tensor, root: i32) -> Result<()>;
        fn barrier(group: &Group) -> Result<()>;
        fn store_set(group: &Group, key: &str, value: &[u8]) -> Result<()>;
        fn store_get(group: &Group, key: &str) -> Result<Vec<u8>>;
        fn nccl_built() -> bool;
    }
}

/// Why a distributed call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The launch environment is incomplete or malformed.
    #[error("{0}")]
    Environment(String),
    /// A tensor cannot take part in the collective as given.
    #[error("{0}")]
    Tensor(String),
    /// c10d failed: a peer died or is unreachable, or the timeout passed.
    #[error("{what} failed on rank {rank} of {size}: {message}")]
    C10d {
        /// The call.
        what: &'static str,
        /// This rank.
        rank: usize,
        /// The group's size.
        size: usize,
        /// c10d's message.
        message: String,
    },
}

/// The collective backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Gloo: CPU tensors (and the only choice without CUDA).
    Gloo,
    /// NCCL: CUDA tensors.
    Nccl,
}

impl Backend {
    /// `gloo` or `nccl`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }

    /// Whether this build can make an NCCL group (libtorch with CUDA, NCCL headers found
    /// at build time).
    pub fn nccl_built() -> bool {
        ffi::nccl_built()
    }
}

/// How to combine a tensor across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// Where this process sits in a distributed launch (torchrun / PyTorchJob variables).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// `RANK`: this process, 0-based over all nodes.
    pub rank: usize,
    /// `WORLD_SIZE`: processes in all.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process on its node (its GPU index).
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: processes on this node.
    pub local_world_size: usize,
    /// `MASTER_ADDR`: host of the store.
    pub master_addr: String,
    /// `MASTER_PORT`: its port.
    pub master_port: u16,
    /// `TORCHELASTIC_RESTART_COUNT` when torchrun's agent serves the store
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank is then a client, under the
    /// attempt's prefix.
    pub agent_store_attempt: Option<u64>,
}

impl Launch {
    /// The launch described by the process environment: `None` without `WORLD_SIZE` (or
    /// `RANK`), a single-process run; an error naming the variable when a distributed
    /// launch is malformed.
    pub fn from_env() -> Result<Option<Launch>, Error> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Launch::from_env`] over any variable source.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>, Error> {
        let (Some(world), Some(rank)) = (var("WORLD_SIZE"), var("RANK")) else {
            return Ok(None);
        };
        let number = |name: &str, text: &str| -> Result<usize, Error> {
            text.trim().parse().map_err(|_| {
                Error::Environment(format!(
                    "{name}={text:?} is not a non-negative integer (set by torchrun or the PyTorchJob operator)"
                ))
            })
        };
        let world_size = number("WORLD_SIZE", &world)?;
        let rank = number("RANK", &rank)?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::Environment(format!(
                "RANK={rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", &v)?,
            None => rank,
        };
        let local_world_size = match var("LOCAL_WORLD_SIZE") {
            Some(v) => number("LOCAL_WORLD_SIZE", &v)?,
            None => world_size,
        };
        let master_addr = var("MASTER_ADDR").filter(|s| !s.is_empty()).ok_or_else(|| {
            Error::Environment(format!(
                "WORLD_SIZE={world_size} but MASTER_ADDR is not set: set it to the host of rank 0 (torchrun and PyTorchJob set it)"
            ))
        })?;
        let port = var("MASTER_PORT").ok_or_else(|| {
            Error::Environment(format!(
                "WORLD_SIZE={world_size} but MASTER_PORT is not set: set it to a free port on {master_addr}"
            ))
        })?;
        let master_port = port.trim().parse().map_err(|_| {
            Error::Environment(format!("MASTER_PORT={port:?} is not a port number"))
        })?;
        let agent = var("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        let agent_store_attempt = if agent {
            Some(match var("TORCHELASTIC_RESTART_COUNT") {
                Some(v) => number("TORCHELASTIC_RESTART_COUNT", &v)? as u64,
                None => 0,
            })
        } else {
            None
        };
        Ok(Some(Launch {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            agent_store_attempt,
        }))
    }
}

/// A process group: every rank of a [`Launch`] joined on its store.
pub struct Group {
    inner: cxx::UniquePtr<ffi::Group>,
    rank: usize,
    size: usize,
    backend: Backend,
    timeout: Duration,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("backend", &self.backend)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Group {
    /// Meets every rank of `launch` on its store and makes the group. Blocks until all
    /// arrived, or fails after `timeout` (which also bounds every later call).
    pub fn connect(launch: &Launch, backend: Backend, timeout: Duration) -> Result<Group, Error> {
        let prefix = match launch.agent_store_attempt {
            Some(attempt) => format!("/worker/attempt_{attempt}/tapline/"),
            None => "tapline/".to_owned(),
        };
        let size = i32::try_from(launch.world_size).map_err(|_| {
            Error::Environment(format!("WORLD_SIZE={} is too large", launch.world_size))
        })?;
        let timeout_ms = i64::try_from(timeout.as_millis())
            .unwrap_or(i64::MAX)
            .max(1);
        let inner = ffi::connect(
            backend.name(),
            &launch.master_addr,
            launch.master_port,
            launch.agent_store_attempt.is_some(),
            &prefix,
            launch.rank as i32,
            size,
            launch.local_rank as i32,
            timeout_ms,
        )
        .map_err(|e| Error::C10d {
            what: "rendezvous",
            rank: launch.rank,
            size: launch.world_size,
            message: format!(
                "{e} (store {}:{}, timeout {timeout:?})",
                launch.master_addr, launch.master_port
            ),
        })?;
        Ok(Group {
            inner,
            rank: launch.rank,
            size: launch.world_size,
            backend,
            timeout,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The timeout of every call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn failed(&self, what: &'static str) -> impl FnOnce(cxx::Exception) -> Error + '_ {
        move |e| Error::C10d {
            what,
            rank: self.rank,
            size: self.size,
            message: e.what().to_owned(),
        }
    }

    fn check(&self, what: &str, t: &Tensor) -> Result<(), Error> {
        if !t.is_contiguous() {
            return Err(Error::Tensor(format!(
                "{what}: the tensor is not contiguous"
            )));
        }
        let wanted_cuda = self.backend == Backend::Nccl;
        if t.device().is_cuda() != wanted_cuda {
            return Err(Error::Tensor(format!(
                "{what}: a {:?} tensor in a {} group ({} runs on {} tensors)",
                t.device(),
                self.backend.name(),
                self.backend.name(),
                if wanted_cuda { "CUDA" } else { "CPU" }
            )));
        }
        Ok(())
    }

    /// Combines `tensor` over every rank, in place (each rank ends with the result).
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), Error> {
        self.check("all_reduce", tensor)?;
        let op = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        };
        // SAFETY: tch's `C_tensor` is libtorch's `at::Tensor` (torch-sys's torch_api.h:
        // `typedef torch::Tensor *tensor`), and `tensor` is borrowed for the whole call.
        // The bridge copies the handle (a reference count) before starting the work, so
        // the storage outlives the work even when this call returns on a timeout.
        #[allow(unsafe_code)]
        unsafe { ffi::all_reduce(&self.inner, tensor.as_ptr().cast(), op) }
            .map_err(self.failed("all_reduce"))
    }

    /// Sums `input` (`size × n` elements, flat) over every rank and leaves rank `r`'s
    /// `n`-element slice of the sum in `output`.
    pub fn reduce_scatter(&self, output: &Tensor, input: &Tensor) -> Result<(), Error> {
        self.check("reduce_scatter", output)?;
        self.check("reduce_scatter", input)?;
        if input.numel() != output.numel() * self.size {
            return Err(Error::Tensor(format!(
                "reduce_scatter: input has {} elements, not {} × {}",
                input.numel(),
                self.size,
                output.numel()
            )));
        }
        // SAFETY: as in `all_reduce`.
        #[allow(unsafe_code)]
        unsafe { ffi::reduce_scatter(&self.inner, output.as_ptr().cast(), input.as_ptr().cast()) }
            .map_err(self.failed("reduce_scatter"))
    }

    /// Concatenates every rank's `input` (`n` elements) into `output` (`size × n`), in
    /// rank order.
    pub fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<(), Error> {
        self.check("all_gather", output)?;
        self.check("all_gather", input)?;
        if output.numel() != input.numel() * self.size {
            return Err(Error::Tensor(format!(
                "all_gather: output has {} elements, not {} × {}",
                output.numel(),
                self.size,
                input.numel()
            )));
        }
        // SAFETY: as in `all_reduce`.
        #[allow(unsafe_code)]
        unsafe { ffi::all_gather(&self.inner, output.as_ptr().cast(), input.as_ptr().cast()) }
            .map_err(self.failed("all_gather"))
    }

    /// Copies `root`'s `tensor` into every rank's.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), Error> {
        self.check("broadcast", tensor)?;
        // SAFETY: as in `all_reduce`.
        #[allow(unsafe_code)]
        unsafe { ffi::broadcast(&self.inner, tensor.as_ptr().cast(), root as i32) }
            .map_err(self.failed("broadcast"))
    }

    /// Returns once every rank called it.
    pub fn barrier(&self) -> Result<(), Error> {
        ffi::barrier(&self.inner).map_err(self.failed("barrier"))
    }

    /// Sets `key` in the group's store (small metadata, not tensors).
    pub fn store_set(&self, key: &str, value: &[u8]) -> Result<(), Error> {
        ffi::store_set(&self.inner, key, value).map_err(self.failed("store set"))
    }

    /// Waits for `key` in the group's store (up to the timeout) and returns it.
    pub fn store_get(&self, key: &str) -> Result<Vec<u8>, Error> {
        ffi::store_get(&self.inner, key).map_err(self.failed("store get"))
    }

    /// Every rank's `value` under `key`, in rank order (through the store).
    pub fn exchange(&self, key: &str, value: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        self.store_set(&format!("{key}/{}", self.rank), value)?;
        (0..self.size)
            .map(|r| self.store_get(&format!("{key}/{r}")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn the_environment_makes_a_launch_or_names_what_is_wrong() {
        assert_eq!(Launch::from_vars(vars(&[])).unwrap(), None);
        let l = Launch::from_vars(vars(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "trainer-0.trainer"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank), (3, 4, 1));
        assert_eq!((l.master_port, l.agent_store_attempt), (29500, Some(2)));
        let err = |pairs: &[(&str, &str)]| Launch::from_vars(vars(pairs)).unwrap_err().to_string();
        assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("not below WORLD_SIZE=2"));
        assert!(err(&[("WORLD_SIZE", "two"), ("RANK", "0")]).contains("WORLD_SIZE=\"two\""));
        assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "0")]).contains("MASTER_ADDR is not set"));
        assert!(
            err(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "h")])
                .contains("MASTER_PORT is not set")
        );
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn launch(rank: usize, size: usize, port: u16) -> Launch {
        Launch {
            rank,
            world_size: size,
            local_rank: rank,
            local_world_size: size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            agent_store_attempt: None,
        }
    }

    /// Two ranks in two threads of this process (Gloo allows it): every collective
    /// gives what its definition says.
    #[test]
    fn gloo_collectives_across_two_ranks() {
        let port = free_port();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                std::thread::spawn(move || {
                    let g = Group::connect(
                        &launch(rank, 2, port),
                        Backend::Gloo,
                        Duration::from_secs(30),
                    )
                    .unwrap();
                    let r = rank as f32;
                    let t = Tensor::from_slice(&[1.0f32 + r, 10.0 * r, -r]);
                    g.all_reduce(&t, ReduceOp::Sum).unwrap();
                    let sum = Vec::<f32>::try_from(&t).unwrap();
                    let t = Tensor::from_slice(&[r, -r]);
                    g.all_reduce(&t, ReduceOp::Max).unwrap();
                    let max = Vec::<f32>::try_from(&t).unwrap();
                    let input = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]) * f64::from(r + 1.0);
                    let out = Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu));
                    g.reduce_scatter(&out, &input).unwrap();
                    let scattered = Vec::<f32>::try_from(&out).unwrap();
                    let mine = Tensor::from_slice(&[r, r + 0.5]);
                    let all = Tensor::zeros([4], (tch::Kind::Float, tch::Device::Cpu));
                    g.all_gather(&all, &mine).unwrap();
                    let gathered = Vec::<f32>::try_from(&all).unwrap();
                    let b = Tensor::from_slice(&[r + 7.0]);
                    g.broadcast(&b, 1).unwrap();
                    let broadcast = Vec::<f32>::try_from(&b).unwrap();
                    let values = g
                        .exchange("hello", format!("rank {rank}").as_bytes())
                        .unwrap();
                    g.barrier().unwrap();
                    let err = g.all_reduce(
                        &Tensor::from_slice(&[1.0f32]).expand([2], false),
                        ReduceOp::Sum,
                    );
                    assert!(err.unwrap_err().to_string().contains("not contiguous"));
                    (sum, max, scattered, gathered, broadcast, values)
                })
            })
            .collect();
        for (rank, h) in ranks.into_iter().enumerate() {
            let (sum, max, scattered, gathered, broadcast, values) = h.join().unwrap();
            assert_eq!(sum, vec![3.0, 10.0, -1.0]);
            assert_eq!(max, vec![1.0, 0.0]);
            // Σ over ranks of [1,2,3,4]·(r+1) = [3,6,9,12]; rank r gets its half.
            assert_eq!(
                scattered,
                if rank == 0 {
                    vec![3.0, 6.0]
                } else {
                    vec![9.0, 12.0]
                }
            );
            assert_eq!(gathered, vec![0.0, 0.5, 1.0, 1.5]);
            assert_eq!(broadcast, vec![8.0]);
            assert_eq!(values, vec![b"rank 0".to_vec(), b"rank 1".to_vec()]);
        }
    }

    /// The NCCL backend where this build has it: on a machine with a GPU a one-rank
    /// group sums a CUDA tensor; without one, making the group or using it fails with an
    /// error (never a crash), and a CPU tensor is refused before reaching NCCL.
    #[test]
    fn nccl_groups_take_cuda_tensors_only() {
        if !Backend::nccl_built() {
            eprintln!("this build has no NCCL backend (no CUDA headers at build time)");
            return;
        }
        let port = free_port();
        match Group::connect(&launch(0, 1, port), Backend::Nccl, Duration::from_secs(20)) {
            Ok(g) => {
                let cpu = Tensor::from_slice(&[1.0f32]);
                let e = g.all_reduce(&cpu, ReduceOp::Sum).unwrap_err().to_string();
                assert!(e.contains("in a nccl group"), "{e}");
                if tch::Cuda::is_available() {
                    let t = Tensor::from_slice(&[2.0f32]).to_device(tch::Device::Cuda(0));
                    g.all_reduce(&t, ReduceOp::Sum).unwrap();
                    assert_eq!(
                        Vec::<f32>::try_from(&t.to_device(tch::Device::Cpu)).unwrap(),
                        vec![2.0]
                    );
                }
            }
            Err(e) => {
                assert!(
                    !tch::Cuda::is_available(),
                    "NCCL group failed with a GPU: {e}"
                );
                eprintln!("no GPU: {e}");
            }
        }
    }

    /// A rank that never arrives: the other fails within the timeout, naming the call.
    #[test]
    fn a_missing_peer_is_an_error_within_the_timeout() {
        let port = free_port();
        let started = std::time::Instant::now();
        let err = Group::connect(&launch(0, 2, port), Backend::Gloo, Duration::from_secs(2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rendezvous failed on rank 0 of 2"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
    }
}
