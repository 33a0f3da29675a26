//! `avm sandbox`: the sandbox tier's process. It serves `avm.sandbox.v1`
//! and nothing else, reads no configuration file and no platform secret
//! (its environment is what its command line and `AVM_SANDBOX_*` give it),
//! and calls no other service.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use avm_common::config::GrpcConfig;
use avm_common::grpc::GrpcServer;
use avm_proto::sandbox::v1::sandbox_service_server::SandboxServiceServer;
use avm_sandbox::SandboxLimits;
use avm_sandbox::service::{Sandbox, Scrub, Trust};
use avm_sandbox::token::TokenVerifier;
use tokio::net::TcpListener;

/// The flags of `avm sandbox`.
#[derive(Debug, clap::Args)]
pub struct SandboxArgs {
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long, env = "AVM_SANDBOX_LISTEN", default_value = "127.0.0.1:7010")]
    listen: String,
    /// Where workspaces are kept, one directory per image (default: a
    /// directory under the system's temporary directory).
    #[arg(long, env = "AVM_SANDBOX_ROOT")]
    root: Option<PathBuf>,
    /// The public token key of the runtime this sandbox serves (a runtime
    /// starting its own sandboxes gives it). Without it the sandbox is a
    /// pool's: the first runtime to claim it gives its key and one image.
    #[arg(long, env = "AVM_SANDBOX_TOKEN_KEY")]
    token_key: Option<String>,
    /// How long a pool's sandbox stays claimed with no call (its runtime
    /// gone without releasing it), e.g. `10m`.
    #[arg(long, env = "AVM_SANDBOX_CLAIM_IDLE", default_value = "10m", value_parser = humantime::parse_duration)]
    claim_idle: std::time::Duration,
    /// Run commands without the namespace fence (only where the sandbox
    /// itself is the fence: a pod of its own, a VM).
    #[arg(long, env = "AVM_SANDBOX_NO_ISOLATE")]
    no_isolate: bool,
    /// More host paths a command's root holds, read-only.
    #[arg(long, env = "AVM_SANDBOX_EXPOSE", value_delimiter = ',')]
    expose: Vec<PathBuf>,
    /// The `avm` executable whose `sandbox-relay` gives fenced commands
    /// their network (default: this one).
    #[arg(long, env = "AVM_SANDBOX_RELAY")]
    relay: Option<PathBuf>,
    /// For a pool's sandbox alone in its container: when a claim ends, empty
    /// these directories too (the container's `/tmp`; repeatable).
    #[arg(long, env = "AVM_SANDBOX_SCRATCH", value_delimiter = ',')]
    scratch: Vec<PathBuf>,
    /// For a pool's sandbox alone in its container: when a claim ends, kill
    /// every other process of its user (but PID 1), so nothing a command
    /// left meets the next image. Never where the user runs anything else.
    #[arg(long, env = "AVM_SANDBOX_KILL_STRAYS")]
    kill_strays: bool,
    /// Stop when standard input closes: a runtime's child goes when the
    /// runtime does, however it ends.
    #[arg(long, hide = true)]
    stop_with_stdin: bool,
}

/// Serves until a signal asks it to stop.
pub async fn run(args: SandboxArgs) -> anyhow::Result<()> {
    let telemetry = crate::telemetry::init(&avm_common::config::LogConfig::default(), "sandbox");
    let trust = match &args.token_key {
        Some(key) => Trust::Runtime(TokenVerifier::from_public_key(key).map_err(anyhow::Error::msg)?),
        None => Trust::Claimable { idle: args.claim_idle },
    };
    let fence = SandboxLimits {
        isolate: !args.no_isolate,
        expose: args.expose,
        relay: args.relay,
        ..SandboxLimits::default()
    };
    avm_sandbox::isolation::check_config(&fence).map_err(anyhow::Error::msg)?;
    let root = args.root.unwrap_or_else(|| std::env::temp_dir().join("avm-sandbox"));
    std::fs::create_dir_all(&root).with_context(|| format!("cannot make {}", root.display()))?;
    let listener = TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let config = GrpcConfig::default();
    let scrub = Scrub {
        scratch: args.scratch,
        strays: args.kill_strays,
    };
    let sandbox = Arc::new(Sandbox::new(root, trust, fence).with_scrub(scrub));
    if args.token_key.is_none() {
        let sandbox = Arc::clone(&sandbox);
        let every = (args.claim_idle / 4).clamp(std::time::Duration::from_secs(1), std::time::Duration::from_secs(60));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                sandbox.expire_idle().await;
            }
        });
    }
    let service = SandboxServiceServer::from_arc(sandbox)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let server = GrpcServer::new(&config).add_service(service);
    println!("listening: grpc http://{addr}");
    tracing::info!(%addr, "sandbox ready");
    let shutdown = avm_common::shutdown::on_signal();
    if args.stop_with_stdin {
        let stop = shutdown.clone();
        // A thread of its own: a read of stdin cannot be cancelled, and the
        // process need not wait for it to end.
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            stop.cancel();
        });
    }
    let served = server.serve(listener, shutdown).await;
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    served.map_err(|err| anyhow::anyhow!(err))
}
