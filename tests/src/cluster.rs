//! A running AgentVM for tests: all components in this process (as `avm
//! serve` runs them), or one spawned `avm` process per component.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};
use avm::{AvmConfig, ServeListeners};
use avm_common::config::Secret;
use avm_runtime::config::ProviderKind;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// How the components run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Everything in this process, composed exactly as `avm serve` composes it.
    OneProcess,
    /// `avm session`, `avm runtime` and `avm gateway` as separate processes.
    PerComponent,
}

/// Which LLM the runtime talks to.
#[derive(Clone, Debug)]
pub enum Llm {
    Offline,
    Anthropic { base_url: String },
    OpenAi { base_url: String },
}

/// What the cluster is started with.
#[derive(Clone, Debug)]
pub struct Options {
    pub llm: Llm,
    /// The session service's database; SQLite under the data dir when `None`.
    pub database_url: Option<String>,
    pub agent_idle_timeout: Option<Duration>,
    /// Consecutive agent messages a group takes (`[runtime] group_runaway_limit`).
    pub group_runaway_limit: Option<u64>,
    /// Events a subscriber may fall behind (`[runtime] subscriber_queue`).
    pub subscriber_queue: Option<usize>,
    /// How long a subscriber that fell behind may read nothing before it is
    /// cut off (`[runtime] subscriber_stall_timeout`).
    pub subscriber_stall_timeout: Option<Duration>,
    /// Group turns at once per runtime and per tenant (`[runtime]
    /// max_running_agents`, `max_running_agents_per_tenant`).
    pub max_running_agents: Option<(usize, usize)>,
    pub max_frame_bytes: Option<usize>,
    pub llm_idle_timeout: Option<Duration>,
    /// Frames per second one WebSocket connection may send.
    pub messages_per_second: Option<u32>,
    /// Failed `POST /v1/auth/token` calls one client may make in a burst
    /// (`[gateway] failed_token_exchanges_per_minute`; 0: no limit).
    pub failed_token_exchanges_per_minute: Option<u32>,
    /// Redis for shared rate limits (`AVM_REDIS_URL`), with the key prefix to use.
    pub redis: Option<(String, String)>,
    /// Runs a per-component cluster without Redis even when
    /// `AVM_TEST_REDIS_URL` is set: a runtime alone, keeping in memory what
    /// it would otherwise share.
    pub without_redis: bool,
    /// Log filter of the components (default `warn`).
    pub log_level: Option<String>,
    /// Keeps the per-component processes' logs for [`Cluster::logs`].
    pub capture_logs: bool,
    /// More environment for every spawned process.
    pub env: Vec<(String, String)>,
    /// Runs a one-process cluster as a spawned `avm serve` rather than in
    /// this process: for what is global to a process (its log subscriber).
    pub serve_process: bool,
    /// Internal addresses tools may reach anyway (`[runtime.fetch] allow`).
    pub network_allow: Vec<String>,
    /// Commands tenants' tool resources may start (`[runtime.mcp] allowed_commands`).
    pub mcp_commands: Vec<String>,
    /// Runtime replicas of a per-component cluster (at least one; several
    /// need `redis`), all named to the gateway in `AVM_RUNTIME_ADDR`.
    pub runtimes: usize,
    /// Where workspaces persist between agents (`[runtime] workspace_store`,
    /// `AVM_RUNTIME_WORKSPACE_STORE`); its settings go in `env`.
    pub workspace_store: Option<String>,
    /// More host paths commands' roots hold, read-only (`[runtime.sandbox] expose`).
    pub expose: Vec<PathBuf>,
    /// Runs commands in an `avm sandbox` child per image
    /// (`[runtime.sandbox] provider = "process"`).
    pub sandbox_process: bool,
    /// Claims commands' sandboxes from these `avm sandbox` addresses
    /// (`[runtime.sandbox] provider = "pool"`, `pool`).
    pub sandbox_pool: Vec<String>,
    /// The pools of environments of their own (`[runtime.sandbox] pools`).
    pub sandbox_pools: avm_sandbox::EnvironmentPools,
    /// Claims commands' sandboxes as pods of a Kubernetes cluster
    /// (`[runtime.sandbox] provider = "kubernetes"`, `kubernetes`).
    pub sandbox_kubernetes: Option<avm_sandbox::KubernetesSandboxes>,
    /// A configuration file a spawned `avm serve` reads (`--config`), as an
    /// operator names it on the command line.
    pub config_file: Option<PathBuf>,
    /// Runs a spawned `avm serve` as this user and group (through
    /// `setpriv`), who owns the data directory: an unprivileged server.
    pub run_as: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            llm: Llm::Offline,
            database_url: None,
            agent_idle_timeout: None,
            group_runaway_limit: None,
            subscriber_queue: None,
            subscriber_stall_timeout: None,
            max_running_agents: None,
            max_frame_bytes: None,
            llm_idle_timeout: None,
            messages_per_second: None,
            failed_token_exchanges_per_minute: None,
            redis: None,
            without_redis: false,
            log_level: None,
            capture_logs: false,
            env: Vec::new(),
            serve_process: false,
            network_allow: Vec::new(),
            mcp_commands: Vec::new(),
            runtimes: 1,
            workspace_store: None,
            expose: Vec::new(),
            sandbox_process: false,
            sandbox_pool: Vec::new(),
            sandbox_pools: avm_sandbox::EnvironmentPools::default(),
            sandbox_kubernetes: None,
            config_file: None,
            run_as: None,
        }
    }
}

impl Options {
    /// Returns options with the given LLM.
    pub fn with_llm(llm: Llm) -> Self {
        Self { llm, ..Self::default() }
    }
}

/// The test API key handed to the runtime; it must never show up anywhere.
pub const TEST_API_KEY: &str = "sk-test-canary-3f1c9a";

