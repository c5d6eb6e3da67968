//! Link arguments for libtorch, as in `trainer/build.rs`: an rpath to libtorch's
//! directory, so the binary and its tests run without `LD_LIBRARY_PATH`, and
//! `--no-as-needed -ltorch`, without which the linker drops `libtorch_cuda` (nothing
//! references it by symbol) and CUDA is silently unavailable. `cargo:rustc-link-arg`
//! only reaches the package that prints it, hence this copy.

fn main() {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os == "linux" {
        if let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
            println!("cargo:rustc-link-arg=-Wl,-rpath={}", lib.to_string_lossy());
        }
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
    }
}
