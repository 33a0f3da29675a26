//! The file tools: read, write, edit and list inside a workspace.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

use serde_json::Value;

use super::workspace::{ToolFailure, Workspace};
use super::{Builtin, text_field};

/// Largest file `read_file` and `edit_file` read, and `write_file` writes.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
/// Most entries `list_files` shows.
const MAX_ENTRIES: usize = 1000;

/// Runs a file tool; the text is what the model reads.
pub fn run(tool: Builtin, workspace: &Workspace, input: &Value) -> Result<String, ToolFailure> {
    match tool {
        Builtin::ReadFile => read_file(workspace, text_field(input, "path")?),
        Builtin::WriteFile => {
            let (path, content) = (text_field(input, "path")?, text_field(input, "content")?);
            write_file(workspace, path, content)?;
            Ok(format!("wrote {} bytes to {path}", content.len()))
        }
        Builtin::EditFile => {
            let path = text_field(input, "path")?;
            let (old, new) = (text_field(input, "old")?, text_field(input, "new")?);
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
            write_file(workspace, path, &text.replacen(old, new, 1))?;
            Ok(format!("edited {path}"))
        }
        Builtin::ListFiles => {
            let path = input.get("path").and_then(Value::as_str).unwrap_or("");
            list_files(workspace, path)
        }
        Builtin::SearchFiles => {
            let text = text_field(input, "text")?;
            let path = input.get("path").and_then(Value::as_str).unwrap_or("");
            search_files(workspace, path, text)
        }
        Builtin::RunCommand | Builtin::FetchUrl | Builtin::SpawnAgent => {
            Err(format!("{} is not a file tool", tool.name()))
        }
    }
}

fn read_file(workspace: &Workspace, path: &str) -> Result<String, ToolFailure> {
    let resolved = workspace.resolve(path)?;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(o_nofollow())
        .open(&resolved)
        .map_err(|err| format!("{path}: {err}"))?;
    let meta = file.metadata().map_err(|err| format!("{path}: {err}"))?;
    if !meta.is_file() {
        return Err(format!("{path}: not a file"));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{path}: {} bytes is more than the {MAX_FILE_BYTES} bytes read_file reads",
            meta.len()
        ));
    }
    let bytes = fs::read(&resolved).map_err(|err| format!("{path}: {err}"))?;
    String::from_utf8(bytes).map_err(|_| format!("{path}: not UTF-8 text"))
}

fn write_file(workspace: &Workspace, path: &str, content: &str) -> Result<(), ToolFailure> {
    if content.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "content of {} bytes is more than the {MAX_FILE_BYTES} bytes a file may have",
            content.len()
        ));
    }
    let resolved = workspace.resolve(path)?;
    if resolved == workspace.dir() {
        return Err("a file path is required".to_owned());
    }
    workspace.check_room(&resolved, content.len() as u64)?;
    if let Some(parent) = resolved.parent() {
        fs::create_dir_all(parent).map_err(|err| format!("{path}: {err}"))?;
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(o_nofollow())
        .open(&resolved)
        .map_err(|err| format!("{path}: {err}"))?;
    file.write_all(content.as_bytes())
        .map_err(|err| format!("{path}: {err}"))
}

