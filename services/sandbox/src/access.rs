//! Clients' access to an image's workspace (list, stat, read, write,
//! remove): the same confinement as the tools'. Reading never creates the
//! workspace.

use std::io::Read;

use nix::sys::stat::{FileStat, SFlag};

use crate::workspace::{Workspace, WorkspaceError, checked_path, entries, kind};

/// Largest file a client reads or writes through the workspace routes.
pub const MAX_TRANSFER_BYTES: u64 = 1024 * 1024;

/// A file or directory of a workspace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Relative to the workspace, `/`-separated.
    pub path: String,
    pub directory: bool,
    pub size: u64,
    pub modified_at_ms: i64,
}

/// Why a workspace access failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccessError {
    /// The path leads outside the workspace or to something not served.
    Refused(String),
    NotFound(String),
    TooLarge(String),
    Failed(String),
}

fn entry(path: String, stat: &FileStat) -> Entry {
    let directory = kind(stat) == SFlag::S_IFDIR;
    let modified_at_ms = stat
        .st_mtime
        .saturating_mul(1000)
        .saturating_add(stat.st_mtime_nsec / 1_000_000);
    Entry {
        path,
        directory,
        size: if directory {
            0
        } else {
            u64::try_from(stat.st_size).unwrap_or(0)
        },
        modified_at_ms,
    }
}

/// Returns the access error a workspace refusal is.
fn refused(path: &str, refusal: WorkspaceError) -> AccessError {
    let message = refusal.describe(path);
    match refusal {
        WorkspaceError::NotFound => AccessError::NotFound(format!("{path:?} is not in the workspace")),
        WorkspaceError::OverQuota(_) => AccessError::TooLarge(message),
        WorkspaceError::Unsupported | WorkspaceError::Io(_) => AccessError::Failed(message),
        _ => AccessError::Refused(message),
    }
}

/// Returns `path` checked as written.
fn checked(path: &str) -> Result<String, AccessError> {
    checked_path(path).map_err(|refusal| refused(path, refusal))
}

/// Lists a directory; an image whose workspace was never made has an empty one.
pub fn list(workspace: &Workspace, path: &str) -> Result<Vec<Entry>, AccessError> {
    let relative = checked(path)?;
    let Some(root) = workspace.open().map_err(|refusal| refused(path, refusal))? else {
        return match relative.is_empty() {
            true => Ok(Vec::new()),
            false => Err(refused(path, WorkspaceError::NotFound)),
        };
    };
    let dir = root.open_dir(&relative).map_err(|refusal| refused(path, refusal))?;
    let mut entries: Vec<Entry> = entries(&dir)
        .map_err(|refusal| refused(path, refusal))?
        .into_iter()
        .filter(|(_, stat)| matches!(kind(stat), SFlag::S_IFDIR | SFlag::S_IFREG))
        .map(|(name, stat)| {
            let path = if relative.is_empty() {
                name
            } else {
                format!("{relative}/{name}")
            };
            entry(path, &stat)
        })
        .collect();
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(entries)
}

/// Reads a file.
pub fn read(workspace: &Workspace, path: &str) -> Result<(Entry, Vec<u8>), AccessError> {
    let relative = checked(path)?;
    let root = workspace
        .open()
        .map_err(|refusal| refused(path, refusal))?
        .ok_or_else(|| refused(path, WorkspaceError::NotFound))?;
    let (file, stat) = root.open_file(&relative).map_err(|refusal| refused(path, refusal))?;
    let size = u64::try_from(stat.st_size).unwrap_or(0);
    if size > MAX_TRANSFER_BYTES {
        return Err(AccessError::TooLarge(format!(
            "{path:?} has {size} bytes; files of up to {MAX_TRANSFER_BYTES} bytes are served"
        )));
    }
    let mut content = Vec::new();
    file.take(MAX_TRANSFER_BYTES + 1)
        .read_to_end(&mut content)
        .map_err(|err| AccessError::Failed(err.to_string()))?;
    if content.len() as u64 > MAX_TRANSFER_BYTES {
        return Err(AccessError::TooLarge(format!(
            "{path:?} grew past the {MAX_TRANSFER_BYTES} bytes served while it was read"
        )));
    }
    Ok((entry(relative, &stat), content))
}

