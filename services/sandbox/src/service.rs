//! The `avm.sandbox.v1` service: an `avm sandbox` process's workspaces and
//! the commands run in them. It answers the runtime only (every call needs
//! a token for the image it names) and reaches nothing itself but the
//! network its commands' proxy lets through.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use avm_common::address::AddressGuard;
use avm_proto::sandbox::v1::sandbox_service_server::SandboxService;
use avm_proto::sandbox::v1::{
    ClaimRequest, ClaimResponse, CommandLimits, PutFilesRequest, PutFilesResponse, ReleaseWorkspaceRequest,
    ReleaseWorkspaceResponse, RunCommandRequest, RunCommandResponse, ServeProgramRequest, ServeProgramResponse,
    TakeChangesRequest, TakeChangesResponse, WorkspaceFile, WriteProgramRequest, WriteProgramResponse,
};
use tonic::{Request, Response, Status};

use crate::sync::{self, Changes, Made, Snapshot};
use crate::token::TokenVerifier;
use crate::{Command, Process, SandboxLimits, Workspace};

/// Largest piece of a file in one message.
pub const PIECE_BYTES: usize = 1024 * 1024;

/// One image's workspace here, and what it held when it was last alike
/// with the runtime's copy.
#[derive(Debug)]
struct Held {
    workspace: Workspace,
    synced: Snapshot,
}

/// Whose tokens a sandbox takes.
#[derive(Debug)]
pub enum Trust {
    /// The key of the runtime that started it, for any of its images.
    Runtime(TokenVerifier),
    /// A pool's: the key and the one image of whoever claimed it, until
    /// they release it or it goes unused for `idle`.
    Claimable { idle: Duration },
}

/// What a pool's sandbox clears when a claim ends, so that nothing of one
/// image meets the next: set where the sandbox is alone in its container.
#[derive(Clone, Debug, Default)]
pub struct Scrub {
    /// Directories whose contents are removed (the container's `/tmp`).
    pub scratch: Vec<PathBuf>,
    /// Kill every other process of this sandbox's user (but PID 1 and its
    /// parent): what a command left running, however it left its group.
    pub strays: bool,
}

/// Who a pool's sandbox serves.
#[derive(Debug)]
struct Claimed {
    key: String,
    verifier: TokenVerifier,
    image_id: String,
    last_used: Instant,
}

/// The sandbox service.
#[derive(Debug)]
pub struct Sandbox {
    /// Where workspaces are made, one directory per image.
    root: PathBuf,
    trust: Trust,
    claimed: Mutex<Option<Claimed>>,
    scrub: Scrub,
    /// This sandbox's fence (`isolate`, `expose`, `relay`); a command's
    /// limits are the runtime's.
    fence: SandboxLimits,
    held: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Held>>>>,
    /// The served programs' standard inputs, by `<image>/<program id>`.
    programs: Programs,
}

/// The served programs' standard inputs.
type Programs = Arc<Mutex<HashMap<String, tokio::sync::mpsc::Sender<Vec<u8>>>>>;

/// A served program while its output is streamed: dropped (the call
/// cancelled, or the program done), it is killed and forgotten.
struct Running {
    stdout: tokio::process::ChildStdout,
    stderr: Option<tokio::process::ChildStderr>,
    _server: crate::process::Server,
    programs: Programs,
    key: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.programs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .remove(&self.key);
    }
}

impl Running {
    /// Returns the next piece of output, or why the program ended.
    async fn next(mut self) -> Option<(Result<ServeProgramResponse, Status>, Option<Running>)> {
        use tokio::io::AsyncReadExt;
        let mut buffer = vec![0_u8; 16 * 1024];
        match self.stdout.read(&mut buffer).await {
            Ok(read) if read > 0 => {
                buffer.truncate(read);
                let piece = ServeProgramResponse {
                    stdout: buffer,
                    ended: String::new(),
                };
                Some((Ok(piece), Some(self)))
            }
            _ => {
                let mut said = vec![0_u8; 2048];
                let read = match self.stderr.as_mut() {
                    Some(stderr) => tokio::time::timeout(Duration::from_millis(200), stderr.read(&mut said))
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .unwrap_or(0),
                    None => 0,
                };
                let said = String::from_utf8_lossy(&said[..read]).trim().to_owned();
                let ended = ServeProgramResponse {
                    stdout: Vec::new(),
                    ended: format!("it ended; it said: {said:?}"),
                };
                Some((Ok(ended), None))
            }
        }
    }
}

