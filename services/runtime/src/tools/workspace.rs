//! An image's workspace: the one directory its agent's file tools reach.
//!
//! Every path a tool names is resolved inside it, component by component:
//! absolute paths, `..`, symbolic links, hard-linked files and anything that
//! is neither a regular file nor a directory (devices, sockets, pipes) are
//! refused, so no tool reads or writes outside the workspace.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// A refused path or a failed file operation, as the model is told it.
pub type ToolFailure = String;

/// An image's workspace directory (created on first use).
#[derive(Clone, Debug)]
pub struct Workspace {
    dir: PathBuf,
    /// The most bytes its files may take together.
    quota: Option<u64>,
    /// Where it persists between agents, when a workspace store is configured.
    keeper: Option<Arc<dyn Keeper>>,
}

/// What keeps a workspace between agents (the workspace store's hold on it,
/// which lets go when the last clone of the workspace is dropped).
#[async_trait::async_trait]
pub trait Keeper: Send + Sync + std::fmt::Debug {
    /// Makes the directory hold what is kept of it, once.
    async fn load(&self) -> Result<(), String>;
    /// Keeps what changed since it was loaded or last saved; `false` when
    /// nothing was written.
    async fn save(&self) -> Result<bool, String>;
}

/// Most entries a usage count visits; a workspace with more is over any quota.
pub(super) const MAX_COUNTED_ENTRIES: usize = 100_000;

