//! A local directory as an object store that also writes conditionally.
//!
//! `object_store`'s `LocalFileSystem` creates objects atomically (`PutMode::Create` is a
//! hard link that fails when the name exists) but refuses `PutMode::Update`: a
//! compare-and-swap on a file needs a lock the crate does not take. [`LocalStore`] adds
//! it: an update takes an exclusive `flock` on a lock file beside the object
//! (`.NAME.lock`, created once and kept), compares the object's current ETag (inode,
//! modification time and size, as `LocalFileSystem` gives it) with the expected one, and
//! only then writes (a staging file renamed over the object, so the ETag changes with
//! every write). Every tapline process updating an object of the store takes the same
//! lock, so of two updates from the same version exactly one succeeds. `flock` on a
//! regular file holds between the processes of one host, and between hosts on NFS
//! (Linux maps it to NFS byte-range locks; on a directory it would not); everything else
//! is `LocalFileSystem`'s.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMode,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// A local directory: `LocalFileSystem` with `PutMode::Update` (see the module docs).
#[derive(Debug)]
pub(crate) struct LocalStore {
    inner: Arc<LocalFileSystem>,
}

impl LocalStore {
    pub(crate) fn new(inner: LocalFileSystem) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Holds the exclusive lock of `location` (its lock file) while the returned file
    /// is open.
    async fn lock(&self, location: &Path) -> Result<std::fs::File> {
        let file = self.inner.path_to_filesystem(location)?;
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let lock = file.with_file_name(format!(".{name}.lock"));
        let io = |source: std::io::Error| object_store::Error::Generic {
            store: "LocalStore",
            source: format!("lock {} for a conditional write: {source}", lock.display()).into(),
        };
        let locked = tokio::task::spawn_blocking({
            let lock = lock.clone();
            move || -> std::io::Result<std::fs::File> {
                let handle = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&lock)?;
                handle.lock()?;
                Ok(handle)
            }
        })
        .await
        .map_err(|e| object_store::Error::Generic {
            store: "LocalStore",
            source: Box::new(e),
        })?;
        match locked {
            Ok(handle) => Ok(handle),
            // No directory: no object in it, so nothing to update.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(object_store::Error::Precondition {
                    path: location.to_string(),
                    source: "the object does not exist".into(),
                })
            }
            Err(e) => Err(io(e)),
        }
    }
}

impl fmt::Display for LocalStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalStore({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for LocalStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let PutMode::Update(expected) = &opts.mode else {
            return self.inner.put_opts(location, payload, opts).await;
        };
        let expected = expected.clone();
        let _lock = self.lock(location).await?;
        let current = match self.inner.head(location).await {
            Ok(meta) => meta,
            Err(object_store::Error::NotFound { path, .. }) => {
                return Err(object_store::Error::Precondition {
                    path,
                    source: "the object does not exist".into(),
                });
            }
            Err(e) => return Err(e),
        };
        if expected.e_tag.is_none() || current.e_tag != expected.e_tag {
            return Err(object_store::Error::Precondition {
                path: location.to_string(),
                source: format!(
                    "the object was written since it was read (ETag {:?}, expected {:?})",
                    current.e_tag, expected.e_tag
                )
                .into(),
            });
        }
        let opts = PutOptions {
            mode: PutMode::Overwrite,
            ..opts
        };
        self.inner.put_opts(location, payload, opts).await
        // `_lock` is released here, after the rename that makes the new object.
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_range(&self, location: &Path, range: Range<u64>) -> Result<Bytes> {
        self.inner.get_range(location, range).await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    async fn head(&self, location: &Path) -> Result<ObjectMeta> {
        self.inner.head(location).await
    }

    async fn delete(&self, location: &Path) -> Result<()> {
        self.inner.delete(location).await
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy(&self, from: &Path, to: &Path) -> Result<()> {
        self.inner.copy(from, to).await
    }

    async fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        self.inner.rename(from, to).await
    }

    async fn copy_if_not_exists(&self, from: &Path, to: &Path) -> Result<()> {
        self.inner.copy_if_not_exists(from, to).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::UpdateVersion;

    fn store() -> (tempfile::TempDir, LocalStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap());
        (dir, store)
    }

    fn update(version: &PutResult) -> PutOptions {
        PutMode::Update(UpdateVersion::from(version.clone())).into()
    }

    #[tokio::test]
    async fn an_update_from_a_stale_version_is_refused_and_changes_nothing() {
        let (_dir, store) = store();
        let key = Path::from("runs/r/cursor.json");
        let first = store
            .put_opts(&key, "1".into(), PutMode::Create.into())
            .await
            .unwrap();
        let second = store
            .put_opts(&key, "2".into(), update(&first))
            .await
            .unwrap();
        assert_ne!(first.e_tag, second.e_tag);
        let stale = store.put_opts(&key, "3".into(), update(&first)).await;
        assert!(
            matches!(stale, Err(object_store::Error::Precondition { .. })),
            "{stale:?}"
        );
        let now = store.get(&key).await.unwrap().bytes().await.unwrap();
        assert_eq!(&now[..], b"2");
        // Create on an existing object is refused too.
        let again = store
            .put_opts(&key, "4".into(), PutMode::Create.into())
            .await;
        assert!(
            matches!(again, Err(object_store::Error::AlreadyExists { .. })),
            "{again:?}"
        );
    }

    #[tokio::test]
    async fn an_update_of_a_missing_object_is_a_precondition_failure() {
        let (_dir, store) = store();
        let version = UpdateVersion {
            e_tag: Some("x".into()),
            version: None,
        };
        for key in ["absent.json", "no/such/dir/absent.json"] {
            let got = store
                .put_opts(
                    &Path::from(key),
                    "1".into(),
                    PutMode::Update(version.clone()).into(),
                )
                .await;
            assert!(
                matches!(got, Err(object_store::Error::Precondition { .. })),
                "{key}: {got:?}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn of_many_racing_updates_from_one_version_exactly_one_wins() {
        let (_dir, store) = store();
        let store = Arc::new(store);
        let key = Path::from("cursor.json");
        let base = store
            .put_opts(&key, "base".into(), PutMode::Create.into())
            .await
            .unwrap();
        for round in 0..20 {
            let base = if round == 0 {
                base.clone()
            } else {
                let meta = store.head(&key).await.unwrap();
                PutResult {
                    e_tag: meta.e_tag,
                    version: meta.version,
                }
            };
            let tasks: Vec<_> = (0..8)
                .map(|i| {
                    let (store, key, opts) = (store.clone(), key.clone(), update(&base));
                    tokio::spawn(async move {
                        store
                            .put_opts(&key, format!("{round}-{i}").into(), opts)
                            .await
                            .is_ok()
                    })
                })
                .collect();
            let mut wins = 0;
            for t in tasks {
                wins += usize::from(t.await.unwrap());
            }
            assert_eq!(wins, 1, "round {round}");
        }
    }
}
