//! Workspaces that follow their agent across runtime replicas
//! (`[runtime] workspace_store`): the `Disk` behind a workspace.
//!
//! While something uses an image's workspace (its agent, a client's access)
//! the workspace is a local directory, since commands run in it; an object
//! store keeps it in between. It is restored before the first tool or client
//! touches it, saved when a turn ends and when its last user lets go of it
//! (then the local copy is removed), saved at shutdown, and deleted with its
//! image.
//!
//! Under the store's prefix each image has `<tenant>/<image>/manifest.json`,
//! listing its directories and files (size, modification time, SHA-256), and
//! `<tenant>/<image>/blobs/<sha-256>`, one object per distinct content. One
//! object per file rather than an archive per workspace: a turn that changes
//! one file of a large workspace uploads that file only. A save uploads the
//! blobs the store lacks, then replaces the manifest in one PUT, which is the
//! commit; blobs are deleted only after a manifest that no longer names them
//! is written, so a save interrupted anywhere leaves the previous manifest
//! with every blob it names. A restore writes into a fresh directory beside
//! the workspace, checks every blob's size and hash, and renames the
//! directory into place: half a restore is never taken for the workspace.
//!
//! A save costs nothing when nothing changed: each file's size, times and
//! inode are compared with the last save's, and only a file modified too
//! close to that save for its times to tell is read again.
//!
//! As the tools do, a save keeps directories and regular files with a single
//! link only, and reads them beneath the workspace's descriptor without
//! following a symbolic link anywhere (`openat2`, see `workspace.rs`): the
//! server's user reads them, so a command that swaps a directory for a link
//! while a save runs must not get a file from outside into the store. A
//! restore makes its directories and files the same way beneath the fresh
//! directory it fills, each file new (`O_EXCL`).
//!
//! The work is blocking file access, so each restore and save runs on a
//! blocking thread, which drives the store's requests with the runtime's
//! handle (and a few at once).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path as LocalPath, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{StreamExt, TryStreamExt};
use nix::sys::stat::FileStat;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::runtime::Handle;

use crate::config::RuntimeConfig;
use crate::error::RuntimeError;
use avm_sandbox::Disk as Keeper;
use avm_sandbox::workspace::{
    MAX_COUNTED_ENTRIES, Met, TooMany, Workspace, WorkspaceDir, WorkspaceError, checked_path, walk,
};

/// The manifest's name under an image's prefix.
const MANIFEST: &str = "manifest.json";
/// Where the contents are, under an image's prefix.
const BLOBS: &str = "blobs";
/// The manifest format this runtime writes and reads.
const MANIFEST_VERSION: u32 = 1;
/// Files up to this size are uploaded in one request; larger ones in parts.
const SINGLE_PUT_BYTES: u64 = 4 * 1024 * 1024;
/// Part size of larger files (S3 wants at least 5 MiB per part but the last).
const PART_BYTES: usize = 8 * 1024 * 1024;
/// Transfers one save or restore runs at once.
const TRANSFERS: usize = 8;
/// A file changed within this long before its times were read may change
/// again without its times moving (file times come from a coarse clock), so
/// the next comparison reads it again.
const RACY: Duration = Duration::from_millis(20);
/// The environment variables passed to the object store as its settings.
const OPTION_PREFIXES: [&str; 3] = ["AWS_", "GOOGLE_", "AZURE_"];

/// Opens the store `[runtime] workspace_store` names, with the settings in
/// the process's environment; `None` when it is unset (local disk only).
pub(crate) fn open(config: &RuntimeConfig) -> Result<Option<WorkspaceStore>, RuntimeError> {
    let Some(url) = config.workspace_store.as_deref().filter(|url| !url.trim().is_empty()) else {
        return Ok(None);
    };
    let environment =
        std::env::vars_os().filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)));
    let store = WorkspaceStore::open(url, environment, config.sandbox.disk_mb.saturating_mul(1024 * 1024))?;
    tracing::info!(store = %store.describe(), "workspaces are kept in an object store");
    Ok(Some(store))
}

/// Returns what a client is told when its image's workspace could not be
/// restored or saved (the cause is logged where it happened).
pub(crate) fn unavailable() -> RuntimeError {
    RuntimeError::Api(avm_common::ApiError::unavailable(
        "WORKSPACE_STORE_UNAVAILABLE",
        "the workspace store could not be reached; try again",
    ))
}

