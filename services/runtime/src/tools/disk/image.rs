//! One image's workspace as this replica keeps it in the store: restore,
//! save and delete, against its manifest.

use super::manifest::*;
use super::*;

/// An image's workspace as this replica keeps it in the store.
pub(super) struct Disk {
    pub(super) objects: Arc<dyn ObjectStore>,
    /// `<prefix>/<tenant>/<image>`.
    pub(super) base: Path,
    /// The local directory.
    pub(super) dir: PathBuf,
    pub(super) key: (String, String),
    pub(super) max_bytes: u64,
    /// Leases alive.
    pub(super) holders: AtomicUsize,
    /// Set when the image's workspace is deleted: nothing is saved any more.
    pub(super) deleted: AtomicBool,
    /// `None` until restored; then the local directory is the workspace,
    /// and this is what was last saved (or restored).
    pub(super) state: tokio::sync::Mutex<Option<Saved>>,
}

impl Disk {
    pub(super) fn manifest_path(&self) -> Path {
        self.base.clone().join(MANIFEST)
    }

    pub(super) fn blob_path(&self, sha256: &str) -> Path {
        self.base.clone().join(BLOBS).join(sha256)
    }

    /// Restores the workspace from the store, off the async threads.
    pub(super) async fn restore(self: &Arc<Self>) -> Result<Saved, DiskError> {
        let disk = Arc::clone(self);
        let handle = Handle::current();
        let started = std::time::Instant::now();
        let result = tokio::task::spawn_blocking(move || disk.restore_blocking(&handle))
            .await
            .map_err(|err| DiskError::Stopped(err.to_string()))
            .and_then(|result| result);
        let outcome = match &result {
            Ok(Some(_)) => "restored",
            Ok(None) => "empty",
            Err(_) => "failed",
        };
        metrics::counter!("avm_runtime_workspace_restores_total", "result" => outcome).increment(1);
        match &result {
            Ok(Some(saved)) => tracing::info!(
                image_id = %self.key.1,
                entries = saved.entries.len(),
                ms = started.elapsed().as_millis(),
                "workspace restored"
            ),
            Ok(None) => {}
            Err(err) => tracing::warn!(image_id = %self.key.1, error = %err, "cannot restore the workspace"),
        }
        result.map(Option::unwrap_or_default)
    }

