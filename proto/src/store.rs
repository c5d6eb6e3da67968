//! Opening an [`ObjectStore`] from a URL — the one function every component uses.
//!
//! | URL | store |
//! |---|---|
//! | `file:///abs/dir`, or a plain path such as `./records` | local directory (created if missing) |
//! | `s3://bucket/prefix` | Amazon S3 or any S3-compatible server |
//! | `gs://bucket/prefix` | Google Cloud Storage |
//! | `az://container/prefix` (also `azure://`) | Azure Blob Storage |
//! | `memory://name/prefix` | in-process memory; one store per `name`, shared within the process |
//!
//! Credentials and endpoints come from the usual environment variables of each cloud
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
//! `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, `AWS_VIRTUAL_HOSTED_STYLE_REQUEST`;
//! `GOOGLE_SERVICE_ACCOUNT`, ...; `AZURE_STORAGE_ACCOUNT_NAME`, ...). Query parameters
//! override them with the same names in lower case, without the cloud prefix:
//! `s3://bucket/p?endpoint=http://127.0.0.1:9000&region=us-east-1`. S3 requests are
//! path-style unless `virtual_hosted_style_request=true`; an `http://` endpoint enables
//! plain HTTP by itself.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

use object_store::ObjectStore;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use url::Url;

/// An opened store and the prefix under which tapline's objects live.
#[derive(Debug, Clone)]
pub struct StoreLocation {
    /// The store.
    pub store: Arc<dyn ObjectStore>,
    /// Prefix of every key tapline reads or writes (may be empty).
    pub prefix: Path,
    /// The URL without query parameters, safe to log.
    pub display: String,
}

impl std::fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display)
    }
}

/// Why a store URL could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreUrlError {
    /// The URL does not parse.
    #[error("store URL {url:?} does not parse: {source}")]
    BadUrl {
        /// The URL given.
        url: String,
        /// The parser's complaint.
        source: url::ParseError,
    },
    /// The scheme is not one tapline knows.
    #[error(
        "store URL {url:?} has unsupported scheme {scheme:?}; use file://, s3://, gs://, az:// or memory:// (or a plain directory path)"
    )]
    UnsupportedScheme {
        /// The URL given.
        url: String,
        /// Its scheme.
        scheme: String,
    },
    /// The URL names no bucket or container.
    #[error(
        "store URL {url:?} names no bucket or container: write {scheme}://NAME/optional/prefix"
    )]
    MissingBucket {
        /// The URL given.
        url: String,
        /// Its scheme.
        scheme: String,
    },
    /// A query parameter is not an option of that store.
    #[error("store URL {url:?}: unknown option {key:?} for {scheme}:// stores")]
    UnknownOption {
        /// The URL given.
        url: String,
        /// Its scheme.
        scheme: String,
        /// The unknown key.
        key: String,
    },
    /// The path part is not a valid object key prefix.
    #[error("store URL {url:?}: invalid prefix: {source}")]
    BadPrefix {
        /// The URL given.
        url: String,
        /// Why the prefix is invalid.
        source: object_store::path::Error,
    },
    /// The local directory cannot be created or opened.
    #[error("store directory {dir:?} cannot be used: {source}")]
    LocalDir {
        /// The directory.
        dir: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The store's builder refused the configuration (e.g. missing credentials).
    #[error("store URL {url:?} cannot be opened: {source}")]
    Build {
        /// The URL given.
        url: String,
        /// The builder's error.
        source: object_store::Error,
    },
}

