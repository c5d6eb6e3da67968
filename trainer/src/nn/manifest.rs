//! The record of a training run: `manifest.json` (everything needed to know what the
//! run read, did, cost and wrote) and `chart.svg` (reward, loss and gradient norm per
//! step). `manifest.json` is written last, so its presence means the checkpoint
//! directory is complete.

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use super::train::{StepMetrics, TrainResult};
use crate::chart::{Panel, Series};

/// Name of the manifest's format.
pub const FORMAT: &str = "tapline.train_run.v1";

pub use crate::GIT_COMMIT;

/// One input segment.
#[derive(Debug, Clone, Serialize)]
pub struct InputSegment {
    /// Key relative to the store prefix.
    pub key: String,
    /// SHA-256 of its bytes.
    pub sha256: String,
}

/// Where the time went, in seconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Phases {
    /// Listing and reading segments.
    pub ingest: f64,
    /// Clean, tokenize, merge, advantages, schedule.
    pub prepare: f64,
    /// Loading the model.
    pub load_model: f64,
    /// Old log-probs before the first update.
    pub old_logprobs: f64,
    /// Optimizer steps.
    pub update: f64,
    /// Writing the checkpoint.
    pub checkpoint: f64,
}

/// What the run cost.
#[derive(Debug, Clone, Serialize)]
pub struct Compute {
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// The CPU model or GPU name.
    pub device_name: String,
    /// Training dtype.
    pub dtype: String,
    /// Wall-clock seconds of the whole run.
    pub wall_clock_seconds: f64,
    /// Seconds the GPU was held (the wall clock of the run when on CUDA, else 0).
    pub gpu_seconds: f64,
    /// CPU time of the process (user + system), seconds.
    pub cpu_seconds: f64,
    /// Peak resident memory of the process, bytes.
    pub peak_rss_bytes: u64,
    /// Peak GPU memory in use on the device, sampled every second with `nvidia-smi`
    /// (libtorch's allocator statistics are not exposed by tch); `null` on CPU or when
    /// `nvidia-smi` is not available.
    pub gpu_peak_memory_bytes_sampled: Option<u64>,
    /// Bytes of optimizer state this process held (moments and fp32 masters; in a
    /// distributed run, rank 0's share).
    pub optimizer_state_bytes: u64,
    /// Per phase.
    pub phases: Phases,
}

/// The run manifest.
#[derive(Debug, Clone, Serialize)]
pub struct RunManifest {
    /// [`FORMAT`].
    pub format: &'static str,
    /// tapline's version.
    pub tapline_version: &'static str,
    /// [`GIT_COMMIT`].
    pub git_commit: &'static str,
    /// The command line.
    pub command: Vec<String>,
    /// Unix seconds at the start.
    pub started_unix_secs: u64,
    /// The full run configuration.
    pub config: Value,
    /// The seed of the update.
    pub seed: u64,
    /// `full` (every weight) or `lora` (an adapter).
    pub mode: &'static str,
    /// The optimizer state resumed (`from`, `optimizer_step`, `optimizer_sha256`), or
    /// `null` for a new one.
    pub resumed: Option<Value>,
    /// Model trained from.
    pub model: Value,
    /// The store, as displayed (no credentials).
    pub store: String,
    /// The cursor name, when one was used.
    pub run: Option<String>,
    /// Every segment read, with its checksum.
    pub input_segments: Vec<InputSegment>,
    /// Cleaning, tokenization, drift, merge and batch report.
    pub report: Value,
    /// Loss tokens trained on (all epochs).
    pub loss_tokens_trained: u64,
    /// Tokens run through the model in training steps.
    pub tokens_trained: u64,
    /// How micro-batches were laid out: `packed` (`[train] packing`), `tokens_computed`
    /// (padding included) and `padding_tokens` (computed − trained: what the padded
    /// layout costs, or an empty micro-batch's one token when packed).
    pub packing: Value,
    /// Per-step metrics.
    pub steps: Vec<StepMetrics>,
    /// Mean importance ratio (trainer / inference) by policy lag (see
    /// `TrainResult::importance_by_lag`; the lag histogram of the calls is in `report`).
    pub importance_by_lag: Value,
    /// Time, device and memory.
    pub compute: Compute,
    /// The checkpoint written.
    pub checkpoint: Value,
    /// Distributed runs: world size, backend, and each rank's compute.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distributed: Option<Value>,
    /// The memory budget, the estimate, what the fit chose (`nn::memory::FitReport`)
    /// and the peak measured (`peak_measured_bytes`, from `peak_measured`: the
    /// process's peak RSS on CPU, the sampled GPU memory on CUDA).
    pub memory: Value,
    /// Where the run's metrics went (`crate::track`): directory, backends, failed
    /// writes; `null` on ranks other than 0.
    pub tracking: Option<Value>,
    /// The trainer's log-probs against the engine's on the loss tokens that have both
    /// (`crate::fidelity`); `null` without engine log-probs, and on ranks other than 0.
    pub fidelity: Option<crate::fidelity::Fidelity>,
}

