//! What the trainer writes for TensorBoard, read back by TensorBoard's own Python readers
//! (`tensorboard_check.py`, from `TAPLINE_PYTHON`'s venv): two runs of one series into
//! one directory, as `train --follow` writes them.

mod common;

use std::path::Path;

use serde_json::{Value, json};
use tapline_trainer::track::{Status, TrackOptions, Tracker};

fn read(dir: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tensorboard_check.py");
    let output = std::process::Command::new(common::python())
        .arg(&script)
        .arg(dir)
        .output()
        .expect("run tensorboard_check.py with TAPLINE_PYTHON");
    assert!(
        output.status.success(),
        "tensorboard_check.py:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn tensorboard_reads_two_runs_as_one_series() {
    let dir = tempfile::tempdir().unwrap();
    let options = TrackOptions {
        tensorboard: true,
        ..TrackOptions::default()
    };
    // Two runs, the second continuing the global steps of the first.
    for (run, first) in [(1u64, 0u64), (2, 2)] {
        let out = dir.path().join(format!("{run:06}"));
        let config = json!({"run": "demo", "train": {"lr": 0.5}, "note": "<script>x</script>"});
        let mut t = Tracker::open(&options, dir.path(), "demo", &out, first, &config);
        for step in first + 1..=first + 2 {
            t.step(
                step,
                &json!({"step": step, "loss": step as f64 / 10.0, "skipped": false,
                        "inference_logprob_gap": null}),
            );
        }
        t.summary(
            first + 2,
            &json!({"reward": {"mean": run as f64 / 4.0}}),
            &[("run/advantages", vec![-1.0, 0.0, 0.5, 1.0])],
        );
        t.finish(Status::Finished, None);
        assert_eq!(t.failures(), 0);
    }
    let got = read(dir.path());
    assert_eq!(got["files"], 2, "{got}");
    assert_eq!(got["versions"], json!(["brain.Event:2", "brain.Event:2"]));
    let loss = &got["scalars"]["train/loss"];
    let steps: Vec<u64> = loss
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4], "one series: {got}");
    assert!((loss[3][1].as_f64().unwrap() - 0.4).abs() < 1e-6);
    assert_eq!(got["scalars"]["train/skipped"][0][1], 0.0);
    assert!(
        got["scalars"].get("train/inference_logprob_gap").is_none(),
        "a null is no point"
    );
    assert!(got["scalars"].get("train/step").is_none());
    assert_eq!(
        got["scalars"]["run/reward/mean"],
        json!([[2, 0.25], [4, 0.5]])
    );
    let h = &got["histograms"]["run/advantages"];
    assert_eq!(h.as_array().unwrap().len(), 2);
    assert_eq!(h[0]["num"], 4.0);
    assert_eq!(h[0]["counts"], 4.0);
    assert_eq!(
        (h[0]["min"].as_f64(), h[0]["max"].as_f64()),
        (Some(-1.0), Some(1.0))
    );
    let config = &got["text"]["config"];
    assert_eq!(config[1][0], 2, "each run's config at its first step");
    let text = config[0][1].as_str().unwrap();
    assert!(text.contains("lr = 0.5"), "{text}");
    assert_eq!(got["plugins"]["config"], "text");
    // metrics.jsonl beside the event files holds the same steps.
    let jsonl = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps = jsonl
        .lines()
        .filter(|l| l.contains("\"event\":\"step\""))
        .count();
    assert_eq!(steps, 4);
}