    /// Restores the workspace; `None` when the store has none (then a local
    /// directory already there, if any, is the workspace: kept, and saved
    /// by the next save).
    pub(super) fn restore_blocking(&self, handle: &Handle) -> Result<Option<Saved>, DiskError> {
        let manifest = match handle.block_on(self.objects.get(&self.manifest_path())) {
            Ok(got) => handle.block_on(got.bytes())?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(err) => return Err(err.into()),
        };
        let manifest: Manifest = serde_json::from_slice(&manifest)
            .map_err(|err| DiskError::Damaged(format!("its manifest cannot be read: {err}")))?;
        let entries = checked(manifest, self.max_bytes)?;
        let parent = self
            .dir
            .parent()
            .ok_or_else(|| DiskError::Damaged("the workspace directory has no parent".to_owned()))?;
        fs::DirBuilder::new().recursive(true).mode(0o700).create(parent)?;
        let name = self.dir.file_name().map(|name| name.to_string_lossy().into_owned());
        let leftover = format!(".{}.restore-", name.unwrap_or_default());
        // What an interrupted restore left.
        for entry in fs::read_dir(parent)?.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&leftover) {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
        let fresh = parent.join(avm_common::ids::new_id(&leftover));
        fs::DirBuilder::new().mode(0o700).create(&fresh)?;
        let written = match WorkspaceDir::open(&fresh)? {
            Some(root) => self.download(handle, &entries, &root),
            None => Err(DiskError::Io(std::io::Error::from_raw_os_error(libc::ENOENT))),
        };
        if let Err(err) = written {
            let _ = fs::remove_dir_all(&fresh);
            return Err(err);
        }
        match fs::remove_dir_all(&self.dir) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(err.into()),
            _ => {}
        }
        fs::rename(&fresh, &self.dir)?;
        // Nothing writes here until this restore returns: once the clock
        // is past the files' times, they tell any later change.
        let scan = scan(&self.dir)?;
        if let Some(newest) = scan.entries.values().flatten().map(Stamp::changed_at).max()
            && let Ok(wait) = (newest + RACY).duration_since(SystemTime::now())
        {
            std::thread::sleep(wait.min(RACY * 5));
        }
        let read_at = SystemTime::now();
        let mut saved = Saved::default();
        for (path, entry) in entries {
            let known = match (entry, scan.entries.get(&path)) {
                (ManifestEntry::Dir { .. }, Some(None)) => Known::Dir,
                (ManifestEntry::File { file, .. }, Some(Some(stamp))) => Known::File {
                    file,
                    stamp: *stamp,
                    racy: stamp.racy(read_at),
                },
                _ => continue,
            };
            saved.entries.insert(path, known);
        }
        Ok(Some(saved))
    }

    /// Writes every file of `entries` beneath `fresh`, checking each blob.
    pub(super) fn download(
        &self,
        handle: &Handle,
        entries: &BTreeMap<String, ManifestEntry>,
        fresh: &WorkspaceDir,
    ) -> Result<(), DiskError> {
        for (path, entry) in entries {
            if let ManifestEntry::Dir { .. } = entry {
                fresh.make_dirs(path)?;
            }
        }
        let files = entries.iter().filter_map(|(path, entry)| match entry {
            ManifestEntry::File { file, .. } => Some((path.as_str(), file)),
            ManifestEntry::Dir { .. } => None,
        });
        // Polled on this blocking thread: the file writes inside block it, not the runtime.
        handle.block_on(
            futures::stream::iter(files)
                .map(|(path, file)| self.download_file(fresh, path, file))
                .buffer_unordered(TRANSFERS)
                .try_collect::<Vec<()>>(),
        )?;
        Ok(())
    }

    pub(super) async fn download_file(
        &self,
        fresh: &WorkspaceDir,
        path: &str,
        file: &FileEntry,
    ) -> Result<(), DiskError> {
        let mode = if file.executable { 0o700 } else { 0o600 };
        let (mut local, _) = fresh.create_file(path, mode, true)?;
        let mut chunks = self.objects.get(&self.blob_path(&file.sha256)).await?.into_stream();
        let mut hasher = Sha256::new();
        let mut written = 0_u64;
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk?;
            written += chunk.len() as u64;
            if written > file.size {
                break;
            }
            hasher.update(&chunk);
            local.write_all(&chunk)?;
        }
        if written != file.size || hex(&hasher.finalize()) != file.sha256 {
            return Err(DiskError::Damaged(format!(
                "the content of {} is not the one its manifest names",
                path.rsplit('/').next().unwrap_or(path)
            )));
        }
        let modified = if file.modified_ns >= 0 {
            UNIX_EPOCH + Duration::from_nanos(file.modified_ns.unsigned_abs())
        } else {
            UNIX_EPOCH - Duration::from_nanos(file.modified_ns.unsigned_abs())
        };
        local.set_modified(modified)?;
        Ok(())
    }

    /// Saves the workspace if it changed since `saved`, off the async threads.
    pub(super) async fn save(self: &Arc<Self>, saved: &mut Saved) -> Result<bool, DiskError> {
        if self.deleted.load(Ordering::Acquire) {
            return Ok(false);
        }
        let disk = Arc::clone(self);
        let handle = Handle::current();
        let started = std::time::Instant::now();
        let last = saved.clone();
        let result = tokio::task::spawn_blocking(move || disk.save_blocking(&handle, &last))
            .await
            .map_err(|err| DiskError::Stopped(err.to_string()))
            .and_then(|result| result);
        let outcome = match &result {
            Ok(Some(_)) => "saved",
            Ok(None) => "unchanged",
            Err(_) => "failed",
        };
        metrics::counter!("avm_runtime_workspace_saves_total", "result" => outcome).increment(1);
        match result {
            Ok(Some((now, uploaded))) => {
                tracing::info!(
                    image_id = %self.key.1,
                    entries = now.entries.len(),
                    uploaded_bytes = uploaded,
                    ms = started.elapsed().as_millis(),
                    "workspace saved"
                );
                *saved = now;
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(err) => {
                tracing::warn!(image_id = %self.key.1, error = %err, "cannot save the workspace");
                Err(err)
            }
        }
    }

    /// Saves the workspace if it changed since `saved`; returns what the
    /// store holds now and the bytes uploaded, or `None` when unchanged.
    pub(super) fn save_blocking(&self, handle: &Handle, saved: &Saved) -> Result<Option<(Saved, u64)>, DiskError> {
        let read_at = SystemTime::now();
        let scan = scan(&self.dir)?;
        if scan.bytes > self.max_bytes {
            return Err(DiskError::TooLarge {
                bytes: scan.bytes,
                limit: self.max_bytes,
            });
        }
        if !self.differs(saved, &scan)? {
            return Ok(None);
        }
        let blobs = saved.blobs();
        let uploaded = AtomicUsize::new(0);
        let files: Vec<(&String, &Stamp)> = scan
            .entries
            .iter()
            .filter_map(|(path, stamp)| stamp.as_ref().map(|stamp| (path, stamp)))
            .collect();
        let stored: Vec<Option<(String, FileEntry)>> = handle.block_on(
            futures::stream::iter(files)
                .map(|(path, stamp)| self.store_file(&scan, saved, &blobs, path, stamp, &uploaded))
                .buffer_unordered(TRANSFERS)
                .try_collect(),
        )?;
        let stored: HashMap<String, FileEntry> = stored.into_iter().flatten().collect();
        let mut now = Saved::default();
        let mut manifest = Manifest {
            version: MANIFEST_VERSION,
            entries: Vec::with_capacity(scan.entries.len()),
        };
        for (path, stamp) in &scan.entries {
            match stamp {
                None => {
                    manifest.entries.push(ManifestEntry::Dir { path: path.clone() });
                    now.entries.insert(path.clone(), Known::Dir);
                }
                Some(stamp) => {
                    // Gone since the scan: left out.
                    let Some(file) = stored.get(path) else { continue };
                    manifest.entries.push(ManifestEntry::File {
                        path: path.clone(),
                        file: file.clone(),
                    });
                    now.entries.insert(
                        path.clone(),
                        Known::File {
                            file: file.clone(),
                            stamp: *stamp,
                            racy: stamp.racy(read_at),
                        },
                    );
                }
            }
        }
        let body = serde_json::to_vec(&manifest).map_err(|err| DiskError::Damaged(err.to_string()))?;
        // The commit: one PUT replaces the manifest whole.
        handle.block_on(self.objects.put(&self.manifest_path(), PutPayload::from(body)))?;
        // Blobs no manifest names any more, and those of interrupted saves.
        let kept: HashSet<String> = stored.into_values().map(|file| file.sha256).collect();
        let blobs = self.base.clone().join(BLOBS);
        let unused = self
            .objects
            .list(Some(&blobs))
            .try_filter(move |meta| {
                futures::future::ready(!meta.location.filename().is_some_and(|name| kept.contains(name)))
            })
            .map_ok(|meta| meta.location);
        if let Err(err) = handle.block_on(delete_all(self.objects.as_ref(), unused)) {
            tracing::warn!(image_id = %self.key.1, error = %err, "cannot delete the workspace's unused blobs");
        }
        Ok(Some((now, uploaded.load(Ordering::Relaxed) as u64)))
    }

    /// Returns whether the scan differs from what was saved: another set of
    /// entries, a file whose stamp moved, or a racy file whose content did.
    pub(super) fn differs(&self, saved: &Saved, scan: &Scan) -> Result<bool, DiskError> {
        if saved.entries.len() != scan.entries.len() {
            return Ok(true);
        }
        for ((path, known), (scanned_path, scanned)) in saved.entries.iter().zip(&scan.entries) {
            if path != scanned_path {
                return Ok(true);
            }
            match (known, scanned) {
                (Known::Dir, None) => {}
                (Known::File { file, stamp, racy }, Some(now)) if stamp == now => {
                    if *racy {
                        let Ok(mut local) = scan.open(path) else {
                            return Ok(true);
                        };
                        let (sha256, size) = hash_reader(&mut local)?;
                        if sha256 != file.sha256 || size != file.size {
                            return Ok(true);
                        }
                    }
                }
                _ => return Ok(true),
            }
        }
        Ok(false)
    }

    /// Returns a file's entry, uploading its content unless the store has
    /// it; `None` when the file is gone.
    pub(super) async fn store_file(
        &self,
        scan: &Scan,
        saved: &Saved,
        blobs: &HashSet<&str>,
        path: &str,
        stamp: &Stamp,
        uploaded: &AtomicUsize,
    ) -> Result<Option<(String, FileEntry)>, DiskError> {
        if let Some(Known::File {
            file,
            stamp: known,
            racy: false,
        }) = saved.entries.get(path)
            && known == stamp
        {
            return Ok(Some((path.to_owned(), file.clone())));
        }
        let mut local = match scan.open(path) {
            Ok(local) => local,
            Err(err) if matches!(err.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)) => {
                return Ok(None);
            }
            Err(err) => return Err(err.into()),
        };
        let entry = |sha256: String, size: u64| FileEntry {
            size,
            modified_ns: stamp.modified_ns(),
            sha256,
            executable: stamp.executable(),
        };
        if stamp.size <= SINGLE_PUT_BYTES {
            // Read once: what is hashed is what is uploaded.
            let mut content = Vec::with_capacity(usize::try_from(stamp.size).unwrap_or(0));
            (&mut local).take(SINGLE_PUT_BYTES).read_to_end(&mut content)?;
            let sha256 = hex(&Sha256::digest(&content));
            let size = content.len() as u64;
            if !blobs.contains(sha256.as_str()) {
                self.objects
                    .put(&self.blob_path(&sha256), PutPayload::from(content))
                    .await?;
                uploaded.fetch_add(usize::try_from(size).unwrap_or(usize::MAX), Ordering::Relaxed);
            }
            return Ok(Some((path.to_owned(), entry(sha256, size))));
        }
        let (sha256, size) = hash_reader(&mut local)?;
        if !blobs.contains(sha256.as_str()) {
            local.rewind()?;
            let mut upload = WriteMultipart::new_with_chunk_size(
                self.objects.put_multipart(&self.blob_path(&sha256)).await?,
                PART_BYTES,
            );
            let mut hasher = Sha256::new();
            let mut buffer = vec![0_u8; 1024 * 1024];
            loop {
                let read = local.read(&mut buffer)?;
                if read == 0 {
                    break;
                }
                hasher.update(&buffer[..read]);
                upload.wait_for_capacity(2).await?;
                upload.write(&buffer[..read]);
            }
            if hex(&hasher.finalize()) != sha256 {
                let _ = upload.abort().await;
                return Err(DiskError::Changed);
            }
            upload.finish().await?;
            uploaded.fetch_add(usize::try_from(size).unwrap_or(usize::MAX), Ordering::Relaxed);
        }
        Ok(Some((path.to_owned(), entry(sha256, size))))
    }
}
