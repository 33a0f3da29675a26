//! The deployments measured: `avm serve` (one process), one process per
//! component, and one process per component with two runtime replicas
//! sharing Redis.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How the product is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Mode {
    /// `avm serve`: every component in one process, SQLite.
    Serve,
    /// One process per component (SQLite files, or Postgres with `--database-url`).
    Components,
    /// One process per component with two runtime replicas sharing Redis
    /// (needs `--redis-url`).
    Replicated,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Serve => "serve",
            Mode::Components => "components",
            Mode::Replicated => "replicated",
        }
    }
}

/// Where the components keep their data and share events.
#[derive(Debug, Clone, Default)]
pub struct Backing {
    /// A Postgres URL: per-component deployments keep their tables there, in
    /// fresh schemas dropped afterwards.
    pub database_url: Option<String>,
    /// A Redis URL: replicated deployments share leases and events there.
    pub redis_url: Option<String>,
    /// More environment for every process.
    pub env: Vec<(String, String)>,
    /// The sandbox provider (`process` or `pool`); `None`: local.
    pub sandbox: Option<String>,
}

/// Sandboxes of a `pool` deployment: enough for every conversation the
/// tools figure holds at once.
const POOL_SANDBOXES: usize = 12;

/// One `avm` process of a deployment.
pub struct Process {
    /// `serve`, or the component it runs.
    pub role: String,
    pub pid: u32,
    child: Child,
}

/// A running deployment of one `avm` binary.
pub struct Deployment {
    pub label: String,
    pub mode: Mode,
    pub url: String,
    /// The operator admin's API key, which every request carries.
    pub admin_key: String,
    pub processes: Vec<Process>,
    /// The Postgres database and schema prefix this deployment made.
    pub database: Option<(String, String)>,
    _data: tempfile::TempDir,
}

/// In start order: each needs those before it.
const COMPONENTS: [&str; 5] = ["auth", "observability", "resource", "session", "config"];