impl Sandbox {
    /// Returns the sandbox keeping workspaces under `root`, serving tokens
    /// as `trust` says, fencing commands as `fence` says.
    pub fn new(root: PathBuf, trust: Trust, fence: SandboxLimits) -> Self {
        Self {
            root,
            trust,
            claimed: Mutex::new(None),
            scrub: Scrub::default(),
            programs: Arc::new(Mutex::new(HashMap::new())),
            fence,
            held: Mutex::new(HashMap::new()),
        }
    }

    /// Returns the sandbox clearing `scrub` when a claim ends.
    pub fn with_scrub(mut self, scrub: Scrub) -> Self {
        self.scrub = scrub;
        self
    }

    /// Ends a pool's claim: every workspace removed, and what `scrub` names
    /// cleared.
    async fn end_claim(&self) {
        *self.claimed.lock().unwrap_or_else(|poison| poison.into_inner()) = None;
        self.forget_all().await;
        let (root, scrub) = (self.root.clone(), self.scrub.clone());
        let _ = tokio::task::spawn_blocking(move || {
            if scrub.strays {
                kill_strays();
            }
            for dir in std::iter::once(&root).chain(&scrub.scratch) {
                empty(dir);
            }
        })
        .await;
    }

    /// Frees a pool's sandbox whose claim went unused for its idle time
    /// (its runtime gone without releasing it): its workspaces are removed.
    pub async fn expire_idle(&self) {
        let Trust::Claimable { idle } = self.trust else { return };
        let expired = {
            let mut claimed = self.claimed.lock().unwrap_or_else(|poison| poison.into_inner());
            match claimed.as_ref() {
                Some(claim) if claim.last_used.elapsed() >= idle => claimed.take(),
                _ => None,
            }
        };
        if let Some(claim) = expired {
            tracing::info!(image_id = %claim.image_id, "a claim went unused: the sandbox is free again");
            self.end_claim().await;
        }
    }

    /// Removes every workspace held.
    async fn forget_all(&self) {
        let held: Vec<_> = self
            .held
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .drain()
            .collect();
        for (_, workspace) in held {
            let dir = workspace.lock().await.workspace.dir().to_owned();
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
        }
    }

    /// Returns the number of workspaces held.
    pub fn workspaces(&self) -> usize {
        self.held.lock().unwrap_or_else(|poison| poison.into_inner()).len()
    }

    /// Checks the call's token for `image_id` and returns its workspace.
    fn authorized<T>(&self, request: &Request<T>, image_id: &str) -> Result<Arc<tokio::sync::Mutex<Held>>, Status> {
        checked_image(image_id)?;
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or_else(|| Status::unauthenticated("a sandbox token is required"))?;
        let verifier = match &self.trust {
            Trust::Runtime(verifier) => verifier.clone(),
            Trust::Claimable { .. } => {
                let mut claimed = self.claimed.lock().unwrap_or_else(|poison| poison.into_inner());
                match claimed.as_mut() {
                    Some(claim) if claim.image_id == image_id => {
                        claim.last_used = Instant::now();
                        claim.verifier.clone()
                    }
                    Some(_) => return Err(Status::permission_denied("this sandbox serves another image")),
                    None => return Err(Status::failed_precondition("this sandbox is not claimed")),
                }
            }
        };
        verifier.check(token, image_id).map_err(Status::permission_denied)?;
        let mut held = self.held.lock().unwrap_or_else(|poison| poison.into_inner());
        let entry = held.entry(image_id.to_owned()).or_insert_with(|| {
            Arc::new(tokio::sync::Mutex::new(Held {
                workspace: Workspace::new(self.root.join(image_id)),
                synced: Snapshot::new(),
            }))
        });
        Ok(Arc::clone(entry))
    }
}

/// Removes what `dir` holds (not `dir`); what cannot be removed is logged.
fn empty(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let removed = match entry.file_type() {
            Ok(kind) if kind.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        if let Err(err) = removed {
            tracing::warn!(path = %path.display(), error = %err, "cannot clear what a claim left");
        }
    }
}

