//! Compiles the C++ bridge against the headers of the libtorch that tch links (torch-sys
//! hands its library directory over as `DEP_TCH_LIBTORCH_LIB`; the headers are beside
//! it), with the same ABI flags torch-sys compiles its own C++ with. The NCCL backend is
//! compiled when NCCL's and CUDA's headers are found (the nvidia wheels that a CUDA
//! build of torch installs beside it, or `TAPLINE_NCCL_INCLUDE` / `TAPLINE_CUDA_INCLUDE`).

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=cpp");
    println!("cargo:rerun-if-env-changed=TAPLINE_NCCL_INCLUDE");
    println!("cargo:rerun-if-env-changed=TAPLINE_CUDA_INCLUDE");
    let lib = PathBuf::from(
        std::env::var_os("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report libtorch's directory (DEP_TCH_LIBTORCH_LIB)"),
    );
    let root = lib.parent().expect("libtorch's lib directory has a parent");
    let include = root.join("include");
    let mut build = cxx_build::bridge("src/lib.rs");
    build
        .file("cpp/bridge.cc")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include("cpp/gloo-shim")
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .define("USE_C10D_GLOO", None)
        .warnings(false);
    if let Some((nccl, cuda)) = nccl_headers(root)
        && lib.join("libtorch_cuda.so").is_file()
    {
        build
            .file("cpp/nccl.cc")
            .include(nccl)
            .include(cuda)
            .define("TAPLINE_WITH_NCCL", None)
            .define("USE_C10D_NCCL", None);
    }
    build.compile("tapline_c10d");
    println!("cargo:rustc-link-search=native={}", lib.display());
    // This crate's own tests run without LD_LIBRARY_PATH (the trainer's build.rs sets
    // the same for its binaries; link arguments reach only the package printing them).
    println!("cargo:rustc-link-arg=-Wl,-rpath={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    if lib.join("libtorch_cuda.so").is_file() {
        println!("cargo:rustc-link-lib=torch_cuda");
        println!("cargo:rustc-link-lib=c10_cuda");
    }
}

/// NCCL's and CUDA's include directories.
fn nccl_headers(torch_root: &Path) -> Option<(PathBuf, PathBuf)> {
    let env = |name: &str| std::env::var_os(name).map(PathBuf::from);
    // torch/ sits in site-packages beside nvidia/.
    let nvidia = torch_root.parent()?.join("nvidia");
    let nccl = env("TAPLINE_NCCL_INCLUDE").or_else(|| {
        let dir = nvidia.join("nccl/include");
        dir.join("nccl.h").is_file().then_some(dir)
    })?;
    let cuda = env("TAPLINE_CUDA_INCLUDE").or_else(|| {
        std::fs::read_dir(&nvidia)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .flat_map(|p| [p.join("include"), p.join("cuda_runtime/include")])
            // cuda_runtime.h includes crt/host_config.h, which the runtime wheel
            // alone lacks (it comes with nvidia-cuda-crt).
            .find(|dir| {
                dir.join("cuda_runtime_api.h").is_file() && dir.join("crt/host_config.h").is_file()
            })
    })?;
    Some((nccl, cuda))
}
