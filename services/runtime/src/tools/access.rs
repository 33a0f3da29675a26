//! Clients' access to an image's workspace (list, read, write): the same
//! confinement as the tools'. Reading never creates the workspace.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::time::UNIX_EPOCH;

use super::workspace::Workspace;

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

fn entry(workspace: &Workspace, path: &std::path::Path, meta: &fs::Metadata) -> Entry {
    let modified_at_ms = meta
        .modified()
        .ok()
        .and_then(|time| time.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |since| i64::try_from(since.as_millis()).unwrap_or(i64::MAX));
    Entry {
        path: workspace.relative(path),
        directory: meta.is_dir(),
        size: if meta.is_dir() { 0 } else { meta.len() },
        modified_at_ms,
    }
}

fn missing(path: &str) -> AccessError {
    AccessError::NotFound(format!("{path:?} is not in the workspace"))
}

/// Lists a directory; an image whose workspace was never made has an empty one.
pub fn list(workspace: &Workspace, path: &str) -> Result<Vec<Entry>, AccessError> {
    let resolved = workspace.resolve(path).map_err(AccessError::Refused)?;
    if !workspace.dir().exists() && resolved == workspace.dir() {
        return Ok(Vec::new());
    }
    let meta = fs::symlink_metadata(&resolved).map_err(|_| missing(path))?;
    if !meta.is_dir() {
        return Err(AccessError::Refused(format!("{path:?} is not a directory")));
    }
    let mut entries: Vec<Entry> = fs::read_dir(&resolved)
        .map_err(|err| AccessError::Failed(err.to_string()))?
        .filter_map(Result::ok)
        .filter_map(|item| {
            let meta = item.metadata().ok()?;
            (meta.is_dir() || meta.is_file()).then(|| entry(workspace, &item.path(), &meta))
        })
        .collect();
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(entries)
}

/// Reads a file.
pub fn read(workspace: &Workspace, path: &str) -> Result<(Entry, Vec<u8>), AccessError> {
    let resolved = workspace.resolve(path).map_err(AccessError::Refused)?;
    let meta = fs::symlink_metadata(&resolved).map_err(|_| missing(path))?;
    if !meta.is_file() {
        return Err(AccessError::Refused(format!("{path:?} is not a file")));
    }
    if meta.len() > MAX_TRANSFER_BYTES {
        return Err(AccessError::TooLarge(format!(
            "{path:?} has {} bytes; files of up to {MAX_TRANSFER_BYTES} bytes are served",
            meta.len()
        )));
    }
    let content = fs::read(&resolved).map_err(|err| AccessError::Failed(err.to_string()))?;
    Ok((entry(workspace, &resolved, &meta), content))
}

/// Writes a file, creating the workspace and the file's directories.
pub fn write(workspace: &Workspace, path: &str, content: &[u8]) -> Result<Entry, AccessError> {
    if content.len() as u64 > MAX_TRANSFER_BYTES {
        return Err(AccessError::TooLarge(format!(
            "{} bytes is more than the {MAX_TRANSFER_BYTES} bytes a file may have",
            content.len()
        )));
    }
    let resolved = workspace.resolve(path).map_err(AccessError::Refused)?;
    if resolved == workspace.dir() {
        return Err(AccessError::Refused("a file path is required".to_owned()));
    }
    workspace.ensure().map_err(AccessError::Failed)?;
    workspace
        .check_room(&resolved, content.len() as u64)
        .map_err(AccessError::TooLarge)?;
    if let Some(parent) = resolved.parent() {
        fs::create_dir_all(parent).map_err(|err| AccessError::Failed(err.to_string()))?;
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&resolved)
        .map_err(|err| AccessError::Refused(format!("{path:?}: {err}")))?;
    file.write_all(content)
        .map_err(|err| AccessError::Failed(err.to_string()))?;
    let meta = file.metadata().map_err(|err| AccessError::Failed(err.to_string()))?;
    Ok(entry(workspace, &resolved, &meta))
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
}
