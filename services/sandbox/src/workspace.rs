//! An image's workspace: the one directory its agent's file tools, its
//! clients and the workspace store reach.
//!
//! Every path is opened beneath the workspace's directory by descriptor, in
//! one `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV`: the kernel refuses a symbolic
//! link at any component while it resolves the path, so a command that swaps
//! a directory for a link while the server opens a file cannot lead the open
//! outside. What was opened is then checked on its descriptor (a regular file
//! with a single link, or a directory), never on a path; directories are
//! made one component at a time, each beneath the one before. Absolute
//! paths and `..` are refused as written. A kernel without `openat2` (before
//! Linux 5.6) gets a clear refusal rather than a weaker check.

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};

use crate::Disk;

/// A refused path or a failed file operation, as the model is told it.
pub type ToolFailure = String;

/// An image's workspace directory (created on first use).
#[derive(Clone, Debug)]
pub struct Workspace {
    dir: PathBuf,
    /// The most bytes its files may take together.
    quota: Option<u64>,
    /// Where it persists between agents, when a workspace store is configured.
    keeper: Option<Arc<dyn Disk>>,
}

/// Most entries a usage count visits; a workspace with more is over any quota.
pub const MAX_COUNTED_ENTRIES: usize = 100_000;

/// Longest path a client or a tool may name, in bytes.
const MAX_PATH_BYTES: usize = 4096;
/// Longest name of one file or directory, in bytes (Linux's `NAME_MAX`).
const MAX_NAME_BYTES: usize = 255;

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
    pub fn kept_by(mut self, keeper: impl Disk + 'static) -> Self {
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

    /// Returns the bytes the workspace's files take (links are not followed,
    /// every directory is opened beneath the workspace's descriptor);
    /// `u64::MAX` past [`MAX_COUNTED_ENTRIES`] entries.
    pub fn usage(&self) -> u64 {
        let Ok(Some(root)) = WorkspaceDir::open(&self.dir) else {
            return 0;
        };
        let mut total = 0_u64;
        let walked = walk(&root, MAX_COUNTED_ENTRIES, |met| {
            if let Met::File(_, stat) | Met::Other(_, stat) = met {
                total = total.saturating_add(u64::try_from(stat.st_size).unwrap_or(0));
            }
            Ok::<_, TooMany>(())
        });
        match walked {
            Ok(()) => total,
            Err(TooMany) => u64::MAX,
        }
    }

    /// Refuses writing `bytes` over a file of `replaced` bytes when the
    /// workspace would go over its quota.
    pub fn check_room(&self, replaced: u64, bytes: u64) -> Result<(), ToolFailure> {
        let Some(quota) = self.quota else { return Ok(()) };
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

    /// Replaces what the file at `relative` (checked) holds with `content`,
    /// making it (and its directories) beneath `root` if it is not there,
    /// within the quota; returns what its descriptor says of it after.
    pub fn write_file(&self, root: &WorkspaceDir, relative: &str, content: &[u8]) -> Result<FileStat, WorkspaceError> {
        // What the write replaces counts for the quota only: a file swapped
        // meanwhile changes the count, never where the write goes.
        let replaced = root
            .open_file(relative)
            .map_or(0, |(_, stat)| u64::try_from(stat.st_size).unwrap_or(0));
        self.check_room(replaced, content.len() as u64)
            .map_err(WorkspaceError::OverQuota)?;
        let (mut file, _) = root.create_file(relative, 0o600, false)?;
        file.set_len(0).map_err(WorkspaceError::Io)?;
        file.write_all(content).map_err(WorkspaceError::Io)?;
        nix::sys::stat::fstat(&file).map_err(WorkspaceError::of)
    }

    /// Opens the directory; `None` when it was never made.
    pub fn open(&self) -> Result<Option<WorkspaceDir>, WorkspaceError> {
        WorkspaceDir::open(&self.dir).map_err(WorkspaceError::Io)
    }
}

/// Returns `path` as a relative, `/`-separated path of the workspace (empty
/// for the workspace itself), refusing absolute paths, `..`, NUL, paths
/// longer than [`MAX_PATH_BYTES`] and names longer than [`MAX_NAME_BYTES`]
/// as written (no file system could hold them).
pub fn checked_path(path: &str) -> Result<String, WorkspaceError> {
    if path.len() > MAX_PATH_BYTES {
        return Err(WorkspaceError::Written(format!(
            "a path of {} bytes is longer than the {MAX_PATH_BYTES} bytes allowed",
            path.len()
        )));
    }
    if path.contains('\0') {
        return Err(WorkspaceError::Written(format!(
            "{path:?}: a path holds no NUL character"
        )));
    }
    let mut parts: Vec<&str> = Vec::new();
    for component in Path::new(path).components() {
        match component {
            Component::Normal(name) if name.len() > MAX_NAME_BYTES => {
                return Err(WorkspaceError::Written(format!(
                    "a name of {} bytes is longer than the {MAX_NAME_BYTES} bytes allowed",
                    name.len()
                )));
            }
            Component::Normal(name) => parts.push(name.to_str().unwrap_or_default()),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(WorkspaceError::Written(format!(
                    "{path}: `..` is not allowed in workspace paths"
                )));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(WorkspaceError::Written(format!(
                    "{path}: absolute paths are not allowed; paths are relative to the workspace"
                )));
            }
        }
    }
    Ok(parts.join("/"))
}

