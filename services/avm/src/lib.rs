//! The AgentVM binary's library: command line, startup order, readiness,
//! shutdown. `avm serve` composes every component in one process; `avm
//! <component>` runs one, with peers reached over gRPC; `avm tenants|users|keys`
//! manage a running server through its REST API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use std::sync::Arc;

use anyhow::{Context, bail};
use avm_common::auth::{AuthConfig, GrpcKeySource, ServiceIdentity, TokenVerifier};
use avm_common::config::{Secret, Sources};
use avm_common::grpc::{GrpcServer, channel};
use clap::{Parser, Subcommand};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

mod cli;
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
        /// Let requests without credentials act as the admin of a local `dev`
        /// tenant (loopback only; never in production).
        #[arg(long)]
        dev: bool,
    },
    /// Run the gateway alone (needs AVM_AUTH_ADDR, AVM_SESSION_ADDR, AVM_RUNTIME_ADDR, AVM_RESOURCE_ADDR,
    /// AVM_CONFIG_ADDR, AVM_OBSERVABILITY_ADDR, AVM_AUTH_SERVICE_KEY).
    Gateway(ComponentArgs),
    /// Run the auth service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_SERVICE_KEY).
    Auth(ComponentArgs),
    /// Run the session service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_AUTH_SERVICE_KEY).
    Session(ComponentArgs),
    /// Run the runtime alone (needs AVM_AUTH_ADDR, AVM_SESSION_ADDR, AVM_RESOURCE_ADDR, AVM_CONFIG_ADDR,
    /// AVM_OBSERVABILITY_ADDR, AVM_AUTH_SERVICE_KEY).
    Runtime(ComponentArgs),
    /// Run the resource service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_AUTH_SERVICE_KEY).
    Resource(ComponentArgs),
    /// Run the config service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_AUTH_SERVICE_KEY,
    /// AVM_CONFIG_SECRET_KEY; its LLM_* variables are the deployment's LLM settings).
    Config(ComponentArgs),
    /// Run the observability service alone: the usage ledger, budgets and tenants' logs (storage from
    /// AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_AUTH_SERVICE_KEY).
    Observability(ComponentArgs),
    /// Manage tenants of a running server (operators).
    Tenants(cli::Tenants),
    /// Manage the users of a tenant (its admins).
    Users(cli::Users),
    /// Manage API keys.
    Keys(cli::Keys),
    /// Show who the credential in use is.
    Whoami(cli::ClientArgs),
    /// Print the OpenAPI 3.1 document of the REST API (as `GET /v1/openapi.json` serves it).
    Openapi,
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
    match cli.command {
        Command::Tenants(command) => return cli::tenants(command, &config).await,
        Command::Users(command) => return cli::users(command, &config).await,
        Command::Keys(command) => return cli::keys(command, &config).await,
        Command::Whoami(client) => return cli::whoami(&client, &config).await,
        Command::Openapi => {
            println!("{}", avm_gateway::router::openapi().to_pretty_json()?);
            return Ok(());
        }
        _ => {}
    }
    let telemetry = avm_common::telemetry::init(&config.log, component_name(&cli.command));
    let shutdown = avm_common::shutdown::on_signal();
    let result = match cli.command {
        Command::Serve { .. } => match ServeListeners::bind(&config).await {
            Ok(listeners) => serve(config, listeners, shutdown).await,
            Err(err) => Err(err),
        },
        Command::Gateway(_) => run_gateway(config, shutdown).await,
        Command::Auth(_) => run_auth(config, shutdown).await,
        Command::Session(_) => run_session(config, shutdown).await,
        Command::Runtime(_) => run_runtime(config, shutdown).await,
        Command::Resource(_) => run_resource(config, shutdown).await,
        Command::Config(_) => run_config(config, shutdown).await,
        Command::Observability(_) => run_observability(config, shutdown).await,
        Command::Tenants(_) | Command::Users(_) | Command::Keys(_) | Command::Whoami(_) | Command::Openapi => Ok(()),
    };
    // Spans still buffered go out now; the exporter blocks on the runtime.
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    result
}

