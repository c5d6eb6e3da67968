//! `tapline-trainer train` on two ranks (Gloo on this CPU), started by the real
//! `torchrun` of the test venv or by hand with the PyTorchJob variables, against one
//! process on the same data: the same checkpoint (fp32, max |Δw| ≤ 1e-5) with the
//! sharded and the replicated optimizer, with LoRA, with an odd number of
//! micro-batches; a two-rank state resumed on one rank; a rank killed mid-run.
//!
//! The model is a tiny random Llama with SmolLM2's vocabulary and tokenizer (made by
//! transformers), so each run takes seconds.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::cli::trainer;
use common::reference::tiny;
use serde_json::Value;
use tapline_proto::store::open_store;
use tapline_trainer::nn::weights::Checkpoint;

const T0: i64 = 1_780_000_000_000_000_000;

fn torchrun() -> PathBuf {
    let python = common::python();
    let bin = python.parent().unwrap().join("torchrun");
    assert!(
        bin.is_file(),
        "no torchrun beside {} (torch is in the test venv)",
        python.display()
    );
    bin
}

fn model() -> tempfile::TempDir {
    let smol = common::smollm2();
    tiny(
        "llama",
        17,
        &["--tie", "--tokenizer-from", smol.to_str().unwrap()],
    )
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// `train` arguments shared by every run: small micro-batches, so a mini-batch of four
/// episodes has several (three or more: one rank gets fewer).
fn train_args(store: &str, run: &str, model: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let now = ((T0 / 1_000_000_000) + 600).to_string();
    let mut args: Vec<String> = vec![
        "train".into(),
        "--store".into(),
        store.into(),
        "--run".into(),
        run.into(),
    ];
    args.extend([
        "--model".into(),
        model.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ]);
    for a in [
        "--lr",
        "1e-4",
        "--now-unix-secs",
        &now,
        "--mini-batch-episodes",
        "3",
    ] {
        args.push(a.into());
    }
    for a in ["--max-seq-len", "128", "--micro-batch-tokens", "128"] {
        args.push(a.into());
    }
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

fn single(args: &[String]) -> String {
    let out = trainer()
        .args(args)
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "train failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn two_ranks(args: &[String]) -> String {
    let out = Command::new(torchrun())
        // `--` ends torchrun's own options: its parser would take `--run` for an
        // abbreviation of its `--run-path`.
        .args(["--nproc-per-node", "2", "--no-python", "--"])
        .arg(env!("CARGO_BIN_EXE_tapline-trainer"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "torchrun failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Largest |a − b| over every tensor of two safetensors files (same names and shapes).
fn max_diff(a: &Path, b: &Path) -> f64 {
    max_diff_of(a, b, |_| true)
}

/// [`max_diff`] over the tensors whose name passes `keep`.
fn max_diff_of(a: &Path, b: &Path, keep: impl Fn(&str) -> bool) -> f64 {
    diff_of(a, b, keep, f64::INFINITY).0
}

/// Largest |a − b| over the tensors whose name passes `keep`, and the fraction of
/// their elements with |a − b| above `over`.
fn diff_of(a: &Path, b: &Path, keep: impl Fn(&str) -> bool, over: f64) -> (f64, f64) {
    let (a, b) = (
        Checkpoint::open_file(a).unwrap(),
        Checkpoint::open_file(b).unwrap(),
    );
    let mut names: Vec<String> = a.names().map(str::to_owned).collect();
    names.sort();
    let theirs: Vec<String> = {
        let mut n: Vec<String> = b.names().map(str::to_owned).collect();
        n.sort();
        n
    };
    assert_eq!(names, theirs);
    let (mut worst, mut above, mut elements) = (0.0f64, 0i64, 0i64);
    for name in names.into_iter().filter(|n| keep(n)) {
        let shape = a.shape(&name).unwrap().to_vec();
        let load = |c: &Checkpoint| {
            c.load(&name, &shape, tch::Kind::Float, tch::Device::Cpu)
                .unwrap()
        };
        let d = (load(&a) - load(&b)).abs();
        worst = worst.max(d.max().double_value(&[]));
        above += d.gt(over).sum(tch::Kind::Int64).int64_value(&[]);
        elements += d.numel() as i64;
    }
    (worst, above as f64 / elements.max(1) as f64)
}

async fn store_with(batches: &[&str]) -> (tempfile::TempDir, String) {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("store").display());
    let store = open_store(&url).unwrap();
    for (i, prefix) in batches.iter().enumerate() {
        common::traces::two_tasks(&format!("sc-{i}"), prefix, T0)
            .write(&store, 9)
            .await;
    }
    (tmp, url)
}

fn cursor_exists(store_dir: &Path, run: &str) -> bool {
    store_dir
        .join("trainer/runs")
        .join(run)
        .join("cursor.json")
        .is_file()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_give_the_checkpoint_of_one_process() {
    let model = model();
    let (tmp, store) = store_with(&[""]).await;
    let lora_config = tmp.path().join("lora.toml");
    std::fs::write(
        &lora_config,
        "[train.lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n",
    )
    .unwrap();
    let lora = ["--config", lora_config.to_str().unwrap()];
    let replicated_config = tmp.path().join("replicated.toml");
    std::fs::write(&replicated_config, "[train]\nshard_optimizer = false\n").unwrap();
    let replicated = ["--config", replicated_config.to_str().unwrap()];
    let bf16 = ["--dtype", "bfloat16"];
    // bf16 weights: the fp32 masters agree as fp32 weights do; a master a hair from a
    // rounding boundary may round to the neighbouring bf16 value (2^-8 relative).
    for (name, extra, weights, tolerance) in [
        ("sharded", &[][..], "model.safetensors", 1e-5),
        ("replicated", &replicated[..], "model.safetensors", 1e-5),
        ("lora", &lora[..], "adapter_model.safetensors", 1e-5),
        ("bf16", &bf16[..], "model.safetensors", 2e-3),
    ] {
        let one = tmp.path().join(format!("{name}-one"));
        let two = tmp.path().join(format!("{name}-two"));
        single(&train_args(
            &store,
            &format!("{name}-one"),
            model.path(),
            &one,
            extra,
        ));
        let stdout = two_ranks(&train_args(
            &store,
            &format!("{name}-two"),
            model.path(),
            &two,
            extra,
        ));
        assert!(
            stdout.contains("rank 1 of 2 finished its steps"),
            "{name}: {stdout}"
        );
        let d = max_diff(&one.join(weights), &two.join(weights));
        println!("{name}: max |Δw| {d:.2e} between one process and two ranks");
        assert!(d <= tolerance, "{name}: max |Δw| {d}");
        // The weights moved (the comparison is not between two untouched copies).
        if name != "lora" {
            let moved = max_diff(&model.path().join("model.safetensors"), &two.join(weights));
            assert!(moved > 5e-5, "{name}: the run changed nothing ({moved})");
        }
        // The optimizer state, gathered into the single-process format.
        let state = |keep: &dyn Fn(&str) -> bool, over| {
            diff_of(
                &one.join("optimizer.safetensors"),
                &two.join("optimizer.safetensors"),
                keep,
                over,
            )
        };
        // bf16 forward passes after the first step run on weights a rounding apart.
        let metric_tolerance = if name == "bf16" { 1e-2 } else { 1e-4 };
        if name == "bf16" {
            // With bf16 weights the gradients themselves are bf16, summed in another
            // order: an element whose gradient is near zero can take Adam's step
            // (about lr) the other way, so one master may end up to 2·lr·steps away
            // (6e-4 here; 5.0e-5 on an Intel machine with AMX, 1.3e-4 on an AMD
            // EPYC). A rank that skipped or misplaced its shard moves half the
            // elements by up to lr·steps: the check is on how many elements differ
            // by more than a tenth of one step, not on the worst one.
            let steps = read_json(&one.join("manifest.json"))["steps"]
                .as_array()
                .map_or(0, Vec::len) as f64;
            let (worst, above) = state(&|n| n.ends_with(".master"), 1e-5);
            println!(
                "bf16: fp32 masters max |Δ| {worst:.2e}, {:.3}% of elements over 1e-5",
                above * 100.0
            );
            assert!(
                worst <= 2.0 * 1e-4 * steps,
                "bf16: a master differs by {worst}: more than two Adam steps' worth per step"
            );
            assert!(
                above <= 0.01,
                "bf16: {:.2}% of the fp32 masters differ by more than 1e-5",
                above * 100.0
            );
        } else {
            let (s, _) = state(&|_| true, f64::INFINITY);
            assert!(s <= 1e-5, "{name}: optimizer state differs by {s}");
        }

        let (m1, m2) = (
            read_json(&one.join("manifest.json")),
            read_json(&two.join("manifest.json")),
        );
        assert_eq!(m1["distributed"], Value::Null);
        let d = &m2["distributed"];
        assert_eq!(d["world_size"], 2, "{name}: {d}");
        assert_eq!(d["backend"], "gloo");
        assert_eq!(d["shard_optimizer"], name != "replicated");
        let ranks = d["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2);
        let steps = m1["steps"].as_array().unwrap();
        assert_eq!(steps.len(), m2["steps"].as_array().unwrap().len());
        for (a, b) in steps.iter().zip(m2["steps"].as_array().unwrap()) {
            for key in ["loss", "grad_norm", "entropy"] {
                let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
                assert!(
                    (x - y).abs() <= metric_tolerance * x.abs().max(1.0),
                    "{name} {key}: {x} vs {y}"
                );
            }
            assert_eq!(a["tokens"], b["tokens"]);
            assert_eq!(a["loss_tokens"], b["loss_tokens"]);
            assert!(b["comm"]["bytes"].as_u64().unwrap() > 0);
        }
        // An odd number of micro-batches: the ranks ran different counts, all of them.
        let counts: Vec<u64> = ranks
            .iter()
            .map(|r| r["micro_batches"].as_u64().unwrap())
            .collect();
        let micro = m1["report"]["batches"]["micro_batches"].as_u64();
        if let Some(total) = micro {
            assert_eq!(counts.iter().sum::<u64>(), total, "{name}: {counts:?}");
        }
        assert_ne!(
            counts[0], counts[1],
            "{name}: {counts:?} (the test wants an odd count)"
        );
        let bytes: Vec<u64> = ranks
            .iter()
            .map(|r| r["optimizer_state_bytes"].as_u64().unwrap())
            .collect();
        let whole = m1["compute"]["optimizer_state_bytes"].as_u64().unwrap();
        if name == "replicated" {
            assert_eq!(bytes, vec![whole, whole]);
        } else {
            let ratio = bytes[0] as f64 / whole as f64;
            println!(
                "{name}: optimizer bytes per rank {bytes:?} at world size 2, {whole} at 1 ({ratio:.3})"
            );
            assert!(
                (0.49..=0.51).contains(&ratio),
                "{name}: {bytes:?} vs {whole}"
            );
        }
        assert!(cursor_exists(
            &tmp.path().join("store"),
            &format!("{name}-two")
        ));
        // The report's trainer log-probs: every rank's micro-batches, gathered on rank 0,
        // the same as one process computed.
        let trainer_logprobs = |dir: &Path| -> Vec<Option<f64>> {
            let samples = read_json(&dir.join("samples.json"));
            samples["samples"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|s| s["tokens"].as_array().unwrap().clone())
                .filter(|t| t["loss"] == true)
                .map(|t| t["trainer_logprob"].as_f64())
                .collect()
        };
        let (a, b) = (trainer_logprobs(&one), trainer_logprobs(&two));
        assert!(
            !a.is_empty() && a.len() == b.len(),
            "{name}: {} vs {}",
            a.len(),
            b.len()
        );
        assert!(
            b.iter().all(Option::is_some),
            "{name}: loss tokens without a trainer log-prob in the two-rank report"
        );
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x.unwrap() - y.unwrap()).abs())
            .fold(0.0, f64::max);
        // The same weights before the first update: bf16 forward passes agree to bf16.
        let lp_tolerance = if name == "bf16" { 2e-2 } else { 1e-4 };
        assert!(
            worst <= lp_tolerance,
            "{name}: trainer log-probs differ by {worst}"
        );
    }
    // Two ranks of packed micro-batches (the default) end where one process of padded
    // ones does, and the manifests count what each layout computed.
    let padded_config = tmp.path().join("padded.toml");
    std::fs::write(&padded_config, "[train]\npacking = false\n").unwrap();
    let padded = tmp.path().join("padded-one");
    single(&train_args(
        &store,
        "padded-one",
        model.path(),
        &padded,
        &["--config", padded_config.to_str().unwrap()],
    ));
    let packed = tmp.path().join("sharded-two");
    let d = max_diff(
        &padded.join("model.safetensors"),
        &packed.join("model.safetensors"),
    );
    println!("padded on one process vs packed on two ranks: max |Δw| {d:.2e}");
    assert!(d <= 1e-5, "padded vs packed: max |Δw| {d}");
    let (m_padded, m_packed) = (
        read_json(&padded.join("manifest.json")),
        read_json(&packed.join("manifest.json")),
    );
    assert_eq!(m_packed["packing"]["packed"], true);
    assert_eq!(
        m_packed["packing"]["padding_tokens"], 0,
        "{}",
        m_packed["packing"]
    );
    assert_eq!(m_padded["packing"]["packed"], false);
    assert!(
        m_padded["packing"]["padding_tokens"].as_u64().unwrap() > 0,
        "{}",
        m_padded["packing"]
    );
    assert_eq!(m_padded["tokens_trained"], m_packed["tokens_trained"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_rank_state_resumes_on_one_rank() {
    let model = model();
    let (tmp, store) = store_with(&["a-"]).await;
    let (a1, a2, b1, b2) = (
        tmp.path().join("a1"),
        tmp.path().join("a2"),
        tmp.path().join("b1"),
        tmp.path().join("b2"),
    );
    two_ranks(&train_args(&store, "a", model.path(), &a1, &[]));
    single(&train_args(&store, "b", model.path(), &b1, &[]));
    // A second batch lands; both continue on one process from their first run.
    let s = open_store(&store).unwrap();
    common::traces::two_tasks("sc-late", "b-", T0 + 60_000_000_000)
        .write(&s, 9)
        .await;
    let a1s = a1.to_str().unwrap().to_owned();
    let b1s = b1.to_str().unwrap().to_owned();
    let out = single(&train_args(
        &store,
        "a",
        model.path(),
        &a2,
        &["--resume", &a1s],
    ));
    assert!(out.contains("optimizer state resumed from"), "{out}");
    single(&train_args(
        &store,
        "b",
        model.path(),
        &b2,
        &["--resume", &b1s],
    ));
    let m = read_json(&a2.join("manifest.json"));
    assert_eq!(m["resumed"]["optimizer_step"], 3, "{}", m["resumed"]);
    let d = max_diff(&a2.join("model.safetensors"), &b2.join("model.safetensors"));
    assert!(d <= 1e-5, "max |Δw| {d}");
}

/// Rank 1 is killed (SIGKILL) during the run: rank 0 exits non-zero within the timeout,
/// with no manifest and the cursor not written. The ranks are started by hand with the
/// PyTorchJob variables (rank 0 serves the store), not by torchrun.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_rank_fails_the_run_and_writes_nothing() {
    let model = model();
    let (tmp, store) = store_with(&["", "x-"]).await;
    let out = tmp.path().join("dead");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // Three steps: rank 1 dies during the second.
    let args = train_args(
        &store,
        "dead",
        model.path(),
        &out,
        &["--dist-timeout-secs", "20"],
    );
    let start = |rank: usize| {
        trainer()
            .args(&args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut rank0 = start(0);
    let mut rank1 = start(1);
    // Wait for rank 0's first step, then kill rank 1.
    let stdout = rank0.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead as _;
        let mut lines = Vec::new();
        let mut killed = None;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if killed.is_none() && line.starts_with("step 1/") {
                let _ = rank1.kill();
                killed = Some(std::time::Instant::now());
            }
            lines.push(line);
        }
        let _ = rank1.kill();
        let _ = rank1.wait();
        (lines, killed)
    });
    let status = rank0.wait().unwrap();
    let exited = std::time::Instant::now();
    let (lines, killed) = reader.join().unwrap();
    let mut stderr = String::new();
    use std::io::Read as _;
    rank0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let killed =
        killed.unwrap_or_else(|| panic!("rank 0 never reported a step: {lines:?}\n{stderr}"));
    assert!(
        !status.success(),
        "rank 0 succeeded without its peer: {lines:?}"
    );
    // Within the 20 s timeout (a closed connection usually fails the next collective
    // at once).
    let after = exited - killed;
    println!("rank 0 exited {after:?} after rank 1 was killed");
    assert!(after < std::time::Duration::from_secs(25), "{after:?}");
    assert!(stderr.contains("failed on rank 0 of 2"), "{stderr}");
    assert!(!out.join("manifest.json").exists());
    assert!(!cursor_exists(&tmp.path().join("store"), "dead"));
}