/// Why a file operation in the workspace was refused or failed.
#[derive(Debug)]
pub enum WorkspaceError {
    /// Refused as written (absolute, `..`, too long); the text says why.
    Written(String),
    /// A symbolic link at some component (it may have been swapped in while
    /// the path was opened).
    Link,
    /// A regular file with several hard links.
    HardLinked,
    /// A directory where a file was asked for.
    NotAFile,
    /// Something else where a directory was asked for, on the way or at the end.
    NotADirectory,
    /// Neither a regular file nor a directory (a device, socket or pipe).
    Special,
    NotFound,
    /// It would leave the workspace's file system.
    Outside,
    /// The kernel has no `openat2`.
    Unsupported,
    /// A write that would take the workspace over its quota; the text says so.
    OverQuota(String),
    Io(std::io::Error),
}

impl WorkspaceError {
    /// Returns what the model or the client is told about `path`.
    pub fn describe(&self, path: &str) -> String {
        match self {
            WorkspaceError::Written(why) | WorkspaceError::OverQuota(why) => why.clone(),
            WorkspaceError::Link => format!("{path}: symbolic links are not followed"),
            WorkspaceError::HardLinked => format!("{path}: files with several hard links are not opened"),
            WorkspaceError::NotAFile => format!("{path}: not a file"),
            WorkspaceError::NotADirectory => format!("{path}: not a directory"),
            WorkspaceError::Special => format!("{path}: not a regular file or directory"),
            WorkspaceError::NotFound => format!("{path}: no such file or directory"),
            WorkspaceError::Outside => format!("{path}: leads outside the workspace"),
            WorkspaceError::Unsupported => "this server's kernel has no openat2 (Linux 5.6 or later is needed), so \
                workspace files are not opened"
                .to_owned(),
            WorkspaceError::Io(err) => format!("{path}: {err}"),
        }
    }

    fn of(errno: Errno) -> Self {
        match errno {
            Errno::ELOOP => WorkspaceError::Link,
            Errno::EXDEV => WorkspaceError::Outside,
            Errno::ENOENT => WorkspaceError::NotFound,
            Errno::ENOTDIR => WorkspaceError::NotADirectory,
            Errno::EISDIR => WorkspaceError::NotAFile,
            Errno::ENXIO => WorkspaceError::Special,
            Errno::ENOSYS => WorkspaceError::Unsupported,
            other => WorkspaceError::Io(other.into()),
        }
    }
}

impl From<WorkspaceError> for std::io::Error {
    fn from(refusal: WorkspaceError) -> Self {
        let errno = match refusal {
            WorkspaceError::Io(err) => return err,
            WorkspaceError::Written(_) => libc::EINVAL,
            WorkspaceError::OverQuota(_) => libc::EDQUOT,
            WorkspaceError::Link | WorkspaceError::HardLinked | WorkspaceError::Special => libc::ELOOP,
            WorkspaceError::NotAFile => libc::EISDIR,
            WorkspaceError::NotADirectory => libc::ENOTDIR,
            WorkspaceError::NotFound => libc::ENOENT,
            WorkspaceError::Outside => libc::EXDEV,
            WorkspaceError::Unsupported => libc::ENOSYS,
        };
        std::io::Error::from_raw_os_error(errno)
    }
}