/// Why a workspace could not be saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("the workspace store failed: {0}")]
    Store(#[from] object_store::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(
        "the workspace holds {bytes} bytes, over the {limit} bytes ([runtime.sandbox] disk_mb) a saved workspace may hold"
    )]
    TooLarge { bytes: u64, limit: u64 },
    #[error("the workspace has more than {MAX_COUNTED_ENTRIES} files and directories")]
    TooMany,
    #[error("the stored workspace is damaged: {0}")]
    Damaged(String),
    #[error("a file changed while it was saved")]
    Changed,
    #[error("the transfer stopped: {0}")]
    Stopped(String),
}

impl From<WorkspaceError> for DiskError {
    fn from(refusal: WorkspaceError) -> Self {
        DiskError::Io(refusal.into())
    }
}

impl From<TooMany> for DiskError {
    fn from(_: TooMany) -> Self {
        DiskError::TooMany
    }
}

impl From<nix::Error> for DiskError {
    fn from(errno: nix::Error) -> Self {
        DiskError::Io(errno.into())
    }
}

/// The object store images' workspaces persist in; cheap to clone.
#[derive(Clone)]
pub struct WorkspaceStore {
    inner: Arc<StoreInner>,
}

impl std::fmt::Debug for WorkspaceStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkspaceStore")
            .field("objects", &self.inner.objects.to_string())
            .field("prefix", &self.inner.prefix.as_ref())
            .finish()
    }
}

struct StoreInner {
    objects: Arc<dyn ObjectStore>,
    prefix: Path,
    /// The most bytes a workspace saved or restored holds.
    max_bytes: u64,
    /// The disks in use on this replica, or not yet let go of, by (tenant, image).
    disks: Mutex<HashMap<(String, String), Arc<Disk>>>,
}

impl StoreInner {
    fn disks(&self) -> MutexGuard<'_, HashMap<(String, String), Arc<Disk>>> {
        self.disks.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Forgets a disk nobody holds any more.
    fn forget(&self, disk: &Arc<Disk>) {
        let mut disks = self.disks();
        if disk.holders.load(Ordering::Acquire) == 0
            && disks.get(&disk.key).is_some_and(|known| Arc::ptr_eq(known, disk))
        {
            disks.remove(&disk.key);
        }
    }
}

