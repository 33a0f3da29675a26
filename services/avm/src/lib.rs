//! The AgentVM binary's library: command line, startup order, readiness,
//! shutdown. `avm serve` composes every component in one process; `avm
//! <component>` runs one, with peers reached over gRPC.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use avm_common::config::{GrpcConfig, Sources};
use avm_common::grpc::{GrpcServer, channel};
use clap::{Parser, Subcommand};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod config;

pub use config::AvmConfig;

/// AgentVM: hosts AI agents for many tenants.
#[derive(Debug, Parser)]
#[command(name = "avm", version, about)]
pub struct Cli {
    /// TOML configuration file (also `AVM_CONFIG`).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Print the effective configuration (secrets redacted) and exit.
    #[arg(long, global = true)]
    print_config: bool,
    /// Log filter, e.g. `info` or `avm_runtime=debug` (also `AVM_LOG_LEVEL`).
    #[arg(long, global = true)]
    log_level: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run every component in one process: gateway, gRPC services, SQLite storage.
    Serve {
        /// Address to bind (loopback unless authentication is configured).
        #[arg(long)]
        host: Option<String>,
        /// Gateway (HTTP + WebSocket) port.
        #[arg(long)]
        port: Option<u16>,
        /// gRPC port of all services.
        #[arg(long)]
        grpc_port: Option<u16>,
        /// Directory of the SQLite files.
        #[arg(long)]
        data_dir: Option<String>,
    },
    /// Run the gateway alone (needs AVM_SESSION_ADDR and AVM_RUNTIME_ADDR).
    Gateway(ComponentArgs),
    /// Run the session service alone (storage from AVM_DATABASE_URL).
    Session(ComponentArgs),
    /// Run the runtime alone (needs AVM_SESSION_ADDR).
    Runtime(ComponentArgs),
}

#[derive(Debug, clap::Args)]
struct ComponentArgs {
    /// Address to listen on, e.g. 127.0.0.1:7000.
    #[arg(long)]
    listen: Option<String>,
}

/// Parses the command line, runs, and maps failure to a non-zero exit.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Loads configuration and runs the chosen command until a shutdown signal.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = load_config(&cli)?;
    if cli.print_config {
        print!("{}", avm_common::config::render(&config)?);
        return Ok(());
    }
    avm_common::telemetry::init(&config.log);
    let shutdown = avm_common::shutdown::on_signal();
    match cli.command {
        Command::Serve { .. } => {
            let listeners = ServeListeners::bind(&config).await?;
            serve(config, listeners, shutdown).await
        }
        Command::Gateway(_) => run_gateway(config, shutdown).await,
        Command::Session(_) => run_session(config, shutdown).await,
        Command::Runtime(_) => run_runtime(config, shutdown).await,
    }
}

fn load_config(cli: &Cli) -> anyhow::Result<AvmConfig> {
    let mut server = Map::new();
    let mut flags = Map::new();
    match &cli.command {
        Command::Serve {
            host,
            port,
            grpc_port,
            data_dir,
        } => {
            insert(&mut server, "host", host.clone().map(Value::from));
            insert(&mut server, "port", port.map(Value::from));
            insert(&mut server, "grpc_port", grpc_port.map(Value::from));
            insert(&mut server, "data_dir", data_dir.clone().map(Value::from));
        }
        Command::Gateway(args) | Command::Session(args) | Command::Runtime(args) => {
            insert(&mut server, "listen", args.listen.clone().map(Value::from));
        }
    }
    if !server.is_empty() {
        flags.insert("server".to_owned(), Value::Object(server));
    }
    if let Some(level) = &cli.log_level {
        flags.insert("log".to_owned(), json!({"level": level}));
    }
    let sources = Sources {
        file: cli.config.clone(),
        flags,
    };
    Ok(avm_common::config::load(&sources)?)
}

fn insert(map: &mut Map<String, Value>, key: &str, value: Option<Value>) {
    if let Some(value) = value {
        map.insert(key.to_owned(), value);
    }
}