/// A workspace's directory, open: every path below it is opened from it.
#[derive(Debug)]
pub struct WorkspaceDir {
    fd: OwnedFd,
}

impl WorkspaceDir {
    /// Opens the directory at `dir` (a path of the server's own, not
    /// followed if it is a link); `None` when it is not there.
    pub fn open(dir: &Path) -> std::io::Result<Option<Self>> {
        match nix::fcntl::open(dir, dir_flags() | OFlag::O_NOFOLLOW, Mode::empty()) {
            Ok(fd) => Ok(Some(Self { fd })),
            Err(Errno::ENOENT) => Ok(None),
            Err(errno) => Err(errno.into()),
        }
    }

    /// Opens the directory `path` (checked, relative; empty for the workspace itself).
    pub fn open_dir(&self, path: &str) -> Result<OwnedFd, WorkspaceError> {
        open_beneath(&self.fd, nonempty(path), dir_flags(), Mode::empty())
    }

    /// Opens the regular file `path` (checked, relative) for reading; it must
    /// have a single link. Returns it with what its descriptor says of it.
    pub fn open_file(&self, path: &str) -> Result<(fs::File, FileStat), WorkspaceError> {
        if path.is_empty() {
            return Err(WorkspaceError::NotAFile);
        }
        // Non-blocking: a file swapped for a pipe does not hang the open.
        let flags = OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
        regular(open_beneath(&self.fd, path, flags, Mode::empty())?)
    }

    /// Opens the regular file `path` (checked, relative) for writing,
    /// creating it with `mode` (and its directories) if it is not there;
    /// with `exclusive`, it must not be there. It is not truncated.
    pub fn create_file(&self, path: &str, mode: u32, exclusive: bool) -> Result<(fs::File, FileStat), WorkspaceError> {
        let (parent, name) = match path.rsplit_once('/') {
            Some((parent, name)) => (parent, name),
            None => ("", path),
        };
        if name.is_empty() {
            return Err(WorkspaceError::NotAFile);
        }
        let parent = self.make_dirs(parent)?;
        let mut flags = OFlag::O_WRONLY
            | OFlag::O_CREAT
            | OFlag::O_CLOEXEC
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY;
        if exclusive {
            flags |= OFlag::O_EXCL;
        }
        regular(open_beneath(&parent, name, flags, Mode::from_bits_truncate(mode))?)
    }

    /// Opens the directory `path` (checked, relative), making what is missing
    /// of it one component at a time, each beneath the one before.
    pub fn make_dirs(&self, path: &str) -> Result<OwnedFd, WorkspaceError> {
        let mut dir = open_beneath(&self.fd, ".", dir_flags(), Mode::empty())?;
        for name in path.split('/').filter(|name| !name.is_empty()) {
            dir = match open_beneath(&dir, name, dir_flags(), Mode::empty()) {
                Err(WorkspaceError::NotFound) => {
                    match nix::sys::stat::mkdirat(&dir, name, Mode::from_bits_truncate(0o700)) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(errno) => return Err(WorkspaceError::of(errno)),
                    }
                    open_beneath(&dir, name, dir_flags(), Mode::empty())?
                }
                opened => opened?,
            };
        }
        Ok(dir)
    }
}

impl WorkspaceDir {
    /// Removes `path` (checked, relative, not the workspace itself): a file
    /// or a link (never what it leads to), or a directory with everything
    /// below it, each entry removed from its parent's descriptor.
    pub fn remove(&self, path: &str) -> Result<(), WorkspaceError> {
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path));
        if name.is_empty() {
            return Err(WorkspaceError::NotAFile);
        }
        remove_entry(&self.open_dir(parent)?, name, 0)
    }
}

/// Deepest directory [`WorkspaceDir::remove`] goes into.
const MAX_REMOVE_DEPTH: usize = 256;

/// Removes the entry `name` of the open directory `parent`, and what it holds.
fn remove_entry(parent: &OwnedFd, name: &str, depth: usize) -> Result<(), WorkspaceError> {
    use nix::unistd::{UnlinkatFlags, unlinkat};
    match unlinkat(parent, name, UnlinkatFlags::NoRemoveDir) {
        Err(Errno::EISDIR) if depth < MAX_REMOVE_DEPTH => {
            // Swapped for a link meanwhile, it is refused here, not followed.
            let dir = open_beneath(parent, name, dir_flags(), Mode::empty())?;
            for (child, _) in entries(&dir)? {
                remove_entry(&dir, &child, depth + 1)?;
            }
            unlinkat(parent, name, UnlinkatFlags::RemoveDir).map_err(WorkspaceError::of)
        }
        removed => removed.map_err(WorkspaceError::of),
    }
}

