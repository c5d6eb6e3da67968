//! `cargo xtask image`: OCI images of `tapline-sidecar` and `tapline-trainer`, assembled
//! `FROM scratch` with podman, since no base image can be pulled on our machines.
//!
//! Each image is a root file system put together here: the binary in `/usr/local/bin`,
//! exactly the shared libraries it loads (its `ldd` closure; for the trainer with
//! libtorch, the whole `torch/lib` and the `nvidia/*/lib` directories of the torch it
//! links, since CUDA opens some of its libraries only when it needs them), CA
//! certificates, `/etc/passwd` with the non-root user `tapline` (65532), a writable
//! `/tmp` and `/var/lib/tapline`, and in the trainer images Debian's static busybox as
//! `/bin/sh` and the few tools the CronJob's script runs; then a `Containerfile` of `FROM scratch`, `COPY`,
//! `ENV`, `USER` and `ENTRYPOINT`, built by `podman build`. The multi-stage
//! `sidecar/Containerfile` and `trainer/Containerfile`, for builders that can pull base
//! images, make the same image from Debian: [`check_in_step`] holds both to the same
//! entrypoint, user and environment.
//!
//! Images: `tapline-sidecar:VERSION` (`ENTRYPOINT ["tapline-sidecar", "serve"]`),
//! `tapline-trainer:VERSION` (with libtorch; `ENTRYPOINT ["tapline-trainer"]`) and
//! `tapline-trainer:VERSION-prepare` (built without the `torch` feature: `prepare`,
//! `tokenize`, `publish`, no libtorch), each also tagged `latest` / `prepare`.
//!
//! podman here needs runc, the cgroupfs cgroup manager and no default ulimits:
//! [`Podman::ensure`] installs the Debian packages when they are missing and writes a
//! `CONTAINERS_CONF` file under `.cache/containers`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The user the images run as (distroless' `nonroot`).
pub const UID: u32 = 65532;

/// Debian's static busybox: the trainer images' `/bin/sh` and the tools the CronJob's
/// script uses (`readlink`, `date`, `grep`, `ln`, `mv`).
const BUSYBOX: &str = "/bin/busybox";

/// One image to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `tapline-sidecar serve`.
    Sidecar,
    /// `tapline-trainer` with libtorch.
    Trainer,
    /// `tapline-trainer` without the `torch` feature.
    TrainerPrepare,
}

impl Kind {
    /// The image name and tags, as the manifests in `examples/deploy` use them.
    pub fn tags(self) -> [String; 2] {
        let v = env!("CARGO_PKG_VERSION");
        match self {
            Kind::Sidecar => [
                format!("tapline-sidecar:{v}"),
                "tapline-sidecar:latest".into(),
            ],
            Kind::Trainer => [
                format!("tapline-trainer:{v}"),
                "tapline-trainer:latest".into(),
            ],
            Kind::TrainerPrepare => [
                format!("tapline-trainer:{v}-prepare"),
                "tapline-trainer:prepare".into(),
            ],
        }
    }

    fn binary(self) -> &'static str {
        match self {
            Kind::Sidecar => "tapline-sidecar",
            Kind::Trainer | Kind::TrainerPrepare => "tapline-trainer",
        }
    }

    /// The `ENTRYPOINT` (also in the multi-stage Containerfile).
    pub fn entrypoint(self) -> &'static str {
        match self {
            Kind::Sidecar => r#"ENTRYPOINT ["tapline-sidecar", "serve"]"#,
            Kind::Trainer | Kind::TrainerPrepare => r#"ENTRYPOINT ["tapline-trainer"]"#,
        }
    }

    /// The `ENV` lines (also in the multi-stage Containerfile): where a container keeps
    /// its state, and where the sidecar listens (all interfaces: the harness reaches it
    /// through the pod's loopback, a probe through the pod IP).
    pub fn env(self) -> &'static [&'static str] {
        match self {
            Kind::Sidecar => &[
                "ENV PATH=/usr/local/bin",
                "ENV TAPLINE_LISTEN=0.0.0.0:4100",
                "ENV TAPLINE_SPOOL_DIR=/var/lib/tapline/spool",
                "ENV TAPLINE_STORE=/var/lib/tapline/store",
            ],
            Kind::Trainer | Kind::TrainerPrepare => &[
                "ENV PATH=/usr/local/bin:/bin",
                "ENV LD_LIBRARY_PATH=/usr/local/lib/tapline",
                "ENV HOME=/var/lib/tapline",
            ],
        }
    }

    fn containerfile(self) -> &'static str {
        match self {
            Kind::Sidecar => "sidecar/Containerfile",
            Kind::Trainer | Kind::TrainerPrepare => "trainer/Containerfile",
        }
    }
}

/// podman as it runs on these machines.
#[derive(Debug)]
pub struct Podman {
    conf: PathBuf,
}

