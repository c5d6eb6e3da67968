//! Tunes glibc's malloc so that what a call's capture held goes back to the system when
//! the call is done, and the resident set follows the memory budget.
//!
//! glibc serves a block of more than `M_MMAP_THRESHOLD` bytes (128 KiB at start) with its
//! own mapping and unmaps it when freed, but raises the threshold to the size of each
//! such block freed, up to 32 MiB. After the first capture-size call, then, bodies up to
//! 32 MiB come from the heap arenas (one per thread that allocates, up to eight per
//! core), and a freed 20 MiB buffer stays resident while anything above it in its arena
//! is live. Under a soak with a capture-cap call every two seconds the sidecar's RSS
//! climbed to 343 MiB under a 160 MiB budget that way (BENCHMARKS.md, "Sidecar: soak").
//! A fixed threshold turns the adjustment off: every large body is mapped on its own and
//! returned when freed (`realloc` of a mapped block is `mremap`, no copy), and the heap
//! keeps only small objects. Fewer arenas keep what the heap holds from being multiplied
//! by the number of threads: the request path is one event loop, and the other threads
//! (spool writer, segment builder, blocking pool) allocate little but often.
//!
//! glibc reads these settings from its environment when a process starts
//! (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_ARENA_MAX`, see mallopt(3)), and this workspace
//! has no `unsafe` to call `mallopt`, so [`tune`] execs the binary once more with them
//! set: same process id, same arguments, before any thread starts (the trainer does
//! the same for its update step). A value already in the environment is kept.

/// glibc's variable for the fixed mmap threshold.
pub const MMAP_THRESHOLD_VAR: &str = "MALLOC_MMAP_THRESHOLD_";

/// glibc's variable for the most malloc arenas.
pub const ARENA_MAX_VAR: &str = "MALLOC_ARENA_MAX";

/// The mmap threshold set: bodies above it get their own mapping.
pub const MMAP_THRESHOLD: u32 = 256 << 10;

/// The most malloc arenas.
pub const ARENA_MAX: u32 = 2;

/// Execs this binary again with the mmap threshold and the arena limit in its
/// environment, unless both are there already; returns only then, or when the exec
/// failed (with a warning on stderr: the sidecar runs, its memory may exceed the
/// budget). Call it first in `main`. A no-op where malloc is not glibc's.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt as _;
        let missing = |var: &str| std::env::var_os(var).is_none();
        if !missing(MMAP_THRESHOLD_VAR) && !missing(ARENA_MAX_VAR) {
            return;
        }
        let mut args = std::env::args_os();
        let arg0 = args.next().unwrap_or_default();
        let exe = match std::env::current_exe() {
            Ok(exe) => exe,
            Err(error) => return untuned("find its own binary", &error),
        };
        let mut command = std::process::Command::new(exe);
        command.arg0(arg0).args(args);
        if missing(MMAP_THRESHOLD_VAR) {
            command.env(MMAP_THRESHOLD_VAR, MMAP_THRESHOLD.to_string());
        }
        if missing(ARENA_MAX_VAR) {
            command.env(ARENA_MAX_VAR, ARENA_MAX.to_string());
        }
        let error = command.exec();
        untuned("restart itself", &error);
    }
}

/// Warns that the sidecar runs with glibc's defaults: it could not `what`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn untuned(what: &str, error: &std::io::Error) {
    eprintln!(
        "tapline-sidecar: warning: cannot {what} to run with {MMAP_THRESHOLD_VAR} and {ARENA_MAX_VAR} set ({error}); freed bodies may stay resident beyond the memory budget (set both in the environment)"
    );
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Set in the child process that runs the measurement alone.
    const CHILD: &str = "TAPLINE_MALLOC_TEST_CHILD";

    fn rss() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            << 10
    }

    /// With the threshold fixed, freed capture-size bodies go back to the system even
    /// after an earlier one was freed (which, untuned, raises the threshold past them
    /// and keeps them in the heap). Measured in a child process started with the
    /// settings [`tune`] gives, running only this test, so that no other test's memory
    /// moves the resident set. (`TAPLINE_MALLOC_TEST_CHILD=untuned cargo test -p
    /// tapline-sidecar --lib freed_large -- --nocapture` measures glibc's defaults:
    /// the freed bodies stay.)
    #[test]
    fn freed_large_bodies_leave_the_resident_set() {
        let Some(mode) = std::env::var_os(CHILD) else {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "malloc::tests::freed_large_bodies_leave_the_resident_set",
                ])
                .args(["--nocapture", "--test-threads=1"])
                .env(CHILD, "tuned")
                .env(MMAP_THRESHOLD_VAR, MMAP_THRESHOLD.to_string())
                .env(ARENA_MAX_VAR, ARENA_MAX.to_string())
                .output()
                .unwrap();
            let log = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "the measuring child failed:\n{log}");
            assert!(log.contains("1 passed"), "the child ran no test:\n{log}");
            return;
        };
        // One freed block raises an untuned threshold to 20 MiB.
        drop(std::hint::black_box(vec![1u8; 20 << 20]));
        let before = rss();
        let mut bodies = Vec::new();
        for _ in 0..4 {
            // Grown as a capture grows, by doubling.
            let mut body = Vec::new();
            for _ in 0..(16 << 10) {
                body.extend_from_slice(&[7u8; 1024]);
            }
            bodies.push(std::hint::black_box(body));
        }
        // A small live object after them keeps the heap's top from being trimmed.
        let pinned = std::hint::black_box(vec![0u8; 1024]);
        let held = rss();
        drop(bodies);
        let after = rss();
        drop(pinned);
        println!(
            "{mode:?}: RSS {} MiB before the bodies, {} MiB holding them, {} MiB after",
            before >> 20,
            held >> 20,
            after >> 20
        );
        assert!(
            held >= before + (60 << 20),
            "the bodies are resident while held"
        );
        assert!(
            after < before + (8 << 20),
            "64 MiB of freed bodies stayed resident: RSS {} MiB before them, {} MiB after",
            before >> 20,
            after >> 20
        );
    }
}