/// Returns `name` in the directory `relative` (empty: the workspace).
pub fn joined(relative: &str, name: &str) -> String {
    if relative.is_empty() {
        name.to_owned()
    } else {
        format!("{relative}/{name}")
    }
}

/// `path`, or `.` for the directory itself.
fn nonempty(path: &str) -> &str {
    if path.is_empty() { "." } else { path }
}

/// How directories are opened beneath one (where no link is followed:
/// `O_NOFOLLOW` would make a link's refusal ENOTDIR rather than ELOOP).
pub fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC
}

/// Opens `path` (relative) beneath `dir`, never through a symbolic link or
/// out of `dir`'s file system: the one way anything below a workspace is opened.
pub fn open_beneath(dir: impl AsFd, path: &str, flags: OFlag, mode: Mode) -> Result<OwnedFd, WorkspaceError> {
    let resolve = ResolveFlag::RESOLVE_BENEATH
        | ResolveFlag::RESOLVE_NO_SYMLINKS
        | ResolveFlag::RESOLVE_NO_MAGICLINKS
        | ResolveFlag::RESOLVE_NO_XDEV;
    let how = OpenHow::new().flags(flags).mode(mode).resolve(resolve);
    nix::fcntl::openat2(dir, path, how).map_err(WorkspaceError::of)
}

/// Returns an opened file if its descriptor says it is a regular file with a single link.
fn regular(fd: OwnedFd) -> Result<(fs::File, FileStat), WorkspaceError> {
    let stat = nix::sys::stat::fstat(&fd).map_err(WorkspaceError::of)?;
    match kind(&stat) {
        SFlag::S_IFREG if stat.st_nlink == 1 => Ok((fs::File::from(fd), stat)),
        SFlag::S_IFREG => Err(WorkspaceError::HardLinked),
        SFlag::S_IFDIR => Err(WorkspaceError::NotAFile),
        _ => Err(WorkspaceError::Special),
    }
}

/// Returns the kind of file a stat describes.
pub fn kind(stat: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits())
}

/// Lists an open directory: each entry's name (UTF-8 names only: no path
/// names the others) with what `fstatat` says of the entry itself, never
/// of what a link leads to.
pub fn entries(dir: impl AsFd) -> Result<Vec<(String, FileStat)>, WorkspaceError> {
    let fd = dir.as_fd().try_clone_to_owned().map_err(WorkspaceError::Io)?;
    let mut listing = nix::dir::Dir::from_fd(fd).map_err(WorkspaceError::of)?;
    let names: Vec<CString> = listing
        .iter()
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_owned())
        .filter(|name| name.as_bytes() != b"." && name.as_bytes() != b"..")
        .collect();
    let mut found = Vec::with_capacity(names.len());
    for name in names {
        let Ok(stat) = nix::sys::stat::fstatat(&listing, name.as_c_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        else {
            continue;
        };
        if let Ok(name) = name.into_string() {
            found.push((name, stat));
        }
    }
    Ok(found)
}

/// What [`walk`] meets below a workspace.
#[derive(Debug)]
pub enum Met<'a> {
    /// A directory (walked into after).
    Directory(&'a str),
    /// A regular file with a single link, as its entry's `fstatat` says.
    File(&'a str, &'a FileStat),
    /// Anything else: a link, a hard-linked or special file (never
    /// followed; its size still counts towards a quota).
    Other(&'a str, &'a FileStat),
}