/// Kills every process of this process's user but itself, PID 1 and its parent.
fn kill_strays() {
    use std::os::unix::fs::MetadataExt;
    let (me, parent) = (std::process::id(), nix::unistd::getppid().as_raw());
    let uid = nix::unistd::getuid().as_raw();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<i32>().ok()) else {
            continue;
        };
        if pid == 1 || pid == parent || u32::try_from(pid).is_ok_and(|pid| pid == me) {
            continue;
        }
        if entry.metadata().is_ok_and(|meta| meta.uid() == uid) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Returns the changes pieces of files carry (pieces of one file joined).
pub fn joined_changes(files: Vec<WorkspaceFile>, removed: Vec<String>) -> Changes {
    let mut made: Vec<Made> = Vec::with_capacity(files.len());
    for file in files {
        match made.last_mut() {
            Some(last) if file.append && last.path == file.path && !last.directory => {
                last.content.extend_from_slice(&file.content);
            }
            _ => made.push(Made {
                path: file.path,
                directory: file.directory,
                content: file.content,
                executable: file.executable,
            }),
        }
    }
    Changes { made, removed }
}

/// Returns changes as messages of at most about [`PIECE_BYTES`] each.
pub fn pieces(changes: Changes) -> Vec<(Vec<WorkspaceFile>, Vec<String>)> {
    let mut messages = Vec::new();
    let mut files = Vec::new();
    let mut bytes = 0_usize;
    for made in changes.made {
        let mut chunks: Vec<&[u8]> = made.content.chunks(PIECE_BYTES).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        for (index, chunk) in chunks.into_iter().enumerate() {
            if bytes + chunk.len() > PIECE_BYTES && !files.is_empty() {
                messages.push((std::mem::take(&mut files), Vec::new()));
                bytes = 0;
            }
            bytes += chunk.len();
            files.push(WorkspaceFile {
                path: made.path.clone(),
                directory: made.directory,
                content: chunk.to_vec(),
                append: index > 0,
                executable: made.executable,
            });
        }
    }
    messages.push((files, changes.removed));
    messages
}

/// Returns the limits of a command: the runtime's, within this sandbox's fence.
pub fn limits_of(fence: &SandboxLimits, limits: Option<&CommandLimits>) -> SandboxLimits {
    let Some(limits) = limits else { return fence.clone() };
    let or = |asked: u64, default: u64| if asked == 0 { default } else { asked };
    SandboxLimits {
        timeout_seconds: or(limits.timeout_seconds, fence.timeout_seconds),
        cpu_seconds: or(limits.cpu_seconds, fence.cpu_seconds),
        memory_mb: or(limits.memory_mb, fence.memory_mb),
        processes: or(limits.processes, fence.processes),
        file_mb: or(limits.file_mb, fence.file_mb),
        output_bytes: usize::try_from(or(limits.output_bytes, fence.output_bytes as u64)).unwrap_or(fence.output_bytes),
        disk_mb: or(limits.disk_mb, fence.disk_mb),
        network: limits.network,
        ..fence.clone()
    }
}

/// Returns a command's limits as the runtime sends them.
pub fn command_limits(limits: &SandboxLimits, allow: &[String]) -> CommandLimits {
    CommandLimits {
        timeout_seconds: limits.timeout_seconds,
        cpu_seconds: limits.cpu_seconds,
        memory_mb: limits.memory_mb,
        processes: limits.processes,
        file_mb: limits.file_mb,
        output_bytes: limits.output_bytes as u64,
        disk_mb: limits.disk_mb,
        network: limits.network,
        allow: allow.to_vec(),
    }
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, String> + Send + 'static) -> Result<T, Status> {
    crate::off_thread(work).await.map_err(Status::failed_precondition)
}

/// Refuses what is not an image id (it names a directory here).
fn checked_image(image_id: &str) -> Result<(), Status> {
    if avm_common::ids::is_plain_name(image_id) && !image_id.starts_with('.') {
        Ok(())
    } else {
        Err(Status::invalid_argument("image_id must be an image id"))
    }
}

#[tonic::async_trait]
impl SandboxService for Sandbox {
    type TakeChangesStream = avm_proto::BoxStream<TakeChangesResponse>;

