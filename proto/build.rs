//! Compiles the protobuf contracts with protox (pure Rust), so building needs no `protoc`.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "avm/auth/v1/auth.proto",
        "avm/session/v1/session.proto",
        "avm/runtime/v1/runtime.proto",
        "avm/resource/v1/resource.proto",
        "avm/config/v1/config.proto",
        "avm/observability/v1/observability.proto",
    ];
    let fds = protox::compile(files, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // Reflection serves this descriptor set so grpcurl and friends can discover the services.
    std::fs::write(out.join("avm_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    Ok(())
}
