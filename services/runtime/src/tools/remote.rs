//! The `process` provider: an image's commands run in an `avm sandbox`
//! child of the runtime, started on the image's first command and stopped
//! (its workspace copy removed) when the agent's toolbox goes.
//!
//! The child holds none of the runtime's secrets: it starts with an empty
//! environment, reads no configuration file, and is given only the public
//! half of the runtime's token key. The runtime keeps the workspace (the
//! file tools, clients and the workspace store use its copy): before a
//! command it puts into the sandbox what changed in its copy since they were
//! last alike (everything, into a new sandbox), and after it takes back what
//! the command changed. A sandbox lost mid-command leaves the runtime's copy
//! as it was after the last command; the next command starts a new one.

use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use avm_proto::sandbox::v1::sandbox_service_client::SandboxServiceClient;
use avm_proto::sandbox::v1::{
    ClaimRequest, EnvironmentVariable, PutFilesRequest, ReleaseWorkspaceRequest, RunCommandRequest,
    ServeProgramRequest, TakeChangesRequest, WriteProgramRequest,
};
use avm_sandbox::service::{command_limits, joined_changes, pieces};
use avm_sandbox::sync::{self, Changes, Snapshot};
use avm_sandbox::token::TokenSigner;
use avm_sandbox::{Command, Process, Program, SandboxEnvironment, SandboxLimits, Served, ToolFailure, Workspace};
use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::transport::Channel;

use super::kubernetes::{Claim, Claims};

/// How long a new sandbox may take to say where it listens.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// Largest message to or from a sandbox (pieces are 1 MiB).
const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// Where sandboxes come from.
#[derive(Debug)]
enum Placement {
    /// Started as children of this process: the `avm` executable, and where
    /// their workspaces go.
    Process { binary: PathBuf, root: PathBuf },
    /// Claimed from a pool of running sandboxes (the environment's, at the
    /// fence's `pools`, else at its `pool`).
    Pool,
    /// A pod per image, claimed through the agent-sandbox API.
    Kubernetes(Box<Claims>),
}

/// What gets sandboxes: where they come from, and the token key.
#[derive(Debug)]
pub struct Launcher {
    placement: Placement,
    signer: TokenSigner,
    /// The fence sandboxes apply (`isolate`, `expose`).
    fence: SandboxLimits,
    /// What commands' network proxy lets through although internal.
    allow: Vec<String>,
}

impl Launcher {
    /// Returns the launcher of the `[runtime.sandbox]` settings, with a new
    /// token key; sandboxes keep their workspaces beside the runtime's
    /// (`<workspace root>-sandboxes/`).
    /// With `provider = "pool"`, sandboxes are claimed from `pool` instead.
    pub fn new(fence: &SandboxLimits, allow: &[String], workspace_root: &std::path::Path) -> Result<Self, String> {
        let placement = if fence.provider == avm_sandbox::Provider::Kubernetes {
            Placement::Kubernetes(Box::new(Claims::new(&fence.kubernetes)?))
        } else if fence.provider == avm_sandbox::Provider::Pool {
            if fence.pool.is_empty() {
                return Err(
                    "[runtime.sandbox] provider = \"pool\" needs the pool's addresses in [runtime.sandbox] pool"
                        .to_owned(),
                );
            }
            for address in fence.pool.iter().chain(&fence.pools.python).chain(&fence.pools.node) {
                pool_address(address)?;
            }
            Placement::Pool
        } else {
            let mut name = workspace_root.file_name().unwrap_or_default().to_owned();
            name.push("-sandboxes");
            Placement::Process {
                binary: fence.relay_binary(),
                root: workspace_root.with_file_name(name),
            }
        };
        Ok(Self {
            placement,
            signer: TokenSigner::random(),
            fence: fence.clone(),
            allow: allow.to_vec(),
        })
    }

    /// Whether the sandbox, not this host, has the interpreters of an
    /// image's environment (a pod of the environment's warm pool).
    pub fn picks_environment(&self) -> bool {
        matches!(self.placement, Placement::Pool | Placement::Kubernetes(_))
    }

