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
        // The captured bodies are `bytes::Bytes`: the sidecar records a slice of the
        // buffer it read (no copy of a 30 MB request), and a record decoded from a
        // `Bytes` buffer shares it.
        .bytes([
            ".tapline.v1.LlmCall.request_body",
            ".tapline.v1.LlmCall.response_body",
        ])
        .compile_fds(descriptors)?;
    Ok(())
}