    async fn claim(&self, request: Request<ClaimRequest>) -> Result<Response<ClaimResponse>, Status> {
        let Trust::Claimable { .. } = self.trust else {
            return Err(Status::failed_precondition(
                "this sandbox serves the runtime that started it: it is not claimed",
            ));
        };
        let ClaimRequest {
            image_id,
            public_key,
            environment,
        } = request.into_inner();
        checked_image(&image_id)?;
        if !environment.is_empty() {
            let environment = crate::SandboxEnvironment::named(&environment)
                .ok_or_else(|| Status::invalid_argument(format!("no environment is named {environment:?}")))?;
            environment.check(&crate::COMMAND_PATH).map_err(|_| {
                Status::failed_precondition(format!("this sandbox has no {} environment", environment.name()))
            })?;
        }
        let verifier = TokenVerifier::from_public_key(&public_key).map_err(Status::invalid_argument)?;
        let mut claimed = self.claimed.lock().unwrap_or_else(|poison| poison.into_inner());
        match claimed.as_mut() {
            Some(claim) if claim.key == public_key && claim.image_id == image_id => {
                claim.last_used = Instant::now();
            }
            Some(_) => return Err(Status::resource_exhausted("this sandbox serves another image")),
            None => {
                *claimed = Some(Claimed {
                    key: public_key,
                    verifier,
                    image_id,
                    last_used: Instant::now(),
                });
            }
        }
        Ok(Response::new(ClaimResponse {}))
    }

    async fn put_files(&self, request: Request<PutFilesRequest>) -> Result<Response<PutFilesResponse>, Status> {
        let held = self.authorized(&request, &request.get_ref().image_id)?;
        let request = request.into_inner();
        let mut held = held.lock_owned().await;
        let workspace = held.workspace.clone();
        let changes = joined_changes(request.files, request.removed);
        let reset = request.reset;
        let synced = blocking(move || {
            sync::apply(&workspace, &changes, reset)?;
            sync::snapshot(&workspace)
        })
        .await?;
        held.synced = synced;
        Ok(Response::new(PutFilesResponse {}))
    }

    async fn run_command(&self, request: Request<RunCommandRequest>) -> Result<Response<RunCommandResponse>, Status> {
        let held = self.authorized(&request, &request.get_ref().image_id)?;
        let request = request.into_inner();
        let limits = limits_of(&self.fence, request.limits.as_ref());
        let allow = request.limits.map(|limits| limits.allow).unwrap_or_default();
        let guard = Arc::new(AddressGuard::new(&allow).map_err(|err| Status::invalid_argument(err.message))?);
        let env: Vec<(String, String)> = request.env.into_iter().map(|var| (var.name, var.value)).collect();
        let workspace = held.lock().await.workspace.clone().with_quota_mb(limits.disk_mb);
        let command = Command {
            script: &request.command,
            limits: &limits,
            guard: &guard,
            env: &env,
        };
        let response = match workspace.run(command).await {
            Ok((text, failed)) => RunCommandResponse {
                text,
                failed,
                refused: false,
            },
            Err(why) => RunCommandResponse {
                text: why,
                failed: true,
                refused: true,
            },
        };
        Ok(Response::new(response))
    }

    async fn take_changes(
        &self,
        request: Request<TakeChangesRequest>,
    ) -> Result<Response<Self::TakeChangesStream>, Status> {
        let held = self.authorized(&request, &request.get_ref().image_id)?;
        let mut held = held.lock_owned().await;
        let workspace = held.workspace.clone();
        let before = held.synced.clone();
        let (changes, now) = blocking(move || {
            let now = sync::snapshot(&workspace)?;
            Ok((sync::changes(&workspace, &before, &now)?, now))
        })
        .await?;
        held.synced = now;
        let messages = pieces(changes)
            .into_iter()
            .map(|(files, removed)| Ok(TakeChangesResponse { files, removed }));
        Ok(Response::new(Box::pin(futures::stream::iter(messages))))
    }

    type ServeProgramStream = avm_proto::BoxStream<ServeProgramResponse>;

