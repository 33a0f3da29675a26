//! Keeping two copies of a workspace alike: the runtime's (which the file
//! tools, clients and the workspace store use) and a sandbox's (where
//! commands run). Each side notes what its copy held when they were last
//! alike ([`Snapshot`]); what differs since is sent as [`Changes`]: whole
//! files, directories, and removed paths. Only regular files with a single
//! link and directories travel; links and special files stay where they
//! were made. Every path is opened beneath the workspace, and what comes
//! from the other side is checked as written, so a copy that sends
//! `../x` or a link writes nothing outside.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;

use crate::workspace::{MAX_COUNTED_ENTRIES, Met, TooMany, Workspace, WorkspaceDir, checked_path, walk};
use crate::{ToolFailure, WorkspaceError};

/// What a path held: a directory, or a file as its metadata says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    Directory,
    File {
        size: u64,
        modified_ns: i64,
        inode: u64,
        mode: u32,
    },
}

/// What a copy held, by path.
pub type Snapshot = BTreeMap<String, Held>;

/// A file (whole) or directory to make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Made {
    pub path: String,
    pub directory: bool,
    pub content: Vec<u8>,
    pub executable: bool,
}

/// What changed in a copy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub made: Vec<Made>,
    /// Deepest first.
    pub removed: Vec<String>,
}

impl Changes {
    /// Returns whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.made.is_empty() && self.removed.is_empty()
    }
}

/// Returns what the workspace holds now (empty when it was never made).
pub fn snapshot(workspace: &Workspace) -> Result<Snapshot, ToolFailure> {
    let mut held = Snapshot::new();
    let Some(root) = workspace.open().map_err(|err| err.describe(""))? else {
        return Ok(held);
    };
    let walked = walk(&root, MAX_COUNTED_ENTRIES, |met| {
        match met {
            Met::Directory(path) => {
                held.insert(path.to_owned(), Held::Directory);
            }
            Met::File(path, stat) => {
                held.insert(
                    path.to_owned(),
                    Held::File {
                        size: u64::try_from(stat.st_size).unwrap_or(0),
                        modified_ns: stat
                            .st_mtime
                            .saturating_mul(1_000_000_000)
                            .saturating_add(stat.st_mtime_nsec),
                        inode: stat.st_ino,
                        mode: stat.st_mode,
                    },
                );
            }
            Met::Other(..) => {}
        }
        Ok::<_, TooMany>(())
    });
    match walked {
        Ok(()) => Ok(held),
        Err(TooMany) => Err(format!("the workspace holds more than {MAX_COUNTED_ENTRIES} entries")),
    }
}

/// Returns what changed from `before` to `now` in the workspace, files read
/// whole (a file gone meanwhile counts as removed).
pub fn changes(workspace: &Workspace, before: &Snapshot, now: &Snapshot) -> Result<Changes, ToolFailure> {
    let mut changes = Changes::default();
    let root = workspace.open().map_err(|err| err.describe(""))?;
    for (path, held) in now {
        if before.get(path) == Some(held) {
            continue;
        }
        match held {
            Held::Directory => changes.made.push(Made {
                path: path.clone(),
                directory: true,
                content: Vec::new(),
                executable: false,
            }),
            Held::File { .. } => {
                let Some(root) = &root else { continue };
                let Ok((mut file, stat)) = root.open_file(path) else {
                    continue;
                };
                let mut content = Vec::new();
                file.read_to_end(&mut content)
                    .map_err(|err| format!("cannot read {path}: {err}"))?;
                changes.made.push(Made {
                    path: path.clone(),
                    directory: false,
                    content,
                    executable: stat.st_mode & 0o100 != 0,
                });
            }
        }
    }
    changes.removed = before.keys().filter(|path| !now.contains_key(*path)).cloned().collect();
    changes
        .removed
        .sort_by_key(|path| std::cmp::Reverse(path.matches('/').count()));
    Ok(changes)
}

/// Makes `changes` in the workspace (made first; with `reset`, after
/// removing everything in it), within its quota.
pub fn apply(workspace: &Workspace, changes: &Changes, reset: bool) -> Result<(), ToolFailure> {
    workspace.ensure()?;
    let root = workspace
        .open()
        .map_err(|err| err.describe(""))?
        .ok_or_else(|| "the workspace is not there".to_owned())?;
    if reset {
        let held = snapshot(workspace)?;
        let mut paths: Vec<&String> = held.keys().collect();
        paths.sort_by_key(|path| std::cmp::Reverse(path.matches('/').count()));
        for path in paths {
            remove(&root, path)?;
        }
    }
    if workspace.quota().is_some() {
        let bytes: u64 = changes.made.iter().map(|made| made.content.len() as u64).sum();
        // What the files replace is freed as they are written.
        let replaced: u64 = changes
            .made
            .iter()
            .filter_map(|made| root.open_file(&made.path).ok())
            .map(|(_, stat)| u64::try_from(stat.st_size).unwrap_or(0))
            .sum();
        workspace.check_room(replaced, bytes)?;
    }
    for made in &changes.made {
        let path = checked_path(&made.path).map_err(|err| err.describe(&made.path))?;
        if path.is_empty() {
            continue;
        }
        if made.directory {
            root.make_dirs(&path).map_err(|err| err.describe(&path))?;
            continue;
        }
        let mode = if made.executable { 0o700 } else { 0o600 };
        let (file, _) = root
            .create_file(&path, mode, false)
            .map_err(|err| err.describe(&path))?;
        write_whole(&file, &made.content).map_err(|err| format!("cannot write {path}: {err}"))?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(|err| format!("cannot write {path}: {err}"))?;
    }
    for path in &changes.removed {
        let path = checked_path(path).map_err(|err| err.describe(path))?;
        if !path.is_empty() {
            remove(&root, &path)?;
        }
    }
    Ok(())
}