    /// Gets a sandbox for `image_id`: starts one, or claims one of the pool
    /// or of the cluster.
    async fn start(&self, image_id: &str, environment: SandboxEnvironment) -> Result<Live, ToolFailure> {
        match &self.placement {
            Placement::Process { binary, root } => self.spawn(binary, root).await,
            Placement::Pool => self.claim(self.fence.pool_of(environment), image_id, environment).await,
            Placement::Kubernetes(claims) => self.claim_pod(claims, image_id, environment).await,
        }
    }

    /// Claims a sandbox pod for `image_id`, then its `avm sandbox`.
    async fn claim_pod(
        &self,
        claims: &Claims,
        image_id: &str,
        environment: SandboxEnvironment,
    ) -> Result<Live, ToolFailure> {
        let counted = |outcome: &'static str| {
            metrics::counter!("avm_runtime_sandboxes_total", "provider" => "kubernetes", "outcome" => outcome)
                .increment(1);
        };
        let (claim, url) = claims
            .claim(image_id, environment)
            .await
            .inspect_err(|_| counted("refused"))?;
        // Ready means its readiness probe passed; a moment's grace for a
        // listener that lags it.
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            match self.claim_at(&url, image_id, environment).await {
                Ok(client) => {
                    counted("claimed");
                    let expires = claim.expires;
                    return Ok(Live {
                        client,
                        _process: None,
                        pooled: false,
                        _claim: Some(claim),
                        expires: Some(expires),
                        synced: None,
                    });
                }
                Err(ClaimFailed::Unreachable) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(failed) => {
                    counted("refused");
                    return Err(match failed {
                        ClaimFailed::Unreachable => format!("the sandbox pod at {url} does not answer"),
                        ClaimFailed::Refused(status) => {
                            format!("the sandbox pod at {url} refused the claim: {}", status.message())
                        }
                    });
                }
            }
        }
    }

    /// Claims the sandbox at `url` for `image_id`, binding it to this
    /// runtime's token key.
    async fn claim_at(
        &self,
        url: &str,
        image_id: &str,
        environment: SandboxEnvironment,
    ) -> Result<SandboxServiceClient<Channel>, ClaimFailed> {
        let endpoint = Channel::from_shared(url.to_owned()).map_err(|_| ClaimFailed::Unreachable)?;
        let channel = endpoint
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .map_err(|_| ClaimFailed::Unreachable)?;
        let mut client = SandboxServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let claim = ClaimRequest {
            image_id: image_id.to_owned(),
            public_key: self.signer.public_key(),
            environment: environment.name().to_owned(),
        };
        client.claim(claim).await.map_err(ClaimFailed::Refused)?;
        Ok(client)
    }

    /// Claims a free sandbox of the pool for `image_id`, trying its
    /// addresses in random order.
    async fn claim(
        &self,
        addresses: &[String],
        image_id: &str,
        environment: SandboxEnvironment,
    ) -> Result<Live, ToolFailure> {
        use rand::seq::SliceRandom;
        let mut candidates = Vec::new();
        for address in addresses {
            let (host, port) = pool_address(address)?;
            match tokio::net::lookup_host((host.as_str(), port)).await {
                Ok(found) => candidates.extend(found.map(|addr| format!("http://{addr}"))),
                Err(err) => tracing::warn!(address, error = %err, "a sandbox pool address does not resolve"),
            }
        }
        candidates.shuffle(&mut rand::rng());
        let tried = candidates.len();
        let (mut busy, mut lacking) = (0, 0);
        for url in candidates {
            match self.claim_at(&url, image_id, environment).await {
                Ok(client) => {
                    metrics::counter!("avm_runtime_sandboxes_total", "provider" => "pool", "outcome" => "claimed")
                        .increment(1);
                    return Ok(Live {
                        client,
                        _process: None,
                        pooled: true,
                        _claim: None,
                        expires: None,
                        synced: None,
                    });
                }
                Err(ClaimFailed::Unreachable) => {}
                Err(ClaimFailed::Refused(status)) if status.code() == tonic::Code::ResourceExhausted => busy += 1,
                Err(ClaimFailed::Refused(status)) if status.code() == tonic::Code::FailedPrecondition => lacking += 1,
                Err(ClaimFailed::Refused(status)) => {
                    tracing::warn!(%url, error = %status.message(), "a sandbox of the pool refused a claim");
                }
            }
        }
        if lacking > 0 && busy == 0 {
            metrics::counter!("avm_runtime_sandboxes_total", "provider" => "pool", "outcome" => "refused").increment(1);
            let name = environment.name();
            return Err(format!(
                "no sandbox of the pool has the {name} environment ({lacking} of {tried} reached lack it): an \
                 operator names a pool of {name} sandboxes in [runtime.sandbox] pools.{name}, or the agent's sandbox \
                 names another environment"
            ));
        }
        metrics::counter!("avm_runtime_sandboxes_total", "provider" => "pool", "outcome" => "exhausted").increment(1);
        Err(format!(
            "no sandbox of the pool is free ({busy} busy of {tried} reached): try again shortly; an operator adds \
             sandboxes to the pool"
        ))
    }

    /// Starts a sandbox child and connects to it.
    async fn spawn(&self, binary: &std::path::Path, base: &std::path::Path) -> Result<Live, ToolFailure> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(base)
            .map_err(|err| format!("cannot make the sandboxes' directory: {err}"))?;
        let root = tempfile::Builder::new()
            .prefix("sandbox-")
            .tempdir_in(base)
            .map_err(|err| format!("cannot make the sandbox's directory: {err}"))?;
        let mut command = tokio::process::Command::new(binary);
        command
            .arg("sandbox")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--root")
            .arg(root.path())
            .arg("--stop-with-stdin")
            .env_clear()
            .env("PATH", avm_sandbox::COMMAND_PATH.join(":"))
            .env("AVM_SANDBOX_TOKEN_KEY", self.signer.public_key())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        if !self.fence.isolate {
            command.arg("--no-isolate");
        }
        for path in &self.fence.expose {
            command.arg("--expose").arg(path);
        }
        command.arg("--relay").arg(binary);
        let mut child = command
            .spawn()
            .map_err(|err| format!("cannot start a sandbox ({} sandbox): {err}", binary.display()))?;
        let stdout = child.stdout.take().ok_or("the sandbox's output is missing")?;
        let stdin = child.stdin.take().ok_or("the sandbox's input is missing")?;
        let mut lines = BufReader::new(stdout).lines();
        let announced = tokio::time::timeout(START_TIMEOUT, async {
            while let Some(line) = lines.next_line().await.ok().flatten() {
                if let Some(url) = line.strip_prefix("listening: grpc ") {
                    return Some(url.to_owned());
                }
            }
            None
        })
        .await;
        let url = match announced {
            Ok(Some(url)) => url,
            Ok(None) => return Err("the sandbox stopped as it started (its log says why)".to_owned()),
            Err(_) => return Err(format!("the sandbox did not start within {START_TIMEOUT:?}")),
        };
        // What it prints later is drained, so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let channel = Channel::from_shared(url)
            .map_err(|err| format!("the sandbox announced a bad address: {err}"))?
            .connect()
            .await
            .map_err(|err| format!("cannot reach the sandbox: {err}"))?;
        metrics::counter!("avm_runtime_sandboxes_total", "provider" => "process", "outcome" => "started").increment(1);
        Ok(Live {
            client: SandboxServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            _process: Some(Child {
                _child: child,
                _stdin: stdin,
                _root: root,
            }),
            pooled: false,
            _claim: None,
            expires: None,
            synced: None,
        })
    }
}

