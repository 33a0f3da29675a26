//! The file tools: read, write, edit and list inside a workspace.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;

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
        Builtin::RunCommand => Err("run_command is not a file tool".to_owned()),
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
}
