//! The run report in a real browser: headless Chromium (Debian's `chromium` package,
//! installed when missing) loads a `report.html` from a file URL, with the network
//! off, and the DOM it built is checked: the curves and the episodes' tokens are there
//! and nothing was logged to the console.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail, ensure};

/// Chromium's command, installed from Debian when missing.
fn ensure_chromium() -> anyhow::Result<&'static str> {
    if super::runs("chromium-browser") && !super::runs("chromium") {
        return Ok("chromium-browser");
    }
    super::ensure_debian("chromium", "chromium", " for the report check")?;
    Ok("chromium")
}

/// Loads `page` in headless Chromium and checks what it rendered; a screenshot goes to
/// `screenshot`.
pub fn check_report(page: &Path, screenshot: &Path) -> anyhow::Result<()> {
    let chromium = ensure_chromium()?;
    let url = format!(
        "file://{}",
        page.canonicalize()
            .with_context(|| format!("{} is missing", page.display()))?
            .display()
    );
    let profile = tempfile_dir()?;
    let base = |cmd: &mut Command| {
        cmd.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            // No network: a self-contained page needs none.
            "--proxy-server=127.0.0.1:9",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()));
    };
    let mut dump = Command::new(chromium);
    base(&mut dump);
    let out = dump
        .args(["--dump-dom", &url])
        .output()
        .context("run chromium --dump-dom")?;
    let dom = String::from_utf8_lossy(&out.stdout);
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("chromium --dump-dom exited with {}: {log}", out.status);
    }
    let console: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .collect();
    ensure!(
        console.is_empty(),
        "the report logged to the console: {console:?}"
    );
    let charts = dom.matches("<div class=\"chart\"><svg").count();
    ensure!(charts >= 9, "{charts} charts rendered, not 9");
    ensure!(
        dom.contains("<polyline"),
        "no curve drawn (a run of one step has no line, but its points)"
    );
    let tokens = dom.matches("class=\"l\"").count();
    ensure!(tokens > 0, "no trained token in the rendered episodes");
    ensure!(
        !dom.contains("<script"),
        "the rendered report holds a script"
    );
    let mut shot = Command::new(chromium);
    base(&mut shot);
    let status = shot
        .arg(format!("--screenshot={}", screenshot.display()))
        .args(["--window-size=1280,2400", &url])
        .output()
        .context("run chromium --screenshot")?;
    ensure!(
        status.status.success() && screenshot.is_file(),
        "chromium --screenshot failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    eprintln!(
        "xtask: report rendered by {chromium}: {charts} charts, {tokens} trained tokens; screenshot {}",
        screenshot.display()
    );
    let _ = std::fs::remove_dir_all(&profile);
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("tapline-chromium-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