/// The two listeners of `avm serve`, bound before anything else starts so a
/// port conflict fails at once.
pub struct ServeListeners {
    pub gateway: TcpListener,
    pub grpc: TcpListener,
}

impl ServeListeners {
    /// Binds the gateway and gRPC ports of the configuration.
    pub async fn bind(config: &AvmConfig) -> anyhow::Result<Self> {
        let host = &config.server.host;
        refuse_public_bind(host)?;
        let gateway = bind(&format_addr(host, config.server.port)).await?;
        let grpc = bind(&format_addr(host, config.server.grpc_port)).await?;
        Ok(Self { gateway, grpc })
    }
}

fn format_addr(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

async fn bind(addr: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// Refuses to expose an unauthenticated server beyond this machine.
fn refuse_public_bind(host: &str) -> anyhow::Result<()> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!(
            "refusing to listen on {host}: AgentVM has no authentication configured, so it only binds to \
             loopback (127.0.0.1 or ::1). Bind to 127.0.0.1 and put an authenticating proxy in front."
        );
    }
    Ok(())
}

fn listen_addr(config: &AvmConfig, default_port: u16) -> String {
    config
        .server
        .listen
        .clone()
        .unwrap_or_else(|| format_addr(&config.server.host, default_port))
}

fn local_url(listener: &TcpListener) -> anyhow::Result<String> {
    let addr: SocketAddr = listener.local_addr()?;
    Ok(format!("http://{addr}"))
}

fn session_store_url(config: &AvmConfig) -> anyhow::Result<String> {
    if let Some(url) = config.database.url.as_ref().and_then(|secret| secret.expose()) {
        return Ok(url.to_owned());
    }
    let dir = config.server.data_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create data dir {}", dir.display()))?;
    Ok(format!("sqlite://{}", dir.join("session.db").display()))
}

fn peer(addr: &Option<String>, variable: &str) -> anyhow::Result<String> {
    addr.clone()
        .with_context(|| format!("{variable} is required (e.g. {variable}=http://127.0.0.1:7000)"))
}

fn runtime_pool(config: &AvmConfig, session_addr: &str, grpc: &GrpcConfig) -> anyhow::Result<avm_runtime::AgentPool> {
    let provider = avm_runtime::llm::build_provider(&config.llm).context("cannot configure the LLM provider")?;
    tracing::info!(provider = provider.name(), model = %config.llm.model, "llm provider configured");
    let sessions = avm_runtime::SessionClient::new(channel(session_addr, grpc)?, grpc);
    Ok(avm_runtime::AgentPool::new(
        config.runtime.clone(),
        config.llm.clone(),
        provider,
        sessions,
    ))
}

/// Runs every component in one process until `shutdown`.
pub async fn serve(config: AvmConfig, listeners: ServeListeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    let grpc_url = local_url(&listeners.grpc)?;
    let gateway_url = local_url(&listeners.gateway)?;
    let store_url = session_store_url(&config)?;
    let store = avm_session::open_store(&store_url, config.database.max_connections).await?;
    let sessions = avm_session::SessionService::new(store);
    let pool = runtime_pool(&config, &grpc_url, &config.grpc)?;

    let servers = CancellationToken::new();
    let grpc_server = GrpcServer::new(&config.grpc)
        .add_service(avm_session::grpc_server(sessions, &config.grpc))
        .add_service(avm_runtime::grpc_server(pool.clone(), &config.grpc));
    let grpc_task = tokio::spawn(grpc_server.serve(listeners.grpc, servers.clone()));
    let reaper = pool.spawn_reaper(servers.clone());
    let backends = avm_gateway::Backends::new(
        channel(&grpc_url, &config.grpc)?,
        channel(&grpc_url, &config.grpc)?,
        &config.grpc,
    );
    let gateway_task = tokio::spawn(avm_gateway::serve(
        listeners.gateway,
        config.gateway.clone(),
        backends,
        servers.clone(),
    ));

    println!("listening: gateway {gateway_url}");
    println!("listening: grpc {grpc_url}");
    tracing::info!(gateway = %gateway_url, grpc = %grpc_url, store = %redact_url(&store_url), "agentvm ready");

    tokio::select! {
        () = shutdown.cancelled() => {}
        result = wait_both(grpc_task, gateway_task) => return result,
    }
    wind_down(&pool, config.grpc.drain_timeout).await;
    servers.cancel();
    reaper.abort();
    tracing::info!("agentvm stopped");
    Ok(())
}