impl Workspace {
    /// Returns the workspace at `dir`; nothing is created yet.
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            quota: None,
            keeper: None,
        }
    }

    /// Returns the workspace kept by `keeper` (held by its clones).
    pub fn kept_by(mut self, keeper: impl Keeper + 'static) -> Self {
        self.keeper = Some(Arc::new(keeper));
        self
    }

    /// Makes the directory hold what the workspace store keeps of it, once,
    /// before anything touches it; nothing to do without a store.
    pub async fn load(&self) -> Result<(), ToolFailure> {
        match &self.keeper {
            Some(keeper) => keeper
                .load()
                .await
                .map_err(|err| format!("the workspace could not be restored: {err}")),
            None => Ok(()),
        }
    }

    /// Saves the workspace to its store if it changed since it was restored
    /// or last saved; `false` when nothing was written (no store, never
    /// loaded, unchanged).
    pub async fn save(&self) -> Result<bool, String> {
        match &self.keeper {
            Some(keeper) => keeper.save().await,
            None => Ok(false),
        }
    }

    /// Returns the workspace with a disk quota of `mb` MiB.
    pub fn with_quota_mb(mut self, mb: u64) -> Self {
        self.quota = Some(mb.saturating_mul(1024 * 1024));
        self
    }

    /// Returns the quota, in bytes.
    pub fn quota(&self) -> Option<u64> {
        self.quota
    }

    /// Returns the bytes the workspace's files take (links are not followed);
    /// `u64::MAX` past [`MAX_COUNTED_ENTRIES`] entries.
    pub fn usage(&self) -> u64 {
        let mut total = 0_u64;
        let mut seen = 0_usize;
        let mut pending = vec![self.dir.clone()];
        while let Some(dir) = pending.pop() {
            let Ok(entries) = fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                seen += 1;
                if seen > MAX_COUNTED_ENTRIES {
                    return u64::MAX;
                }
                let Ok(meta) = entry.metadata() else { continue };
                if meta.is_dir() {
                    pending.push(entry.path());
                } else {
                    total = total.saturating_add(meta.len());
                }
            }
        }
        total
    }

    /// Refuses writing `bytes` to `target` (replacing what it holds) when the
    /// workspace would go over its quota.
    pub fn check_room(&self, target: &Path, bytes: u64) -> Result<(), ToolFailure> {
        let Some(quota) = self.quota else { return Ok(()) };
        let replaced = fs::symlink_metadata(target).map(|meta| meta.len()).unwrap_or(0);
        let after = self.usage().saturating_sub(replaced).saturating_add(bytes);
        if after > quota {
            return Err(format!(
                "the workspace would hold {} bytes, over its quota of {quota} bytes ({} MiB); remove files first",
                after,
                quota / (1024 * 1024)
            ));
        }
        Ok(())
    }

    /// Returns the directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates the directory if it is not there yet (private to the server's user).
    pub fn ensure(&self) -> Result<(), ToolFailure> {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|err| format!("cannot create the workspace: {err}"))
    }

    /// Resolves `path` (relative to the workspace) to a location inside it.
    ///
    /// Each existing component must be a directory (the last one may be a
    /// regular file with a single link); a missing tail is allowed, for
    /// creating it.
    pub fn resolve(&self, path: &str) -> Result<PathBuf, ToolFailure> {
        let relative = Path::new(path);
        let mut resolved = self.dir.clone();
        let mut missing = false;
        let components: Vec<Component<'_>> = relative.components().collect();
        for (index, component) in components.iter().enumerate() {
            let name = match component {
                Component::Normal(name) => name,
                Component::CurDir => continue,
                Component::ParentDir => return Err(format!("{path}: `..` is not allowed in workspace paths")),
                Component::RootDir | Component::Prefix(_) => {
                    return Err(format!(
                        "{path}: absolute paths are not allowed; paths are relative to the workspace"
                    ));
                }
            };
            resolved.push(name);
            if missing {
                continue;
            }
            let last = index + 1 == components.len();
            match fs::symlink_metadata(&resolved) {
                Ok(meta) => {
                    let kind = meta.file_type();
                    if kind.is_symlink() {
                        return Err(format!("{path}: symbolic links are not followed"));
                    }
                    if kind.is_file() {
                        if !last {
                            return Err(format!("{path}: {} is a file, not a directory", name.to_string_lossy()));
                        }
                        if meta.nlink() > 1 {
                            return Err(format!("{path}: files with several hard links are not opened"));
                        }
                    } else if !kind.is_dir() {
                        return Err(format!("{path}: not a regular file or directory"));
                    }
                }
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => missing = true,
                Err(err) => return Err(format!("{path}: {err}")),
            }
        }
        Ok(resolved)
    }

    /// Returns `path` as the workspace names it (relative, `/`-separated).
    pub fn relative(&self, path: &Path) -> String {
        path.strip_prefix(&self.dir)
            .map(|rest| rest.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// Returns a made workspace in a temporary directory (kept while the guard lives).
#[cfg(test)]
pub(crate) fn temporary() -> (tempfile::TempDir, Workspace) {
    let temp = tempfile::tempdir().unwrap_or_else(|err| panic!("no temporary directory: {err}"));
    let workspace = Workspace::new(temp.path().join("ws"));
    workspace.ensure().unwrap_or_else(|err| panic!("{err}"));
    (temp, workspace)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace() -> (tempfile::TempDir, Workspace) {
        temporary()
    }

    #[test]
    fn paths_stay_inside() {
        let (temp, ws) = workspace();
        fs::write(temp.path().join("secret"), "s").unwrap();
        fs::create_dir(ws.dir().join("sub")).unwrap();
        fs::write(ws.dir().join("sub/a.txt"), "a").unwrap();
        assert_eq!(ws.resolve("sub/a.txt").unwrap(), ws.dir().join("sub/a.txt"));
        assert_eq!(ws.resolve("./new/dir/b.txt").unwrap(), ws.dir().join("new/dir/b.txt"));
        assert_eq!(ws.resolve("").unwrap(), ws.dir());
        for refused in ["../secret", "sub/../../secret", "/etc/passwd", "sub/a.txt/x"] {
            assert!(ws.resolve(refused).is_err(), "{refused}");
        }
        std::os::unix::fs::symlink(temp.path().join("secret"), ws.dir().join("link")).unwrap();
        std::os::unix::fs::symlink(temp.path(), ws.dir().join("dirlink")).unwrap();
        fs::hard_link(temp.path().join("secret"), ws.dir().join("hard")).unwrap();
        for refused in ["link", "dirlink/secret", "hard"] {
            let err = ws.resolve(refused).unwrap_err();
            assert!(err.starts_with(refused), "{err}");
        }
    }
}