impl Podman {
    /// Installs podman and runc from Debian when missing; writes the containers.conf.
    pub fn ensure(root: &Path) -> anyhow::Result<Podman> {
        let have = |bin: &str| {
            Command::new(bin)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if !have("podman")
            || !Path::new("/usr/sbin/runc").is_file()
            || !Path::new(BUSYBOX).is_file()
        {
            eprintln!("xtask: installing podman and runc (Debian packages)");
            crate::run(Command::new("apt-get").args(["update", "-qq"]))?;
            crate::run(
                Command::new("apt-get")
                    .args(["install", "-y", "-qq", "--no-install-recommends"])
                    .args([
                        "podman",
                        "runc",
                        "ca-certificates",
                        "uidmap",
                        "busybox-static",
                    ])
                    .env("DEBIAN_FRONTEND", "noninteractive"),
            )?;
        }
        let dir = root.join(".cache/containers");
        std::fs::create_dir_all(&dir)?;
        let conf = dir.join("containers.conf");
        std::fs::write(
            &conf,
            "# Written by cargo xtask image: podman on these machines.\n\
             [containers]\ndefault_ulimits = []\n\n\
             [engine]\ncgroup_manager = \"cgroupfs\"\nruntime = \"runc\"\n",
        )?;
        Ok(Podman { conf })
    }

    /// The containers.conf file.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// `podman --runtime /usr/sbin/runc ARGS` with this containers.conf.
    pub fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", &self.conf)
            .args(["--runtime", "/usr/sbin/runc"]);
        c
    }

