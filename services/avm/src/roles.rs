//! The roles of the binary. Each is built as an [`App`] — listeners bound
//! first, its services opened, its servers and background work added — and
//! run by the one lifecycle of `avm-common`.
//!
//! `avm serve` composes the services' own objects in this process: every
//! call between components is a method call on the service's gRPC adapter
//! (`<Service>Local`), with no encoding, no network hop and no token
//! verification. `avm <component>` reaches its peers over gRPC
//! (`<Service>Remote`) at the addresses of `AVM_*_ADDR`. Both implement the
//! same trait, so every component's code is the same in both.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, bail};
use avm_common::auth::{AuthKeySource, ServiceIdentity, TokenVerifier};
use avm_common::config::Secret;
use avm_common::grpc::{GrpcPort, GrpcServer, LocalCalls, channel};
use avm_common::lifecycle::App;
use avm_proto::auth::v1::{AuthServiceHandle, AuthServiceLocal, AuthServiceRemote};
use avm_proto::config::v1::{ConfigServiceHandle, ConfigServiceLocal, ConfigServiceRemote};
use avm_proto::observability::v1::{ObservabilityServiceHandle, ObservabilityServiceLocal, ObservabilityServiceRemote};
use avm_proto::resource::v1::{ResourceServiceHandle, ResourceServiceLocal, ResourceServiceRemote};
use avm_proto::runtime::v1::RuntimeServiceLocal;
use avm_proto::session::v1::{SessionServiceHandle, SessionServiceLocal, SessionServiceRemote};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::AvmConfig;
use crate::storage::{
    open_auth, open_config, open_observability, open_resources, open_session, random_key, redact_url, store_url,
};

/// What one `avm` process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Every component in one process.
    Serve,
    Gateway,
    Auth,
    Session,
    Resource,
    Config,
    Observability,
    Runtime,
}

impl Role {
    /// Returns the name the process goes by in logs, metrics and traces.
    pub fn name(self) -> &'static str {
        match self {
            Role::Serve => "serve",
            Role::Gateway => "gateway",
            Role::Auth => "auth",
            Role::Session => "session",
            Role::Resource => "resource",
            Role::Config => "config",
            Role::Observability => "observability",
            Role::Runtime => "runtime",
        }
    }

    /// Builds the role and runs it until `shutdown`.
    pub async fn run(self, config: AvmConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
        let app = match self {
            Role::Serve => {
                let listeners = ServeListeners::bind(&config).await?;
                serve_app(config, listeners).await?
            }
            Role::Gateway => gateway_app(config).await?,
            Role::Auth => auth_app(config).await?,
            Role::Session | Role::Resource | Role::Config | Role::Observability => {
                store_service_app(self, config).await?
            }
            Role::Runtime => runtime_app(config).await?,
        };
        app.run(shutdown).await.map_err(|err| anyhow::anyhow!(err))
    }
}

