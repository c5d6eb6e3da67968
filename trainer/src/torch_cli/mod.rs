//! The commands of `tapline-trainer` that need libtorch (the `torch` feature): `train`
//! (once, or `--follow`), `score`, `merge-lora` and `bench-update`. The arguments and
//! the torch-free commands are in `main.rs`.
//!
//! One module per command: `train` (and its `--follow` loop in `follow`), `score`,
//! `merge-lora`, `bench-update`; the stop signal that `train` and `--follow` watch is here.

mod bench;
mod follow;
mod merge;
mod score;
mod train;

pub(super) use bench::bench_update;
pub(super) use merge::merge_lora;
pub(super) use score::score;
pub(super) use train::train;

/// SIGTERM / Ctrl-C seen (`train --follow`).
static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn stop_requested() -> bool {
    STOP.load(std::sync::atomic::Ordering::SeqCst)
}

/// Sets [`STOP`] on SIGTERM or SIGINT, from a thread of its own.
fn watch_signals() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::spawn(move || {
        runtime.block_on(async {
            let Ok(mut term) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            else {
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            eprintln!(
                "train: stop requested; a run in progress stops after its current step and is dropped (trained again on the next start; signal again to exit at once)"
            );
            STOP.store(true, std::sync::atomic::Ordering::SeqCst);
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            // Safe at any point: a run directory without its manifest is removed on
            // restart, the manifest and the cursor are each replaced whole, and a claimed
            // version that never went live is skipped.
            eprintln!("train: second stop signal; exiting now");
            std::process::exit(130);
        });
    });
    Ok(())
}