/// Returns the name a command's process goes by in logs, metrics and traces.
fn component_name(command: &Command) -> &'static str {
    match command {
        Command::Serve { .. } => "serve",
        Command::Gateway(_) => "gateway",
        Command::Auth(_) => "auth",
        Command::Session(_) => "session",
        Command::Runtime(_) => "runtime",
        Command::Resource(_) => "resource",
        Command::Config(_) => "config",
        Command::Observability(_) => "observability",
        Command::Tenants(_) | Command::Users(_) | Command::Keys(_) | Command::Whoami(_) | Command::Openapi => "cli",
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
            dev,
        } => {
            insert(&mut server, "host", host.clone().map(Value::from));
            insert(&mut server, "port", port.map(Value::from));
            insert(&mut server, "grpc_port", grpc_port.map(Value::from));
            insert(&mut server, "data_dir", data_dir.clone().map(Value::from));
            if *dev {
                flags.insert("auth".to_owned(), json!({"dev": true}));
            }
        }
        Command::Gateway(args)
        | Command::Auth(args)
        | Command::Session(args)
        | Command::Runtime(args)
        | Command::Resource(args)
        | Command::Config(args)
        | Command::Observability(args) => {
            insert(&mut server, "listen", args.listen.clone().map(Value::from));
        }
        Command::Tenants(_) | Command::Users(_) | Command::Keys(_) | Command::Whoami(_) | Command::Openapi => {}
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
        if config.auth.dev {
            refuse_public_bind(host)?;
        }
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

/// Refuses to expose a server that lets anonymous requests in (`--dev`)
/// beyond this machine.
fn refuse_public_bind(host: &str) -> anyhow::Result<()> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!(
            "refusing to listen on {host} with --dev: anonymous access is for this machine only. \
             Bind to 127.0.0.1, or drop --dev (auth.dev) and authenticate with API keys."
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

/// Returns the database url of `service`: its own file or schema of the
/// configured database, or a SQLite file under the data dir.
fn store_url(config: &AvmConfig, service: &str) -> anyhow::Result<String> {
    if let Some(url) = config.database.url.as_ref().and_then(|secret| secret.expose()) {
        return Ok(avm_common::db::service_url(url, service)?);
    }
    let dir = data_dir(config)?;
    Ok(format!("sqlite://{}", dir.join(format!("{service}.db")).display()))
}

/// Returns the data directory, creating it readable only by the user: it
/// holds the databases (the auth one with the token signing keys) and the
/// admin key.
fn data_dir(config: &AvmConfig) -> anyhow::Result<PathBuf> {
    let dir = config.server.data_dir();
    if !dir.exists() {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder
            .create(&dir)
            .with_context(|| format!("cannot create data dir {}", dir.display()))?;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir)
            .with_context(|| format!("cannot read data dir {}", dir.display()))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                data_dir = %dir.display(),
                mode = format!("{:o}", mode & 0o777),
                "the data dir is readable by others; it holds signing keys (chmod 700 it)"
            );
        }
    }
    Ok(dir)
}

/// The file the first run's admin API key is written to.
pub const ADMIN_KEY_FILE: &str = "admin.key";

/// Opens the auth service's store and, on a fresh one, creates the operator
/// tenant and prints its admin key once (and writes it to a file only the
/// user can read).
async fn open_auth(config: &AvmConfig, auth_config: AuthConfig) -> anyhow::Result<avm_auth::AuthService> {
    let url = store_url(config, "auth")?;
    let store = avm_auth::open_store(&url, config.database.max_connections).await?;
    let auth = avm_auth::AuthService::new(store, auth_config).await?;
    if let Some(first) = auth.bootstrap().await? {
        let path = data_dir(config)?.join(ADMIN_KEY_FILE);
        write_private(&path, &first.secret)?;
        println!(
            "created the operator tenant {} with an admin API key (shown only this once):",
            first.tenant_id
        );
        println!();
        println!("    {}", first.secret);
        println!();
        println!("saved to {} (readable only by you)", path.display());
        tracing::info!(tenant_id = %first.tenant_id, key_id = %first.key_id, file = %path.display(), "first run: admin key created");
    }
    Ok(auth)
}