impl WorkspaceStore {
    /// Opens the store a `workspace_store` URL names (`s3://bucket/prefix`,
    /// `gs://…`, `az://…`, `file:///path`); its settings and credentials come
    /// from `environment`'s `AWS_*`, `GOOGLE_*` and `AZURE_*` variables
    /// (`AWS_ENDPOINT`, `AWS_ALLOW_HTTP`… for S3-compatible servers). A
    /// workspace of more than `max_bytes` is neither saved nor restored.
    ///
    /// Errors name the setting and never contain a credential: the URL may
    /// hold none, and the variables' values are cut out of what the store says.
    pub fn open(
        url: &str,
        environment: impl IntoIterator<Item = (String, String)>,
        max_bytes: u64,
    ) -> Result<Self, RuntimeError> {
        let invalid = |why: String| {
            RuntimeError::invalid(
                "INVALID_CONFIG",
                format!("runtime.workspace_store (AVM_RUNTIME_WORKSPACE_STORE): {why}"),
            )
        };
        let expected = "expected s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or file:///path";
        let parsed = url::Url::parse(url.trim()).map_err(|err| invalid(format!("not a URL ({err}); {expected}")))?;
        if !parsed.username().is_empty()
            || parsed.password().is_some()
            || parsed.query().is_some()
            || parsed.fragment().is_some()
        {
            return Err(invalid(
                "credentials and settings go in the environment (AWS_*, GOOGLE_*, AZURE_*), not in the URL".to_owned(),
            ));
        }
        let options: Vec<(String, String)> = environment
            .into_iter()
            .filter(|(name, _)| OPTION_PREFIXES.iter().any(|prefix| name.starts_with(prefix)))
            .collect();
        let (objects, prefix) = object_store::parse_url_opts(&parsed, options.iter().cloned())
            .map_err(|err| invalid(scrub(format!("cannot open {parsed}: {err}; {expected}"), &options)))?;
        Ok(Self {
            inner: Arc::new(StoreInner {
                objects: Arc::from(objects),
                prefix,
                max_bytes,
                disks: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// Returns the store with its objects passed through `wrap` (tests count
    /// and fail requests so).
    #[cfg(test)]
    fn wrapped(self, wrap: impl FnOnce(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore>) -> Self {
        Self {
            inner: Arc::new(StoreInner {
                objects: wrap(Arc::clone(&self.inner.objects)),
                prefix: self.inner.prefix.clone(),
                max_bytes: self.inner.max_bytes,
                disks: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Returns the store as its URL names it, for logs.
    pub fn describe(&self) -> String {
        format!("{} {}", self.inner.objects, self.inner.prefix)
    }

    /// Returns the workspace of an image at `dir`, kept in this store: the
    /// directory is restored on first use and removed when the returned
    /// workspace, and every other user of the image's, is gone.
    pub fn workspace(&self, tenant_id: &str, image_id: &str, dir: PathBuf) -> Workspace {
        let key = (tenant_id.to_owned(), image_id.to_owned());
        let disk = {
            let mut disks = self.inner.disks();
            let disk = disks.entry(key.clone()).or_insert_with(|| {
                let base = self.inner.prefix.clone().join(tenant_id).join(image_id);
                Arc::new(Disk {
                    objects: Arc::clone(&self.inner.objects),
                    base,
                    dir: dir.clone(),
                    key,
                    max_bytes: self.inner.max_bytes,
                    holders: AtomicUsize::new(0),
                    deleted: AtomicBool::new(false),
                    state: tokio::sync::Mutex::new(None),
                })
            });
            disk.holders.fetch_add(1, Ordering::AcqRel);
            Arc::clone(disk)
        };
        Workspace::new(dir).kept_by(DiskLease {
            disk,
            store: Arc::clone(&self.inner),
        })
    }

    /// Deletes an image's workspace from the store; a save still under way
    /// finishes first and none follows.
    pub async fn delete(&self, tenant_id: &str, image_id: &str) -> Result<(), DiskError> {
        let live = self
            .inner
            .disks()
            .get(&(tenant_id.to_owned(), image_id.to_owned()))
            .cloned();
        let _state = match &live {
            Some(disk) => {
                let state = disk.state.lock().await;
                disk.deleted.store(true, Ordering::Release);
                Some(state)
            }
            None => None,
        };
        let base = self.inner.prefix.clone().join(tenant_id).join(image_id);
        let objects = &self.inner.objects;
        // The manifest first: from then on nothing of the image is restored.
        match objects.delete(&base.clone().join(MANIFEST)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(err) => return Err(err.into()),
        }
        delete_all(objects.as_ref(), objects.list(Some(&base)).map_ok(|meta| meta.location)).await
    }

    /// Saves every workspace in use on this replica that changed, within
    /// `limit` (at shutdown); returns whether all were saved.
    pub async fn flush(&self, limit: Duration) -> bool {
        let disks: Vec<Arc<Disk>> = self.inner.disks().values().cloned().collect();
        let saves = futures::stream::iter(disks)
            .map(|disk| async move {
                let mut state = disk.state.lock().await;
                match state.as_mut() {
                    Some(saved) => disk.save(saved).await.is_ok(),
                    None => true,
                }
            })
            .buffer_unordered(TRANSFERS)
            .collect::<Vec<bool>>();
        match tokio::time::timeout(limit, saves).await {
            Ok(saved) => saved.into_iter().all(|ok| ok),
            Err(_) => {
                tracing::warn!("workspaces not all saved before the shutdown deadline");
                false
            }
        }
    }
}

/// Returns `text` with every variable value that could be a credential cut out.
fn scrub(mut text: String, options: &[(String, String)]) -> String {
    for (_, value) in options {
        if value.len() >= 4 && text.contains(value.as_str()) {
            text = text.replace(value.as_str(), avm_common::config::REDACTED);
        }
    }
    text
}

/// Deletes what `locations` names; a location already gone is no failure.
async fn delete_all(
    objects: &dyn ObjectStore,
    locations: impl futures::Stream<Item = object_store::Result<Path>> + Send + 'static,
) -> Result<(), DiskError> {
    let mut deleted = objects.delete_stream(locations.boxed());
    while let Some(result) = deleted.next().await {
        match result {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

/// One user's hold on an image's disk; the last one to go saves the
/// workspace and removes the local copy.
pub struct DiskLease {
    disk: Arc<Disk>,
    store: Arc<StoreInner>,
}

impl std::fmt::Debug for DiskLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskLease")
            .field("base", &self.disk.base.as_ref())
            .finish()
    }
}

#[async_trait::async_trait]
impl Keeper for DiskLease {
    /// Restores the workspace unless it was (the local directory is then the workspace).
    async fn load(&self) -> Result<(), String> {
        let mut state = self.disk.state.lock().await;
        if state.is_none() {
            *state = Some(self.disk.restore().await.map_err(|err| err.to_string())?);
        }
        Ok(())
    }

    /// Saves the workspace if it was restored and changed since.
    async fn save(&self) -> Result<bool, String> {
        let mut state = self.disk.state.lock().await;
        match state.as_mut() {
            Some(saved) => self.disk.save(saved).await.map_err(|err| err.to_string()),
            None => Ok(false),
        }
    }
}

impl Drop for DiskLease {
    fn drop(&mut self) {
        if self.disk.holders.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // Never restored (a tool-free agent, say): nothing to save or remove.
        if let Ok(state) = self.disk.state.try_lock()
            && state.is_none()
        {
            self.store.forget(&self.disk);
            return;
        }
        // Without a runtime (it is shutting down) the local copy stays: the
        // next restore replaces it, and shutdown saved it already.
        if let Ok(handle) = Handle::try_current() {
            handle.spawn(release(Arc::clone(&self.store), Arc::clone(&self.disk)));
        }
    }
}

/// Saves a workspace nobody holds and removes its local copy; a workspace
/// that cannot be saved keeps its local copy, used again by its next holder.
async fn release(store: Arc<StoreInner>, disk: Arc<Disk>) {
    let mut state = disk.state.lock().await;
    if disk.holders.load(Ordering::Acquire) > 0 {
        // Held again meanwhile: the new holder goes on with it.
        return;
    }
    if let Some(saved) = state.as_mut() {
        if !disk.deleted.load(Ordering::Acquire)
            && let Err(err) = disk.save(saved).await
        {
            tracing::error!(
                image_id = %disk.key.1,
                dir = %disk.dir.display(),
                error = %err,
                "cannot save the workspace; its local copy is kept"
            );
            return;
        }
        let dir = disk.dir.clone();
        let removed = tokio::task::spawn_blocking(move || match fs::remove_dir_all(&dir) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        })
        .await;
        if let Ok(Err(err)) | Err(err) = removed.map_err(std::io::Error::other) {
            tracing::warn!(image_id = %disk.key.1, error = %err, "cannot remove the workspace's local copy");
        }
        *state = None;
    }
    drop(state);
    store.forget(&disk);
}

mod image;
mod manifest;

use image::Disk;

#[cfg(test)]
mod tests {
    use super::manifest::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use avm_common::testing::S3Server;
    use futures::stream::BoxStream;
    use object_store::{
        CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, PutMultipartOptions, PutOptions,
        PutResult,
    };

    use super::*;

    const TENANT: &str = "ten_a";
    const IMAGE: &str = "img_1";
    const MAX: u64 = 64 * 1024 * 1024;

    /// Counts the writes that reach the store, and fails manifest writes
    /// on demand (a save interrupted before its commit).
    #[derive(Debug)]
    struct Watched {
        inner: Arc<dyn ObjectStore>,
        puts: AtomicUsize,
        fail_manifest: AtomicBool,
    }

    impl std::fmt::Display for Watched {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "watched {}", self.inner)
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Watched {
        async fn put_opts(
            &self,
            location: &Path,
            payload: PutPayload,
            opts: PutOptions,
        ) -> object_store::Result<PutResult> {
            if self.fail_manifest.load(Ordering::SeqCst) && location.filename() == Some(MANIFEST) {
                return Err(object_store::Error::Generic {
                    store: "watched",
                    source: "interrupted".into(),
                });
            }
            self.puts.fetch_add(1, Ordering::SeqCst);
            self.inner.put_opts(location, payload, opts).await
        }

        async fn put_multipart_opts(
            &self,
            location: &Path,
            opts: PutMultipartOptions,
        ) -> object_store::Result<Box<dyn MultipartUpload>> {
            self.puts.fetch_add(1, Ordering::SeqCst);
            self.inner.put_multipart_opts(location, opts).await
        }

        async fn get_opts(&self, location: &Path, options: GetOptions) -> object_store::Result<GetResult> {
            self.inner.get_opts(location, options).await
        }

        fn delete_stream(
            &self,
            locations: BoxStream<'static, object_store::Result<Path>>,
        ) -> BoxStream<'static, object_store::Result<Path>> {
            self.inner.delete_stream(locations)
        }

        fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            self.inner.list(prefix)
        }

        async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }

        async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }

    /// Where the bodies below run: a store URL with its settings, opened
    /// afresh for each "replica" (each has its own disks).
    struct Place {
        url: String,
        env: Vec<(String, String)>,
        temp: tempfile::TempDir,
    }

    impl Place {
        fn local() -> Place {
            let temp = tempfile::tempdir().unwrap();
            let store = temp.path().join("store");
            fs::create_dir(&store).unwrap();
            Place {
                url: format!("file://{}", store.display()),
                env: Vec::new(),
                temp,
            }
        }

        async fn s3(server: &S3Server, bucket: &str) -> Place {
            server.create_bucket(bucket).await;
            Place {
                url: format!("s3://{bucket}/workspaces"),
                env: server.env(),
                temp: tempfile::tempdir().unwrap(),
            }
        }

        /// Opens the store as one replica does, watched.
        fn open(&self, max_bytes: u64) -> (WorkspaceStore, Arc<Watched>) {
            let store = WorkspaceStore::open(&self.url, self.env.clone(), max_bytes).unwrap();
            let watched = Arc::new(Watched {
                inner: Arc::clone(&store.inner.objects),
                puts: AtomicUsize::new(0),
                fail_manifest: AtomicBool::new(false),
            });
            let objects: Arc<dyn ObjectStore> = watched.clone();
            (store.wrapped(|_| objects), watched)
        }

        /// Returns the workspace directory of replica `replica`.
        fn dir(&self, replica: &str) -> PathBuf {
            self.temp.path().join(replica).join(TENANT).join(IMAGE)
        }
    }

    /// Returns the stored keys of the image (manifest and blobs).
    async fn stored(store: &WorkspaceStore) -> Vec<String> {
        let base = store.inner.prefix.clone().join(TENANT).join(IMAGE);
        let mut keys: Vec<String> = store
            .inner
            .objects
            .list(Some(&base))
            .map_ok(|meta| meta.location.as_ref().to_owned())
            .try_collect()
            .await
            .unwrap();
        keys.sort();
        keys
    }

    /// Describes a directory as a save keeps it: directories, and regular
    /// files with one link by content, executable bit and modification time.
    fn tree(dir: &LocalPath) -> BTreeMap<String, String> {
        let mut found = BTreeMap::new();
        let mut pending = vec![dir.to_owned()];
        while let Some(at) = pending.pop() {
            for entry in fs::read_dir(&at).unwrap() {
                let entry = entry.unwrap();
                let meta = entry.metadata().unwrap();
                let path = entry.path().strip_prefix(dir).unwrap().display().to_string();
                if meta.is_dir() {
                    pending.push(entry.path());
                    found.insert(path, "dir".to_owned());
                } else if meta.is_file() && meta.nlink() == 1 {
                    let content = fs::read(entry.path()).unwrap();
                    let description = format!(
                        "{} exec={} mtime={}.{}",
                        hex(&Sha256::digest(&content)),
                        meta.mode() & 0o100 != 0,
                        meta.mtime(),
                        meta.mtime_nsec()
                    );
                    found.insert(path, description);
                }
            }
        }
        found
    }

    /// Waits until the released workspace's local copy is gone.
    async fn removed(dir: &LocalPath) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while dir.exists() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} was not removed",
                dir.display()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn write(dir: &LocalPath, path: &str, content: &[u8]) {
        let target = dir.join(path);
        fs::create_dir_all(target.parent().unwrap()).unwrap();
        fs::write(target, content).unwrap();
    }

    /// Saves, restores on another replica and saves again: nested
    /// directories, empty files and directories, binary content, a file
    /// uploaded in parts, the executable bit and times survive; links and
    /// what they lead to do not travel; unchanged means no write.
    async fn round_trip(place: &Place) {
        let (one, watched) = place.open(MAX);
        let ws = one.workspace(TENANT, IMAGE, place.dir("one"));
        ws.load().await.unwrap();
        assert!(!ws.dir().exists(), "nothing stored: nothing made");
        assert!(!ws.save().await.unwrap(), "nothing to save");
        ws.ensure().unwrap();
        write(ws.dir(), "notes/todo.txt", b"milk");
        write(ws.dir(), "empty", b"");
        let binary: Vec<u8> = (0..=255_u8).cycle().take(70_000).collect();
        write(ws.dir(), "deep/a/b/c/blob.bin", &binary);
        write(ws.dir(), "same-as-todo.txt", b"milk");
        fs::create_dir_all(ws.dir().join("empty-dir/inner")).unwrap();
        write(ws.dir(), "run.sh", b"#!/bin/sh\necho hi\n");
        fs::set_permissions(ws.dir().join("run.sh"), fs::Permissions::from_mode(0o700)).unwrap();
        let big: Vec<u8> = (0..9 * 1024 * 1024_u32).map(|i| (i % 251) as u8).collect();
        write(ws.dir(), "big.dat", &big);
        let outside = place.temp.path().join("outside");
        write(&outside, "secret", b"not the workspace's");
        std::os::unix::fs::symlink(&outside, ws.dir().join("escape")).unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), ws.dir().join("secret-link")).unwrap();
        // Hard-linked files are not opened (by the tools either), so not kept.
        write(ws.dir(), "linked", b"linked");
        fs::hard_link(ws.dir().join("linked"), ws.dir().join("linked-again")).unwrap();
        let expected = tree(ws.dir());

        assert!(ws.save().await.unwrap(), "first save writes");
        let puts = watched.puts.load(Ordering::SeqCst);
        assert!(!ws.save().await.unwrap(), "unchanged: nothing written");
        assert_eq!(watched.puts.load(Ordering::SeqCst), puts, "no request wrote anything");
        let keys = stored(&one).await;
        // The manifest and one blob per distinct content (the two "milk" files share one).
        assert_eq!(keys.len(), 1 + 5, "{keys:?}");

        // Let go of: saved (nothing new) and the local copy removed.
        let dir = ws.dir().to_owned();
        drop(ws);
        removed(&dir).await;
        assert_eq!(
            watched.puts.load(Ordering::SeqCst),
            puts,
            "nothing changed since the last save"
        );

        // Another replica restores it.
        let (two, watched_two) = place.open(MAX);
        let ws = two.workspace(TENANT, IMAGE, place.dir("two"));
        ws.load().await.unwrap();
        assert_eq!(tree(ws.dir()), expected);
        assert!(!ws.save().await.unwrap(), "a restored workspace is unchanged");
        assert_eq!(watched_two.puts.load(Ordering::SeqCst), 0);

        // Changes there: one file rewritten (same size), one removed, one added.
        write(ws.dir(), "notes/todo.txt", b"eggs");
        fs::remove_file(ws.dir().join("same-as-todo.txt")).unwrap();
        fs::remove_dir(ws.dir().join("empty-dir/inner")).unwrap();
        write(ws.dir(), "notes/new.txt", b"bread");
        let expected = tree(ws.dir());
        assert!(ws.save().await.unwrap());
        assert_eq!(
            watched_two.puts.load(Ordering::SeqCst),
            3,
            "only the new contents and the manifest are written"
        );
        let dir = ws.dir().to_owned();
        drop(ws);
        removed(&dir).await;
        // The old "milk" blob went with the manifest that named it.
        assert_eq!(stored(&two).await.len(), 1 + 6);

        // And back on the first replica.
        let ws = one.workspace(TENANT, IMAGE, place.dir("one"));
        ws.load().await.unwrap();
        assert_eq!(tree(ws.dir()), expected);
    }

    /// A save interrupted before its commit leaves the previous one whole;
    /// the next save completes and clears what the interrupted one left.
    async fn interrupted_save(place: &Place) {
        let (one, watched) = place.open(MAX);
        let ws = one.workspace(TENANT, IMAGE, place.dir("one"));
        ws.load().await.unwrap();
        ws.ensure().unwrap();
        write(ws.dir(), "a.txt", b"first");
        assert!(ws.save().await.unwrap());
        let first = tree(ws.dir());

        write(ws.dir(), "a.txt", b"second version");
        write(ws.dir(), "b/c.txt", b"added");
        watched.fail_manifest.store(true, Ordering::SeqCst);
        assert!(ws.save().await.is_err(), "the commit failed");
        assert_eq!(
            stored(&one).await.len(),
            1 + 3,
            "blobs of the interrupted save are there"
        );

        let (two, _) = place.open(MAX);
        let other = two.workspace(TENANT, IMAGE, place.dir("two"));
        other.load().await.unwrap();
        assert_eq!(tree(other.dir()), first, "the previous save, whole");
        drop(other);

        watched.fail_manifest.store(false, Ordering::SeqCst);
        assert!(ws.save().await.unwrap());
        let second = tree(ws.dir());
        assert_eq!(stored(&one).await.len(), 1 + 2, "the first version's blob is gone");
        let (three, _) = place.open(MAX);
        let other = three.workspace(TENANT, IMAGE, place.dir("three"));
        other.load().await.unwrap();
        assert_eq!(tree(other.dir()), second);
    }

    /// A deleted workspace is gone from the store, is not saved again by a
    /// holder that remained, and restores as nothing.
    async fn deletion(place: &Place) {
        let (one, watched) = place.open(MAX);
        let ws = one.workspace(TENANT, IMAGE, place.dir("one"));
        ws.load().await.unwrap();
        ws.ensure().unwrap();
        write(ws.dir(), "a.txt", b"a");
        assert!(ws.save().await.unwrap());
        one.delete(TENANT, IMAGE).await.unwrap();
        assert_eq!(stored(&one).await, Vec::<String>::new());
        write(ws.dir(), "late.txt", b"written after the deletion");
        let puts = watched.puts.load(Ordering::SeqCst);
        assert!(!ws.save().await.unwrap());
        let dir = ws.dir().to_owned();
        drop(ws);
        removed(&dir).await;
        assert_eq!(
            watched.puts.load(Ordering::SeqCst),
            puts,
            "nothing saved after the deletion"
        );
        assert_eq!(stored(&one).await, Vec::<String>::new());

        let (two, _) = place.open(MAX);
        let ws = two.workspace(TENANT, IMAGE, place.dir("two"));
        ws.load().await.unwrap();
        assert!(!ws.dir().exists());
        // Deleting what is not there is no failure.
        two.delete(TENANT, IMAGE).await.unwrap();
    }

    /// A damaged blob fails the restore and leaves nothing half made (a
    /// stale local copy stays until a restore succeeds); the size limit
    /// holds both ways; a manifest that leads outside is refused.
    async fn damage_and_limits(place: &Place) {
        let (one, _) = place.open(MAX);
        let ws = one.workspace(TENANT, IMAGE, place.dir("one"));
        ws.load().await.unwrap();
        ws.ensure().unwrap();
        write(ws.dir(), "a.txt", b"the content");
        assert!(ws.save().await.unwrap());
        let saved = tree(ws.dir());
        let blob = one
            .inner
            .prefix
            .clone()
            .join(TENANT)
            .join(IMAGE)
            .join(BLOBS)
            .join(hex(&Sha256::digest(b"the content")).as_str());
        one.inner
            .objects
            .put(&blob, PutPayload::from_static(b"the contenT"))
            .await
            .unwrap();

        let (two, _) = place.open(MAX);
        let stale = place.dir("two");
        write(&stale, "stale.txt", b"from an earlier life");
        let other = two.workspace(TENANT, IMAGE, stale.clone());
        let err = other.load().await.unwrap_err();
        assert!(err.contains("damaged"), "{err}");
        assert!(stale.join("stale.txt").exists(), "the stale copy stays as it was");
        let leftovers: Vec<_> = fs::read_dir(stale.parent().unwrap())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, [IMAGE], "no half-restored directory left");
        one.inner
            .objects
            .put(&blob, PutPayload::from_static(b"the content"))
            .await
            .unwrap();
        other.load().await.unwrap();
        assert_eq!(tree(other.dir()), saved, "the stale copy was replaced");
        drop(other);

        // Over the size limit: not saved, not restored.
        let (small, _) = place.open(8);
        let big = small.workspace(TENANT, "img_big", place.temp.path().join("small/img_big"));
        big.load().await.unwrap();
        big.ensure().unwrap();
        write(big.dir(), "big.txt", &[b'x'; 9]);
        let err = big.save().await.unwrap_err();
        assert!(err.contains("holds 9 bytes, over the 8 bytes"), "{err}");
        let restored = small.workspace(TENANT, IMAGE, place.temp.path().join("small").join(IMAGE));
        let err = restored.load().await.unwrap_err();
        assert!(err.contains("over the 8 bytes"), "{err}");

        // A manifest naming a path outside the workspace.
        let evil = Manifest {
            version: MANIFEST_VERSION,
            entries: vec![ManifestEntry::File {
                path: "../escaped.txt".to_owned(),
                file: FileEntry {
                    size: 11,
                    modified_ns: 0,
                    sha256: hex(&Sha256::digest(b"the content")),
                    executable: false,
                },
            }],
        };
        let manifest = one.inner.prefix.clone().join(TENANT).join("img_evil").join(MANIFEST);
        one.inner
            .objects
            .put(&manifest, PutPayload::from(serde_json::to_vec(&evil).unwrap()))
            .await
            .unwrap();
        let (three, _) = place.open(MAX);
        let evil = three.workspace(TENANT, "img_evil", place.temp.path().join("three/ten_a/img_evil"));
        let err = evil.load().await.unwrap_err();
        assert!(err.contains("not a path inside a workspace"), "{err}");
        assert!(!place.temp.path().join("three/ten_a/escaped.txt").exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn round_trip_on_local_files() {
        round_trip(&Place::local()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn interrupted_save_on_local_files() {
        interrupted_save(&Place::local()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deletion_on_local_files() {
        deletion(&Place::local()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn damage_and_limits_on_local_files() {
        damage_and_limits(&Place::local()).await;
    }

    /// The same, against a real S3-compatible server (moto's).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn everything_on_s3() {
        let Some(server) = S3Server::start().await else { return };
        round_trip(&Place::s3(&server, "round-trip").await).await;
        interrupted_save(&Place::s3(&server, "interrupted").await).await;
        deletion(&Place::s3(&server, "deletion").await).await;
        damage_and_limits(&Place::s3(&server, "damage").await).await;
    }

    #[test]
    fn a_racy_file_is_compared_by_content() {
        let temp = tempfile::tempdir().unwrap();
        write(temp.path(), "a.txt", b"aaaa");
        let scan = scan(temp.path()).unwrap();
        let stamp = scan.entries["a.txt"].unwrap();
        let known = |content: &[u8], racy: bool| Saved {
            entries: BTreeMap::from([(
                "a.txt".to_owned(),
                Known::File {
                    file: FileEntry {
                        size: 4,
                        modified_ns: stamp.modified_ns(),
                        sha256: hex(&Sha256::digest(content)),
                        executable: false,
                    },
                    stamp,
                    racy,
                },
            )]),
        };
        let (store, _) = Place::local().open(MAX);
        let _ws = store.workspace(TENANT, IMAGE, temp.path().to_owned());
        let disk = Arc::clone(&store.inner.disks()[&(TENANT.to_owned(), IMAGE.to_owned())]);
        // Same stamp: trusted when its times tell, read when they may not.
        assert!(!disk.differs(&known(b"bbbb", false), &scan).unwrap());
        assert!(disk.differs(&known(b"bbbb", true), &scan).unwrap());
        assert!(!disk.differs(&known(b"aaaa", true), &scan).unwrap());
    }

    #[tokio::test]
    async fn bad_settings_are_named_without_secrets() {
        let env = || {
            vec![
                ("AWS_SECRET_ACCESS_KEY".to_owned(), "hunter2-secret".to_owned()),
                ("AWS_ALLOW_HTTP".to_owned(), "hunter2-not-a-bool".to_owned()),
                ("HOME".to_owned(), "/root".to_owned()),
            ]
        };
        for url in [
            "not a url",
            "s3://AKIAKEY:hunter2-secret@bucket/prefix",
            "s3://bucket/prefix?secret=hunter2-secret",
            "ftp://host/prefix",
            "s3://bucket/prefix",
        ] {
            let err = WorkspaceStore::open(url, env(), MAX).unwrap_err().to_string();
            assert!(
                err.starts_with("runtime.workspace_store (AVM_RUNTIME_WORKSPACE_STORE): "),
                "{err}"
            );
            assert!(!err.contains("hunter2"), "{err}");
        }
        let temp = tempfile::tempdir().unwrap();
        let config = RuntimeConfig {
            workspace_store: Some(format!("file://{}", temp.path().display())),
            ..RuntimeConfig::default()
        };
        assert!(open(&config).unwrap().is_some());
        for unset in [None, Some(String::new())] {
            let config = RuntimeConfig {
                workspace_store: unset,
                ..RuntimeConfig::default()
            };
            assert!(open(&config).unwrap().is_none());
        }
    }
}