/// Why a sandbox could not be claimed.
enum ClaimFailed {
    /// Nothing answers at its address.
    Unreachable,
    /// It answered no.
    Refused(tonic::Status),
}

/// A sandbox child of this process.
#[derive(Debug)]
struct Child {
    /// Killed when dropped.
    _child: tokio::process::Child,
    /// Held open: the sandbox stops when it closes (when this process ends,
    /// however it ends).
    _stdin: tokio::process::ChildStdin,
    /// Its workspaces, removed when dropped.
    _root: tempfile::TempDir,
}

/// A sandbox in use.
#[derive(Debug)]
struct Live {
    client: SandboxServiceClient<Channel>,
    /// The child process, when this runtime started it.
    _process: Option<Child>,
    /// Claimed from a pool: released when no longer used.
    pooled: bool,
    /// The pod's claim (`kubernetes`): deleted when no longer used.
    _claim: Option<Claim>,
    /// When the sandbox goes on its own (its claim's shutdown time).
    expires: Option<std::time::Instant>,
    /// What the runtime's copy held when the two were last alike; `None`
    /// before the first put.
    synced: Option<Snapshot>,
}

/// One image's commands, run in a sandbox of its own.
#[derive(Debug)]
pub struct RemoteProcess {
    launcher: Arc<Launcher>,
    image_id: String,
    /// What its commands are given besides a shell.
    environment: SandboxEnvironment,
    /// The runtime's copy.
    workspace: Workspace,
    live: tokio::sync::Mutex<Option<Live>>,
}

