//! What the store and the local directory say of a workspace: the stored
//! manifest, the stamps that tell a file unchanged, and the scan.

use super::*;

/// What the store holds of a workspace, with the local stamp of each file
/// when it was saved or restored.
#[derive(Clone, Debug, Default)]
pub(super) struct Saved {
    pub(super) entries: BTreeMap<String, Known>,
}

#[derive(Clone, Debug)]
pub(super) enum Known {
    Dir,
    File {
        file: FileEntry,
        stamp: Stamp,
        /// Its times do not prove it unchanged: the next comparison reads it.
        racy: bool,
    },
}

impl Saved {
    /// Returns the blobs the store holds for these entries.
    pub(super) fn blobs(&self) -> HashSet<&str> {
        self.entries
            .values()
            .filter_map(|known| match known {
                Known::File { file, .. } => Some(file.sha256.as_str()),
                Known::Dir => None,
            })
            .collect()
    }
}

/// The stored list of a workspace's directories and files.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub(super) version: u32,
    pub(super) entries: Vec<ManifestEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub(super) enum ManifestEntry {
    Dir {
        path: String,
    },
    File {
        path: String,
        #[serde(flatten)]
        file: FileEntry,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct FileEntry {
    pub(super) size: u64,
    /// Nanoseconds since the Unix epoch.
    pub(super) modified_ns: i64,
    pub(super) sha256: String,
    #[serde(default)]
    pub(super) executable: bool,
}

/// What says a file has not changed: its size, times, inode and mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Stamp {
    pub(super) size: u64,
    pub(super) modified: (i64, i64),
    pub(super) changed: (i64, i64),
    pub(super) inode: u64,
    pub(super) mode: u32,
}

impl Stamp {
    pub(super) fn of(stat: &FileStat) -> Self {
        Stamp {
            size: u64::try_from(stat.st_size).unwrap_or(0),
            modified: (stat.st_mtime, stat.st_mtime_nsec),
            changed: (stat.st_ctime, stat.st_ctime_nsec),
            inode: stat.st_ino,
            mode: stat.st_mode,
        }
    }

    pub(super) fn modified_ns(&self) -> i64 {
        self.modified
            .0
            .saturating_mul(1_000_000_000)
            .saturating_add(self.modified.1)
    }

    pub(super) fn executable(&self) -> bool {
        self.mode & 0o100 != 0
    }

    /// Returns when the file (its content or its inode) last changed.
    pub(super) fn changed_at(&self) -> SystemTime {
        UNIX_EPOCH
            + Duration::new(
                u64::try_from(self.changed.0).unwrap_or(0),
                u32::try_from(self.changed.1).unwrap_or(0),
            )
    }

    /// Returns whether the file changed too close to `read_at` for its
    /// times to tell a later change.
    pub(super) fn racy(&self, read_at: SystemTime) -> bool {
        self.changed_at() + RACY >= read_at
    }
}

/// What a scan found: directories (`None`) and files by path (relative,
/// `/`-separated), and the directory it scanned, to read them from.
#[derive(Debug, Default)]
pub(super) struct Scan {
    pub(super) entries: BTreeMap<String, Option<Stamp>>,
    pub(super) bytes: u64,
    /// `None` when the workspace was never made.
    pub(super) root: Option<WorkspaceDir>,
}

impl Scan {
    /// Opens one of the scanned files (a regular file with a single link).
    pub(super) fn open(&self, path: &str) -> std::io::Result<fs::File> {
        match &self.root {
            Some(root) => Ok(root.open_file(path)?.0),
            None => Err(std::io::Error::from_raw_os_error(libc::ENOENT)),
        }
    }
}

/// Returns a manifest's entries by path, refusing one that could write
/// outside the workspace or hold more than `max_bytes`.
pub(super) fn checked(manifest: Manifest, max_bytes: u64) -> Result<BTreeMap<String, ManifestEntry>, DiskError> {
    let damaged = |why: String| Err(DiskError::Damaged(why));
    if manifest.version != MANIFEST_VERSION {
        return damaged(format!(
            "manifest version {} is not {MANIFEST_VERSION}",
            manifest.version
        ));
    }
    if manifest.entries.len() > MAX_COUNTED_ENTRIES {
        return Err(DiskError::TooMany);
    }
    let mut entries = BTreeMap::new();
    let mut bytes = 0_u64;
    for entry in manifest.entries {
        let path = match &entry {
            ManifestEntry::Dir { path } => path,
            ManifestEntry::File { path, file } => {
                bytes = bytes.saturating_add(file.size);
                let hex_digest = file.sha256.len() == 64
                    && file
                        .sha256
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
                if !hex_digest {
                    return damaged(format!("{path:?} has no SHA-256"));
                }
                path
            }
        };
        // As written, and as the workspace's one rule for paths takes it.
        let plain = !path.is_empty() && checked_path(path).is_ok_and(|checked| checked == *path);
        if !plain {
            return damaged(format!("{path:?} is not a path inside a workspace"));
        }
        if entries.insert(path.clone(), entry).is_some() {
            return damaged("a path is listed twice".to_owned());
        }
    }
    if bytes > max_bytes {
        return Err(DiskError::TooLarge {
            bytes,
            limit: max_bytes,
        });
    }
    Ok(entries)
}

/// Lists a workspace's directories (`None`) and regular files with a single
/// link (their stamp), below `dir`, never through a symbolic link.
pub(super) fn scan(dir: &LocalPath) -> Result<Scan, DiskError> {
    let mut scan = Scan::default();
    let Some(root) = WorkspaceDir::open(dir)? else {
        return Ok(scan);
    };
    let root: &WorkspaceDir = scan.root.insert(root);
    let (entries, bytes) = (&mut scan.entries, &mut scan.bytes);
    walk(root, MAX_COUNTED_ENTRIES, |met| {
        match met {
            Met::Directory(path) => {
                entries.insert(path.to_owned(), None);
            }
            Met::File(path, stat) => {
                let stamp = Stamp::of(stat);
                *bytes = bytes.saturating_add(stamp.size);
                entries.insert(path.to_owned(), Some(stamp));
            }
            Met::Other(..) => {}
        }
        Ok::<_, DiskError>(())
    })?;
    Ok(scan)
}

/// Returns the SHA-256 (hex) and length of what `reader` gives.
pub(super) fn hash_reader(reader: &mut impl Read) -> std::io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0_u8; 256 * 1024];
    let mut size = 0_u64;
    loop {
        let read = reader.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        size += read as u64;
        hasher.update(&buffer[..read]);
    }
    Ok((hex(&hasher.finalize()), size))
}

pub(super) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut text, byte| {
            let _ = write!(text, "{byte:02x}");
            text
        })
}