impl RunManifest {
    /// Writes `dir/manifest.json` (through a temporary file and a rename).
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join("manifest.json.partial");
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, dir.join("manifest.json"))
    }
}

/// The chart of a run: reward, loss and gradient norm per step.
pub fn write_chart(path: &Path, title: &str, result: &TrainResult) -> std::io::Result<()> {
    let series = |name: &str, f: &dyn Fn(&StepMetrics) -> f64| Series {
        name: name.into(),
        points: result.steps.iter().map(|s| (s.step as f64, f(s))).collect(),
    };
    let panel = |title: &str, s: Vec<Series>| Panel {
        title: title.into(),
        x_label: "step".into(),
        series: s,
    };
    crate::chart::write_svg(
        path,
        title,
        &[
            panel("mean reward", vec![series("reward", &|s| s.reward_mean)]),
            panel("loss", vec![series("loss", &|s| s.loss)]),
            panel(
                "gradient norm (before clipping)",
                vec![series("grad norm", &|s| s.grad_norm)],
            ),
        ],
    )
}

/// CPU time of this process (user + system) in seconds, from `/proc/self/stat`.
pub fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may contain spaces) start after ") ".
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// Peak resident set size (`VmHWM`) in bytes.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// A name for the device: the CPU model, or the GPU's name from `nvidia-smi`.
pub fn device_name(device: tch::Device) -> String {
    match device {
        tch::Device::Cuda(n) => std::process::Command::new("nvidia-smi")
            .args([
                "--query-gpu=name",
                "--format=csv,noheader",
                "-i",
                &n.to_string(),
            ])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("cuda:{n}")),
        _ => std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("model name"))
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            })
            .map(|m| format!("{m} ({} threads)", tch::get_num_threads()))
            .unwrap_or_else(|| "cpu".into()),
    }
}

/// Samples the memory in use on a GPU every second with `nvidia-smi`, in a thread, and
/// keeps the maximum.
#[derive(Debug)]
pub struct GpuMemorySampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Option<u64>>>,
}

fn gpu_memory_used(index: usize) -> Option<u64> {
    nvidia_smi_mib("memory.used", index)
}

/// The memory of GPU `index` (`nvidia-smi`'s `memory.total`).
pub fn gpu_memory_total(index: usize) -> Option<u64> {
    nvidia_smi_mib("memory.total", index)
}

fn nvidia_smi_mib(query: &str, index: usize) -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            &format!("--query-gpu={query}"),
            "--format=csv,noheader,nounits",
            "-i",
            &index.to_string(),
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let mib: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    Some(mib << 20)
}

impl GpuMemorySampler {
    /// Starts sampling when `device` is a GPU.
    pub fn start(device: tch::Device) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = match device {
            tch::Device::Cuda(index) => {
                let stop = stop.clone();
                Some(std::thread::spawn(move || {
                    let mut peak = gpu_memory_used(index);
                    peak?;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_secs(1));
                        peak = peak.max(gpu_memory_used(index));
                    }
                    peak
                }))
            }
            _ => None,
        };
        GpuMemorySampler { stop, thread }
    }

    /// Stops sampling; the peak seen, if any.
    pub fn finish(mut self) -> Option<u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok().flatten())
    }
}