/// The service key of per-component clusters; it must never show up anywhere either.
pub const TEST_SERVICE_KEY: &str = "svc-test-canary-0b7d1e5a9c2f4e6b8d0a1c3e5f7a9b1d";

/// The key sealing stored secrets in per-component clusters; never shown either.
pub const TEST_CONFIG_SECRET_KEY: &str = "cfg-test-canary-6e2b8d4f0a1c3e5a7b9d1f3e5c7a9b2d";

enum Running {
    InProcess {
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<anyhow::Result<()>>,
    },
    Processes {
        children: Vec<Child>,
    },
}

/// A started cluster; stopped when dropped.
pub struct Cluster {
    pub mode: Mode,
    /// `http://127.0.0.1:PORT` of the gateway.
    pub gateway_url: String,
    /// `http://127.0.0.1:PORT` of the session service's gRPC.
    pub session_grpc: String,
    /// `http://127.0.0.1:PORT` of the runtime's gRPC (the first replica's).
    pub runtime_grpc: String,
    /// Every runtime replica's gRPC URL (per-component clusters).
    pub runtimes: Vec<String>,
    /// Where each runtime replica is among the processes.
    runtime_slots: Vec<usize>,
    /// How each component of a per-component cluster was started, to start
    /// it again after a fault.
    components: Vec<Component>,
    /// `http://127.0.0.1:PORT` of the auth service's gRPC.
    pub auth_grpc: String,
    /// `http://127.0.0.1:PORT` of the resource service's gRPC.
    pub resource_grpc: String,
    /// `http://127.0.0.1:PORT` of the config service's gRPC.
    pub config_grpc: String,
    /// `http://127.0.0.1:PORT` of the observability service's gRPC.
    pub observability_grpc: String,
    /// The operator admin's API key, as the first run printed it.
    pub admin_key: String,
    options: Options,
    data_dir: PathBuf,
    /// The environment of the gateway process, for extra replicas.
    gateway_env: Vec<(String, String)>,
    /// What the processes wrote to stderr, when captured.
    logs: Arc<Mutex<String>>,
    _temp: Option<Arc<tempfile::TempDir>>,
    /// Drops the Postgres schemas of a cluster that made its own.
    _schemas: Option<Arc<SchemaGuard>>,
    running: Option<Running>,
}

/// One process of a per-component cluster: what it is, its environment and
/// where it listens, and where it is among the processes.
struct Component {
    name: String,
    env: Vec<(String, String)>,
    url: String,
    slot: usize,
}

/// The per-service schemas (`<base>_auth`, `<base>_session`, …) a per-component
/// cluster made in `AVM_TEST_DATABASE_URL`, dropped with the cluster.
struct SchemaGuard {
    url: String,
    base: String,
}

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        let schemas: Vec<String> = SERVICES
            .iter()
            .map(|service| format!("{}_{service}", self.base))
            .collect();
        avm_store::testing::drop_schemas(&self.url, &schemas);
    }
}

/// The services that keep tables, each in its own schema or file.
const SERVICES: [&str; 5] = ["auth", "session", "resource", "config", "observability"];
/// Returns a variable of the external test services, when set.
fn external(variable: &str) -> Option<String> {
    std::env::var(variable).ok().filter(|value| !value.is_empty())
}