impl RemoteProcess {
    /// Returns the commands of `image_id`'s workspace; no sandbox is started yet.
    pub fn new(launcher: Arc<Launcher>, image_id: &str, environment: SandboxEnvironment, workspace: Workspace) -> Self {
        Self {
            launcher,
            image_id: image_id.to_owned(),
            environment,
            workspace,
            live: tokio::sync::Mutex::new(None),
        }
    }

    /// Returns the image's sandbox, got if there is none or if the one there
    /// goes on its own `within` from now (its claim ends).
    async fn sandbox<'a>(&self, live: &'a mut Option<Live>, within: Duration) -> Result<&'a mut Live, ToolFailure> {
        let ending = live
            .as_ref()
            .and_then(|sandbox| sandbox.expires)
            .is_some_and(|expires| expires <= std::time::Instant::now() + within);
        if ending {
            // Its files are the runtime's: the next one is given them all.
            *live = None;
        }
        if live.is_none() {
            *live = Some(self.launcher.start(&self.image_id, self.environment).await?);
        }
        live.as_mut().ok_or_else(|| "the sandbox is not there".to_owned())
    }

    /// Returns `message` with this image's token.
    fn signed<T>(&self, message: T) -> tonic::Request<T> {
        signed(&self.launcher, &self.image_id, message)
    }

    /// Puts into the sandbox what changed in the runtime's copy since they
    /// were last alike (everything, the first time).
    async fn put(&self, live: &mut Live) -> Result<(), Lost> {
        let workspace = self.workspace.clone();
        let before = live.synced.clone();
        let (changes, now) = avm_sandbox::off_thread(move || {
            let now = sync::snapshot(&workspace)?;
            let changes = sync::changes(&workspace, before.as_ref().unwrap_or(&Snapshot::new()), &now)?;
            Ok((changes, now))
        })
        .await
        .map_err(Lost)?;
        let reset = live.synced.is_none();
        if changes.is_empty() && !reset {
            return Ok(());
        }
        for (index, (files, removed)) in pieces(changes).into_iter().enumerate() {
            let request = self.signed(PutFilesRequest {
                image_id: self.image_id.clone(),
                reset: reset && index == 0,
                files,
                removed,
            });
            live.client.put_files(request).await.map_err(lost)?;
        }
        live.synced = Some(now);
        Ok(())
    }

    /// Takes back what the command changed into the runtime's copy.
    async fn take(&self, live: &mut Live) -> Result<(), Lost> {
        let mut stream = live
            .client
            .take_changes(self.signed(TakeChangesRequest {
                image_id: self.image_id.clone(),
            }))
            .await
            .map_err(lost)?
            .into_inner();
        let (mut files, mut removed) = (Vec::new(), Vec::new());
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(lost)?;
            files.extend(piece.files);
            removed.extend(piece.removed);
        }
        let changes: Changes = joined_changes(files, removed);
        let workspace = self.workspace.clone();
        let now = avm_sandbox::off_thread(move || {
            if !changes.is_empty() {
                sync::apply(&workspace, &changes, false)?;
            }
            sync::snapshot(&workspace)
        })
        .await
        .map_err(Lost)?;
        live.synced = Some(now);
        Ok(())
    }

    /// Runs a command; `Err` when the sandbox failed (the command's own
    /// failures are `Ok(Err(..))`).
    async fn run_in(&self, live: &mut Live, command: Command<'_>) -> Result<Result<(String, bool), ToolFailure>, Lost> {
        self.put(live).await?;
        let request = RunCommandRequest {
            image_id: self.image_id.clone(),
            command: command.script.to_owned(),
            limits: Some(command_limits(command.limits, &self.launcher.allow)),
            env: command
                .env
                .iter()
                .map(|(name, value)| EnvironmentVariable {
                    name: name.clone(),
                    value: value.clone(),
                })
                .collect(),
        };
        let mut request = self.signed(request);
        request.set_timeout(Duration::from_secs(command.limits.timeout_seconds.max(1) + 30));
        let ran = live.client.run_command(request).await.map_err(lost)?.into_inner();
        self.take(live).await?;
        if ran.refused {
            return Ok(Err(ran.text));
        }
        Ok(Ok((ran.text, ran.failed)))
    }
}