/// Describes a file or directory (the workspace itself for an empty path).
pub fn stat(workspace: &Workspace, path: &str) -> Result<Entry, AccessError> {
    let relative = checked(path)?;
    let root = workspace
        .open()
        .map_err(|refusal| refused(path, refusal))?
        .ok_or_else(|| refused(path, WorkspaceError::NotFound))?;
    let stat = match root.open_dir(&relative) {
        Ok(dir) => nix::sys::stat::fstat(&dir).map_err(|errno| AccessError::Failed(errno.to_string()))?,
        Err(WorkspaceError::NotADirectory) => root.open_file(&relative).map_err(|refusal| refused(path, refusal))?.1,
        Err(refusal) => return Err(refused(path, refusal)),
    };
    Ok(entry(relative, &stat))
}

/// Removes a file, a link or a directory with what it holds; the workspace
/// itself is not removed this way.
pub fn remove(workspace: &Workspace, path: &str) -> Result<(), AccessError> {
    let relative = checked(path)?;
    if relative.is_empty() {
        return Err(AccessError::Refused("a path in the workspace is required".to_owned()));
    }
    let root = workspace
        .open()
        .map_err(|refusal| refused(path, refusal))?
        .ok_or_else(|| refused(path, WorkspaceError::NotFound))?;
    root.remove(&relative).map_err(|refusal| refused(path, refusal))
}