impl Cluster {
    /// Starts a cluster in `mode` with a fresh data directory.
    ///
    /// A per-component cluster runs as in production when the external test
    /// services are configured: every service on Postgres (its own fresh
    /// schemas in `AVM_TEST_DATABASE_URL`) and rate limits in Redis
    /// (`AVM_TEST_REDIS_URL`, under a fresh key prefix). A one-process
    /// cluster stays on SQLite files and in-memory counters, as on a laptop.
    pub async fn start(mode: Mode, mut options: Options) -> anyhow::Result<Self> {
        let temp = Arc::new(tempfile::tempdir()?);
        let data_dir = temp.path().to_owned();
        // As `avm` makes its own data dir: readable only by the user.
        #[cfg(unix)]
        std::fs::set_permissions(&data_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        if let Some(user) = options.run_as {
            std::os::unix::fs::chown(&data_dir, Some(user), Some(user))?;
        }
        let mut schemas = None;
        if mode == Mode::PerComponent {
            if options.database_url.is_none()
                && let Some(url) = external("AVM_TEST_DATABASE_URL")
            {
                let base = avm_common::ids::new_id("avm_e2e");
                let separator = if url.contains('?') { '&' } else { '?' };
                options.database_url = Some(format!("{url}{separator}options=-c%20search_path%3D{base}"));
                schemas = Some(Arc::new(SchemaGuard { url, base }));
            }
            if options.redis.is_none()
                && !options.without_redis
                && let Some(url) = external("AVM_TEST_REDIS_URL")
            {
                options.redis = Some((url, format!("{}:", avm_common::ids::new_id("avmtest"))));
            }
        }
        Self::start_in(mode, options, data_dir, Some(temp), schemas).await
    }

    async fn start_in(
        mode: Mode,
        options: Options,
        data_dir: PathBuf,
        temp: Option<Arc<tempfile::TempDir>>,
        schemas: Option<Arc<SchemaGuard>>,
    ) -> anyhow::Result<Self> {
        let mut cluster = Self {
            mode,
            gateway_url: String::new(),
            session_grpc: String::new(),
            runtime_grpc: String::new(),
            runtimes: Vec::new(),
            runtime_slots: Vec::new(),
            components: Vec::new(),
            auth_grpc: String::new(),
            resource_grpc: String::new(),
            config_grpc: String::new(),
            observability_grpc: String::new(),
            admin_key: String::new(),
            options,
            data_dir,
            gateway_env: Vec::new(),
            logs: Arc::new(Mutex::new(String::new())),
            _temp: temp,
            _schemas: schemas,
            running: None,
        };
        match mode {
            Mode::OneProcess if cluster.options.serve_process => cluster.start_serve_process().await?,
            Mode::OneProcess => cluster.start_in_process().await?,
            Mode::PerComponent => cluster.start_processes().await?,
        }
        Ok(cluster)
    }

    /// Returns the Redis URL and key prefix the cluster's processes share,
    /// when it has Redis.
    pub fn redis(&self) -> Option<(&str, &str)> {
        self.options
            .redis
            .as_ref()
            .map(|(url, prefix)| (url.as_str(), prefix.as_str()))
    }

    /// Returns the WebSocket endpoint, authenticated as the operator admin.
    pub fn ws_url(&self) -> String {
        self.ws_url_as(&self.admin_key)
    }

    /// Returns the WebSocket endpoint authenticated with `credential` in `?token=`.
    pub fn ws_url_as(&self, credential: &str) -> String {
        format!("{}?token={credential}", self.ws_base_url())
    }

    /// Returns the WebSocket endpoint without credentials.
    pub fn ws_base_url(&self) -> String {
        format!("{}/ws", self.gateway_url.replacen("http://", "ws://", 1))
    }

    /// Returns an HTTP client that authenticates as the operator admin.
    pub fn http(&self) -> anyhow::Result<reqwest::Client> {
        http_client(&self.admin_key)
    }

    /// Returns the data directory (SQLite files, the admin key).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Returns what the component processes logged so far (per-component
    /// clusters started with `capture_logs`).
    pub fn logs(&self) -> String {
        self.logs.lock().unwrap_or_else(|poison| poison.into_inner()).clone()
    }

    /// Starts another gateway replica of a per-component cluster and returns its URL.
    pub async fn spawn_gateway(&mut self) -> anyhow::Result<String> {
        let Some(Running::Processes { children }) = &mut self.running else {
            bail!("extra gateways need a per-component cluster");
        };
        let logs = self.options.capture_logs.then(|| Arc::clone(&self.logs));
        let (child, url) = spawn_component("gateway", &self.gateway_env, logs).await?;
        children.push(child);
        Ok(url)
    }

    /// Kills runtime replica `index` (SIGKILL, no drain) and waits for it to die.
    pub async fn kill_runtime(&mut self, index: usize) -> anyhow::Result<()> {
        let child = self.runtime_process(index)?;
        child.kill().await.context("cannot kill the runtime")?;
        Ok(())
    }

    /// Stops runtime replica `index` with SIGTERM; fails unless it exits 0.
    pub async fn terminate_runtime(&mut self, index: usize) -> anyhow::Result<()> {
        terminate(self.runtime_process(index)?).await
    }

    /// Kills every process of the cluster (SIGKILL: no drain, nothing
    /// flushed), as a crash or a power cut would; [`Cluster::restart`] starts
    /// it again on the same data.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(Running::Processes { children }) = &mut self.running {
            for child in children {
                child.kill().await.context("cannot kill a process")?;
            }
        }
        Ok(())
    }

    /// Kills the first process of `component` (`auth`, `session`, `runtime`,
    /// …) of a per-component cluster with SIGKILL and waits for it to die.
    pub async fn kill_component(&mut self, component: &str) -> anyhow::Result<()> {
        let slot = self.component(component)?.slot;
        self.process(slot)?.kill().await.context("cannot kill the process")?;
        Ok(())
    }

    /// Starts `component` again (after [`Cluster::kill_component`]) with its
    /// environment, on the address it had, so its peers find it again.
    pub async fn restart_component(&mut self, component: &str) -> anyhow::Result<()> {
        self.restart_component_with(component, &[]).await
    }

    /// Starts `component` again as [`Cluster::restart_component`] does, with
    /// `overrides` on top of its environment (say another service key).
    pub async fn restart_component_with(&mut self, component: &str, overrides: &[(&str, &str)]) -> anyhow::Result<()> {
        let (mut env, url, slot) = {
            let found = self.component(component)?;
            (found.env.clone(), found.url.clone(), found.slot)
        };
        for (name, value) in overrides {
            env.retain(|(key, _)| key != name);
            env.push(((*name).to_owned(), (*value).to_owned()));
        }
        let listen = url
            .strip_prefix("http://")
            .context("a component URL is http://")?
            .to_owned();
        let logs = self.options.capture_logs.then(|| Arc::clone(&self.logs));
        // The port was just freed; another process may briefly hold it (a
        // connection of its own in TIME_WAIT does not stop a listener).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let child = loop {
            match spawn_avm(&[component, "--listen", &listen], 1, &env, logs.clone()).await {
                Ok((child, _)) => break child,
                Err(err) if tokio::time::Instant::now() > deadline => return Err(err),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        *self.process(slot)? = child;
        Ok(())
    }

    fn component(&self, component: &str) -> anyhow::Result<&Component> {
        self.components
            .iter()
            .find(|c| c.name == component)
            .with_context(|| format!("no {component} process in this cluster"))
    }

    fn process(&mut self, slot: usize) -> anyhow::Result<&mut Child> {
        match &mut self.running {
            Some(Running::Processes { children }) => children.get_mut(slot).context("no such process"),
            _ => bail!("the cluster runs no processes"),
        }
    }

    fn runtime_process(&mut self, index: usize) -> anyhow::Result<&mut Child> {
        let slot = *self.runtime_slots.get(index).context("no such runtime replica")?;
        match &mut self.running {
            Some(Running::Processes { children }) => children.get_mut(slot).context("no such process"),
            _ => bail!("runtime replicas need a per-component cluster"),
        }
    }

    /// Returns the auth service's current signing key as its database holds
    /// it: its kid, and its private half as stored (sealed).
    pub async fn stored_signing_key(&self) -> anyhow::Result<avm_auth::SigningKeyRecord> {
        const CURRENT: &str = "SELECT kid, private_key, public_jwk, created_at_ms FROM signing_keys \
                               WHERE retired_at_ms IS NULL ORDER BY created_at_ms DESC LIMIT 1";
        let (kid, private_key, public_jwk, created_at_ms): (String, Vec<u8>, String, i64) =
            match &self.options.database_url {
                Some(url) => {
                    let url = avm_store::db::service_url(url, "auth")?;
                    let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await?;
                    sqlx::query_as(CURRENT).fetch_one(&mut connection).await?
                }
                None => {
                    let url = format!("sqlite://{}?mode=ro", self.data_dir.join("auth.db").display());
                    let mut connection = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url).await?;
                    sqlx::query_as(CURRENT).fetch_one(&mut connection).await?
                }
            };
        Ok(avm_auth::SigningKeyRecord {
            kid,
            private_key,
            public_jwk,
            created_at_ms,
            retired_at_ms: None,
        })
    }

    /// Returns the auth service's current signing key, read from its
    /// database and opened with the deployment's secret key, for tests that
    /// forge tokens as someone holding both would.
    pub async fn signing_key(&self) -> anyhow::Result<avm_common::auth::SigningKey> {
        let material = match self.mode {
            Mode::PerComponent => TEST_CONFIG_SECRET_KEY.to_owned(),
            // `avm serve` keeps its own in the data dir.
            Mode::OneProcess => std::fs::read_to_string(self.data_dir.join(avm::CONFIG_KEY_FILE))?,
        };
        let seal = avm_auth::KeySeal::new(&material)?;
        Ok(seal.open(&self.stored_signing_key().await?)?)
    }

    /// Exchanges an API key for an access token at the auth service's gRPC.
    pub async fn access_token(&self, api_key: &str) -> anyhow::Result<String> {
        let channel = tonic::transport::Endpoint::from_shared(self.auth_grpc.clone())?
            .connect()
            .await?;
        let response = avm_proto::auth::v1::auth_service_client::AuthServiceClient::new(channel)
            .exchange_api_key(avm_proto::auth::v1::ExchangeApiKeyRequest {
                api_key: api_key.to_owned(),
            })
            .await?;
        Ok(response.into_inner().access_token)
    }

    /// Returns the URL of a gateway path.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.gateway_url)
    }

    /// Stops the cluster (gracefully: SIGTERM for processes) and starts it
    /// again on the same data, as a user restarting the server would.
    pub async fn restart(mut self) -> anyhow::Result<Self> {
        self.stop().await?;
        let temp = self._temp.take();
        let schemas = self._schemas.take();
        Self::start_in(self.mode, self.options.clone(), self.data_dir.clone(), temp, schemas).await
    }

    /// Stops every component and waits for it to exit.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        match self.running.take() {
            Some(Running::InProcess { shutdown, task }) => {
                shutdown.cancel();
                tokio::time::timeout(Duration::from_secs(20), task)
                    .await
                    .context("serve did not stop")???;
            }
            Some(Running::Processes { mut children }) => {
                // In the reverse order of their start (gateway first, auth last),
                // as a rolling stop would.
                while let Some(mut child) = children.pop() {
                    terminate(&mut child).await?;
                }
            }
            None => {}
        }
        Ok(())
    }

    fn config(&self) -> AvmConfig {
        let mut config = AvmConfig::default();
        config.server.host = "127.0.0.1".into();
        config.server.port = 0;
        config.server.grpc_port = 0;
        config.server.data_dir = self.data_dir.display().to_string();
        config.log.level = self.options.log_level.clone().unwrap_or_else(|| "warn".into());
        config.database.url = self.options.database_url.clone().map(Secret::new);
        config.auth.service_key = Secret::new(TEST_SERVICE_KEY);
        match &self.options.llm {
            Llm::Offline => config.llm.provider = Some(ProviderKind::Offline),
            Llm::Anthropic { base_url } => {
                config.llm.provider = Some(ProviderKind::Anthropic);
                config.llm.base_url = Some(base_url.clone());
                config.llm.api_key = Secret::new(TEST_API_KEY);
            }
            Llm::OpenAi { base_url } => {
                config.llm.provider = Some(ProviderKind::Openai);
                config.llm.base_url = Some(base_url.clone());
                config.llm.api_key = Secret::new(TEST_API_KEY);
            }
        }
        if let Some(timeout) = self.options.agent_idle_timeout {
            config.runtime.agent_idle_timeout = timeout;
        }
        if let Some(limit) = self.options.group_runaway_limit {
            config.runtime.group_runaway_limit = limit;
        }
        if let Some(queue) = self.options.subscriber_queue {
            config.runtime.subscriber_queue = queue;
        }
        if let Some(timeout) = self.options.subscriber_stall_timeout {
            config.runtime.subscriber_stall_timeout = timeout;
        }
        if let Some((replica, tenant)) = self.options.max_running_agents {
            config.runtime.max_running_agents = replica;
            config.runtime.max_running_agents_per_tenant = tenant;
        }
        if let Some(limit) = self.options.max_frame_bytes {
            config.gateway.max_frame_bytes = limit;
        }
        if let Some(rate) = self.options.messages_per_second {
            config.gateway.messages_per_second = rate;
        }
        if let Some(burst) = self.options.failed_token_exchanges_per_minute {
            config.gateway.failed_token_exchanges_per_minute = burst;
        }
        if let Some(timeout) = self.options.llm_idle_timeout {
            config.llm.idle_timeout = timeout;
            config.llm.request_timeout = timeout;
        }
        if let Some((url, prefix)) = &self.options.redis {
            config.redis.url = Some(Secret::new(url.clone()));
            config.redis.key_prefix.clone_from(prefix);
        }
        config.runtime.fetch.allow.clone_from(&self.options.network_allow);
        config.runtime.sandbox.expose.clone_from(&self.options.expose);
        if self.options.sandbox_process {
            config.runtime.sandbox.provider = avm_sandbox::Provider::Process;
        }
        if !self.options.sandbox_pool.is_empty() {
            config.runtime.sandbox.provider = avm_sandbox::Provider::Pool;
            config.runtime.sandbox.pool.clone_from(&self.options.sandbox_pool);
            config.runtime.sandbox.pools.clone_from(&self.options.sandbox_pools);
        }
        if let Some(kubernetes) = &self.options.sandbox_kubernetes {
            config.runtime.sandbox.provider = avm_sandbox::Provider::Kubernetes;
            config.runtime.sandbox.kubernetes = kubernetes.clone();
        }
        // The executable in this process is the test's: the relay is avm's.
        config.runtime.sandbox.relay = avm_binary().ok();
        config.runtime.workspace_store.clone_from(&self.options.workspace_store);
        config
            .runtime
            .mcp
            .allowed_commands
            .clone_from(&self.options.mcp_commands);
        config
    }

    async fn start_in_process(&mut self) -> anyhow::Result<()> {
        let config = self.config();
        let listeners = ServeListeners::bind(&config).await?;
        self.gateway_url = format!("http://{}", listeners.gateway.local_addr()?);
        self.session_grpc = format!("http://{}", listeners.grpc.local_addr()?);
        self.runtime_grpc = self.session_grpc.clone();
        self.auth_grpc = self.session_grpc.clone();
        self.resource_grpc = self.session_grpc.clone();
        self.config_grpc = self.session_grpc.clone();
        self.observability_grpc = self.session_grpc.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(avm::serve(config, listeners, shutdown.clone()));
        self.running = Some(Running::InProcess { shutdown, task });
        self.wait_ready().await?;
        self.read_admin_key()
    }

    /// Reads the admin key the first run wrote (kept across restarts).
    fn read_admin_key(&mut self) -> anyhow::Result<()> {
        let path = self.data_dir.join(avm::ADMIN_KEY_FILE);
        self.admin_key = std::fs::read_to_string(&path)
            .with_context(|| format!("no admin key at {}", path.display()))?
            .trim()
            .to_owned();
        Ok(())
    }

    /// Starts `avm serve` as a child process on this cluster's data.
    async fn start_serve_process(&mut self) -> anyhow::Result<()> {
        let mut env = self.process_env();
        env.extend(self.llm_env());
        let logs = self.options.capture_logs.then(|| Arc::clone(&self.logs));
        let mut args = vec!["serve", "--port", "0", "--grpc-port", "0"];
        let config_file = self.options.config_file.as_ref().map(|file| file.display().to_string());
        if let Some(file) = &config_file {
            args.extend(["--config", file]);
        }
        let (child, urls) = spawn_avm_as(self.options.run_as, &args, 2, &env, logs).await?;
        let [gateway, grpc] = <[String; 2]>::try_from(urls)
            .map_err(|urls| anyhow::anyhow!("avm serve listens on {urls:?}, not a gateway and a gRPC port"))?;
        self.gateway_url = gateway;
        for url in [
            &mut self.session_grpc,
            &mut self.runtime_grpc,
            &mut self.auth_grpc,
            &mut self.resource_grpc,
            &mut self.config_grpc,
            &mut self.observability_grpc,
        ] {
            url.clone_from(&grpc);
        }
        self.running = Some(Running::Processes { children: vec![child] });
        self.wait_ready().await?;
        self.read_admin_key()
    }

    /// The environment every spawned `avm` process gets.
    fn process_env(&self) -> Vec<(String, String)> {
        let config = self.config();
        let mut env: Vec<(String, String)> = vec![
            ("AVM_LOG_LEVEL".into(), config.log.level.clone()),
            ("AVM_LOG_FORMAT".into(), "text".into()),
            ("AVM_SERVER_DATA_DIR".into(), config.server.data_dir.clone()),
            ("AVM_AUTH_SERVICE_KEY".into(), TEST_SERVICE_KEY.into()),
        ];
        if let Some(timeout) = self.options.agent_idle_timeout {
            env.push((
                "AVM_RUNTIME_AGENT_IDLE_TIMEOUT".into(),
                format!("{}ms", timeout.as_millis()),
            ));
        }
        if let Some(limit) = self.options.max_frame_bytes {
            env.push(("AVM_GATEWAY_MAX_FRAME_BYTES".into(), limit.to_string()));
        }
        if let Some(limit) = self.options.group_runaway_limit {
            env.push(("AVM_RUNTIME_GROUP_RUNAWAY_LIMIT".into(), limit.to_string()));
        }
        if let Some(queue) = self.options.subscriber_queue {
            env.push(("AVM_RUNTIME_SUBSCRIBER_QUEUE".into(), queue.to_string()));
        }
        if let Some(timeout) = self.options.subscriber_stall_timeout {
            env.push((
                "AVM_RUNTIME_SUBSCRIBER_STALL_TIMEOUT".into(),
                format!("{}ms", timeout.as_millis()),
            ));
        }
        if let Some((replica, tenant)) = self.options.max_running_agents {
            env.push(("AVM_RUNTIME_MAX_RUNNING_AGENTS".into(), replica.to_string()));
            env.push(("AVM_RUNTIME_MAX_RUNNING_AGENTS_PER_TENANT".into(), tenant.to_string()));
        }
        if let Some(store) = &self.options.workspace_store {
            env.push(("AVM_RUNTIME_WORKSPACE_STORE".into(), store.clone()));
        }
        if let Some(rate) = self.options.messages_per_second {
            env.push(("AVM_GATEWAY_MESSAGES_PER_SECOND".into(), rate.to_string()));
        }
        if let Some(burst) = self.options.failed_token_exchanges_per_minute {
            env.push((
                "AVM_GATEWAY_FAILED_TOKEN_EXCHANGES_PER_MINUTE".into(),
                burst.to_string(),
            ));
        }
        if let Some(url) = &self.options.database_url {
            env.push(("AVM_DATABASE_URL".into(), url.clone()));
        }
        if let Some((url, prefix)) = &self.options.redis {
            env.push(("AVM_REDIS_URL".into(), url.clone()));
            env.push(("AVM_REDIS_KEY_PREFIX".into(), prefix.clone()));
        }
        // Nested sections have no variables: they go in a configuration file.
        if !self.options.network_allow.is_empty()
            || !self.options.mcp_commands.is_empty()
            || !self.options.expose.is_empty()
            || self.options.sandbox_process
            || !self.options.sandbox_pool.is_empty()
            || self.options.sandbox_kubernetes.is_some()
        {
            let mut file = toml::Table::new();
            let mut runtime = toml::Table::new();
            runtime.insert(
                "fetch".into(),
                toml::Value::Table(toml::Table::from_iter([(
                    "allow".to_owned(),
                    toml::Value::try_from(&self.options.network_allow).unwrap_or(toml::Value::Array(Vec::new())),
                )])),
            );
            runtime.insert(
                "mcp".into(),
                toml::Value::Table(toml::Table::from_iter([(
                    "allowed_commands".to_owned(),
                    toml::Value::try_from(&self.options.mcp_commands).unwrap_or(toml::Value::Array(Vec::new())),
                )])),
            );
            let mut sandbox = toml::Table::from_iter([(
                "expose".to_owned(),
                toml::Value::try_from(&self.options.expose).unwrap_or(toml::Value::Array(Vec::new())),
            )]);
            if self.options.sandbox_process {
                sandbox.insert("provider".into(), toml::Value::String("process".into()));
            }
            if !self.options.sandbox_pool.is_empty() {
                sandbox.insert("provider".into(), toml::Value::String("pool".into()));
                sandbox.insert(
                    "pool".into(),
                    toml::Value::try_from(&self.options.sandbox_pool).unwrap_or(toml::Value::Array(Vec::new())),
                );
                if let Ok(pools) = toml::Value::try_from(&self.options.sandbox_pools) {
                    sandbox.insert("pools".into(), pools);
                }
            }
            if let Some(kubernetes) = &self.options.sandbox_kubernetes {
                sandbox.insert("provider".into(), toml::Value::String("kubernetes".into()));
                if let Ok(table) = toml::Value::try_from(kubernetes) {
                    sandbox.insert("kubernetes".into(), table);
                }
            }
            runtime.insert("sandbox".into(), toml::Value::Table(sandbox));
            file.insert("runtime".into(), toml::Value::Table(runtime));
            let path = self.data_dir.join("avm.toml");
            if std::fs::write(&path, file.to_string()).is_ok() {
                env.push(("AVM_CONFIG".into(), path.display().to_string()));
            }
        }
        env.extend(self.options.env.iter().cloned());
        env
    }

    /// The LLM settings as environment (for whoever holds the deployment's configuration).
    fn llm_env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = match &self.options.llm {
            Llm::Offline => vec![("LLM_PROVIDER".into(), "offline".into())],
            Llm::Anthropic { base_url } => vec![
                ("LLM_PROVIDER".into(), "anthropic".into()),
                ("LLM_BASE_URL".into(), base_url.clone()),
                ("LLM_API_KEY".into(), TEST_API_KEY.into()),
            ],
            Llm::OpenAi { base_url } => vec![
                ("LLM_PROVIDER".into(), "openai".into()),
                ("LLM_BASE_URL".into(), base_url.clone()),
                ("LLM_API_KEY".into(), TEST_API_KEY.into()),
            ],
        };
        if let Some(timeout) = self.options.llm_idle_timeout {
            env.push(("LLM_IDLE_TIMEOUT".into(), format!("{}ms", timeout.as_millis())));
            env.push(("LLM_REQUEST_TIMEOUT".into(), format!("{}ms", timeout.as_millis())));
        }
        env
    }

    async fn start_processes(&mut self) -> anyhow::Result<()> {
        let mut env = self.process_env();
        let logs = self.options.capture_logs.then(|| Arc::clone(&self.logs));
        let mut children = Vec::new();
        let mut components = Vec::new();
        let mut remember = |name: &str, env: &[(String, String)], url: &str, slot: usize| {
            components.push(Component {
                name: name.to_owned(),
                env: env.to_vec(),
                url: url.to_owned(),
                slot,
            });
        };
        // The auth service seals its signing keys with the deployment's secret key.
        let mut auth_env = env.clone();
        auth_env.push(("AVM_CONFIG_SECRET_KEY".into(), TEST_CONFIG_SECRET_KEY.into()));
        let (child, auth) = spawn_component("auth", &auth_env, logs.clone()).await?;
        remember("auth", &auth_env, &auth, children.len());
        children.push(child);
        self.auth_grpc = auth;
        env.push(("AVM_AUTH_ADDR".into(), self.auth_grpc.clone()));
        // The observability service next, so everyone else can send it logs
        // (until it answers, the auth service's own are dropped: best effort).
        let (child, observability) = spawn_component("observability", &env, logs.clone()).await?;
        remember("observability", &env, &observability, children.len());
        children.push(child);
        self.observability_grpc = observability;
        env.push(("AVM_OBSERVABILITY_ADDR".into(), self.observability_grpc.clone()));

        let (child, resource) = spawn_component("resource", &env, logs.clone()).await?;
        remember("resource", &env, &resource, children.len());
        children.push(child);
        self.resource_grpc = resource;
        // The session service checks images' references with the resource service.
        env.push(("AVM_RESOURCE_ADDR".into(), self.resource_grpc.clone()));

        let (child, session) = spawn_component("session", &env, logs.clone()).await?;
        remember("session", &env, &session, children.len());
        children.push(child);
        self.session_grpc = session;

        // The config service holds the deployment's LLM settings (its
        // environment is their layer); the runtime reads them from it.
        let mut config_env = env.clone();
        config_env.push(("AVM_CONFIG_SECRET_KEY".into(), TEST_CONFIG_SECRET_KEY.into()));
        config_env.extend(self.llm_env());
        let (child, config) = spawn_component("config", &config_env, logs.clone()).await?;
        remember("config", &config_env, &config, children.len());
        children.push(child);
        self.config_grpc = config;

        env.extend([
            ("AVM_SESSION_ADDR".into(), self.session_grpc.clone()),
            ("AVM_CONFIG_ADDR".into(), self.config_grpc.clone()),
        ]);
        for _ in 0..self.options.runtimes.max(1) {
            let (child, runtime) = spawn_component("runtime", &env, logs.clone()).await?;
            remember("runtime", &env, &runtime, children.len());
            self.runtime_slots.push(children.len());
            children.push(child);
            self.runtimes.push(runtime);
        }
        self.runtime_grpc = self.runtimes[0].clone();

        let mut gateway_env = env;
        gateway_env.push(("AVM_RUNTIME_ADDR".into(), self.runtimes.join(",")));
        let (child, gateway) = spawn_component("gateway", &gateway_env, logs).await?;
        remember("gateway", &gateway_env, &gateway, children.len());
        self.gateway_env = gateway_env;
        children.push(child);
        self.components = components;
        self.gateway_url = gateway;
        self.running = Some(Running::Processes { children });
        self.wait_ready().await?;
        self.read_admin_key()
    }

    /// Polls `/ready` until every backend answers, within a deadline.
    async fn wait_ready(&self) -> anyhow::Result<()> {
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let ready = client.get(format!("{}/ready", self.gateway_url)).send().await;
            if ready.is_ok_and(|response| response.status().is_success()) {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("cluster not ready within 20s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        match self.running.take() {
            Some(Running::InProcess { shutdown, .. }) => shutdown.cancel(),
            // Children are spawned with kill_on_drop.
            Some(Running::Processes { children }) => drop(children),
            None => {}
        }
    }
}