/// Runs every component in one process until `shutdown`.
pub async fn serve(config: AvmConfig, listeners: ServeListeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    serve_app(config, listeners)
        .await?
        .run(shutdown)
        .await
        .map_err(|err| anyhow::anyhow!(err))
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

/// Binds a single component's listener (`--listen`, else host and `default_port`).
async fn bind_component(config: &AvmConfig, default_port: u16) -> anyhow::Result<TcpListener> {
    let addr = config
        .server
        .listen
        .clone()
        .unwrap_or_else(|| format_addr(&config.server.host, default_port));
    bind(&addr).await
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

fn local_url(listener: &TcpListener) -> anyhow::Result<String> {
    let addr: SocketAddr = listener.local_addr()?;
    Ok(format!("http://{addr}"))
}

/// Returns the address of a peer, or says which variable names it.
fn peer_addr(addr: &Option<String>, variable: &str) -> anyhow::Result<String> {
    addr.clone()
        .with_context(|| format!("{variable} is required (e.g. {variable}=http://127.0.0.1:7000)"))
}

/// Returns the service key of this deployment.
fn service_key(config: &AvmConfig) -> anyhow::Result<String> {
    Ok(config.auth.require_service_key()?.to_owned())
}

/// How a process takes part in authentication: the auth service (here or
/// there), its own credential, and a verifier following revocations.
struct Credentials {
    auth: AuthServiceHandle,
    identity: ServiceIdentity,
    verifier: TokenVerifier,
}

impl Credentials {
    /// Returns the credentials of a process whose auth service is `auth`;
    /// the verifier follows auth events until the background stops.
    fn new(config: &AvmConfig, service_key: &str, auth: AuthServiceHandle, app: &mut App) -> Self {
        let identity = ServiceIdentity::new(service_key, auth.clone());
        let verifier = TokenVerifier::new(&config.auth, Arc::new(AuthKeySource::new(auth.clone())));
        app.background(verifier.spawn_watch(identity.clone(), app.background_stop()));
        Self {
            auth,
            identity,
            verifier,
        }
    }

    /// Returns the credentials of a component whose auth service is at `AVM_AUTH_ADDR`.
    fn remote(config: &AvmConfig, app: &mut App) -> anyhow::Result<Self> {
        let addr = peer_addr(&config.peers.auth, "AVM_AUTH_ADDR")?;
        let auth = AuthServiceRemote::new(channel(&addr, &config.grpc)?, config.grpc.max_message_bytes).handle();
        Ok(Self::new(config, &service_key(config)?, auth, app))
    }

    /// Returns the readiness check of a component holding these credentials
    /// (the gRPC health name `ready`): its service key accepted, auth events live.
    fn readiness(&self) -> impl Fn() -> Vec<avm_common::auth::Unready> + Send + Sync + 'static {
        let (identity, verifier) = (self.identity.clone(), self.verifier.clone());
        move || avm_common::auth::unready(&identity, &verifier)
    }

    /// Returns the gateway's authenticator.
    fn authenticator(&self, config: &AvmConfig) -> avm_gateway::Authenticator {
        avm_gateway::Authenticator::new(self.verifier.clone(), self.identity.clone(), config.auth.oidc.is_some())
    }
}

/// Returns the client of a peer at the address a variable names.
fn remote<T>(
    config: &AvmConfig,
    addr: &Option<String>,
    variable: &str,
    client: impl FnOnce(tonic::transport::Channel, usize) -> T,
) -> anyhow::Result<T> {
    let addr = peer_addr(addr, variable)?;
    Ok(client(channel(&addr, &config.grpc)?, config.grpc.max_message_bytes))
}

/// Sends this process's tenant log events to `observability` (flushed before
/// the servers stop), or, without one, stops queueing them.
fn forward_logs(app: &mut App, observability: Option<ObservabilityServiceHandle>, identity: &ServiceIdentity) {
    let Some(observability) = observability else {
        tracing::info!("AVM_OBSERVABILITY_ADDR is not set: this process's logs stay out of /v1/logs");
        // Nobody will read the queue: closing it stops events being queued.
        drop(avm_common::telemetry::take_log_events());
        return;
    };
    let stop = CancellationToken::new();
    let task = avm_observability::spawn_log_forwarder(observability, identity.clone(), stop.clone());
    app.flush_before_servers("log forwarder", stop, task);
}

/// Returns the observability service at `AVM_OBSERVABILITY_ADDR`, when one is named.
fn remote_observability(config: &AvmConfig) -> anyhow::Result<Option<ObservabilityServiceHandle>> {
    match &config.peers.observability {
        None => Ok(None),
        Some(addr) => Ok(Some(
            ObservabilityServiceRemote::new(channel(addr, &config.grpc)?, config.grpc.max_message_bytes).handle(),
        )),
    }
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

/// Opens a component's gRPC port: it answers health from now on, not ready
/// and refusing calls as `STARTING` until the component's services attach.
async fn open_grpc(app: &mut App, listener: TcpListener, config: &AvmConfig) -> anyhow::Result<(GrpcPort, String)> {
    let url = local_url(&listener)?;
    let (port, serving) = GrpcPort::open(listener, &config.grpc, app.servers_stop()).await?;
    app.serve("grpc server", serving);
    println!("starting: grpc {url}");
    Ok((port, url))
}

// The components. Each builder opens what its component owns and adds the
// component's background work to the app. `avm serve` composes every one of
// them in one process; `avm <component>` runs one over its peers' gRPC.

/// The auth service: its store and background work.
async fn auth_component(
    config: &AvmConfig,
    auth_config: avm_common::auth::AuthConfig,
    allow_data_dir_key: bool,
    app: &mut App,
) -> anyhow::Result<avm_auth::AuthService> {
    let auth = open_auth(config, auth_config, allow_data_dir_key).await?;
    app.background(auth.spawn_background(app.background_stop()));
    Ok(auth)
}

/// The session service, resolving resource references at `resources`.
async fn session_component(
    config: &AvmConfig,
    resources: ResourceServiceHandle,
    app: &mut App,
) -> anyhow::Result<avm_session::SessionService> {
    let sessions = open_session(config)
        .await?
        .with_references(avm_session::References::new(resources));
    app.background(sessions.spawn_background(app.background_stop()));
    // Retention applies each tenant's policy, a bounded sweep at a time.
    app.background(sessions.spawn_retention(config.session.retention_interval, app.background_stop()));
    Ok(sessions)
}

/// The config service.
async fn config_component(
    config: &AvmConfig,
    allow_data_dir_key: bool,
    app: &mut App,
) -> anyhow::Result<avm_config::ConfigService> {
    let settings = open_config(config, allow_data_dir_key).await?;
    app.background(settings.spawn_background(app.background_stop()));
    Ok(settings)
}

/// The observability service. Its ledger writes what it still holds once
/// the servers stop, and the calls it writes count against the token
/// quotas of `auth` after it.
async fn observability_component(
    config: &AvmConfig,
    auth: AuthServiceHandle,
    identity: &ServiceIdentity,
    app: &mut App,
) -> anyhow::Result<avm_observability::ObservabilityService> {
    let observability = open_observability(config).await?;
    app.flush_after_servers("usage ledger", observability.spawn_background(app.background_stop()));
    let stop = CancellationToken::new();
    let (quotas, task) = avm_observability::AuthQuotas::spawn(auth, identity.clone(), stop.clone());
    observability.count_quotas_with(quotas);
    app.flush_after_servers_on("quota reports", stop, task);
    Ok(observability)
}

/// The runtime's peers.
struct RuntimePeers {
    session: SessionServiceHandle,
    resource: ResourceServiceHandle,
    config: ConfigServiceHandle,
    observability: ObservabilityServiceHandle,
}

/// The runtime: its agent pool over `peers`, whose background work runs
/// with the app. At shutdown running turns finish within the drain timeout
/// (the rest are interrupted, so their partial replies are stored), the
/// workspaces kept in an object store are saved and the usage of every call
/// is sent, before the services it reports to stop.
fn runtime_component(
    config: &AvmConfig,
    peers: RuntimePeers,
    identity: &ServiceIdentity,
    replicas: Option<avm_runtime::replicas::Replicas>,
    app: &mut App,
) -> anyhow::Result<avm_runtime::AgentPool> {
    use avm_runtime::peers::{Configs, Resources, Sessions, Usages};
    let mut runtime = config.runtime.clone();
    let data_dir = std::path::absolute(config.server.data_dir())?;
    let workspace_root = match &runtime.workspace_root {
        Some(root) => std::path::absolute(root)?,
        None => data_dir.join("workspaces"),
    };
    runtime.workspace_root = Some(workspace_root);
    let pool = avm_runtime::AgentPool::new(
        runtime,
        avm_runtime::LlmSettings::new(Configs::new(peers.config), identity.clone()),
        avm_runtime::Metering::new(Usages::new(peers.observability), identity.clone()),
        Sessions::new(peers.session),
        Resources::new(peers.resource),
        identity.clone(),
        replicas,
    )
    .map_err(|err| anyhow::anyhow!(err))?;
    app.background(pool.spawn_background(app.background_stop()));
    let drain_timeout = config.grpc.drain_timeout;
    let draining = pool.clone();
    app.on_drain(move || async move {
        draining.drain(drain_timeout).await;
        let deadline = tokio::time::Instant::now() + drain_timeout;
        while draining.any_running() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Workspaces kept in an object store follow their agents to another replica.
        draining.save_workspaces(drain_timeout).await;
        draining.flush_usage(drain_timeout).await;
    });
    Ok(pool)
}

/// The gateway on `listener`, translating the public API for `peers`.
async fn gateway_component(
    config: &AvmConfig,
    listener: TcpListener,
    peers: avm_gateway::Peers,
    authenticator: avm_gateway::Authenticator,
    app: &mut App,
) -> anyhow::Result<()> {
    let server = avm_gateway::serve(
        listener,
        config.gateway.clone(),
        peers,
        authenticator,
        rate_limiter(config).await?,
        app.stopping(),
        app.servers_stop(),
    );
    app.serve("gateway", server);
    Ok(())
}

/// Every component in one process, each built as its own role builds it,
/// calling the others through their services' gRPC adapters in process.
/// How long `avm serve` waits for its runtime to follow the session
/// service's changes before it opens the gateway anyway.
const SESSIONS_FOLLOWED_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

async fn serve_app(config: AvmConfig, listeners: ServeListeners) -> anyhow::Result<App> {
    let gateway_url = local_url(&listeners.gateway)?;
    let mut app = App::new("serve", config.grpc.drain_timeout);
    let (port, grpc_url) = open_grpc(&mut app, listeners.grpc, &config).await?;
    // One process: the components share a service key made for this run,
    // unless the configuration names one.
    let mut auth_config = config.auth.clone();
    if !auth_config.service_key.is_set() {
        auth_config.service_key = Secret::new(random_key());
    }
    let key = auth_config.require_service_key()?.to_owned();
    let auth = auth_component(&config, auth_config, true, &mut app).await?;
    let auth_handle = AuthServiceLocal::new(avm_auth::AuthGrpc::new(auth.clone()), LocalCalls).handle();
    let credentials = Credentials::new(&config, &key, auth_handle.clone(), &mut app);
    let resources = open_resources(&config).await?;
    let resource_handle =
        ResourceServiceLocal::new(avm_resource::ResourceGrpc::new(resources.clone()), LocalCalls).handle();
    let sessions = session_component(&config, resource_handle.clone(), &mut app).await?;
    let session_handle = SessionServiceLocal::new(avm_session::SessionGrpc::new(sessions.clone()), LocalCalls).handle();
    let settings = config_component(&config, true, &mut app).await?;
    let config_handle = ConfigServiceLocal::new(avm_config::ConfigGrpc::new(settings.clone()), LocalCalls).handle();
    let observability = observability_component(&config, auth_handle.clone(), &credentials.identity, &mut app).await?;
    let observability_handle = ObservabilityServiceLocal::new(
        avm_observability::ObservabilityGrpc::new(observability.clone()),
        LocalCalls,
    )
    .handle();
    let peers = RuntimePeers {
        session: session_handle.clone(),
        resource: resource_handle.clone(),
        config: config_handle.clone(),
        observability: observability_handle.clone(),
    };
    let pool = runtime_component(&config, peers, &credentials.identity, None, &mut app)?;
    let runtime_handle = RuntimeServiceLocal::new(avm_runtime::RuntimeGrpc::new(pool.clone()), LocalCalls).handle();
    forward_logs(&mut app, Some(observability_handle.clone()), &credentials.identity);

    // The gRPC port serves every service to internal callers.
    let verifier = &credentials.verifier;
    let grpc = GrpcServer::new(&config.grpc)
        .add_service(avm_auth::grpc_server(auth.clone(), &config.grpc))
        .add_service(avm_session::grpc_server(sessions, verifier.clone(), &config.grpc))
        .add_service(avm_resource::grpc_server(resources, verifier.clone(), &config.grpc))
        .add_service(avm_config::grpc_server(settings, verifier.clone(), &config.grpc))
        .add_service(avm_observability::grpc_server(
            observability,
            verifier.clone(),
            &config.grpc,
        ))
        .add_service(avm_runtime::grpc_server(pool.clone(), verifier.clone(), &config.grpc));
    port.attach(grpc).await;

    let mut authenticator = credentials.authenticator(&config);
    if config.auth.dev {
        authenticator = authenticator.with_anonymous(auth.dev_key().await?);
        tracing::warn!("dev mode: requests without credentials act as the admin of the local `dev` tenant");
        println!("dev mode: requests without credentials act as the admin of tenant `dev` (loopback only)");
    }
    let peers = avm_gateway::Peers::local(
        auth_handle,
        session_handle,
        runtime_handle,
        resource_handle,
        config_handle,
        observability_handle,
    );
    // Opened once a group message posted through it would wake its agents.
    if !pool.following_sessions(SESSIONS_FOLLOWED_WITHIN).await {
        tracing::warn!(
            "the runtime does not follow the session service's changes yet: group messages wake nobody until it does"
        );
    }
    gateway_component(&config, listeners.gateway, peers, authenticator, &mut app).await?;
    println!("listening: gateway {gateway_url}");
    println!("listening: grpc {grpc_url}");
    tracing::info!(
        gateway = %gateway_url,
        grpc = %grpc_url,
        session_store = %redact_url(&store_url(&config, "session")?),
        "agentvm ready"
    );
    Ok(app)
}

/// The auth service alone; it is its own peer for its service identity.
async fn auth_app(config: AvmConfig) -> anyhow::Result<App> {
    let listener = bind_component(&config, config.server.grpc_port).await?;
    let key = service_key(&config)?;
    let mut app = App::new("auth", config.grpc.drain_timeout);
    let (port, url) = open_grpc(&mut app, listener, &config).await?;
    let auth = auth_component(&config, config.auth.clone(), false, &mut app).await?;
    let own = AuthServiceLocal::new(avm_auth::AuthGrpc::new(auth.clone()), LocalCalls).handle();
    let identity = ServiceIdentity::new(&key, own);
    forward_logs(&mut app, remote_observability(&config)?, &identity);
    port.attach(GrpcServer::new(&config.grpc).add_service(avm_auth::grpc_server(auth, &config.grpc)))
        .await;
    println!("listening: grpc {url}");
    tracing::info!(addr = %url, store = %redact_url(&store_url(&config, "auth")?), "auth service ready");
    Ok(app)
}

/// One of the services that own a store: session, resource, config, observability.
async fn store_service_app(role: Role, config: AvmConfig) -> anyhow::Result<App> {
    let listener = bind_component(&config, config.server.grpc_port).await?;
    let mut app = App::new(role.name(), config.grpc.drain_timeout);
    let (port, url) = open_grpc(&mut app, listener, &config).await?;
    let credentials = Credentials::remote(&config, &mut app)?;
    let verifier = credentials.verifier.clone();
    let server = GrpcServer::new(&config.grpc).with_readiness(credentials.readiness());
    let (server, observability) = match role {
        Role::Session => {
            let resources = remote(
                &config,
                &config.peers.resource,
                "AVM_RESOURCE_ADDR",
                |channel, limit| ResourceServiceRemote::new(channel, limit).handle(),
            )?;
            let sessions = session_component(&config, resources, &mut app).await?;
            (
                server.add_service(avm_session::grpc_server(sessions, verifier, &config.grpc)),
                remote_observability(&config)?,
            )
        }
        Role::Resource => {
            let resources = open_resources(&config).await?;
            (
                server.add_service(avm_resource::grpc_server(resources, verifier, &config.grpc)),
                remote_observability(&config)?,
            )
        }
        Role::Config => {
            let settings = config_component(&config, false, &mut app).await?;
            (
                server.add_service(avm_config::grpc_server(settings, verifier, &config.grpc)),
                remote_observability(&config)?,
            )
        }
        Role::Observability => {
            let observability =
                observability_component(&config, credentials.auth.clone(), &credentials.identity, &mut app).await?;
            // Its own log events go straight to itself.
            let own = ObservabilityServiceLocal::new(
                avm_observability::ObservabilityGrpc::new(observability.clone()),
                LocalCalls,
            )
            .handle();
            (
                server.add_service(avm_observability::grpc_server(observability, verifier, &config.grpc)),
                Some(own),
            )
        }
        Role::Serve | Role::Gateway | Role::Auth | Role::Runtime => bail!("{} does not own a store", role.name()),
    };
    forward_logs(&mut app, observability, &credentials.identity);
    port.attach(server).await;
    println!("listening: grpc {url}");
    let store = redact_url(&store_url(&config, role.name())?);
    tracing::info!(addr = %url, %store, "{} service ready", role.name());
    Ok(app)
}

/// The runtime alone, over its peers' gRPC.
async fn runtime_app(config: AvmConfig) -> anyhow::Result<App> {
    let listener = bind_component(&config, config.server.grpc_port).await?;
    let mut app = App::new("runtime", config.grpc.drain_timeout);
    let replicas = runtime_replicas(&config, &listener).await?;
    let (port, url) = open_grpc(&mut app, listener, &config).await?;
    let credentials = Credentials::remote(&config, &mut app)?;
    if config.llm.settings_tree() != avm_runtime::LlmConfig::default().settings_tree() {
        tracing::warn!(
            "LLM settings in the runtime's own configuration are not used: the runtime reads them from the \
             config service (set LLM_* on `avm config`, or PUT /v1/config)"
        );
    }
    let peers = &config.peers;
    let observability = remote(
        &config,
        &peers.observability,
        "AVM_OBSERVABILITY_ADDR",
        |channel, limit| ObservabilityServiceRemote::new(channel, limit).handle(),
    )?;
    let peers = RuntimePeers {
        session: remote(&config, &peers.session, "AVM_SESSION_ADDR", |channel, limit| {
            SessionServiceRemote::new(channel, limit).handle()
        })?,
        resource: remote(&config, &peers.resource, "AVM_RESOURCE_ADDR", |channel, limit| {
            ResourceServiceRemote::new(channel, limit).handle()
        })?,
        config: remote(&config, &peers.config, "AVM_CONFIG_ADDR", |channel, limit| {
            ConfigServiceRemote::new(channel, limit).handle()
        })?,
        observability: observability.clone(),
    };
    let pool = runtime_component(&config, peers, &credentials.identity, replicas, &mut app)?;
    forward_logs(&mut app, Some(observability), &credentials.identity);
    let credentials_ready = credentials.readiness();
    let starting = pool.clone();
    let server = GrpcServer::new(&config.grpc)
        .with_readiness(move || {
            let mut unready = credentials_ready();
            unready.extend(starting.starting());
            unready
        })
        .add_service(avm_runtime::grpc_server(
            pool,
            credentials.verifier.clone(),
            &config.grpc,
        ));
    port.attach(server).await;
    println!("listening: grpc {url}");
    tracing::info!(addr = %url, "runtime ready");
    Ok(app)
}

/// Returns this runtime's place among its replicas, when Redis is configured
/// (`AVM_REDIS_URL`): it registers at `AVM_SERVER_ADVERTISE`, else at its
/// listen address (which must then be one others can reach).
async fn runtime_replicas(
    config: &AvmConfig,
    listener: &TcpListener,
) -> anyhow::Result<Option<avm_runtime::replicas::Replicas>> {
    let Some(url) = config.redis.url.as_ref().and_then(Secret::expose) else {
        tracing::info!("AVM_REDIS_URL is not set: this runtime runs alone (no replicas)");
        return Ok(None);
    };
    let advertise = match &config.server.advertise {
        Some(addr) => addr.clone(),
        None => {
            let url = local_url(listener)?;
            if listener.local_addr()?.ip().is_unspecified() {
                bail!(
                    "the runtime listens on {url} and shares agents through redis: set AVM_SERVER_ADVERTISE \
                     to the address other replicas and gateways reach it at (in Kubernetes, the pod IP)"
                );
            }
            url
        }
    };
    let settings = avm_runtime::replicas::ReplicaSettings {
        redis_url: url.to_owned(),
        key_prefix: config.redis.key_prefix.clone(),
        advertise,
        grpc: config.grpc.clone(),
    };
    let runtime = &config.runtime;
    let replicas =
        avm_runtime::replicas::Replicas::connect(settings, runtime.event_retention, runtime.event_retention_period)
            .await
            .map_err(|err| anyhow::anyhow!("{}", err.message))?;
    Ok(Some(replicas))
}

/// The gateway alone, over its peers' gRPC.
async fn gateway_app(config: AvmConfig) -> anyhow::Result<App> {
    if config.auth.dev {
        bail!("--dev (auth.dev) is for `avm serve` only");
    }
    let listener = bind_component(&config, config.server.port).await?;
    let mut app = App::new("gateway", config.grpc.drain_timeout);
    let credentials = Credentials::remote(&config, &mut app)?;
    let addr = |addr: &Option<String>, variable: &str| -> anyhow::Result<tonic::transport::Channel> {
        Ok(channel(&peer_addr(addr, variable)?, &config.grpc)?)
    };
    let peers = &config.peers;
    let channels = avm_gateway::PeerChannels {
        auth: addr(&peers.auth, "AVM_AUTH_ADDR")?,
        session: addr(&peers.session, "AVM_SESSION_ADDR")?,
        runtime: avm_common::grpc::channels(&peer_addr(&peers.runtime, "AVM_RUNTIME_ADDR")?, &config.grpc)?,
        resource: addr(&peers.resource, "AVM_RESOURCE_ADDR")?,
        config: addr(&peers.config, "AVM_CONFIG_ADDR")?,
        observability: addr(&peers.observability, "AVM_OBSERVABILITY_ADDR")?,
    };
    forward_logs(&mut app, remote_observability(&config)?, &credentials.identity);
    let url = local_url(&listener)?;
    let peers = avm_gateway::Peers::remote(channels, &config.grpc)?;
    gateway_component(&config, listener, peers, credentials.authenticator(&config), &mut app).await?;
    println!("listening: gateway {url}");
    tracing::info!(addr = %url, "gateway ready");
    Ok(app)
}
