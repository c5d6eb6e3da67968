//! The git commit (for run manifests), and link arguments for libtorch, as tch's own build script sets them for its examples:
//! an rpath to libtorch's directory, so the binaries and tests run without
//! `LD_LIBRARY_PATH`, and `--no-as-needed -ltorch`, without which the linker drops
//! `libtorch_cuda` (nothing references it by symbol) and CUDA is silently unavailable.
//! `cargo:rustc-link-arg` only reaches the package that prints it, hence this copy.

fn main() {
    // The commit for run manifests.
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TAPLINE_GIT_COMMIT={commit}");
    println!(
        "cargo:rustc-env=TAPLINE_GIT_COMMIT_SHORT={}",
        commit.get(..12).unwrap_or(&commit)
    );
    println!("cargo:rerun-if-changed=../.git/HEAD");
    println!("cargo:rerun-if-changed=../.git/refs/heads");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    // Without the `torch` feature nothing links libtorch.
    let torch = std::env::var_os("CARGO_FEATURE_TORCH").is_some();
    if os == "linux" && torch {
        if let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
            println!("cargo:rustc-link-arg=-Wl,-rpath={}", lib.to_string_lossy());
        }
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
    }
}
