//! The file tools: read, write, edit and list inside a workspace.

use std::fs;
use std::io::Read;

use nix::sys::stat::SFlag;

use crate::workspace::{ToolFailure, Workspace, WorkspaceDir, WorkspaceError, checked_path, entries, joined, kind};

/// Largest file `read_file` and `edit_file` read, and `write_file` writes.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
/// Most entries `list_files` shows.
const MAX_ENTRIES: usize = 1000;

/// Replaces the one occurrence of `old` in the text file at `path` with `new`.
pub fn edit_file(workspace: &Workspace, path: &str, old: &str, new: &str) -> Result<(), ToolFailure> {
    let text = read_file(workspace, path)?;
    if old.is_empty() {
        return Err("`old` must not be empty".to_owned());
    }
    match text.matches(old).count() {
        0 => return Err(format!("{path}: `old` was not found")),
        1 => {}
        count => {
            return Err(format!(
                "{path}: `old` occurs {count} times; give more context so that it occurs once"
            ));
        }
    }
    write_file(workspace, path, &text.replacen(old, new, 1))
}

/// Opens the workspace; a tool runs after it was made.
fn opened(workspace: &Workspace, path: &str) -> Result<WorkspaceDir, ToolFailure> {
    workspace
        .open()
        .map_err(|refusal| refusal.describe(path))?
        .ok_or_else(|| "the workspace is not there".to_owned())
}

/// Reads what `file` holds, up to `limit` bytes (more is refused).
fn read_capped(file: fs::File, limit: u64, path: &str) -> Result<Vec<u8>, ToolFailure> {
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|err| format!("{path}: {err}"))?;
    if bytes.len() as u64 > limit {
        return Err(format!("{path}: more than the {limit} bytes read_file reads"));
    }
    Ok(bytes)
}

pub fn read_file(workspace: &Workspace, path: &str) -> Result<String, ToolFailure> {
    let relative = checked_path(path).map_err(|refusal| refusal.describe(path))?;
    let root = opened(workspace, path)?;
    let (file, stat) = root.open_file(&relative).map_err(|refusal| refusal.describe(path))?;
    let size = u64::try_from(stat.st_size).unwrap_or(0);
    if size > MAX_FILE_BYTES {
        return Err(format!(
            "{path}: {size} bytes is more than the {MAX_FILE_BYTES} bytes read_file reads"
        ));
    }
    let bytes = read_capped(file, MAX_FILE_BYTES, path)?;
    String::from_utf8(bytes).map_err(|_| format!("{path}: not UTF-8 text"))
}

pub fn write_file(workspace: &Workspace, path: &str, content: &str) -> Result<(), ToolFailure> {
    if content.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "content of {} bytes is more than the {MAX_FILE_BYTES} bytes a file may have",
            content.len()
        ));
    }
    let relative = checked_path(path).map_err(|refusal| refusal.describe(path))?;
    if relative.is_empty() {
        return Err("a file path is required".to_owned());
    }
    let root = opened(workspace, path)?;
    workspace
        .write_file(&root, &relative, content.as_bytes())
        .map_err(|refusal| refusal.describe(path))?;
    Ok(())
}

pub fn list_files(workspace: &Workspace, path: &str) -> Result<String, ToolFailure> {
    let relative = checked_path(path).map_err(|refusal| refusal.describe(path))?;
    let root = opened(workspace, path)?;
    let shown = if relative.is_empty() { "." } else { relative.as_str() };
    let dir = root.open_dir(&relative).map_err(|refusal| refusal.describe(shown))?;
    let mut entries: Vec<String> = entries(&dir)
        .map_err(|refusal| refusal.describe(shown))?
        .into_iter()
        .map(|(name, stat)| {
            if kind(&stat) == SFlag::S_IFDIR {
                format!("{name}/")
            } else {
                name
            }
        })
        .collect();
    entries.sort();
    let total = entries.len();
    entries.truncate(MAX_ENTRIES);
    let mut text = if entries.is_empty() {
        format!(
            "{} is empty",
            if relative.is_empty() {
                "the workspace"
            } else {
                &relative
            }
        )
    } else {
        entries.join("\n")
    };
    if total > MAX_ENTRIES {
        text.push_str(&format!("\n[… {} more entries not shown]", total - MAX_ENTRIES));
    }
    Ok(text)
}

/// Most matches `search_files` answers with.
const MAX_MATCHES: usize = 200;
/// Most files and directories `search_files` looks at.
const MAX_VISITED: usize = 10_000;

