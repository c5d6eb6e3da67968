//! `cargo xtask bench-gateway`: the sidecar beside nginx, measured with wrk, as an
//! operator would compare it with a gateway. nginx (one worker) serves a 400-byte chat
//! completion; wrk posts to it directly, through nginx as a reverse proxy (a C proxy
//! that records nothing: the ceiling on this machine), and through the release
//! sidecar (and, with `--baseline PATH`, another sidecar build), one after the other,
//! `--rounds` times. Prints every run, then the medians: p50 at 1 connection and the
//! p50 added over direct, requests/s at 64 connections and their ratio to direct.
//!
//! Needs `nginx` and `wrk` on PATH (Debian: `apt-get install nginx-light wrk`); not
//! part of `cargo xtask test`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

const ANSWER: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello there, this is a short answer from the upstream, about as long as a short tool reply"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":12,"total_tokens":22}}"#;

pub fn bench_gateway(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let rounds: usize = flag("--rounds").map_or(Ok(3), |v| v.parse())?;
    let secs: u64 = flag("--secs").map_or(Ok(5), |v| v.parse())?;
    for tool in ["nginx", "wrk"] {
        if Command::new(tool)
            .arg("-v")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            bail!("bench-gateway needs {tool} on PATH (Debian: apt-get install nginx-light wrk)");
        }
    }
    super::run(Command::new("cargo").current_dir(root).args([
        "build",
        "--release",
        "-p",
        "tapline-sidecar",
        "--bin",
        "tapline-sidecar",
    ]))?;
    let mut sidecars = vec![(
        "sidecar".to_owned(),
        root.join("target/release/tapline-sidecar"),
    )];
    if let Some(baseline) = flag("--baseline") {
        sidecars.push(("baseline".to_owned(), PathBuf::from(baseline)));
    }

    let work = root.join("target/bench-gateway");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let dir = Dir(work);
    let (origin, proxy, listen) = (free_port()?, free_port()?, free_port()?);
    std::fs::create_dir_all(dir.path().join("logs"))?;
    std::fs::write(
        dir.path().join("nginx.conf"),
        format!(
            "worker_processes 1;\npid {pid};\nerror_log {dir}/logs/error.log warn;\nevents {{ worker_connections 4096; }}\nhttp {{\n  access_log off;\n  keepalive_requests 1000000;\n  upstream origin {{ server 127.0.0.1:{origin}; keepalive 128; }}\n  server {{ listen 127.0.0.1:{proxy}; location / {{ proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }}\n  server {{ listen 127.0.0.1:{origin}; location / {{ default_type application/json; return 200 '{ANSWER}'; }} }}\n}}\n",
            pid = dir.path().join("nginx.pid").display(),
            dir = dir.path().display(),
        ),
    )?;
    std::fs::write(
        dir.path().join("post.lua"),
        "wrk.method = \"POST\"\nwrk.body = '{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\nwrk.headers[\"Content-Type\"] = \"application/json\"\n",
    )?;
    let nginx = Command::new("nginx")
        .arg("-c")
        .arg(dir.path().join("nginx.conf"))
        .arg("-p")
        .arg(dir.path())
        .args(["-g", "daemon off;"])
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot start nginx")?;
    let _nginx = Stop(nginx);
    wait_port(origin)?;
    wait_port(proxy)?;

    let lua = dir.path().join("post.lua");
    let wrk = |port: u16, conns: u32| -> anyhow::Result<(f64, f64)> {
        let out = Command::new("wrk")
            .args(["-t", if conns == 1 { "1" } else { "2" }])
            .args([
                "-c",
                &conns.to_string(),
                "-d",
                &format!("{secs}s"),
                "--latency",
            ])
            .arg("-s")
            .arg(&lua)
            .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .output()
            .context("cannot run wrk")?;
        parse_wrk(&String::from_utf8_lossy(&out.stdout))
    };
    // Name -> (p50 µs at 1 connection, req/s at 64), one entry per round.
    let mut runs: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut record = |name: &str, p50: f64, rps: f64| {
        println!("{name:>16}: 1 connection p50 {p50:.0} µs, 64 connections {rps:.0} req/s");
        match runs.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => v.push((p50, rps)),
            None => runs.push((name.to_owned(), vec![(p50, rps)])),
        }
    };
    for round in 1..=rounds {
        println!("round {round} of {rounds}");
        for (name, port) in [("direct", origin), ("nginx proxy", proxy)] {
            let (p50, _) = wrk(port, 1)?;
            let (_, rps) = wrk(port, 64)?;
            record(name, p50, rps);
        }
        for (name, binary) in &sidecars {
            let data = dir.path().join(format!("{name}-{round}"));
            let child = Command::new(binary)
                .args(["serve", "--listen", &format!("127.0.0.1:{listen}")])
                .args(["--upstream", &format!("http://127.0.0.1:{origin}")])
                .arg("--store")
                .arg(data.join("store"))
                .arg("--spool-dir")
                .arg(data.join("spool"))
                .args(["--sidecar-id", "bench"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("cannot start {}", binary.display()))?;
            let child = Stop(child);
            wait_port(listen)?;
            let (p50, _) = wrk(listen, 1)?;
            let (_, rps) = wrk(listen, 64)?;
            drop(child);
            record(name, p50, rps);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let direct = runs
        .iter()
        .find(|(n, _)| n == "direct")
        .map(|(_, v)| {
            (
                median(v.iter().map(|r| r.0).collect()),
                median(v.iter().map(|r| r.1).collect()),
            )
        })
        .unwrap_or((0.0, 1.0));
    println!(
        "\nmedians of {rounds} rounds, {secs} s each (wrk, POST of a chat request, a 400-byte answer)"
    );
    println!(
        "| target | p50 at 1 connection | added p50 | req/s at 64 connections | ratio to direct |"
    );
    println!("|---|---|---|---|---|");
    for (name, v) in &runs {
        let p50 = median(v.iter().map(|r| r.0).collect());
        let rps = median(v.iter().map(|r| r.1).collect());
        println!(
            "| {name} | {p50:.0} µs | {:+.0} µs | {rps:.0} | {:.2}× |",
            p50 - direct.0,
            rps / direct.1
        );
    }
    Ok(())
}

/// The bench's scratch directory (nginx's config and logs, the sidecars' data).
struct Dir(PathBuf);

impl Dir {
    fn path(&self) -> &Path {
        &self.0
    }
}

/// Kills a child process when dropped.
struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn wait_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on 127.0.0.1:{port} after 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Requests/s and the p50 latency in µs of wrk's `--latency` output.
fn parse_wrk(out: &str) -> anyhow::Result<(f64, f64)> {
    let rps = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .with_context(|| format!("no Requests/sec in wrk's output:\n{out}"))?;
    let p50 = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("50%"))
        .and_then(|v| micros(v.trim()))
        .with_context(|| format!("no 50% latency in wrk's output:\n{out}"))?;
    Ok((p50, rps))
}

fn micros(v: &str) -> Option<f64> {
    let split = v.find(|c: char| c.is_ascii_alphabetic())?;
    let (n, unit) = v.split_at(split);
    let n: f64 = n.parse().ok()?;
    Some(match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_figures_are_read_in_microseconds() {
        let out = "  Latency Distribution\n     50%  101.00us\n     75%    1.55ms\nRequests/sec:  38475.37\n";
        assert_eq!(parse_wrk(out).unwrap(), (101.0, 38475.37));
        assert_eq!(micros("1.55ms"), Some(1550.0));
        assert_eq!(micros("2.00s"), Some(2e6));
        assert!(parse_wrk("no figures").is_err());
    }
}