#[async_trait::async_trait]
impl Process for RemoteProcess {
    async fn serve(&self, program: Program<'_>) -> Result<Served, ToolFailure> {
        self.serve_remote(program).await
    }

    async fn run(&self, command: Command<'_>) -> Result<(String, bool), ToolFailure> {
        if command.script.trim().is_empty() {
            return Err("`command` must not be empty".to_owned());
        }
        let mut live = self.live.lock().await;
        let within = Duration::from_secs(command.limits.timeout_seconds + 60);
        let sandbox = self.sandbox(&mut live, within).await?;
        match self.run_in(sandbox, command).await {
            Ok(ran) => ran,
            Err(Lost(why)) => {
                // Killed with its copy of the workspace: the next command starts another.
                *live = None;
                Err(why)
            }
        }
    }
}

/// A program served by a sandbox: its output and input pumped between the
/// call and local pipes; dropped, the pumps stop and the call is cancelled,
/// which kills the program there.
#[derive(Debug)]
struct RemoteProgram {
    pumps: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RemoteProgram {
    fn drop(&mut self) {
        for pump in &self.pumps {
            pump.abort();
        }
    }
}

/// How long a served program (a stdio MCP server) is expected to run: a
/// sandbox whose claim ends sooner is replaced first.
const SERVED_FOR: Duration = Duration::from_secs(30 * 60);

/// Buffered between a served program's call and its local pipes.
const PIPE_BYTES: usize = 64 * 1024;

impl RemoteProcess {
    /// Starts a program in the sandbox (started or claimed if need be, the
    /// workspace put in first).
    async fn serve_remote(&self, program: Program<'_>) -> Result<Served, ToolFailure> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut client = {
            let mut live = self.live.lock().await;
            let sandbox = self.sandbox(&mut live, SERVED_FOR).await?;
            if let Err(Lost(why)) = self.put(sandbox).await {
                *live = None;
                return Err(why);
            }
            sandbox.client.clone()
        };
        let variables = |vars: &mut dyn Iterator<Item = (&String, &String)>| -> Vec<EnvironmentVariable> {
            vars.map(|(name, value)| EnvironmentVariable {
                name: name.clone(),
                value: value.clone(),
            })
            .collect()
        };
        let program_id = format!("prog_{:032x}", rand::random::<u128>());
        let request = ServeProgramRequest {
            image_id: self.image_id.clone(),
            program_id: program_id.clone(),
            program: program.program.to_owned(),
            args: program.args.to_vec(),
            limits: Some(command_limits(program.limits, &self.launcher.allow)),
            env: variables(&mut program.env.iter().map(|(name, value)| (name, value))),
            own_env: variables(&mut program.own.iter()),
        };
        let mut output = client
            .serve_program(self.signed(request))
            .await
            .map_err(|status| lost(status).0)?
            .into_inner();
        let (mut stdout_in, stdout) = tokio::io::duplex(PIPE_BYTES);
        let (stdin, mut stdin_out) = tokio::io::duplex(PIPE_BYTES);
        let (mut stderr_in, stderr) = tokio::io::duplex(4096);
        let reading = tokio::spawn(async move {
            while let Some(Ok(piece)) = output.next().await {
                if !piece.ended.is_empty() {
                    let _ = stderr_in.write_all(piece.ended.as_bytes()).await;
                    break;
                }
                if stdout_in.write_all(&piece.stdout).await.is_err() {
                    break;
                }
            }
        });
        let (image_id, launcher) = (self.image_id.clone(), Arc::clone(&self.launcher));
        let writing = tokio::spawn(async move {
            let mut buffer = vec![0_u8; PIPE_BYTES];
            while let Ok(read) = stdin_out.read(&mut buffer).await {
                if read == 0 {
                    break;
                }
                let write = WriteProgramRequest {
                    image_id: image_id.clone(),
                    program_id: program_id.clone(),
                    stdin: buffer[..read].to_vec(),
                };
                let request = signed(&launcher, &image_id, write);
                if client.write_program(request).await.is_err() {
                    break;
                }
            }
        });
        Ok(Served {
            stdout: Box::pin(stdout),
            stdin: Box::pin(stdin),
            stderr: Some(Box::pin(stderr)),
            keep: Box::new(RemoteProgram {
                pumps: vec![reading, writing],
            }),
        })
    }
}

