//! An image's sandbox: the resources an agent's tools use, as traits with a
//! local implementation each.
//!
//! - [`FileSystem`]: the workspace's files, every path confined beneath its
//!   root by [`workspace`] (one rule, for the tools and for clients' access).
//! - [`Process`]: a command run in the workspace behind the fence of
//!   [`isolation`], under limits and a wall timeout, everything it started
//!   killed when it ends, its network only through the guarded proxy of
//!   [`egress`].
//! - [`Env`]: the variables a command sees, secrets redacted from what
//!   tools return.
//! - [`Disk`]: where a workspace persists between agents (restored once,
//!   saved when it changed).
//!
//! The runtime composes them into an agent's toolbox; where commands run
//! (the runtime's own process, or an `avm sandbox` holding no platform
//! secret) is the runtime's `[runtime.sandbox] provider`.

use std::fmt::Debug;
use std::sync::Arc;

use avm_common::address::AddressGuard;

pub mod access;
mod cgroup;
pub mod egress;
pub mod files;
pub mod isolation;
mod limits;
pub mod process;
pub mod service;
pub mod sync;
pub mod token;
pub mod workspace;

pub use access::{AccessError, Entry};
pub use limits::{
    COMMAND_PATH, EnvValue, EnvironmentPools, HIDE_REMOVED, KubernetesSandboxes, Provider, Removed, SandboxEnvironment,
    SandboxLimits, SandboxRequest, WarmPools,
};
pub use workspace::{ToolFailure, Workspace, WorkspaceError};

/// The files of one workspace, as an agent's file tools (text, answers the
/// model reads) and clients (bytes, typed refusals) reach them. Every path is
/// relative to the workspace and confined beneath it.
#[async_trait::async_trait]
pub trait FileSystem: Send + Sync + Debug {
    /// Returns a text file's content.
    async fn read(&self, path: &str) -> Result<String, ToolFailure>;
    /// Replaces (or makes) a file, and the directories to it.
    async fn write(&self, path: &str, content: &str) -> Result<(), ToolFailure>;
    /// Replaces the one occurrence of `old` in a file with `new`.
    async fn edit(&self, path: &str, old: &str, new: &str) -> Result<(), ToolFailure>;
    /// Returns a directory's entries, one per line.
    async fn list(&self, path: &str) -> Result<String, ToolFailure>;
    /// Returns the lines that hold `text`, beneath a directory.
    async fn search(&self, path: &str, text: &str) -> Result<String, ToolFailure>;
    /// Returns a directory's entries (none for a workspace never made).
    async fn entries(&self, path: &str) -> Result<Vec<Entry>, AccessError>;
    /// Describes a file or directory.
    async fn stat(&self, path: &str) -> Result<Entry, AccessError>;
    /// Returns a file's bytes.
    async fn fetch(&self, path: &str) -> Result<(Entry, Vec<u8>), AccessError>;
    /// Replaces (or makes) a file with `content`, and the directories to it.
    async fn store(&self, path: &str, content: Vec<u8>) -> Result<Entry, AccessError>;
    /// Removes a file, a link or a directory with what it holds.
    async fn remove(&self, path: &str) -> Result<(), AccessError>;
}

/// A command for [`Process::run`].
#[derive(Clone, Copy, Debug)]
pub struct Command<'a> {
    /// What `/bin/sh -c` runs.
    pub script: &'a str,
    pub limits: &'a SandboxLimits,
    /// Which addresses its network reaches (through the proxy).
    pub guard: &'a Arc<AddressGuard>,
    /// The variables it sees besides the fence's own.
    pub env: &'a [(String, String)],
}

/// A long-lived program for [`Process::serve`] (a stdio MCP server).
#[derive(Clone, Copy, Debug)]
pub struct Program<'a> {
    pub program: &'a str,
    pub args: &'a [String],
    pub limits: &'a SandboxLimits,
    pub guard: &'a Arc<AddressGuard>,
    /// The sandbox's variables, then the program's own.
    pub env: &'a [(String, String)],
    pub own: &'a std::collections::BTreeMap<String, String>,
}

/// A served program's standard streams, and what keeps it running.
pub struct Served {
    pub stdout: std::pin::Pin<Box<dyn tokio::io::AsyncRead + Send>>,
    pub stdin: std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    /// What it writes to standard error (read when it fails to start).
    pub stderr: Option<std::pin::Pin<Box<dyn tokio::io::AsyncRead + Send>>>,
    /// Kills it, and everything it started, when dropped.
    pub keep: Box<dyn std::any::Any + Send + Sync>,
}

impl Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Served")
    }
}