/// Finds the lines containing `needle` in the text files below `path`.
///
/// Every directory and file is opened beneath the workspace's descriptor;
/// symbolic links, files with several hard links, files over
/// [`MAX_FILE_BYTES`] and files that are not UTF-8 are passed over.
pub fn search_files(workspace: &Workspace, path: &str, needle: &str) -> Result<String, ToolFailure> {
    if needle.is_empty() {
        return Err("`text` must not be empty".to_owned());
    }
    let relative = checked_path(path).map_err(|refusal| refusal.describe(path))?;
    let root = opened(workspace, path)?;
    let (mut matches, mut visited, mut more) = (Vec::new(), 0_usize, false);
    let search = |shown: &str, file: fs::File, matches: &mut Vec<String>| {
        let Ok(bytes) = read_capped(file, MAX_FILE_BYTES, shown) else {
            return false;
        };
        let Ok(text) = String::from_utf8(bytes) else {
            return false;
        };
        for (number, line) in text.lines().enumerate() {
            if line.contains(needle) {
                if matches.len() == MAX_MATCHES {
                    return true;
                }
                matches.push(format!("{shown}:{}: {line}", number + 1));
            }
        }
        false
    };
    // The path itself may be a file.
    match root.open_dir(&relative) {
        Ok(_) => {}
        Err(WorkspaceError::NotADirectory) => {
            let (file, stat) = root.open_file(&relative).map_err(|refusal| refusal.describe(path))?;
            if u64::try_from(stat.st_size).unwrap_or(0) <= MAX_FILE_BYTES {
                more = search(&relative, file, &mut matches);
            }
            return Ok(answer(&matches, needle, more));
        }
        Err(refusal) => return Err(refusal.describe(path)),
    };
    // Each directory and file is opened from the workspace by its path when
    // its turn comes: one open at a time.
    let mut pending: Vec<(String, bool)> = vec![(relative, true)];
    while let Some((shown, directory)) = pending.pop() {
        visited += 1;
        if visited > MAX_VISITED || matches.len() >= MAX_MATCHES {
            more = true;
            break;
        }
        if directory {
            let Ok(dir) = root.open_dir(&shown) else { continue };
            let mut children = entries(&dir).unwrap_or_default();
            // Popped from the end: sorted backwards, files come out in order.
            children.sort_by(|a, b| b.0.cmp(&a.0));
            for (name, stat) in children {
                pending.push((joined(&shown, &name), kind(&stat) == SFlag::S_IFDIR));
            }
            continue;
        }
        // What was opened, not what was listed, must be a plain file.
        let Ok((file, stat)) = root.open_file(&shown) else {
            continue;
        };
        if u64::try_from(stat.st_size).unwrap_or(0) > MAX_FILE_BYTES {
            continue;
        }
        if search(&shown, file, &mut matches) {
            more = true;
            break;
        }
    }
    Ok(answer(&matches, needle, more))
}

/// Returns `search_files`' answer.
fn answer(matches: &[String], needle: &str, more: bool) -> String {
    if matches.is_empty() {
        return format!("no line contains {needle:?}");
    }
    let mut answer = matches.join("\n");
    if more {
        answer.push_str("\n[… search stopped: more matches or files than are shown]");
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_edit_and_list() {
        let (_temp, ws) = crate::workspace::temporary();
        write_file(&ws, "notes/a.txt", "one two").unwrap();
        assert_eq!(read_file(&ws, "notes/a.txt").unwrap(), "one two");
        edit_file(&ws, "notes/a.txt", "two", "2").unwrap();
        assert_eq!(read_file(&ws, "notes/a.txt").unwrap(), "one 2");
        let err = edit_file(&ws, "notes/a.txt", "three", "3").unwrap_err();
        assert!(err.contains("not found"), "{err}");
        write_file(&ws, "notes/b.txt", "x x").unwrap();
        let err = edit_file(&ws, "notes/b.txt", "x", "y").unwrap_err();
        assert!(err.contains("occurs 2 times"), "{err}");
        assert!(edit_file(&ws, "notes/b.txt", "", "y").is_err());
        assert_eq!(list_files(&ws, "").unwrap(), "notes/");
        assert_eq!(list_files(&ws, "notes").unwrap(), "a.txt\nb.txt");
        assert!(read_file(&ws, "../ws/notes/a.txt").is_err());
        assert!(write_file(&ws, "/tmp/x", "").is_err());
    }

    #[test]
    fn search_finds_lines_inside_and_passes_links_over() {
        let (temp, ws) = crate::workspace::temporary();
        std::fs::create_dir_all(ws.dir().join("src/deep")).unwrap();
        std::fs::write(ws.dir().join("src/a.rs"), "fn main() {}\n// TODO: tidy\n").unwrap();
        std::fs::write(ws.dir().join("src/deep/b.rs"), "no\nTODO twice\n").unwrap();
        std::fs::write(temp.path().join("outside.txt"), "TODO outside").unwrap();
        std::os::unix::fs::symlink(temp.path(), ws.dir().join("out")).unwrap();
        std::fs::hard_link(temp.path().join("outside.txt"), ws.dir().join("hard.txt")).unwrap();
        assert_eq!(
            search_files(&ws, "", "TODO").unwrap(),
            "src/a.rs:2: // TODO: tidy\nsrc/deep/b.rs:2: TODO twice"
        );
        assert_eq!(
            search_files(&ws, "src/deep", "TODO").unwrap(),
            "src/deep/b.rs:2: TODO twice"
        );
        assert_eq!(search_files(&ws, "", "absent").unwrap(), "no line contains \"absent\"");
        assert!(search_files(&ws, "out", "TODO").is_err());
        assert!(search_files(&ws, "", "").is_err());
    }
}