fn write_whole(mut file: &std::fs::File, content: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    file.set_len(0)?;
    file.write_all(content)
}

/// Removes the file, link or directory (with what it holds) at `path`
/// beneath the workspace; a path that is not there is left.
fn remove(root: &WorkspaceDir, path: &str) -> Result<(), ToolFailure> {
    match root.remove(path) {
        Ok(()) | Err(WorkspaceError::NotFound) => Ok(()),
        Err(err) => Err(format!("cannot remove {}", err.describe(path))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_changed_on_one_side_is_made_on_the_other_and_nothing_else() {
        let (_a, left) = crate::workspace::temporary();
        let (_b, right) = crate::workspace::temporary();
        std::fs::create_dir_all(left.dir().join("src/deep")).unwrap();
        std::fs::write(left.dir().join("src/deep/a.txt"), "one").unwrap();
        std::fs::write(left.dir().join("run.sh"), "echo hi").unwrap();
        std::fs::set_permissions(left.dir().join("run.sh"), std::fs::Permissions::from_mode(0o700)).unwrap();
        let first = snapshot(&left).unwrap();
        apply(&right, &changes(&left, &Snapshot::new(), &first).unwrap(), true).unwrap();
        assert_eq!(
            std::fs::read_to_string(right.dir().join("src/deep/a.txt")).unwrap(),
            "one"
        );
        let mode = std::fs::metadata(right.dir().join("run.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o100, 0o100, "the script stays executable");

        // A change, a removal and an addition travel; what did not change does not.
        std::fs::write(left.dir().join("src/deep/a.txt"), "two").unwrap();
        std::fs::remove_file(left.dir().join("run.sh")).unwrap();
        std::fs::write(left.dir().join("new.txt"), "new").unwrap();
        let second = snapshot(&left).unwrap();
        let diff = changes(&left, &first, &second).unwrap();
        let made: Vec<&str> = diff.made.iter().map(|made| made.path.as_str()).collect();
        assert_eq!(made, ["new.txt", "src/deep/a.txt"]);
        assert_eq!(diff.removed, ["run.sh"]);
        apply(&right, &diff, false).unwrap();
        assert_eq!(
            std::fs::read_to_string(right.dir().join("src/deep/a.txt")).unwrap(),
            "two"
        );
        assert!(!right.dir().join("run.sh").exists());
        assert!(changes(&left, &second, &snapshot(&left).unwrap()).unwrap().is_empty());
    }

    #[test]
    fn changes_from_the_other_side_stay_inside_and_links_do_not_travel() {
        let (temp, ws) = crate::workspace::temporary();
        std::fs::write(temp.path().join("outside.txt"), "secret").unwrap();
        std::os::unix::fs::symlink(temp.path(), ws.dir().join("out")).unwrap();
        assert!(
            snapshot(&ws).unwrap().is_empty(),
            "a link is not a file of the workspace"
        );
        for path in ["../outside.txt", "/etc/passwd", "out/outside.txt", "a\0b"] {
            let evil = Changes {
                made: vec![Made {
                    path: path.to_owned(),
                    directory: false,
                    content: b"planted".to_vec(),
                    executable: false,
                }],
                removed: Vec::new(),
            };
            assert!(apply(&ws, &evil, false).is_err(), "{path}");
            let removal = Changes {
                made: Vec::new(),
                removed: vec![path.to_owned()],
            };
            let _ = apply(&ws, &removal, false);
        }
        assert_eq!(
            std::fs::read_to_string(temp.path().join("outside.txt")).unwrap(),
            "secret"
        );
        let over = Workspace::new(ws.dir().to_owned()).with_quota_mb(1);
        let big = Changes {
            made: vec![Made {
                path: "big".to_owned(),
                directory: false,
                content: vec![0; 2 * 1024 * 1024],
                executable: false,
            }],
            removed: Vec::new(),
        };
        assert!(apply(&over, &big, false).unwrap_err().contains("quota"));
    }
}