/// Returns a gRPC interceptor adding `authorization: Bearer <token>`.
pub fn bearer(
    token: &str,
) -> anyhow::Result<impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone> {
    let value: tonic::metadata::MetadataValue<tonic::metadata::Ascii> = format!("Bearer {token}").parse()?;
    Ok(move |mut request: tonic::Request<()>| {
        request.metadata_mut().insert("authorization", value.clone());
        Ok(request)
    })
}

/// Returns an HTTP client sending `Authorization: Bearer <credential>`.
pub fn http_client(credential: &str) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        reqwest::header::HeaderValue::from_str(&format!("Bearer {credential}"))?,
    );
    Ok(reqwest::Client::builder().default_headers(headers).build()?)
}

/// Returns the `avm` binary, built once per test process with the profile of
/// the running tests (a no-op when cargo already built it).
pub fn avm_binary() -> anyhow::Result<PathBuf> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY
        .get_or_init(|| build_avm().map_err(|err| format!("{err:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build_avm() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // Test binaries live in <target>/<profile>/deps/.
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("unexpected test binary location")?;
    let target_dir = profile_dir.parent().context("unexpected test binary location")?;
    let profile = profile_dir
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or("debug");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = std::process::Command::new(cargo);
    command
        .args(["build", "--quiet", "--package", "avm", "--bin", "avm", "--target-dir"])
        .arg(target_dir);
    if profile != "debug" {
        command.args(["--profile", if profile == "release" { "release" } else { profile }]);
    }
    let status = command.status().context("cannot run cargo to build the avm binary")?;
    if !status.success() {
        bail!("building the avm binary failed");
    }
    let binary = profile_dir.join("avm");
    if !binary.exists() {
        bail!("avm binary not found at {}", binary.display());
    }
    Ok(binary)
}

/// Returns a command running the `avm` binary with none of the developer's
/// own `AVM_*` and `LLM_*` settings, so they cannot leak into a test.
pub fn avm_command() -> anyhow::Result<Command> {
    avm_command_as(None)
}

/// Returns [`avm_command`], run as `user` (uid and gid) through `setpriv` when given.
fn avm_command_as(user: Option<u32>) -> anyhow::Result<Command> {
    let mut command = match user {
        None => Command::new(avm_binary()?),
        Some(user) => {
            let mut setpriv = Command::new("setpriv");
            setpriv
                .args([format!("--reuid={user}"), format!("--regid={user}")])
                .args(["--clear-groups", "--"])
                .arg(avm_binary()?);
            setpriv
        }
    };
    for (key, _) in std::env::vars() {
        if key.starts_with("AVM_") || key.starts_with("LLM_") {
            command.env_remove(key);
        }
    }
    command.stdin(Stdio::null()).kill_on_drop(true);
    Ok(command)
}

/// Spawns `avm <component> --listen 127.0.0.1:0` and returns it with its URL;
/// its stderr goes to `logs` when given.
async fn spawn_component(
    component: &str,
    env: &[(String, String)],
    logs: Option<Arc<Mutex<String>>>,
) -> anyhow::Result<(Child, String)> {
    let (child, mut urls) = spawn_avm(&[component, "--listen", "127.0.0.1:0"], 1, env, logs).await?;
    Ok((child, urls.remove(0)))
}

/// Spawns `avm <args>` and returns it with the URLs of its first
/// `listeners` `listening:` lines; its stderr goes to `logs` when given.
async fn spawn_avm(
    args: &[&str],
    listeners: usize,
    env: &[(String, String)],
    logs: Option<Arc<Mutex<String>>>,
) -> anyhow::Result<(Child, Vec<String>)> {
    spawn_avm_as(None, args, listeners, env, logs).await
}

/// [`spawn_avm`], as `user` when given.
async fn spawn_avm_as(
    user: Option<u32>,
    args: &[&str],
    listeners: usize,
    env: &[(String, String)],
    logs: Option<Arc<Mutex<String>>>,
) -> anyhow::Result<(Child, Vec<String>)> {
    spawn_avm_until(user, args, "listening: ", listeners, env, logs).await
}

/// Spawns `avm <args>` and returns it with the URLs of its first `count`
/// lines starting with `prefix` (`listening: ` once it serves, `starting: `
/// as soon as its port answers).
async fn spawn_avm_until(
    user: Option<u32>,
    args: &[&str],
    prefix: &str,
    count: usize,
    env: &[(String, String)],
    logs: Option<Arc<Mutex<String>>>,
) -> anyhow::Result<(Child, Vec<String>)> {
    let component = args.first().copied().unwrap_or_default();
    let mut command = tokio::task::spawn_blocking(move || avm_command_as(user)).await??;
    command.args(args);
    command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    command.stdout(Stdio::piped());
    command.stderr(if logs.is_some() {
        Stdio::piped()
    } else {
        Stdio::inherit()
    });
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot spawn avm {component}"))?;
    if let (Some(logs), Some(stderr)) = (logs, child.stderr.take()) {
        let mut lines = BufReader::new(stderr).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut logs = logs.lock().unwrap_or_else(|poison| poison.into_inner());
                logs.push_str(&line);
                logs.push('\n');
            }
        });
    }
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let urls = tokio::time::timeout(Duration::from_secs(20), async {
        let mut urls = Vec::new();
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix(prefix) {
                let url = rest.split_whitespace().nth(1).context("malformed listening line")?;
                urls.push(url.to_owned());
                if urls.len() == count {
                    return Ok::<_, anyhow::Error>(urls);
                }
            }
        }
        bail!("avm {component} exited before listening")
    })
    .await
    .with_context(|| format!("avm {component} did not start within 20s"))??;
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, urls))
}

