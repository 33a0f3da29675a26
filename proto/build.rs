//! Compiles the protobuf contracts with protox (pure Rust), so building needs
//! no `protoc`, and writes each service's two peers: `<Service>Remote` (a
//! gRPC client that implements the service's trait) and `<Service>Local`
//! (an in-process object behind the same trait, each call observed).

use std::fmt::Write as _;
use std::path::PathBuf;

use prost::Message;
use prost_types::FileDescriptorSet;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "avm/auth/v1/auth.proto",
        "avm/session/v1/session.proto",
        "avm/runtime/v1/runtime.proto",
        "avm/resource/v1/resource.proto",
        "avm/config/v1/config.proto",
        "avm/observability/v1/observability.proto",
        "avm/sandbox/v1/sandbox.proto",
    ];
    let fds = protox::compile(files, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // Reflection serves this descriptor set so grpcurl and friends can discover the services.
    std::fs::write(out.join("avm_descriptor.bin"), fds.encode_to_vec())?;
    write_peers(&fds, &out)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    // The generated peers change with this script too.
    println!("cargo:rerun-if-changed=build.rs");
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    Ok(())
}

/// Writes `<package>.peers.rs` for every package with services.
///
/// Generated rather than written by hand so that a new RPC needs nothing
/// but its line in the .proto: both peers implement the whole trait or the
/// build fails.
fn write_peers(fds: &FileDescriptorSet, out: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    for file in &fds.file {
        let package = file.package();
        let component = package.split('.').nth(1).ok_or("package without a component")?;
        let mut code = String::new();
        for service in &file.service {
            let name = service.name();
            let module = snake(name);
            let server = format!("{module}_server::{name}");
            let client = format!("{module}_client::{name}Client");
            let mut streams = Vec::new();
            let mut remote = String::new();
            let mut local = String::new();
            for method in &service.method {
                if method.client_streaming() {
                    return Err(format!("{name}.{}: client streaming is not supported", method.name()).into());
                }
                let rpc = method.name();
                let function = snake(rpc);
                let input = local_type(package, method.input_type())?;
                let output = local_type(package, method.output_type())?;
                if method.server_streaming() {
                    let stream = format!("{rpc}Stream");
                    streams.push(format!("{stream} = crate::BoxStream<{output}>"));
                    let signature = format!(
                        "    async fn {function}(&self, request: tonic::Request<{input}>) -> \
                         Result<tonic::Response<Self::{stream}>, tonic::Status>"
                    );
                    writeln!(remote, "    type {stream} = crate::BoxStream<{output}>;")?;
                    writeln!(
                        remote,
                        "{signature} {{\n        let response = self.client.clone().{function}(request).await?;\n        \
                         Ok(response.map(|stream| Box::pin(stream) as crate::BoxStream<{output}>))\n    }}"
                    )?;
                    writeln!(local, "    type {stream} = crate::BoxStream<{output}>;")?;
                    writeln!(
                        local,
                        "{signature} {{\n        let call = self.observe.begin(\"{component}\", \"{rpc}\", request.metadata());\n        \
                         self.observe.run(call, self.inner.{function}(request)).await\n    }}"
                    )?;
                } else {
                    let signature = format!(
                        "    async fn {function}(&self, request: tonic::Request<{input}>) -> \
                         Result<tonic::Response<{output}>, tonic::Status>"
                    );
                    writeln!(
                        remote,
                        "{signature} {{\n        self.client.clone().{function}(request).await\n    }}"
                    )?;
                    writeln!(
                        local,
                        "{signature} {{\n        let call = self.observe.begin(\"{component}\", \"{rpc}\", request.metadata());\n        \
                         self.observe.run(call, self.inner.{function}(request)).await\n    }}"
                    )?;
                }
            }
            let bound = if streams.is_empty() {
                server.clone()
            } else {
                format!("{server}<{}>", streams.join(", "))
            };
            write!(
                code,
                r#"
/// `{name}` as an object: its own gRPC adapter in this process
/// ([`{name}Local`]) or a client of another process ([`{name}Remote`]).
pub type {name}Api = dyn {bound};

/// A shared `{name}`, local or remote.
pub type {name}Handle = std::sync::Arc<{name}Api>;

/// Calls `{name}` in another process over gRPC.
#[derive(Clone, Debug)]
pub struct {name}Remote {{
    client: {client}<crate::Transport>,
}}

impl {name}Remote {{
    /// Returns a client over `channel` that sends and accepts messages up to `max_message_bytes`.
    pub fn new(channel: tonic::transport::Channel, max_message_bytes: usize) -> Self {{
        Self::over(crate::transport(channel), max_message_bytes)
    }}

    /// Returns a client over any transport (several peers behind one, say).
    pub fn over(transport: crate::Transport, max_message_bytes: usize) -> Self {{
        let client = {client}::new(transport)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes);
        Self {{ client }}
    }}

    /// Returns it as a shared handle.
    pub fn handle(self) -> {name}Handle {{
        std::sync::Arc::new(self)
    }}
}}

#[tonic::async_trait]
impl {server} for {name}Remote {{
{remote}}}

/// Calls `{name}` in this process: no encoding, no network, no token
/// verification; each call observed by `O` as the gRPC server observes its own.
pub struct {name}Local<S, O> {{
    inner: S,
    observe: O,
}}

impl<S, O> {name}Local<S, O>
where
    S: {bound},
    O: crate::Observe,
{{
    /// Wraps the service's own gRPC adapter.
    pub fn new(inner: S, observe: O) -> Self {{
        Self {{ inner, observe }}
    }}

    /// Returns it as a shared handle.
    pub fn handle(self) -> {name}Handle {{
        std::sync::Arc::new(self)
    }}
}}

#[tonic::async_trait]
impl<S, O> {server} for {name}Local<S, O>
where
    S: {bound},
    O: crate::Observe,
{{
{local}}}
"#
            )?;
        }
        if !code.is_empty() {
            std::fs::write(out.join(format!("{package}.peers.rs")), code)?;
        }
    }
    Ok(())
}

/// Returns the Rust name of a message of `package` (`.avm.x.v1.Foo` → `Foo`).
fn local_type(package: &str, full: &str) -> Result<String, String> {
    full.strip_prefix('.')
        .and_then(|name| name.strip_prefix(package))
        .and_then(|name| name.strip_prefix('.'))
        .filter(|name| !name.contains('.'))
        .map(str::to_owned)
        .ok_or_else(|| format!("{full} is not a message of {package}"))
}

/// Returns `CamelCase` as `snake_case`.
fn snake(name: &str) -> String {
    let mut out = String::new();
    for (index, char) in name.chars().enumerate() {
        if char.is_ascii_uppercase() {
            if index > 0 {
                out.push('_');
            }
            out.push(char.to_ascii_lowercase());
        } else {
            out.push(char);
        }
    }
    out
}
