//! Compiles `tapline/v1/*.proto` with a pure-Rust protobuf compiler (protox), so a build
//! needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["tapline/v1/record.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."])?;
    prost_build::Config::new()
        .btree_map(["."])
        .compile_fds(descriptors)?;
    Ok(())
}