/// Sends SIGTERM and waits for a clean exit.
async fn terminate(child: &mut Child) -> anyhow::Result<()> {
    let Some(pid) = child.id() else { return Ok(()) };
    let status = Command::new("kill").args(["-TERM", &pid.to_string()]).status().await?;
    if !status.success() {
        bail!("kill -TERM {pid} failed");
    }
    let exit = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .context("process did not stop")??;
    if !exit.success() {
        bail!("process exited with {exit}");
    }
    Ok(())
}

// Replicas of the services that keep data: another process of a component
// beside a running cluster, on the same database, and processes of a
// component started together.

impl Cluster {
    /// Starts another replica of `component` (`auth`, `session`, `resource`,
    /// `config`, `observability` or `gateway`) of a per-component cluster,
    /// with the environment the cluster gives its components and `overrides`
    /// on top (say `AVM_AUTH_ADDR` naming another auth replica); returns its
    /// URL. It stops with the cluster.
    pub async fn spawn_replica(&mut self, component: &str, overrides: &[(&str, &str)]) -> anyhow::Result<String> {
        self.spawn_replica_until(component, overrides, "listening: ").await
    }

    /// [`Cluster::spawn_replica`], returning as soon as the process's gRPC
    /// port answers (its `starting:` line), while it may still be starting.
    pub async fn spawn_starting(&mut self, component: &str, overrides: &[(&str, &str)]) -> anyhow::Result<String> {
        self.spawn_replica_until(component, overrides, "starting: ").await
    }

