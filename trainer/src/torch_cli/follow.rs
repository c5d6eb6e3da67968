//! `train --follow`: runs into `--out/000001`, `--out/000002`, ... each from the one before,
//! and what a restarted follower finishes of the run it finds on disk.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use serde_json::Value;
use tapline_trainer::ingest;

use crate::cli::*;

use super::train::{CursorCommit, Finished, PUBLISHED_FILE, committed, train_once};
use super::{stop_requested, watch_signals};

/// `train --follow`: runs into `--out/000001`, `--out/000002`, ... each continuing from
/// the one before.
///
/// A stop signal ends the run in progress after its current step and drops it (nothing
/// written, the cursor not advanced: the next start trains that batch again), then the
/// follower. What a stop at any other point leaves is picked up by the next start: a run directory
/// without a manifest is removed and trained again (the cursor was not advanced); a run
/// whose manifest was written but whose cursor was not (`cursor-commit.json` says both)
/// gets its cursor written; a run not published yet (no `published.json`) is published,
/// unless a newer run is. A publish that fails is retried at every poll, and given up
/// for a newer run's, which carries the same training on.
pub(super) fn follow(args: TrainArgs) -> anyhow::Result<()> {
    if !(args.poll_secs.is_finite() && args.poll_secs > 0.0) {
        anyhow::bail!(
            "--poll-secs {} is not a positive number of seconds",
            args.poll_secs
        );
    }
    anyhow::ensure!(
        !args.prepare.no_cursor,
        "--follow needs the run's cursor to know what was trained on: drop --no-cursor (with it every run would train on the same data again)"
    );
    watch_signals()?;
    let base = args.prepare.out.clone();
    std::fs::create_dir_all(&base).with_context(|| format!("create {}", base.display()))?;
    // Continue after the runs already in --out (a restarted follower).
    let mut previous: Option<(u64, PathBuf)> = std::fs::read_dir(&base)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n: u64 = e.file_name().to_str()?.parse().ok()?;
            e.path()
                .join("manifest.json")
                .is_file()
                .then(|| (n, e.path()))
        })
        .max();
    let mut unpublished: Option<Finished> = None;
    if let Some((_, dir)) = &previous {
        let location = tapline_proto::store::open_store(&args.prepare.store)?;
        finish_cursor_commit(&location, dir)?;
        let manifest = read_manifest(dir)?;
        let publish = run_config_publish(dir, &manifest)?;
        if publish.is_some() && !dir.join(PUBLISHED_FILE).is_file() {
            unpublished = Some(Finished {
                out: dir.clone(),
                location,
                publish,
                // Its publish joins the series the run was tracked in.
                track: tapline_trainer::track::TrackedRun::from_manifest(&manifest),
            });
        }
    }
    let try_publish = |unpublished: &mut Option<Finished>| {
        if let Some(done) = unpublished.as_ref() {
            match done.publish() {
                Ok(()) => *unpublished = None,
                Err(e) => eprintln!(
                    "train: {e:#}; retrying at the next poll (or when the follower starts again)"
                ),
            }
        }
    };
    loop {
        try_publish(&mut unpublished);
        if stop_requested() {
            println!("train: stopped");
            return Ok(());
        }
        let n = previous.as_ref().map_or(1, |(n, _)| n + 1);
        let mut run = args.clone();
        run.prepare.out = base.join(format!("{n:06}"));
        // One series for all the runs: their metrics in the --out root.
        run.series_dir = Some(base.clone());
        if let Some((_, dir)) = &previous {
            run.resume = Some(dir.clone());
            run.adapter = None;
            run.fresh_optimizer = false;
        }
        if run.prepare.out.exists() {
            // A run that stopped before its manifest: start it again.
            std::fs::remove_dir_all(&run.prepare.out)
                .with_context(|| format!("remove the unfinished {}", run.prepare.out.display()))?;
        }
        let trained = train_once(&run, args.min_episodes.or(Some(0)))?;
        let waited = trained.is_none();
        if let Some(done) = trained {
            previous = Some((n, done.out.clone()));
            // A newer run carries the unpublished one's training on: publish it instead.
            unpublished = Some(done);
            try_publish(&mut unpublished);
        }
        if stop_requested() {
            println!("train: stopped");
            return Ok(());
        }
        if waited || unpublished.is_some() {
            let until = Instant::now() + std::time::Duration::from_secs_f64(args.poll_secs);
            while Instant::now() < until && !stop_requested() {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// The manifest of the finished run in `dir`.
fn read_manifest(dir: &std::path::Path) -> anyhow::Result<Value> {
    let path = dir.join("manifest.json");
    serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("read {}", path.display()))?,
    )
    .with_context(|| format!("{} is not JSON", path.display()))
}

/// The `[publish]` section of the configuration a finished run recorded in its manifest.
fn run_config_publish(
    dir: &std::path::Path,
    manifest: &Value,
) -> anyhow::Result<Option<tapline_trainer::publish::PublishConfig>> {
    let path = dir.join("manifest.json");
    match manifest["config"].get("publish") {
        None | Some(Value::Null) => Ok(None),
        Some(p) => Ok(Some(serde_json::from_value(p.clone()).with_context(
            || format!("the [publish] section recorded in {}", path.display()),
        )?)),
    }
}

/// Writes the cursor a finished run in `dir` committed to, if the store still holds the
/// one it started from (the trainer stopped between its manifest and its cursor). A run
/// whose commit is already in the store (`cursor-committed.json`) is left alone,
/// whatever the cursor became since.
fn finish_cursor_commit(
    location: &tapline_proto::store::StoreLocation,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    let path = dir.join(CURSOR_COMMIT_FILE);
    let Ok(bytes) = std::fs::read(&path) else {
        return Ok(());
    };
    let commit: CursorCommit = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a cursor commit", path.display()))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let (now, version) = runtime.block_on(ingest::read_cursor_versioned(location, &commit.run))?;
    if now == commit.after {
        return committed(dir);
    }
    let moved = if now == commit.before {
        match runtime.block_on(ingest::write_cursor(
            location,
            &commit.run,
            &commit.after,
            &version,
        )) {
            Ok(_) => {
                println!(
                    "train: {} was finished but its cursor not written (stopped in between); wrote it now",
                    dir.display()
                );
                return committed(dir);
            }
            Err(e @ ingest::IngestError::CursorMoved { .. }) => e,
            Err(e) => return Err(e.into()),
        }
    } else {
        ingest::IngestError::CursorMoved {
            run: commit.run.clone(),
            key: ingest::cursor_key(location, &commit.run),
        }
    };
    // Another trainer advanced the cursor past what this directory was trained on: it
    // cannot be committed, nor continued from.
    mark_incomplete(dir, &moved.to_string())?;
    Err(anyhow::Error::new(moved).context(format!(
        "{} was trained but its cursor never written, and another trainer has moved the cursor since; it is marked incomplete: start again to continue from the run before it",
        dir.display()
    )))
}