/// Interrupts running turns so their partial replies are stored before the
/// servers stop, waiting at most `limit`.
async fn wind_down(pool: &avm_runtime::AgentPool, limit: Duration) {
    pool.interrupt_all();
    let deadline = tokio::time::Instant::now() + limit;
    while pool.any_running() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_both(
    grpc: tokio::task::JoinHandle<Result<(), avm_common::grpc::GrpcError>>,
    gateway: tokio::task::JoinHandle<std::io::Result<()>>,
) -> anyhow::Result<()> {
    tokio::select! {
        result = grpc => { result??; bail!("the grpc server stopped unexpectedly") }
        result = gateway => { result??; bail!("the gateway stopped unexpectedly") }
    }
}

fn redact_url(url: &str) -> String {
    // Postgres urls may carry a password between "//" and "@".
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…{}", &url[..scheme], &url[at..]),
        _ => url.to_owned(),
    }
}

async fn run_session(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let addr = listen_addr(&config, config.server.grpc_port);
    let listener = bind(&addr).await?;
    let store_url = session_store_url(&config)?;
    let store = avm_session::open_store(&store_url, config.database.max_connections).await?;
    let server = GrpcServer::new(&config.grpc).add_service(avm_session::grpc_server(
        avm_session::SessionService::new(store),
        &config.grpc,
    ));
    println!("listening: grpc {}", local_url(&listener)?);
    tracing::info!(addr = %listener.local_addr()?, store = %redact_url(&store_url), "session service ready");
    server.serve(listener, shutdown).await?;
    Ok(())
}

async fn run_runtime(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let addr = listen_addr(&config, config.server.grpc_port);
    let listener = bind(&addr).await?;
    let session_addr = peer(&config.peers.session, "AVM_SESSION_ADDR")?;
    let pool = runtime_pool(&config, &session_addr, &config.grpc)?;
    let servers = CancellationToken::new();
    let reaper = pool.spawn_reaper(servers.clone());
    let server = GrpcServer::new(&config.grpc).add_service(avm_runtime::grpc_server(pool.clone(), &config.grpc));
    println!("listening: grpc {}", local_url(&listener)?);
    tracing::info!(addr = %listener.local_addr()?, session = %session_addr, "runtime ready");
    let task = tokio::spawn(server.serve(listener, servers.clone()));
    tokio::select! {
        () = shutdown.cancelled() => {}
        result = task => { result??; bail!("the grpc server stopped unexpectedly") }
    }
    wind_down(&pool, config.grpc.drain_timeout).await;
    servers.cancel();
    reaper.abort();
    Ok(())
}

async fn run_gateway(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let addr = listen_addr(&config, config.server.port);
    let host = addr.rsplit_once(':').map_or(addr.as_str(), |(host, _)| host);
    refuse_public_bind(host)?;
    let listener = bind(&addr).await?;
    let session = peer(&config.peers.session, "AVM_SESSION_ADDR")?;
    let runtime = peer(&config.peers.runtime, "AVM_RUNTIME_ADDR")?;
    let backends = avm_gateway::Backends::new(
        channel(&session, &config.grpc)?,
        channel(&runtime, &config.grpc)?,
        &config.grpc,
    );
    println!("listening: gateway {}", local_url(&listener)?);
    tracing::info!(addr = %listener.local_addr()?, session = %session, runtime = %runtime, "gateway ready");
    avm_gateway::serve(listener, config.gateway.clone(), backends, shutdown).await?;
    Ok(())
}