    async fn spawn_replica_until(
        &mut self,
        component: &str,
        overrides: &[(&str, &str)],
        prefix: &str,
    ) -> anyhow::Result<String> {
        let mut env = self.process_env();
        let peers = [
            ("AVM_AUTH_ADDR", &self.auth_grpc),
            ("AVM_OBSERVABILITY_ADDR", &self.observability_grpc),
            ("AVM_RESOURCE_ADDR", &self.resource_grpc),
            ("AVM_SESSION_ADDR", &self.session_grpc),
            ("AVM_CONFIG_ADDR", &self.config_grpc),
            ("AVM_RUNTIME_ADDR", &self.runtime_grpc),
        ];
        env.extend(peers.map(|(name, url)| (name.to_owned(), url.clone())));
        if component == "config" || component == "auth" {
            env.push(("AVM_CONFIG_SECRET_KEY".into(), TEST_CONFIG_SECRET_KEY.into()));
        }
        if component == "config" {
            env.extend(self.llm_env());
        }
        for (name, value) in overrides {
            env.retain(|(key, _)| key != name);
            env.push(((*name).to_owned(), (*value).to_owned()));
        }
        let logs = self.options.capture_logs.then(|| Arc::clone(&self.logs));
        let Some(Running::Processes { children }) = &mut self.running else {
            bail!("replicas need a per-component cluster");
        };
        let (child, mut urls) =
            spawn_avm_until(None, &[component, "--listen", "127.0.0.1:0"], prefix, 1, &env, logs).await?;
        children.push(child);
        Ok(urls.remove(0))
    }
}

/// Spawns `avm <component> --listen 127.0.0.1:0` with `env` (and none of the
/// developer's own `AVM_*` or `LLM_*`); returns it, killed when dropped, with
/// its URL once it listens.
pub async fn spawn_process(component: &str, env: &[(String, String)]) -> anyhow::Result<(Child, String)> {
    spawn_component(component, env, None).await
}