/// Opens the store named by `url`; see the module documentation for the forms accepted.
pub fn open_store(url: &str) -> Result<StoreLocation, StoreUrlError> {
    if !url.contains("://") {
        return open_local(std::path::Path::new(url), url);
    }
    let parsed = Url::parse(url).map_err(|source| StoreUrlError::BadUrl {
        url: url.to_owned(),
        source,
    })?;
    let scheme = parsed.scheme().to_owned();
    let mut display = format!(
        "{scheme}://{}{}",
        parsed.host_str().unwrap_or(""),
        parsed.path()
    );
    if scheme == "file" {
        let dir = parsed
            .to_file_path()
            .map_err(|()| StoreUrlError::UnsupportedScheme {
                url: url.to_owned(),
                scheme: "file (with a host; use file:///absolute/path)".to_owned(),
            })?;
        return open_local(&dir, url);
    }
    let bucket = parsed.host_str().unwrap_or("").to_owned();
    if bucket.is_empty() {
        return Err(StoreUrlError::MissingBucket {
            url: url.to_owned(),
            scheme,
        });
    }
    let prefix = Path::parse(parsed.path().trim_start_matches('/')).map_err(|source| {
        StoreUrlError::BadPrefix {
            url: url.to_owned(),
            source,
        }
    })?;
    let options: Vec<(String, String)> = parsed
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    let unknown = |key: &str| StoreUrlError::UnknownOption {
        url: url.to_owned(),
        scheme: scheme.clone(),
        key: key.to_owned(),
    };
    let build = |source| StoreUrlError::Build {
        url: url.to_owned(),
        source,
    };
    let store: Arc<dyn ObjectStore> = match scheme.as_str() {
        "s3" | "s3a" => {
            let mut builder = AmazonS3Builder::from_env().with_bucket_name(&bucket);
            for (key, value) in &options {
                let key = AmazonS3ConfigKey::from_str(key).map_err(|_| unknown(key))?;
                builder = builder.with_config(key, value);
            }
            if let Some(endpoint) = builder.get_config_value(&AmazonS3ConfigKey::Endpoint) {
                if endpoint.starts_with("http://") {
                    builder = builder.with_allow_http(true);
                }
                display = format!("{display} (endpoint {endpoint})");
            }
            Arc::new(builder.build().map_err(build)?)
        }
        "gs" => {
            let mut builder = GoogleCloudStorageBuilder::from_env().with_bucket_name(&bucket);
            for (key, value) in &options {
                let key = GoogleConfigKey::from_str(key).map_err(|_| unknown(key))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(build)?)
        }
        "az" | "azure" => {
            let mut builder = MicrosoftAzureBuilder::from_env().with_container_name(&bucket);
            for (key, value) in &options {
                let key = AzureConfigKey::from_str(key).map_err(|_| unknown(key))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(build)?)
        }
        "memory" => {
            if let Some((key, _)) = options.first() {
                return Err(unknown(key));
            }
            memory_store(&bucket)
        }
        _ => {
            return Err(StoreUrlError::UnsupportedScheme {
                url: url.to_owned(),
                scheme,
            });
        }
    };
    Ok(StoreLocation {
        store,
        prefix,
        display,
    })
}

fn open_local(dir: &std::path::Path, url: &str) -> Result<StoreLocation, StoreUrlError> {
    let local_err = |source| StoreUrlError::LocalDir {
        dir: dir.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(local_err)?;
    let store = LocalFileSystem::new_with_prefix(dir).map_err(|source| StoreUrlError::Build {
        url: url.to_owned(),
        source,
    })?;
    let display = std::fs::canonicalize(dir)
        .map(|d| format!("file://{}", d.display()))
        .unwrap_or_else(|_| url.to_owned());
    Ok(StoreLocation {
        // With conditional updates, which `LocalFileSystem` alone refuses.
        store: Arc::new(crate::store_local::LocalStore::new(store)),
        prefix: Path::default(),
        display,
    })
}

/// In-memory stores are shared by name within the process, so that a test can hand
/// `memory://x` to several components and have them see the same objects.
fn memory_store(name: &str) -> Arc<dyn ObjectStore> {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    let mut stores = STORES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    stores
        .entry(name.to_owned())
        .or_insert_with(|| Arc::new(InMemory::new()))
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::PutPayload;

    #[tokio::test]
    async fn memory_stores_are_shared_by_name() {
        let a = open_store("memory://shared-test/pre/fix").unwrap();
        assert_eq!(a.prefix.as_ref(), "pre/fix");
        a.store
            .put(&Path::from("k"), PutPayload::from_static(b"v"))
            .await
            .unwrap();
        let b = open_store("memory://shared-test").unwrap();
        assert_eq!(
            b.store
                .get(&Path::from("k"))
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
                .as_ref(),
            b"v"
        );
        let other = open_store("memory://other-test").unwrap();
        assert!(other.store.get(&Path::from("k")).await.is_err());
    }

    #[tokio::test]
    async fn local_directories_are_created() {
        let dir = std::env::temp_dir().join(format!("tapline-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = format!("file://{}", dir.join("nested").display());
        let loc = open_store(&url).unwrap();
        loc.store
            .put(&Path::from("a/b"), PutPayload::from_static(b"x"))
            .await
            .unwrap();
        assert!(dir.join("nested/a/b").is_file());
        let plain = open_store(dir.join("nested").to_str().unwrap()).unwrap();
        assert!(plain.store.head(&Path::from("a/b")).await.is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn s3_takes_endpoint_and_options_from_the_query() {
        let loc = open_store("s3://bucket/runs/one?endpoint=http://127.0.0.1:9000&region=us-east-1&access_key_id=a&secret_access_key=b")
            .unwrap();
        assert_eq!(loc.prefix.as_ref(), "runs/one");
        assert!(loc.display.starts_with("s3://bucket/runs/one"));
        assert!(!loc.display.contains("secret"), "{}", loc.display);
    }

    #[test]
    fn errors_name_the_problem() {
        let err = open_store("ftp://host/x").unwrap_err();
        assert!(
            matches!(err, StoreUrlError::UnsupportedScheme { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("s3://"), "{err}");
        let err = open_store("s3:///prefix").unwrap_err();
        assert!(matches!(err, StoreUrlError::MissingBucket { .. }), "{err}");
        let err = open_store("s3://b/p?no_such_option=1").unwrap_err();
        assert!(err.to_string().contains("no_such_option"), "{err}");
        let err = open_store("memory://m?x=1").unwrap_err();
        assert!(matches!(err, StoreUrlError::UnknownOption { .. }), "{err}");
    }
}