impl Drop for RemoteProcess {
    /// A pool's sandbox is released (its copy of the workspace removed) for
    /// the next image; a child is killed with its copy.
    fn drop(&mut self) {
        let Some(live) = self.live.get_mut().take() else { return };
        if !live.pooled {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let request = self.signed(ReleaseWorkspaceRequest {
            image_id: self.image_id.clone(),
        });
        let mut client = live.client;
        runtime.spawn(async move {
            if let Err(status) = client.release_workspace(request).await {
                tracing::warn!(error = %status.message(), "cannot release a sandbox of the pool; it frees itself when idle");
            }
        });
    }
}

/// Returns `message` with a token of `launcher`'s for `image_id`.
fn signed<T>(launcher: &Launcher, image_id: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(value) = format!("Bearer {}", launcher.signer.issue(image_id)).parse() {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// Returns the host and port of a pool address (`http://host:port`).
fn pool_address(address: &str) -> Result<(String, u16), String> {
    let url =
        url::Url::parse(address).map_err(|err| format!("[runtime.sandbox] pool: {address:?} is not a URL: {err}"))?;
    match (url.scheme(), url.host_str(), url.port_or_known_default()) {
        ("http", Some(host), Some(port)) => Ok((host.trim_start_matches('[').trim_end_matches(']').to_owned(), port)),
        _ => Err(format!("[runtime.sandbox] pool: {address:?} must be http://host:port")),
    }
}

/// A sandbox that failed a call: it is stopped; the text is what the model reads.
#[derive(Debug)]
struct Lost(ToolFailure);

/// Says a sandbox failed a call.
fn lost(status: tonic::Status) -> Lost {
    Lost(lost_text(&status))
}

fn lost_text(status: &tonic::Status) -> ToolFailure {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Internal => format!(
            "the command's sandbox stopped ({}); the workspace is as it was after the last command, and the next \
             command gets a new sandbox",
            status.message()
        ),
        tonic::Code::DeadlineExceeded => "the command's sandbox did not answer in time and was stopped".to_owned(),
        _ => format!("the command's sandbox refused it: {}", status.message()),
    }
}