/// Writes a secret to a file readable only by its owner.
fn write_private(path: &std::path::Path, secret: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(file, "{secret}").with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Returns the gateway's rate limiter: shared through Redis when configured.
async fn rate_limiter(config: &AvmConfig) -> anyhow::Result<avm_gateway::RateLimiter> {
    match config.redis.url.as_ref().and_then(Secret::expose) {
        Some(url) => {
            let limiter = avm_gateway::RateLimiter::shared(url, &config.redis.key_prefix).await?;
            tracing::info!("rate limits shared through redis");
            Ok(limiter)
        }
        None => Ok(avm_gateway::RateLimiter::new()),
    }
}

/// Returns the service key of this deployment.
fn service_key(config: &AvmConfig) -> anyhow::Result<String> {
    Ok(config.auth.require_service_key()?.to_owned())
}

/// The pieces every component but auth needs to take part in authentication.
struct AuthPeer {
    channel: tonic::transport::Channel,
    identity: ServiceIdentity,
    verifier: TokenVerifier,
}

impl AuthPeer {
    /// Connects to the auth service at `addr` with `service_key`.
    fn new(addr: &str, service_key: &str, config: &AvmConfig) -> anyhow::Result<Self> {
        let channel = channel(addr, &config.grpc)?;
        let identity = ServiceIdentity::new(service_key, channel.clone(), &config.grpc);
        let source = Arc::new(GrpcKeySource::new(channel.clone()));
        let verifier = TokenVerifier::new(&config.auth, source);
        Ok(Self {
            channel,
            identity,
            verifier,
        })
    }

    /// Returns the gateway's authenticator.
    fn authenticator(&self, config: &AvmConfig) -> avm_gateway::Authenticator {
        avm_gateway::Authenticator::new(self.verifier.clone(), self.channel.clone(), config.auth.oidc.is_some())
    }
}

fn peer_addr(addr: &Option<String>, variable: &str) -> anyhow::Result<String> {
    addr.clone()
        .with_context(|| format!("{variable} is required (e.g. {variable}=http://127.0.0.1:7000)"))
}

/// Where the runtime finds the services it reads.
struct RuntimePeers<'a> {
    session: &'a str,
    resource: &'a str,
    config: &'a str,
    observability: &'a str,
}

fn runtime_pool(
    config: &AvmConfig,
    peers: &RuntimePeers<'_>,
    identity: ServiceIdentity,
) -> anyhow::Result<avm_runtime::AgentPool> {
    let grpc = &config.grpc;
    let sessions = avm_runtime::SessionClient::new(channel(peers.session, grpc)?, grpc);
    let resources = avm_runtime::ResourceClient::new(channel(peers.resource, grpc)?, grpc);
    let llm = avm_runtime::LlmSettings::new(channel(peers.config, grpc)?, identity.clone(), grpc);
    let metering = avm_runtime::Metering::new(channel(peers.observability, grpc)?, identity.clone(), grpc);
    Ok(avm_runtime::AgentPool::new(
        config.runtime.clone(),
        llm,
        metering,
        sessions,
        resources,
        identity,
    ))
}