/// Writes a file, creating the workspace and the file's directories.
pub fn write(workspace: &Workspace, path: &str, content: &[u8]) -> Result<Entry, AccessError> {
    if content.len() as u64 > MAX_TRANSFER_BYTES {
        return Err(AccessError::TooLarge(format!(
            "{} bytes is more than the {MAX_TRANSFER_BYTES} bytes a file may have",
            content.len()
        )));
    }
    let relative = checked(path)?;
    if relative.is_empty() {
        return Err(AccessError::Refused("a file path is required".to_owned()));
    }
    workspace.ensure().map_err(AccessError::Failed)?;
    let root = workspace
        .open()
        .map_err(|refusal| refused(path, refusal))?
        .ok_or_else(|| refused(path, WorkspaceError::NotFound))?;
    let stat = workspace
        .write_file(&root, &relative, content)
        .map_err(|refusal| refused(path, refusal))?;
    Ok(entry(relative, &stat))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_read_write_stay_inside() {
        let temp = tempfile::tempdir().unwrap();
        let ws = Workspace::new(temp.path().join("ws"));
        assert_eq!(list(&ws, "").unwrap(), Vec::new(), "no workspace yet: empty, none made");
        assert!(!ws.dir().exists());
        let written = write(&ws, "docs/a.txt", b"hello").unwrap();
        assert_eq!(
            (written.path.as_str(), written.size, written.directory),
            ("docs/a.txt", 5, false)
        );
        let listed = list(&ws, "").unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!((listed[0].path.as_str(), listed[0].directory), ("docs", true));
        assert_eq!(read(&ws, "docs/a.txt").unwrap().1, b"hello");
        assert!(matches!(read(&ws, "docs/b.txt"), Err(AccessError::NotFound(_))));
        assert!(matches!(read(&ws, "../ws/docs/a.txt"), Err(AccessError::Refused(_))));
        assert!(matches!(write(&ws, "/etc/x", b""), Err(AccessError::Refused(_))));
        assert!(matches!(list(&ws, "docs/a.txt"), Err(AccessError::Refused(_))));
    }

    #[test]
    fn stat_and_remove_stay_inside_and_never_follow_a_link() {
        let temp = tempfile::tempdir().unwrap();
        let outside = temp.path().join("outside");
        std::fs::create_dir_all(outside.join("keep")).unwrap();
        std::fs::write(outside.join("keep/key"), "secret").unwrap();
        let ws = Workspace::new(temp.path().join("ws"));
        assert!(
            matches!(stat(&ws, ""), Err(AccessError::NotFound(_))),
            "no workspace yet"
        );
        write(&ws, "docs/deep/a.txt", b"hello").unwrap();
        let file = stat(&ws, "docs/deep/a.txt").unwrap();
        assert_eq!((file.size, file.directory), (5, false));
        assert!(stat(&ws, "docs").unwrap().directory);
        assert!(stat(&ws, "").unwrap().directory);
        assert!(matches!(stat(&ws, "docs/nothing"), Err(AccessError::NotFound(_))));
        assert!(matches!(stat(&ws, "../outside"), Err(AccessError::Refused(_))));

        // A link is removed, not what it leads to, alone or inside a directory.
        std::os::unix::fs::symlink(&outside, ws.dir().join("link")).unwrap();
        std::os::unix::fs::symlink(&outside, ws.dir().join("docs/deep/link")).unwrap();
        assert!(matches!(stat(&ws, "link"), Err(AccessError::Refused(_))));
        remove(&ws, "link").unwrap();
        remove(&ws, "docs").unwrap();
        assert_eq!(list(&ws, "").unwrap(), Vec::new());
        assert_eq!(std::fs::read_to_string(outside.join("keep/key")).unwrap(), "secret");
        assert!(matches!(remove(&ws, ""), Err(AccessError::Refused(_))));
        assert!(matches!(remove(&ws, "../outside"), Err(AccessError::Refused(_))));
        assert!(matches!(remove(&ws, "docs"), Err(AccessError::NotFound(_))));
        assert!(outside.join("keep/key").exists());
    }

    /// Issue 26 item 2: a command swapped a directory and a link to the data
    /// directory (`renameat2(RENAME_EXCHANGE)`) while a client read
    /// `d/admin.key` and wrote `w/x`: the path was checked, then opened, and
    /// the open followed the link. Every file operation, the clients' and the
    /// tools', opens beneath the workspace through no link at all.
    #[test]
    fn a_directory_swapped_for_a_link_never_redirects_a_file_operation() {
        use crate::files;
        use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};

        let temp = tempfile::tempdir().unwrap();
        let data = temp.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("admin.key"), "the-admin-key").unwrap();
        let ws = Workspace::new(data.join("workspaces/t/i"));
        write(&ws, "d/admin.key", b"decoy").unwrap();
        write(&ws, "w/kept", b"").unwrap();
        std::os::unix::fs::symlink(&data, ws.dir().join("s")).unwrap();
        std::os::unix::fs::symlink(&data, ws.dir().join("t")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let (dir, stop) = (ws.dir().to_owned(), std::sync::Arc::clone(&stop));
            std::thread::spawn(move || {
                let exchange = |a: &str, b: &str| {
                    renameat2(
                        AT_FDCWD,
                        &dir.join(a),
                        AT_FDCWD,
                        &dir.join(b),
                        RenameFlags::RENAME_EXCHANGE,
                    )
                    .unwrap();
                };
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    exchange("d", "s");
                    exchange("w", "t");
                }
            })
        };
        let mut served = 0;
        for round in 0..4000 {
            if let Ok((_, content)) = read(&ws, "d/admin.key") {
                assert_eq!(content, b"decoy", "round {round}: a read followed the link");
                served += 1;
            }
            let _ = write(&ws, "w/x", b"planted");
            let or_failure = |result: Result<String, String>| result.unwrap_or_else(|failure| failure);
            let read_by_tool = or_failure(files::read_file(&ws, "d/admin.key"));
            assert!(!read_by_tool.contains("the-admin-key"), "round {round}: {read_by_tool}");
            let _ = files::write_file(&ws, "w/y", "planted");
            let _ = files::edit_file(&ws, "d/admin.key", "the", "a");
            let searched = or_failure(files::search_files(&ws, "", "admin"));
            assert!(!searched.contains("the-admin-key"), "round {round}: {searched}");
            let listed = or_failure(files::list_files(&ws, "d"));
            assert!(
                !listed.contains("workspaces"),
                "round {round}: a listing followed the link: {listed}"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        assert!(served > 0, "the reads were all refused");
        for planted in ["x", "y"] {
            assert!(
                !data.join(planted).exists(),
                "a write followed the link into the data directory"
            );
        }
        assert_eq!(
            std::fs::read_to_string(data.join("admin.key")).unwrap(),
            "the-admin-key"
        );
    }
}