impl Deployment {
    /// Starts `binary` in `mode` with `mock_url` (Anthropic API) as its LLM.
    pub async fn start(
        label: &str,
        binary: &Path,
        mode: Mode,
        mock_url: &str,
        backing: &Backing,
    ) -> anyhow::Result<Self> {
        let data = tempfile::tempdir()?;
        // As `avm` makes its own: readable only by the user (it holds keys).
        std::fs::set_permissions(data.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let tag = format!(
            "avmbench{}_{}",
            std::process::id(),
            label.replace(|c: char| !c.is_ascii_alphanumeric(), "")
        );
        let mut env: Vec<(String, String)> = vec![
            ("AVM_LOG_LEVEL".into(), "warn".into()),
            ("AVM_SERVER_DATA_DIR".into(), data.path().display().to_string()),
            ("AVM_AUTH_SERVICE_KEY".into(), format!("svc-bench-{:032x}", rand_u128())),
            ("AVM_AUTH_DEFAULT_REQUESTS_PER_MINUTE".into(), "0".into()),
            ("AVM_GATEWAY_MESSAGES_PER_SECOND".into(), "0".into()),
        ];
        env.extend(backing.env.iter().cloned());
        let mut processes = Vec::new();
        if let Some(provider) = &backing.sandbox {
            let mut pool = Vec::new();
            if provider == "pool" {
                for index in 0..POOL_SANDBOXES {
                    let root = data.path().join(format!("pool-{index}"));
                    let root = root.display().to_string();
                    let args = ["sandbox", "--listen", "127.0.0.1:0", "--root", &root];
                    let (process, urls) = spawn(binary, "sandbox", &args, 1, &[]).await?;
                    processes.push(process);
                    pool.push(format!("{:?}", urls[0]));
                }
            }
            let file = data.path().join("avm.toml");
            std::fs::write(
                &file,
                format!(
                    "[runtime.sandbox]\nprovider = {provider:?}\npool = [{}]\n",
                    pool.join(", ")
                ),
            )?;
            env.push(("AVM_CONFIG".into(), file.display().to_string()));
        }
        let llm = [
            ("LLM_PROVIDER".to_owned(), "anthropic".to_owned()),
            ("LLM_BASE_URL".to_owned(), mock_url.to_owned()),
            ("LLM_API_KEY".to_owned(), "bench".to_owned()),
        ];
        let mut database = None;
        let url = match mode {
            Mode::Serve => {
                env.extend(llm);
                let (process, urls) =
                    spawn(binary, "serve", &["serve", "--port", "0", "--grpc-port", "0"], 2, &env).await?;
                processes.push(process);
                urls[0].clone()
            }
            Mode::Components | Mode::Replicated => {
                if let Some(url) = &backing.database_url {
                    let separator = if url.contains('?') { '&' } else { '?' };
                    env.push((
                        "AVM_DATABASE_URL".into(),
                        format!("{url}{separator}options=-c%20search_path%3D{tag}"),
                    ));
                    database = Some((url.clone(), tag.clone()));
                }
                let runtimes = if mode == Mode::Replicated {
                    let redis = backing
                        .redis_url
                        .as_ref()
                        .context("the replicated mode needs --redis-url")?;
                    env.push(("AVM_REDIS_URL".into(), redis.clone()));
                    env.push(("AVM_REDIS_KEY_PREFIX".into(), format!("{tag}:")));
                    2
                } else {
                    1
                };
                let mut peers = Vec::new();
                // Seals stored secrets (config) and the token signing keys (auth).
                let secret_key = format!("cfg-bench-{:032x}", rand_u128());
                for component in COMPONENTS {
                    let mut own = env.clone();
                    own.extend(peers.iter().cloned());
                    if component == "config" || component == "auth" {
                        own.push(("AVM_CONFIG_SECRET_KEY".into(), secret_key.clone()));
                    }
                    if component == "config" {
                        own.extend(llm.iter().cloned());
                    }
                    let (process, urls) =
                        spawn(binary, component, &[component, "--listen", "127.0.0.1:0"], 1, &own).await?;
                    processes.push(process);
                    peers.push((format!("AVM_{}_ADDR", component.to_uppercase()), urls[0].clone()));
                }
                env.extend(peers);
                let mut runtime_urls = Vec::new();
                for _ in 0..runtimes {
                    let (process, urls) =
                        spawn(binary, "runtime", &["runtime", "--listen", "127.0.0.1:0"], 1, &env).await?;
                    processes.push(process);
                    runtime_urls.push(urls[0].clone());
                }
                env.push(("AVM_RUNTIME_ADDR".into(), runtime_urls.join(",")));
                let (process, urls) =
                    spawn(binary, "gateway", &["gateway", "--listen", "127.0.0.1:0"], 1, &env).await?;
                processes.push(process);
                urls[0].clone()
            }
        };
        let admin_key = read_admin_key(data.path()).await?;
        let deployment = Self {
            label: label.to_owned(),
            mode,
            url,
            admin_key,
            processes,
            database,
            _data: data,
        };
        deployment.wait_ready().await?;
        eprintln!("{label} ({}): gateway at {}", mode.name(), deployment.url);
        Ok(deployment)
    }

    /// The pids of every process, or of those in `role`.
    pub fn pids(&self, role: Option<&str>) -> Vec<u32> {
        self.processes
            .iter()
            .filter(|process| role.is_none_or(|role| process.role == role))
            .map(|process| process.pid)
            .collect()
    }

    /// The roles present, in start order, without repeats.
    pub fn roles(&self) -> Vec<String> {
        let mut roles: Vec<String> = Vec::new();
        for process in &self.processes {
            if !roles.contains(&process.role) {
                roles.push(process.role.clone());
            }
        }
        roles
    }

    /// The process that relays to clients (the gateway, or `avm serve`).
    pub fn edge_pid(&self) -> u32 {
        self.pids(Some(if self.mode == Mode::Serve { "serve" } else { "gateway" }))[0]
    }

    /// Returns the data directory (which every sandbox's `--root` is under).
    pub fn data_dir(&self) -> &Path {
        self._data.path()
    }

    /// The processes that hold agents.
    pub fn agent_pids(&self) -> Vec<u32> {
        self.pids(Some(if self.mode == Mode::Serve { "serve" } else { "runtime" }))
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !client
            .get(format!("{}/ready", self.url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            ensure!(Instant::now() < deadline, "{} never became ready", self.label);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Stops every process (gateway first) and drops the schemas it made.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        while let Some(mut process) = self.processes.pop() {
            let _ = Command::new("kill")
                .args(["-TERM", &process.pid.to_string()])
                .status()
                .await;
            if tokio::time::timeout(Duration::from_secs(20), process.child.wait())
                .await
                .is_err()
            {
                eprintln!("{}: {} did not stop within 20 s; killed", self.label, process.role);
                let _ = process.child.kill().await;
            }
        }
        if let Some((url, tag)) = self.database.take() {
            let schemas: Vec<String> = COMPONENTS.iter().map(|service| format!("{tag}_{service}")).collect();
            let mut all = schemas;
            all.push(tag);
            tokio::task::spawn_blocking(move || avm_store::testing::drop_schemas(&url, &all)).await?;
        }
        Ok(())
    }
}

/// Spawns `binary args` and returns it once it printed `listeners` `listening:` lines, with their URLs.
async fn spawn(
    binary: &Path,
    role: &str,
    args: &[&str],
    listeners: usize,
    env: &[(String, String)],
) -> anyhow::Result<(Process, Vec<String>)> {
    let mut command = Command::new(binary);
    for (key, _) in std::env::vars() {
        if key.starts_with("AVM_") || key.starts_with("LLM_") {
            command.env_remove(key);
        }
    }
    command
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot run {}", binary.display()))?;
    let pid = child.id().context("avm exited at once")?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let urls = tokio::time::timeout(Duration::from_secs(30), async {
        let mut urls = Vec::new();
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix("listening: ") {
                urls.push(
                    rest.split_whitespace()
                        .nth(1)
                        .context("malformed listening line")?
                        .to_owned(),
                );
                if urls.len() == listeners {
                    return Ok::<_, anyhow::Error>(urls);
                }
            }
        }
        bail!("avm {role} exited before listening")
    })
    .await
    .with_context(|| format!("avm {role} did not start within 30 s"))??;
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((
        Process {
            role: role.to_owned(),
            pid,
            child,
        },
        urls,
    ))
}

/// Reads the admin key the auth component wrote on its first start.
async fn read_admin_key(data: &Path) -> anyhow::Result<String> {
    let path: PathBuf = data.join(avm::ADMIN_KEY_FILE);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(key) = std::fs::read_to_string(&path)
            && !key.trim().is_empty()
        {
            return Ok(key.trim().to_owned());
        }
        ensure!(Instant::now() < deadline, "no admin key at {}", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A random number for the per-run service and config keys.
fn rand_u128() -> u128 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    nanos ^ (u128::from(std::process::id()) << 64)
}
