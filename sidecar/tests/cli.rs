//! The binary's own surface: `--version` names the commit, `--log-format json` (or
//! `TAPLINE_LOG_FORMAT=json`) writes one JSON object per log line.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn sidecar() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tapline-sidecar"))
}

/// `NAME 0.1.0 (commit 0123456789ab)`, with 12 hex digits or `unknown` outside git.
fn check_version(name: &str, out: &str) {
    let rest = out
        .trim()
        .strip_prefix(&format!("{name} {} (commit ", env!("CARGO_PKG_VERSION")))
        .unwrap_or_else(|| panic!("{out:?}"));
    let commit = rest.strip_suffix(')').unwrap_or_else(|| panic!("{out:?}"));
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{out:?}"
    );
}

#[test]
fn version_names_the_commit() {
    let out = sidecar().arg("--version").output().unwrap();
    assert!(out.status.success());
    check_version("tapline-sidecar", &String::from_utf8_lossy(&out.stdout));
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until the sidecar started as `child` serves its own health on `port`
/// (not merely until something accepts there: a port from `free_port` can be
/// taken by a sidecar another test started at the same time).
fn wait_serving(child: &mut std::process::Child, port: u16, sidecar_id: &str) {
    use std::io::Write;
    let deadline = Instant::now() + Duration::from_secs(20);
    let want = format!("\"sidecar_id\":\"{sidecar_id}\"");
    loop {
        assert!(Instant::now() < deadline, "the sidecar did not start");
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the sidecar exited before serving: {status}");
        }
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = write!(
                s,
                "GET /tapline/v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            );
            let mut reply = String::new();
            let _ = s.read_to_string(&mut reply);
            if reply.replace(' ', "").contains(&want) {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Starts the sidecar, waits until it serves, stops it with SIGTERM; returns stderr.
/// `tapline-sidecar serve` on `port` as `id`, recording under `dir`, its upstream a
/// port nothing listens on.
fn serve_command(dir: &std::path::Path, port: u16, id: &str) -> Command {
    let mut cmd = sidecar();
    cmd.args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--upstream", "http://127.0.0.1:9", "--sidecar-id", id])
        .arg("--store")
        .arg(dir.join("store"))
        .arg("--spool-dir")
        .arg(dir.join("spool"));
    cmd
}

fn run_and_stop(configure: impl FnOnce(&mut Command)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut cmd = serve_command(dir.path(), port, "logs");
    cmd.args(["--drain-secs", "1", "--header-read-timeout-secs", "0.5"])
        .env("TAPLINE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    configure(&mut cmd);
    let mut child = cmd.spawn().unwrap();
    wait_serving(&mut child, port, "logs");
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "{status}: {stderr}");
    stderr
}

fn check_json_lines(stderr: &str) {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "start and stop are logged: {stderr}");
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        for key in ["timestamp", "level", "target", "message"] {
            assert!(v.get(key).is_some(), "{key} missing in {line}");
        }
    }
}

#[test]
fn log_format_json_writes_one_object_per_line() {
    check_json_lines(&run_and_stop(|c| {
        c.args(["--log-format", "json"]);
    }));
    check_json_lines(&run_and_stop(|c| {
        c.env("TAPLINE_LOG_FORMAT", "json");
    }));
    // Text stays the default, and a wrong value names the right ones.
    let text = run_and_stop(|_| {});
    assert!(serde_json::from_str::<serde_json::Value>(text.lines().next().unwrap()).is_err());
    let out = sidecar().args(["--log-format", "xml"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("text") && err.contains("json"), "{err}");
}

/// The soft and hard "Max open files" of a running process.
fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let mut fields = line["Max open files".len()..].split_whitespace();
    (
        fields.next().unwrap().to_owned(),
        fields.next().unwrap().to_owned(),
    )
}

#[test]
fn the_soft_open_files_limit_is_raised_and_too_many_connections_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hard: u64 = {
        let out = Command::new("sh")
            .args(["-c", "ulimit -Hn"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(u64::MAX)
    };
    let bin = env!("CARGO_BIN_EXE_tapline-sidecar");
    let common = |port: u16| {
        format!(
            "--listen 127.0.0.1:{port} --upstream http://127.0.0.1:9 --sidecar-id fds \
             --store {d}/store --spool-dir {d}/spool",
            d = dir.path().display()
        )
    };
    if hard >= 1024 {
        // Soft 256, hard as it is: the sidecar raises soft to hard and serves 300
        // connections, which need more than 256.
        let port = free_port();
        let mut child = Command::new("sh")
            .args([
                "-c",
                &format!(
                    "ulimit -Sn 256 && exec {bin} {} --max-connections 300",
                    common(port)
                ),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_serving(&mut child, port, "fds");
        let (soft, hard_seen) = open_files_limits(child.id());
        assert_eq!(soft, hard_seen, "soft raised to hard");
        assert_eq!(hard_seen, hard.to_string());
        let _ = child.kill();
        let _ = child.wait();
    }
    // Hard 512: 1024 connections cannot fit; the sidecar says so and does not start.
    let out = Command::new("sh")
        .args([
            "-c",
            &format!(
                "ulimit -n 512 && exec {bin} {} --max-connections 1024",
                common(free_port())
            ),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("max-connections")
            && err.contains("may open only 512")
            && err.contains("at most 128"),
        "{err}"
    );
}

/// The `NAME=value` entries of a running process's environment.
fn environment(pid: u32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    raw.split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .collect()
}

/// The sidecar restarts itself (same process id) with glibc's mmap threshold fixed and
/// two arenas, so that a freed capture leaves the resident set (src/malloc.rs); a value
/// set in the environment is kept, and the arguments survive the restart.
#[test]
fn the_sidecar_runs_with_malloc_tuned_and_keeps_a_value_it_was_given() {
    for (given, threshold, arenas) in [
        (None, "262144", "2"),
        (Some(("MALLOC_ARENA_MAX", "3")), "262144", "3"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut cmd = serve_command(dir.path(), port, "malloc");
        cmd.env_remove("MALLOC_MMAP_THRESHOLD_")
            .env_remove("MALLOC_ARENA_MAX")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((name, value)) = given {
            cmd.env(name, value);
        }
        let mut child = cmd.spawn().unwrap();
        // Serving on the port it was given, under the id it was given: the arguments
        // came through the restart.
        wait_serving(&mut child, port, "malloc");
        let env = environment(child.id());
        assert!(
            env.contains(&format!("MALLOC_MMAP_THRESHOLD_={threshold}")),
            "{env:?}"
        );
        assert!(
            env.contains(&format!("MALLOC_ARENA_MAX={arenas}")),
            "{env:?}"
        );
        let _ = child.kill();
        let _ = child.wait();
    }
}