fn list_files(workspace: &Workspace, path: &str) -> Result<String, ToolFailure> {
    let resolved = workspace.resolve(path)?;
    let mut entries: Vec<String> = fs::read_dir(&resolved)
        .map_err(|err| format!("{}: {err}", if path.is_empty() { "." } else { path }))?
        .filter_map(Result::ok)
        .map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => format!("{name}/"),
                _ => name,
            }
        })
        .collect();
    entries.sort();
    let total = entries.len();
    entries.truncate(MAX_ENTRIES);
    let shown = workspace.relative(&resolved);
    let mut text = if entries.is_empty() {
        format!("{} is empty", if shown.is_empty() { "the workspace" } else { &shown })
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
/// Symbolic links, files with several hard links, files over
/// [`MAX_FILE_BYTES`] and files that are not UTF-8 are passed over.
fn search_files(workspace: &Workspace, path: &str, needle: &str) -> Result<String, ToolFailure> {
    if needle.is_empty() {
        return Err("`text` must not be empty".to_owned());
    }
    let root = workspace.resolve(path)?;
    let mut pending = vec![root];
    let (mut matches, mut visited, mut more) = (Vec::new(), 0_usize, false);
    while let Some(at) = pending.pop() {
        visited += 1;
        if visited > MAX_VISITED || matches.len() >= MAX_MATCHES {
            more = true;
            break;
        }
        let Ok(meta) = fs::symlink_metadata(&at) else { continue };
        if meta.is_dir() {
            let mut children: Vec<_> = fs::read_dir(&at)
                .map_err(|err| format!("{path}: {err}"))?
                .filter_map(Result::ok)
                .map(|entry| entry.path())
                .collect();
            // Popped from the end: sorted backwards, files come out in order.
            children.sort_by(|a, b| b.cmp(a));
            pending.extend(children);
            continue;
        }
        if !meta.is_file() || meta.nlink() > 1 || meta.len() > MAX_FILE_BYTES {
            continue;
        }
        let Ok(text) = fs::read_to_string(&at) else { continue };
        let shown = workspace.relative(&at);
        for (number, line) in text.lines().enumerate() {
            if line.contains(needle) {
                if matches.len() == MAX_MATCHES {
                    more = true;
                    break;
                }
                matches.push(format!("{shown}:{}: {line}", number + 1));
            }
        }
    }
    if matches.is_empty() {
        return Ok(format!("no line contains {needle:?}"));
    }
    let mut answer = matches.join("\n");
    if more {
        answer.push_str("\n[… search stopped: more matches or files than are shown]");
    }
    Ok(answer)
}

/// `O_NOFOLLOW`: the last component is opened only if it is not a symbolic
/// link, closing the window between resolving a path and opening it.
fn o_nofollow() -> i32 {
    libc::O_NOFOLLOW
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn write_read_edit_and_list() {
        let (_temp, ws) = crate::tools::workspace::temporary();
        let run = |tool, input: Value| run(tool, &ws, &input);
        assert_eq!(
            run(Builtin::WriteFile, json!({"path": "notes/a.txt", "content": "one two"})).unwrap(),
            "wrote 7 bytes to notes/a.txt"
        );
        assert_eq!(
            run(Builtin::ReadFile, json!({"path": "notes/a.txt"})).unwrap(),
            "one two"
        );
        run(
            Builtin::EditFile,
            json!({"path": "notes/a.txt", "old": "two", "new": "2"}),
        )
        .unwrap();
        assert_eq!(run(Builtin::ReadFile, json!({"path": "notes/a.txt"})).unwrap(), "one 2");
        let err = run(
            Builtin::EditFile,
            json!({"path": "notes/a.txt", "old": "three", "new": "3"}),
        )
        .unwrap_err();
        assert!(err.contains("not found"), "{err}");
        assert_eq!(run(Builtin::ListFiles, json!({})).unwrap(), "notes/");
        assert_eq!(run(Builtin::ListFiles, json!({"path": "notes"})).unwrap(), "a.txt");
        assert_eq!(
            run(Builtin::ReadFile, json!({"path": 3})).unwrap_err(),
            "`path` must be a string"
        );
        assert!(run(Builtin::ReadFile, json!({"path": "../ws/notes/a.txt"})).is_err());
        assert!(run(Builtin::WriteFile, json!({"path": "/tmp/x", "content": ""})).is_err());
    }

    #[test]
    fn search_finds_lines_inside_and_passes_links_over() {
        let (temp, ws) = crate::tools::workspace::temporary();
        let run = |input: Value| run(Builtin::SearchFiles, &ws, &input);
        std::fs::create_dir_all(ws.dir().join("src/deep")).unwrap();
        std::fs::write(ws.dir().join("src/a.rs"), "fn main() {}\n// TODO: tidy\n").unwrap();
        std::fs::write(ws.dir().join("src/deep/b.rs"), "no\nTODO twice\n").unwrap();
        std::fs::write(temp.path().join("outside.txt"), "TODO outside").unwrap();
        std::os::unix::fs::symlink(temp.path(), ws.dir().join("out")).unwrap();
        std::fs::hard_link(temp.path().join("outside.txt"), ws.dir().join("hard.txt")).unwrap();
        assert_eq!(
            run(json!({"text": "TODO"})).unwrap(),
            "src/a.rs:2: // TODO: tidy\nsrc/deep/b.rs:2: TODO twice"
        );
        assert_eq!(
            run(json!({"text": "TODO", "path": "src/deep"})).unwrap(),
            "src/deep/b.rs:2: TODO twice"
        );
        assert_eq!(run(json!({"text": "absent"})).unwrap(), "no line contains \"absent\"");
        assert!(run(json!({"text": "TODO", "path": "out"})).is_err());
        assert!(run(json!({"text": ""})).is_err());
    }
}