/// Visits every directory and regular file (with a single link) below the
/// open workspace, each directory opened beneath it by its path, never
/// through a link; names that are not UTF-8 are passed over. Stops with `Err(TooMany)` past `limit` entries
/// visited, or with the visitor's error.
pub fn walk<E: From<TooMany>>(
    root: &WorkspaceDir,
    limit: usize,
    mut visit: impl FnMut(Met<'_>) -> Result<(), E>,
) -> Result<(), E> {
    let mut seen = 0_usize;
    let mut pending = vec![String::new()];
    while let Some(relative) = pending.pop() {
        // Replaced since it was listed: what it holds now is not the workspace's.
        let Ok(dir) = root.open_dir(&relative) else { continue };
        for (name, stat) in entries(&dir).unwrap_or_default() {
            seen += 1;
            if seen > limit {
                return Err(E::from(TooMany));
            }
            let path = joined(&relative, &name);
            match kind(&stat) {
                SFlag::S_IFDIR => {
                    visit(Met::Directory(&path))?;
                    pending.push(path);
                }
                SFlag::S_IFREG if stat.st_nlink == 1 => visit(Met::File(&path, &stat))?,
                _ => visit(Met::Other(&path, &stat))?,
            }
        }
    }
    Ok(())
}

/// A walk went past its limit of entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooMany;

/// Returns a made workspace in a temporary directory (kept while the guard lives).
#[cfg(test)]
pub fn temporary() -> (tempfile::TempDir, Workspace) {
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
    fn paths_are_checked_as_written() {
        assert_eq!(checked_path("./sub//a.txt").unwrap(), "sub/a.txt");
        assert_eq!(checked_path("").unwrap(), "");
        for refused in ["../secret", "sub/../../secret", "/etc/passwd", "a\0b"] {
            assert!(
                matches!(checked_path(refused), Err(WorkspaceError::Written(_))),
                "{refused}"
            );
        }
        let long = "a/".repeat(MAX_PATH_BYTES);
        let Err(WorkspaceError::Written(why)) = checked_path(&long) else {
            panic!("a long path passed")
        };
        assert!(why.len() < 100, "the path is not echoed: {why}");
        // A name no file system holds is the caller's mistake, not a failure.
        let Err(WorkspaceError::Written(why)) = checked_path(&format!("docs/{}", "é".repeat(128))) else {
            panic!("a 256-byte name passed")
        };
        assert!(why.len() < 100, "the name is not echoed: {why}");
        assert!(checked_path(&format!("docs/{}", "a".repeat(MAX_NAME_BYTES))).is_ok());
    }

    #[test]
    fn opens_stay_beneath_and_follow_no_link() {
        let (temp, ws) = workspace();
        fs::write(temp.path().join("secret"), "s").unwrap();
        fs::create_dir(ws.dir().join("sub")).unwrap();
        fs::write(ws.dir().join("sub/a.txt"), "a").unwrap();
        let root = ws.open().unwrap().unwrap();
        assert!(root.open_file("sub/a.txt").is_ok());
        assert!(root.open_dir("").is_ok() && root.open_dir("sub").is_ok());
        std::os::unix::fs::symlink(temp.path().join("secret"), ws.dir().join("link")).unwrap();
        std::os::unix::fs::symlink(temp.path(), ws.dir().join("dirlink")).unwrap();
        std::os::unix::fs::symlink("sub", ws.dir().join("inside")).unwrap();
        fs::hard_link(temp.path().join("secret"), ws.dir().join("hard")).unwrap();
        for linked in ["link", "dirlink/secret", "inside/a.txt"] {
            assert!(matches!(root.open_file(linked), Err(WorkspaceError::Link)), "{linked}");
        }
        assert!(matches!(root.open_file("hard"), Err(WorkspaceError::HardLinked)));
        assert!(matches!(root.open_file("sub"), Err(WorkspaceError::NotAFile)));
        assert!(matches!(
            root.open_file("sub/a.txt/x"),
            Err(WorkspaceError::NotADirectory)
        ));
        assert!(matches!(
            root.create_file("dirlink/new", 0o600, false),
            Err(WorkspaceError::Link)
        ));
        assert!(matches!(
            root.create_file("link", 0o600, false),
            Err(WorkspaceError::Link)
        ));
        let (_, stat) = root.create_file("made/deep/b.txt", 0o600, true).unwrap();
        assert_eq!(stat.st_size, 0);
        assert!(matches!(
            root.create_file("made/deep/b.txt", 0o600, true),
            Err(WorkspaceError::Io(_))
        ));
        assert!(!temp.path().join("new").exists());
        assert_eq!(fs::read_to_string(temp.path().join("secret")).unwrap(), "s");
        let mut names: Vec<String> = entries(root.open_dir("").unwrap())
            .unwrap()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        names.sort();
        assert_eq!(names, ["dirlink", "hard", "inside", "link", "made", "sub"]);
    }
}