    /// The size of an image in bytes.
    pub fn size(&self, tag: &str) -> anyhow::Result<u64> {
        let out = self
            .cmd()
            .args(["image", "inspect", "--format", "{{.Size}}", tag])
            .output()?;
        if !out.status.success() {
            bail!(
                "podman image inspect {tag}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .context("podman image inspect printed no size")
    }
}

/// The shared libraries `binary` loads, as `ldd` resolves them (the ELF interpreter
/// included); fails on a library `ldd` cannot find.
pub fn ldd_closure(binary: &Path) -> anyhow::Result<BTreeSet<PathBuf>> {
    let out = Command::new("ldd").arg(binary).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("ldd {}: {text}", binary.display());
    }
    let mut libs = BTreeSet::new();
    for line in text.lines() {
        let line = line.trim();
        if line.contains("=> not found") {
            bail!("{}: {line}", binary.display());
        }
        let path = match line.split_once("=>") {
            Some((_, right)) => right.trim(),
            None => line,
        };
        let path = path.split(" (").next().unwrap_or("").trim();
        if path.starts_with('/') {
            libs.insert(PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// Copies `src` (following links) to `rootfs` + `dest`.
fn put(rootfs: &Path, src: &Path, dest: &Path) -> anyhow::Result<()> {
    let to = rootfs.join(dest.strip_prefix("/").unwrap_or(dest));
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::copy(src, &to)
        .with_context(|| format!("copy {} to {}", src.display(), to.display()))?;
    Ok(())
}

/// Whether `lib` is one of the system's (Debian's) libraries rather than libtorch's.
fn is_system_lib(lib: &Path) -> bool {
    ["/lib", "/lib64", "/usr/lib", "/usr/lib64"]
        .iter()
        .any(|d| lib.starts_with(d))
}

/// Builds the image of `kind` from `binary`; `torch_lib` is the `torch/lib` directory
/// the trainer links (for [`Kind::Trainer`]). Returns the size in bytes.
pub fn build(
    root: &Path,
    podman: &Podman,
    kind: Kind,
    binary: &Path,
    torch_lib: Option<&Path>,
) -> anyhow::Result<u64> {
    let context = root
        .join(".cache/images")
        .join(kind.tags()[0].replace(':', "-"));
    let _ = std::fs::remove_dir_all(&context);
    let rootfs = context.join("rootfs");
    std::fs::create_dir_all(&rootfs)?;
    let installed = Path::new("/usr/local/bin").join(kind.binary());
    put(&rootfs, binary, &installed)?;
    // Release builds carry line tables (`debug = 1`): the image keeps the symbols, so a
    // backtrace still names functions, and drops the rest (the sidecar: 100 MB -> 16 MB).
    crate::run(
        Command::new("strip")
            .arg("--strip-debug")
            .arg(rootfs.join(installed.strip_prefix("/").unwrap_or(&installed))),
    )?;
    let private_libs = Path::new("/usr/local/lib/tapline");
    for lib in ldd_closure(binary)? {
        if is_system_lib(&lib) {
            put(&rootfs, &lib, &lib)?;
        } else if let Some(name) = lib.file_name() {
            put(&rootfs, &lib, &private_libs.join(name))?;
        }
    }
    if kind == Kind::Trainer {
        let torch_lib = torch_lib.context("the trainer image needs torch's lib directory")?;
        // Everything of torch/lib and of the nvidia wheels beside it: CUDA and cuDNN open
        // some of their libraries at run time, which `ldd` cannot see. Their system
        // dependencies come from the closure of each library.
        let mut dirs = vec![torch_lib.to_path_buf()];
        let site = torch_lib.parent().and_then(Path::parent);
        if let Some(Ok(entries)) = site.map(|s| std::fs::read_dir(s.join("nvidia"))) {
            for e in entries.flatten() {
                if e.path().join("lib").is_dir() {
                    dirs.push(e.path().join("lib"));
                }
            }
        }
        let mut system = BTreeSet::new();
        for dir in dirs {
            for e in std::fs::read_dir(&dir)?.flatten() {
                let path = e.path();
                let name = e.file_name().to_string_lossy().into_owned();
                if !(path.is_file() && name.contains(".so")) {
                    continue;
                }
                put(&rootfs, &path, &private_libs.join(&name))?;
                if let Ok(libs) = ldd_closure(&path) {
                    system.extend(libs.into_iter().filter(|l| is_system_lib(l)));
                }
            }
        }
        for lib in system {
            put(&rootfs, &lib, &lib)?;
        }
    }
    if kind != Kind::Sidecar {
        put(&rootfs, Path::new(BUSYBOX), Path::new(BUSYBOX))?;
        let out = Command::new(BUSYBOX).arg("--list").output()?;
        for applet in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let link = rootfs.join("bin").join(applet);
            if applet != "busybox" && !link.exists() {
                std::os::unix::fs::symlink("busybox", &link)?;
            }
        }
    }
    let certs = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if !certs.is_file() {
        bail!(
            "{} is missing: install Debian's ca-certificates",
            certs.display()
        );
    }
    put(&rootfs, certs, certs)?;
    let etc = rootfs.join("etc");
    std::fs::write(
        etc.join("passwd"),
        format!(
            "root:x:0:0:root:/root:/sbin/nologin\ntapline:x:{UID}:{UID}:tapline:/var/lib/tapline:/sbin/nologin\n"
        ),
    )?;
    std::fs::write(etc.join("group"), format!("root:x:0:\ntapline:x:{UID}:\n"))?;
    std::fs::write(etc.join("nsswitch.conf"), "hosts: files dns\n")?;
    // Empty directories the user owns, copied with --chown.
    let state = context.join("state");
    std::fs::create_dir_all(state.join("var/lib/tapline"))?;
    std::fs::create_dir_all(state.join("tmp"))?;

    let mut file =
        String::from("# Written by cargo xtask image (xtask/src/image.rs).\nFROM scratch\n");
    file.push_str("COPY rootfs/ /\n");
    file.push_str(&format!("COPY --chown={UID}:{UID} state/ /\n"));
    for line in kind.env() {
        file.push_str(line);
        file.push('\n');
    }
    file.push_str(&format!("USER {UID}:{UID}\n"));
    file.push_str("WORKDIR /var/lib/tapline\n");
    file.push_str(kind.entrypoint());
    file.push('\n');
    std::fs::write(context.join("Containerfile"), file)?;

    let [tag, alias] = kind.tags();
    let previous = podman
        .cmd()
        .args(["image", "inspect", "--format", "{{.Id}}", &tag])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    crate::run(
        podman
            .cmd()
            .args(["build", "--quiet", "--format", "oci", "--layers=false"])
            .args(["-t", &tag, "-t", &alias, "-f"])
            .arg(context.join("Containerfile"))
            .arg(&context),
    )?;
    let _ = std::fs::remove_dir_all(&context);
    // The image these tags named before is dangling now: drop it (only it).
    if let Some(previous) = previous {
        let _ = podman.cmd().args(["rmi", &previous]).output();
    }
    podman.size(&tag)
}

/// Checks that the multi-stage Containerfile of `kind` has the entrypoint, user and
/// environment of the image built here.
pub fn check_in_step(root: &Path, kind: Kind) -> anyhow::Result<()> {
    let path = root.join(kind.containerfile());
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let lines: BTreeSet<&str> = text.lines().map(str::trim).collect();
    let user = format!("USER {UID}:{UID}");
    for want in kind
        .env()
        .iter()
        .copied()
        .chain([kind.entrypoint(), user.as_str()])
    {
        if !lines.contains(want) {
            bail!(
                "{} lacks `{want}`, which the image cargo xtask image builds has: keep the two in step",
                path.display()
            );
        }
    }
    Ok(())
}

/// Checks that every tapline image the manifests in `examples/deploy` name is one this
/// xtask builds, by the same name and version.
pub fn check_manifests(root: &Path) -> anyhow::Result<()> {
    let known: BTreeSet<String> = [Kind::Sidecar, Kind::Trainer, Kind::TrainerPrepare]
        .iter()
        .flat_map(|k| k.tags())
        .collect();
    let dir = root.join("examples/deploy");
    let mut named = 0;
    for entry in std::fs::read_dir(&dir)?.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        for line in text.lines() {
            let Some(image) = line.trim().strip_prefix("image:") else {
                continue;
            };
            let image = image.split('#').next().unwrap_or("").trim();
            if image.contains("tapline-") {
                named += 1;
                if !known.contains(image) {
                    bail!(
                        "{} uses the image {image}, which cargo xtask image does not build (it builds {})",
                        path.display(),
                        known.iter().cloned().collect::<Vec<_>>().join(", ")
                    );
                }
            }
        }
    }
    if named == 0 {
        bail!("no manifest in {} names a tapline image", dir.display());
    }
    Ok(())
}