/// Returns the key material that seals the config service's stored secrets:
/// the configured one, or for `avm serve` one kept in the data dir.
fn config_secret_key(config: &AvmConfig, allow_data_dir: bool) -> anyhow::Result<String> {
    if let Some(key) = config.config.secret_key.expose() {
        return Ok(key.to_owned());
    }
    if !allow_data_dir {
        bail!(
            "AVM_CONFIG_SECRET_KEY is required: 32+ random characters (e.g. `openssl rand -hex 32`), \
             the same on every config replica; it encrypts stored secrets such as llm.apiKey"
        );
    }
    let path = data_dir(config)?.join(CONFIG_KEY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(key) => Ok(key.trim().to_owned()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            let bits: [u64; 4] = rand::random();
            let key: String = bits.iter().map(|b| format!("{b:016x}")).collect();
            write_private(&path, &key)?;
            tracing::info!(file = %path.display(), "made the key that encrypts stored secrets");
            Ok(key)
        }
        Err(err) => Err(err).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// The file `avm serve` keeps the config service's secret key in.
pub const CONFIG_KEY_FILE: &str = "config.key";

/// Opens the config service on its store, over the deployment's layers.
async fn open_config(config: &AvmConfig, allow_data_dir_key: bool) -> anyhow::Result<avm_config::ConfigService> {
    let key = config_secret_key(config, allow_data_dir_key)?;
    let store = avm_config::open_store(&store_url(config, "config")?, config.database.max_connections).await?;
    Ok(avm_config::ConfigService::new(store, config.deployment(), &key)?)
}

/// Opens the observability service on its store.
async fn open_observability(config: &AvmConfig) -> anyhow::Result<avm_observability::ObservabilityService> {
    let store =
        avm_observability::open_store(&store_url(config, "observability")?, config.database.max_connections).await?;
    Ok(avm_observability::ObservabilityService::new(
        store,
        avm_observability::LedgerSettings::default(),
    ))
}

/// Forwards this process's tenant log events to the observability service
/// at `AVM_OBSERVABILITY_ADDR`, when one is named.
fn forward_logs(
    config: &AvmConfig,
    identity: &ServiceIdentity,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(addr) = &config.peers.observability else {
        tracing::info!("AVM_OBSERVABILITY_ADDR is not set: this process's logs stay out of /v1/logs");
        // Nobody will read the queue: closing it stops events being queued.
        drop(avm_common::telemetry::take_log_events());
        return Ok(None);
    };
    forward_logs_to(addr, config, identity, shutdown).map(Some)
}

fn forward_logs_to(
    addr: &str,
    config: &AvmConfig,
    identity: &ServiceIdentity,
    shutdown: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    Ok(avm_common::tenant_logs::spawn_forwarder(
        channel(addr, &config.grpc)?,
        identity.clone(),
        shutdown.clone(),
    ))
}

/// Opens the resource service on its store.
async fn open_resources(config: &AvmConfig) -> anyhow::Result<avm_resource::ResourceService> {
    let store = avm_resource::open_store(&store_url(config, "resource")?, config.database.max_connections).await?;
    Ok(avm_resource::ResourceService::new(store))
}

/// Runs every component in one process until `shutdown`.
pub async fn serve(config: AvmConfig, listeners: ServeListeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    let grpc_url = local_url(&listeners.grpc)?;
    let gateway_url = local_url(&listeners.gateway)?;
    // One process: the components share a service key made for this run,
    // unless the configuration names one.
    let mut auth_config = config.auth.clone();
    if !auth_config.service_key.is_set() {
        let bits: [u64; 4] = rand::random();
        let key: String = bits.iter().map(|b| format!("{b:016x}")).collect();
        auth_config.service_key = Secret::new(key);
    }
    let service_key = auth_config.require_service_key()?.to_owned();
    let auth = open_auth(&config, auth_config).await?;
    let session_url = store_url(&config, "session")?;
    let store = avm_session::open_store(&session_url, config.database.max_connections).await?;
    let sessions = avm_session::SessionService::new(store);
    let settings = open_config(&config, true).await?;
    let resources = open_resources(&config).await?;
    let observability = open_observability(&config).await?;
    let peer = AuthPeer::new(&grpc_url, &service_key, &config)?;
    let all_here = RuntimePeers {
        session: &grpc_url,
        resource: &grpc_url,
        config: &grpc_url,
        observability: &grpc_url,
    };
    let pool = runtime_pool(&config, &all_here, peer.identity.clone())?;

    let servers = CancellationToken::new();
    let grpc_server = GrpcServer::new(&config.grpc)
        .add_service(avm_auth::grpc_server(auth.clone(), &config.grpc))
        .add_service(avm_session::grpc_server(sessions, peer.verifier.clone(), &config.grpc))
        .add_service(avm_resource::grpc_server(
            resources,
            peer.verifier.clone(),
            &config.grpc,
        ))
        .add_service(avm_config::grpc_server(
            settings.clone(),
            peer.verifier.clone(),
            &config.grpc,
        ))
        .add_service(avm_observability::grpc_server(
            observability.clone(),
            peer.verifier.clone(),
            &config.grpc,
        ))
        .add_service(avm_runtime::grpc_server(
            pool.clone(),
            peer.verifier.clone(),
            &config.grpc,
        ));
    let grpc_task = tokio::spawn(grpc_server.serve(listeners.grpc, servers.clone()));
    let background = auth.spawn_background(servers.clone());
    let config_events = settings.spawn_background(servers.clone());
    let ledger = observability.spawn_background(servers.clone());
    let watch = peer.verifier.spawn_watch(peer.identity.clone(), servers.clone());
    let reaper = pool.spawn_background(servers.clone());
    // Log events go to this process's own gRPC server: the forwarder stops
    // (sending what it holds) before the servers do.
    let forwarding = CancellationToken::new();
    let logs = avm_common::tenant_logs::spawn_forwarder(
        channel(&grpc_url, &config.grpc)?,
        peer.identity.clone(),
        forwarding.clone(),
    );
    let mut authenticator = peer.authenticator(&config);
    if config.auth.dev {
        authenticator = authenticator.with_anonymous(auth.dev_key().await?);
        tracing::warn!("dev mode: requests without credentials act as the admin of the local `dev` tenant");
        println!("dev mode: requests without credentials act as the admin of tenant `dev` (loopback only)");
    }
    let local = channel(&grpc_url, &config.grpc)?;
    let peers = avm_gateway::PeerChannels {
        auth: peer.channel.clone(),
        session: local.clone(),
        runtime: local.clone(),
        resource: local.clone(),
        config: local.clone(),
        observability: local,
    };
    let gateway_peers = avm_gateway::Peers::new(peers, &config.grpc);
    let gateway_task = tokio::spawn(avm_gateway::serve(
        listeners.gateway,
        config.gateway.clone(),
        gateway_peers,
        authenticator,
        rate_limiter(&config).await?,
        servers.clone(),
    ));

    println!("listening: gateway {gateway_url}");
    println!("listening: grpc {grpc_url}");
    tracing::info!(
        gateway = %gateway_url,
        grpc = %grpc_url,
        session_store = %redact_url(&session_url),
        "agentvm ready"
    );

    tokio::select! {
        () = shutdown.cancelled() => {}
        result = wait_both(grpc_task, gateway_task) => return result,
    }
    wind_down(&pool, config.grpc.drain_timeout).await;
    forwarding.cancel();
    finish(logs, config.grpc.drain_timeout).await;
    servers.cancel();
    // The ledger writes what it still holds.
    finish(ledger, config.grpc.drain_timeout).await;
    reaper.abort();
    watch.abort();
    background.abort();
    config_events.abort();
    tracing::info!("agentvm stopped");
    Ok(())
}

/// Interrupts running turns so their partial replies are stored, then sends
/// the usage records of every call, before the servers stop; waits at most
/// `limit` for each.
async fn wind_down(pool: &avm_runtime::AgentPool, limit: Duration) {
    pool.interrupt_all();
    let deadline = tokio::time::Instant::now() + limit;
    while pool.any_running() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pool.flush_usage(limit).await;
}

/// Waits for a background task that finishes its work at shutdown, at most `limit`.
async fn finish(task: tokio::task::JoinHandle<()>, limit: Duration) {
    if tokio::time::timeout(limit, task).await.is_err() {
        tracing::warn!(?limit, "a background task did not finish in time");
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

async fn run_auth(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let addr = listen_addr(&config, config.server.grpc_port);
    let listener = bind(&addr).await?;
    service_key(&config)?;
    let auth = open_auth(&config, config.auth.clone()).await?;
    let background = auth.spawn_background(shutdown.clone());
    let server = GrpcServer::new(&config.grpc).add_service(avm_auth::grpc_server(auth, &config.grpc));
    let own_url = local_url(&listener)?;
    // The auth service is its own peer for the identity its log forwarder uses.
    let identity = ServiceIdentity::new(
        service_key(&config)?.as_str(),
        channel(&own_url, &config.grpc)?,
        &config.grpc,
    );
    let logs = forward_logs(&config, &identity, &shutdown)?;
    println!("listening: grpc {own_url}");
    tracing::info!(addr = %listener.local_addr()?, store = %redact_url(&store_url(&config, "auth")?), "auth service ready");
    server.serve(listener, shutdown).await?;
    background.abort();
    if let Some(logs) = logs {
        logs.abort();
    }
    Ok(())
}

/// Runs one service that owns a store (`service` names it and its store)
/// until `shutdown`: binds first, so a port conflict fails before anything
/// else; then `add` opens the store and puts the service on the gRPC server,
/// verifying callers with the auth service's keys.
async fn run_store_service(
    config: &AvmConfig,
    shutdown: CancellationToken,
    service: &str,
    add: impl AsyncFnOnce(GrpcServer, TokenVerifier) -> anyhow::Result<GrpcServer>,
) -> anyhow::Result<()> {
    let addr = listen_addr(config, config.server.grpc_port);
    let listener = bind(&addr).await?;
    let peer = AuthPeer::new(
        &peer_addr(&config.peers.auth, "AVM_AUTH_ADDR")?,
        &service_key(config)?,
        config,
    )?;
    let server = add(GrpcServer::new(&config.grpc), peer.verifier.clone()).await?;
    let watch = peer.verifier.spawn_watch(peer.identity.clone(), shutdown.clone());
    let own_url = local_url(&listener)?;
    let logs = if service == "observability" {
        Some(forward_logs_to(&own_url, config, &peer.identity, &shutdown)?)
    } else {
        forward_logs(config, &peer.identity, &shutdown)?
    };
    println!("listening: grpc {own_url}");
    let store = redact_url(&store_url(config, service)?);
    tracing::info!(addr = %listener.local_addr()?, %store, "{service} service ready");
    server.serve(listener, shutdown).await?;
    watch.abort();
    if let Some(logs) = logs {
        logs.abort();
    }
    Ok(())
}

async fn run_session(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_store_service(&config, shutdown, "session", async |server, verifier| {
        let store = avm_session::open_store(&store_url(&config, "session")?, config.database.max_connections).await?;
        let sessions = avm_session::SessionService::new(store);
        Ok(server.add_service(avm_session::grpc_server(sessions, verifier, &config.grpc)))
    })
    .await
}

async fn run_resource(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_store_service(&config, shutdown, "resource", async |server, verifier| {
        let resources = open_resources(&config).await?;
        Ok(server.add_service(avm_resource::grpc_server(resources, verifier, &config.grpc)))
    })
    .await
}

async fn run_config(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut events = None;
    let result = run_store_service(&config, shutdown.clone(), "config", async |server, verifier| {
        let settings = open_config(&config, false).await?;
        events = Some(settings.spawn_background(shutdown.clone()));
        Ok(server.add_service(avm_config::grpc_server(settings, verifier, &config.grpc)))
    })
    .await;
    if let Some(events) = events {
        events.abort();
    }
    result
}

async fn run_observability(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut ledger = None;
    let result = run_store_service(&config, shutdown.clone(), "observability", async |server, verifier| {
        let observability = open_observability(&config).await?;
        ledger = Some(observability.spawn_background(shutdown.clone()));
        Ok(server.add_service(avm_observability::grpc_server(observability, verifier, &config.grpc)))
    })
    .await;
    // The ledger writes what it still holds before the process ends.
    if let Some(ledger) = ledger {
        finish(ledger, config.grpc.drain_timeout).await;
    }
    result
}

async fn run_runtime(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let addr = listen_addr(&config, config.server.grpc_port);
    let listener = bind(&addr).await?;
    let peer = AuthPeer::new(
        &peer_addr(&config.peers.auth, "AVM_AUTH_ADDR")?,
        &service_key(&config)?,
        &config,
    )?;
    let session_addr = peer_addr(&config.peers.session, "AVM_SESSION_ADDR")?;
    let resource_addr = peer_addr(&config.peers.resource, "AVM_RESOURCE_ADDR")?;
    let config_addr = peer_addr(&config.peers.config, "AVM_CONFIG_ADDR")?;
    let observability_addr = peer_addr(&config.peers.observability, "AVM_OBSERVABILITY_ADDR")?;
    if config.llm.settings_tree() != avm_runtime::LlmConfig::default().settings_tree() {
        tracing::warn!(
            "LLM settings in the runtime's own configuration are not used: the runtime reads them from the \
             config service (set LLM_* on `avm config`, or PUT /v1/config)"
        );
    }
    let peers = RuntimePeers {
        session: &session_addr,
        resource: &resource_addr,
        config: &config_addr,
        observability: &observability_addr,
    };
    let pool = runtime_pool(&config, &peers, peer.identity.clone())?;
    let servers = CancellationToken::new();
    let reaper = pool.spawn_background(servers.clone());
    let logs = forward_logs(&config, &peer.identity, &servers)?;
    let watch = peer.verifier.spawn_watch(peer.identity.clone(), servers.clone());
    let server = GrpcServer::new(&config.grpc).add_service(avm_runtime::grpc_server(
        pool.clone(),
        peer.verifier.clone(),
        &config.grpc,
    ));
    println!("listening: grpc {}", local_url(&listener)?);
    tracing::info!(addr = %listener.local_addr()?, session = %session_addr, "runtime ready");
    let task = tokio::spawn(server.serve(listener, servers.clone()));
    tokio::select! {
        () = shutdown.cancelled() => {}
        result = task => { result??; bail!("the grpc server stopped unexpectedly") }
    }
    wind_down(&pool, config.grpc.drain_timeout).await;
    servers.cancel();
    if let Some(logs) = logs {
        finish(logs, config.grpc.drain_timeout).await;
    }
    reaper.abort();
    watch.abort();
    Ok(())
}

async fn run_gateway(config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let addr = listen_addr(&config, config.server.port);
    if config.auth.dev {
        bail!("--dev (auth.dev) is for `avm serve` only");
    }
    let listener = bind(&addr).await?;
    let peer = AuthPeer::new(
        &peer_addr(&config.peers.auth, "AVM_AUTH_ADDR")?,
        &service_key(&config)?,
        &config,
    )?;
    let session = peer_addr(&config.peers.session, "AVM_SESSION_ADDR")?;
    let runtime = peer_addr(&config.peers.runtime, "AVM_RUNTIME_ADDR")?;
    let peers = avm_gateway::PeerChannels {
        auth: peer.channel.clone(),
        session: channel(&session, &config.grpc)?,
        runtime: channel(&runtime, &config.grpc)?,
        resource: channel(&peer_addr(&config.peers.resource, "AVM_RESOURCE_ADDR")?, &config.grpc)?,
        config: channel(&peer_addr(&config.peers.config, "AVM_CONFIG_ADDR")?, &config.grpc)?,
        observability: channel(
            &peer_addr(&config.peers.observability, "AVM_OBSERVABILITY_ADDR")?,
            &config.grpc,
        )?,
    };
    let gateway_peers = avm_gateway::Peers::new(peers, &config.grpc);
    let watch = peer.verifier.spawn_watch(peer.identity.clone(), shutdown.clone());
    let logs = forward_logs(&config, &peer.identity, &shutdown)?;
    println!("listening: gateway {}", local_url(&listener)?);
    tracing::info!(addr = %listener.local_addr()?, session = %session, runtime = %runtime, "gateway ready");
    avm_gateway::serve(
        listener,
        config.gateway.clone(),
        gateway_peers,
        peer.authenticator(&config),
        rate_limiter(&config).await?,
        shutdown,
    )
    .await?;
    watch.abort();
    if let Some(logs) = logs {
        logs.abort();
    }
    Ok(())
}