/// Runs commands and programs in one workspace.
#[async_trait::async_trait]
pub trait Process: Send + Sync + Debug {
    /// Runs `command` to its end (or its wall timeout); the text says how it
    /// exited and what it printed, the flag whether it failed. `Err` is for a
    /// command that could not run, ran out of time or lost its sandbox.
    async fn run(&self, command: Command<'_>) -> Result<(String, bool), ToolFailure>;

    /// Starts `program`, its standard streams piped to the caller.
    async fn serve(&self, program: Program<'_>) -> Result<Served, ToolFailure>;
}

/// What keeps a workspace between agents (the workspace store's hold on it,
/// which lets go when the last clone of the workspace is dropped).
#[async_trait::async_trait]
pub trait Disk: Send + Sync + Debug {
    /// Makes the directory hold what is kept of it, once.
    async fn load(&self) -> Result<(), String>;
    /// Keeps what changed since it was loaded or last saved; `false` when
    /// nothing was written.
    async fn save(&self) -> Result<bool, String>;
}

/// The variables a sandbox's commands see, its secrets resolved.
#[derive(Debug, Default)]
pub struct Env {
    pub vars: Vec<(String, String)>,
    /// Each secret's name and value, longest value first: what tools return
    /// has every value replaced by `[secret <name>]`.
    secrets: Vec<(String, String)>,
}

impl Env {
    /// Adds a plain variable.
    pub fn set(&mut self, name: &str, value: &str) {
        self.vars.push((name.to_owned(), value.to_owned()));
    }

    /// Adds a variable set from the secret `secret`.
    pub fn set_secret(&mut self, name: &str, secret: &str, value: &str) {
        self.vars.push((name.to_owned(), value.to_owned()));
        self.secrets.push((secret.to_owned(), value.to_owned()));
        self.secrets.sort_by_key(|(_, value)| std::cmp::Reverse(value.len()));
        self.secrets.dedup();
    }

    /// Returns `text` with every secret's value replaced by its name.
    pub fn redacted(&self, mut text: String) -> String {
        for (name, value) in &self.secrets {
            if text.contains(value.as_str()) {
                text = text.replace(value.as_str(), &format!("[secret {name}]"));
            }
        }
        text
    }
}

#[async_trait::async_trait]
impl FileSystem for Workspace {
    async fn read(&self, path: &str) -> Result<String, ToolFailure> {
        let path = path.to_owned();
        self.blocking(move |workspace| files::read_file(workspace, &path)).await
    }

    async fn write(&self, path: &str, content: &str) -> Result<(), ToolFailure> {
        let (path, content) = (path.to_owned(), content.to_owned());
        self.blocking(move |workspace| files::write_file(workspace, &path, &content))
            .await
    }

    async fn edit(&self, path: &str, old: &str, new: &str) -> Result<(), ToolFailure> {
        let (path, old, new) = (path.to_owned(), old.to_owned(), new.to_owned());
        self.blocking(move |workspace| files::edit_file(workspace, &path, &old, &new))
            .await
    }

    async fn list(&self, path: &str) -> Result<String, ToolFailure> {
        let path = path.to_owned();
        self.blocking(move |workspace| files::list_files(workspace, &path))
            .await
    }

    async fn search(&self, path: &str, text: &str) -> Result<String, ToolFailure> {
        let (path, text) = (path.to_owned(), text.to_owned());
        self.blocking(move |workspace| files::search_files(workspace, &path, &text))
            .await
    }

    async fn entries(&self, path: &str) -> Result<Vec<Entry>, AccessError> {
        let path = path.to_owned();
        self.accessed(move |workspace| access::list(workspace, &path)).await
    }

    async fn stat(&self, path: &str) -> Result<Entry, AccessError> {
        let path = path.to_owned();
        self.accessed(move |workspace| access::stat(workspace, &path)).await
    }

    async fn fetch(&self, path: &str) -> Result<(Entry, Vec<u8>), AccessError> {
        let path = path.to_owned();
        self.accessed(move |workspace| access::read(workspace, &path)).await
    }

    async fn store(&self, path: &str, content: Vec<u8>) -> Result<Entry, AccessError> {
        let path = path.to_owned();
        self.accessed(move |workspace| access::write(workspace, &path, &content))
            .await
    }

    async fn remove(&self, path: &str) -> Result<(), AccessError> {
        let path = path.to_owned();
        self.accessed(move |workspace| access::remove(workspace, &path)).await
    }
}

#[async_trait::async_trait]
impl Process for Workspace {
    async fn run(&self, command: Command<'_>) -> Result<(String, bool), ToolFailure> {
        self.ensure()?;
        process::run_command(self, command.script, command.limits, command.guard, command.env).await
    }

    async fn serve(&self, program: Program<'_>) -> Result<Served, ToolFailure> {
        let mut server = process::serve(
            self,
            program.program,
            program.args,
            program.limits,
            program.guard,
            program.env,
            program.own,
        )
        .await?;
        let child = &mut server.child;
        let (Some(stdout), Some(stdin), stderr) = (child.stdout.take(), child.stdin.take(), child.stderr.take()) else {
            return Err("the program's standard streams are missing".to_owned());
        };
        Ok(Served {
            stdout: Box::pin(stdout),
            stdin: Box::pin(stdin),
            stderr: stderr.map(|stderr| Box::pin(stderr) as std::pin::Pin<Box<dyn tokio::io::AsyncRead + Send>>),
            keep: Box::new(server),
        })
    }
}

impl Workspace {
    /// Runs a client's access off the async threads (it makes the workspace
    /// only where it writes).
    async fn accessed<T: Send + 'static>(
        &self,
        operation: impl FnOnce(&Workspace) -> Result<T, AccessError> + Send + 'static,
    ) -> Result<T, AccessError> {
        let workspace = self.clone();
        tokio::task::spawn_blocking(move || operation(&workspace))
            .await
            .unwrap_or_else(|err| Err(AccessError::Failed(format!("the workspace access stopped: {err}"))))
    }

    /// Runs a file operation off the async threads, in the made workspace.
    async fn blocking<T: Send + 'static>(
        &self,
        operation: impl FnOnce(&Workspace) -> Result<T, ToolFailure> + Send + 'static,
    ) -> Result<T, ToolFailure> {
        let workspace = self.clone();
        off_thread(move || {
            workspace.ensure()?;
            operation(&workspace)
        })
        .await
    }
}

/// Runs blocking file work off the async threads; work that panicked is a
/// failure like any other.
pub async fn off_thread<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ToolFailure> + Send + 'static,
) -> Result<T, ToolFailure> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|err| Err(format!("the workspace work stopped unexpectedly: {err}")))
}