    async fn serve_program(
        &self,
        request: Request<ServeProgramRequest>,
    ) -> Result<Response<Self::ServeProgramStream>, Status> {
        let held = self.authorized(&request, &request.get_ref().image_id)?;
        let request = request.into_inner();
        if !avm_common::ids::is_plain_name(&request.program_id) {
            return Err(Status::invalid_argument("program_id must be a plain name"));
        }
        let limits = limits_of(&self.fence, request.limits.as_ref());
        let allow = request.limits.map(|limits| limits.allow).unwrap_or_default();
        let guard = Arc::new(AddressGuard::new(&allow).map_err(|err| Status::invalid_argument(err.message))?);
        let env: Vec<(String, String)> = request.env.into_iter().map(|var| (var.name, var.value)).collect();
        let own: std::collections::BTreeMap<String, String> =
            request.own_env.into_iter().map(|var| (var.name, var.value)).collect();
        let workspace = held.lock().await.workspace.clone().with_quota_mb(limits.disk_mb);
        let served =
            crate::process::serve(&workspace, &request.program, &request.args, &limits, &guard, &env, &own).await;
        let mut server = match served {
            Ok(server) => server,
            Err(why) => {
                let ended = ServeProgramResponse {
                    stdout: Vec::new(),
                    ended: why,
                };
                return Ok(Response::new(Box::pin(futures::stream::iter([Ok(ended)]))));
            }
        };
        let child = &mut server.child;
        let (Some(stdout), Some(mut stdin), stderr) = (child.stdout.take(), child.stdin.take(), child.stderr.take())
        else {
            return Err(Status::internal("the program's standard streams are missing"));
        };
        let key = format!("{}/{}", request.image_id, request.program_id);
        let (sender, mut received) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
        self.programs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .insert(key.clone(), sender);
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Some(bytes) = received.recv().await {
                if stdin.write_all(&bytes).await.is_err() || stdin.flush().await.is_err() {
                    break;
                }
            }
        });
        let running = Running {
            stdout,
            stderr,
            _server: server,
            programs: Arc::clone(&self.programs),
            key,
        };
        let stream = futures::stream::unfold(Some(running), |running| async move { running?.next().await });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn write_program(
        &self,
        request: Request<WriteProgramRequest>,
    ) -> Result<Response<WriteProgramResponse>, Status> {
        self.authorized(&request, &request.get_ref().image_id)?;
        let request = request.into_inner();
        let key = format!("{}/{}", request.image_id, request.program_id);
        let sender = self
            .programs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .get(&key)
            .cloned()
            .ok_or_else(|| Status::failed_precondition("the program has ended"))?;
        sender
            .send(request.stdin)
            .await
            .map_err(|_| Status::failed_precondition("the program has ended"))?;
        Ok(Response::new(WriteProgramResponse {}))
    }

    async fn release_workspace(
        &self,
        request: Request<ReleaseWorkspaceRequest>,
    ) -> Result<Response<ReleaseWorkspaceResponse>, Status> {
        let image_id = request.get_ref().image_id.clone();
        let held = self.authorized(&request, &image_id)?;
        let held = held.lock_owned().await;
        let dir = held.workspace.dir().to_owned();
        blocking(move || match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(format!("cannot remove the workspace: {err}")),
        })
        .await?;
        self.held
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .remove(&image_id);
        drop(held);
        if let Trust::Claimable { .. } = self.trust {
            self.end_claim().await;
        }
        Ok(Response::new(ReleaseWorkspaceResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::token::TokenSigner;

    fn signed<T>(message: T, token: &str) -> Request<T> {
        let mut request = Request::new(message);
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        request
    }

    fn file(path: &str, content: &str) -> WorkspaceFile {
        WorkspaceFile {
            path: path.to_owned(),
            content: content.as_bytes().to_vec(),
            ..WorkspaceFile::default()
        }
    }

    #[tokio::test]
    async fn each_call_needs_a_token_for_its_own_image() {
        let temp = tempfile::tempdir().unwrap();
        let signer = TokenSigner::random();
        let verifier = TokenVerifier::from_public_key(&signer.public_key()).unwrap();
        let sandbox = Sandbox::new(
            temp.path().to_owned(),
            Trust::Runtime(verifier),
            SandboxLimits::default(),
        );
        let (a, b) = (signer.issue("img_a"), signer.issue("img_b"));
        let put = |image: &str, path: &str| PutFilesRequest {
            image_id: image.to_owned(),
            reset: false,
            files: vec![file(path, "kept")],
            removed: Vec::new(),
        };
        sandbox.put_files(signed(put("img_a", "a.txt"), &a)).await.unwrap();

        // Another image's token, no token, another runtime's token, a bad id.
        let refused = sandbox.put_files(signed(put("img_a", "x.txt"), &b)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        let refused = sandbox
            .put_files(Request::new(put("img_a", "x.txt")))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        let foreign = TokenSigner::random().issue("img_a");
        let refused = sandbox
            .put_files(signed(put("img_a", "x.txt"), &foreign))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        for bad in ["..", "../img_a", "img_a/x", "", &"i".repeat(20_000), "img\0a"] {
            let token = signer.issue(bad);
            let refused = sandbox.put_files(signed(put(bad, "x.txt"), &token)).await.unwrap_err();
            assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
        assert!(!temp.path().join("img_a/x.txt").exists());

        // Image B's workspace holds nothing of A's, and A's changes are A's.
        let take = |image: &str, token: &str| {
            signed(
                TakeChangesRequest {
                    image_id: image.to_owned(),
                },
                token,
            )
        };
        let mut changes = sandbox.take_changes(take("img_b", &b)).await.unwrap().into_inner();
        let piece = changes.next().await.unwrap().unwrap();
        assert!(piece.files.is_empty() && piece.removed.is_empty(), "{piece:?}");
        let refused = sandbox
            .take_changes(take("img_a", &b))
            .await
            .err()
            .map(|status| status.code());
        assert_eq!(refused, Some(tonic::Code::PermissionDenied));
        std::fs::write(temp.path().join("img_a/made.txt"), "by a command").unwrap();
        let mut changes = sandbox.take_changes(take("img_a", &a)).await.unwrap().into_inner();
        let piece = changes.next().await.unwrap().unwrap();
        let paths: Vec<&str> = piece.files.iter().map(|file| file.path.as_str()).collect();
        assert_eq!(paths, ["made.txt"], "only what changed since the put comes back");

        let release = |image: &str, token: &str| {
            signed(
                ReleaseWorkspaceRequest {
                    image_id: image.to_owned(),
                },
                token,
            )
        };
        assert!(sandbox.release_workspace(release("img_a", &b)).await.is_err());
        assert!(temp.path().join("img_a").exists());
        sandbox.release_workspace(release("img_a", &a)).await.unwrap();
        assert!(!temp.path().join("img_a").exists());
    }

    #[tokio::test]
    async fn a_pools_sandbox_serves_one_image_of_one_runtime_at_a_time() {
        let temp = tempfile::tempdir().unwrap();
        let idle = Duration::from_secs(3600);
        let sandbox = Sandbox::new(
            temp.path().to_owned(),
            Trust::Claimable { idle },
            SandboxLimits::default(),
        );
        let (ours, theirs) = (TokenSigner::random(), TokenSigner::random());
        let claim = |image: &str, key: &TokenSigner| {
            Request::new(ClaimRequest {
                image_id: image.to_owned(),
                public_key: key.public_key(),
                environment: "shell".to_owned(),
            })
        };
        let put = |image: &str| PutFilesRequest {
            image_id: image.to_owned(),
            reset: true,
            files: vec![file("a.txt", "a")],
            removed: Vec::new(),
        };
        // An environment it cannot know is refused, claiming nothing.
        let mut unknown = claim("img_a", &ours);
        unknown.get_mut().environment = "cobol".to_owned();
        assert_eq!(
            sandbox.claim(unknown).await.unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        // Unclaimed, it serves nobody.
        let refused = sandbox
            .put_files(signed(put("img_a"), &ours.issue("img_a")))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        sandbox.claim(claim("img_a", &ours)).await.unwrap();
        sandbox.claim(claim("img_a", &ours)).await.unwrap();
        sandbox
            .put_files(signed(put("img_a"), &ours.issue("img_a")))
            .await
            .unwrap();
        // Another image, another runtime: busy; a token of another key: refused.
        for (image, key) in [("img_b", &ours), ("img_a", &theirs), ("img_b", &theirs)] {
            let refused = sandbox.claim(claim(image, key)).await.unwrap_err();
            assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{image}");
        }
        let refused = sandbox
            .put_files(signed(put("img_a"), &theirs.issue("img_a")))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        let refused = sandbox
            .put_files(signed(put("img_b"), &ours.issue("img_b")))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        // Released, it is free for anyone, and holds nothing of the last image.
        let release = ReleaseWorkspaceRequest {
            image_id: "img_a".to_owned(),
        };
        sandbox
            .release_workspace(signed(release, &ours.issue("img_a")))
            .await
            .unwrap();
        assert!(!temp.path().join("img_a").exists());
        sandbox.claim(claim("img_b", &theirs)).await.unwrap();
        sandbox
            .put_files(signed(put("img_b"), &theirs.issue("img_b")))
            .await
            .unwrap();

        // Scratch directories are emptied when a claim ends.
        let scratch = temp.path().join("scratch");
        std::fs::create_dir_all(scratch.join("left/deep")).unwrap();
        std::fs::write(scratch.join("left/deep/note"), "from img_b").unwrap();
        let scrubbed = Sandbox::new(
            temp.path().join("s"),
            Trust::Claimable { idle },
            SandboxLimits::default(),
        )
        .with_scrub(Scrub {
            scratch: vec![scratch.clone()],
            strays: false,
        });
        scrubbed.claim(claim("img_b", &theirs)).await.unwrap();
        let release = ReleaseWorkspaceRequest {
            image_id: "img_b".to_owned(),
        };
        scrubbed
            .release_workspace(signed(release, &theirs.issue("img_b")))
            .await
            .unwrap();
        assert!(scratch.exists() && std::fs::read_dir(&scratch).unwrap().next().is_none());

        // A claim left unused goes, its workspace with it.
        let quick = Sandbox::new(
            temp.path().join("q"),
            Trust::Claimable { idle: Duration::ZERO },
            SandboxLimits::default(),
        );
        quick.claim(claim("img_c", &ours)).await.unwrap();
        quick
            .put_files(signed(put("img_c"), &ours.issue("img_c")))
            .await
            .unwrap();
        assert!(temp.path().join("q/img_c/a.txt").exists());
        quick.expire_idle().await;
        assert!(!temp.path().join("q/img_c").exists());
        quick.claim(claim("img_d", &theirs)).await.unwrap();
    }

    #[tokio::test]
    async fn a_served_program_reads_what_is_written_and_goes_with_its_call() {
        let temp = tempfile::tempdir().unwrap();
        let signer = TokenSigner::random();
        let verifier = TokenVerifier::from_public_key(&signer.public_key()).unwrap();
        let fence = SandboxLimits {
            isolate: false,
            ..SandboxLimits::default()
        };
        let sandbox = Sandbox::new(temp.path().to_owned(), Trust::Runtime(verifier), fence);
        let token = signer.issue("img_a");
        let serve = ServeProgramRequest {
            image_id: "img_a".to_owned(),
            program_id: "prog_1".to_owned(),
            program: "/bin/cat".to_owned(),
            limits: Some(CommandLimits {
                network: false,
                ..CommandLimits::default()
            }),
            ..ServeProgramRequest::default()
        };
        let mut output = sandbox.serve_program(signed(serve, &token)).await.unwrap().into_inner();
        let write = |image: &str, token: &str| {
            signed(
                WriteProgramRequest {
                    image_id: image.to_owned(),
                    program_id: "prog_1".to_owned(),
                    stdin: b"ping\n".to_vec(),
                },
                token,
            )
        };
        // Another image's token writes nothing to it.
        let refused = sandbox
            .write_program(write("img_a", &signer.issue("img_b")))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        sandbox.write_program(write("img_a", &token)).await.unwrap();
        let piece = output.next().await.unwrap().unwrap();
        assert_eq!(piece.stdout, b"ping\n");
        // The call cancelled, the program is gone.
        drop(output);
        let gone = sandbox.write_program(write("img_a", &token)).await.unwrap_err();
        assert_eq!(gone.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn large_files_travel_in_pieces_and_are_joined_whole() {
        let content: Vec<u8> = (0..(PIECE_BYTES * 2 + 10)).map(|i| (i % 251) as u8).collect();
        let changes = Changes {
            made: vec![
                Made {
                    path: "big.bin".to_owned(),
                    directory: false,
                    content: content.clone(),
                    executable: true,
                },
                Made {
                    path: "empty".to_owned(),
                    directory: false,
                    content: Vec::new(),
                    executable: false,
                },
            ],
            removed: vec!["gone".to_owned()],
        };
        let messages = pieces(changes.clone());
        assert!(messages.len() >= 3, "{}", messages.len());
        for (files, _) in &messages {
            assert!(files.iter().map(|file| file.content.len()).sum::<usize>() <= PIECE_BYTES);
        }
        let (files, removed): (Vec<_>, Vec<_>) = messages.into_iter().unzip();
        let joined = joined_changes(files.concat(), removed.concat());
        assert_eq!(joined, changes);
    }
}
