//! `--watch DIR`: once a second, look for checkpoint directories in `DIR` and load the
//! newest one.
//!
//! A checkpoint is a subdirectory holding `manifest.json` (the trainer writes it last,
//! so its presence means the directory is complete). "Newest" is the greatest name; a
//! checkpoint is loaded when its name is greater than the greatest one loaded from `DIR`
//! so far (by the watcher or by `POST /v1/reload`), so a manual reload of an older
//! checkpoint stays until a newer one appears. A checkpoint that fails to load is
//! reported once and skipped.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;

use crate::engine::EngineHandle;

/// The greatest checkpoint name in `dir` above `after`, skipping `skip`.
pub fn newest_checkpoint(
    dir: &Path,
    after: Option<&str>,
    skip: &HashSet<String>,
) -> std::io::Result<Option<(String, PathBuf)>> {
    let mut best: Option<(String, PathBuf)> = None;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if after.is_some_and(|a| name.as_str() <= a)
            || skip.contains(&name)
            || best.as_ref().is_some_and(|(b, _)| name <= *b)
        {
            continue;
        }
        let path = entry.path();
        if path.is_dir() && path.join("manifest.json").is_file() {
            best = Some((name, path));
        }
    }
    Ok(best)
}

/// Polls `dir` every `interval` until `stop` turns true.
pub async fn run(
    dir: PathBuf,
    engine: EngineHandle,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let mut cursor: Option<String> = None;
    let mut failed: HashSet<String> = HashSet::new();
    let mut unreadable = false;
    loop {
        // What is loaded counts when it comes from the watched directory.
        let loaded = engine.loaded().dir;
        if loaded.parent() == Some(canonical(&dir).as_path())
            && let Some(name) = loaded.file_name().and_then(|n| n.to_str())
            && cursor.as_deref().is_none_or(|c| name > c)
        {
            cursor = Some(name.to_owned());
        }
        let scan = {
            let (dir, cursor, failed) = (dir.clone(), cursor.clone(), failed.clone());
            tokio::task::spawn_blocking(move || newest_checkpoint(&dir, cursor.as_deref(), &failed))
                .await
        };
        match scan {
            Ok(Ok(Some((name, path)))) => {
                unreadable = false;
                tracing::info!(checkpoint = %path.display(), "new checkpoint; loading");
                match crate::server::load(&engine, path).await {
                    Ok(_) => cursor = Some(name),
                    Err(message) => {
                        tracing::warn!(%name, %message, "checkpoint skipped");
                        failed.insert(name);
                    }
                }
            }
            Ok(Ok(None)) => unreadable = false,
            Ok(Err(error)) => {
                if !unreadable {
                    tracing::warn!(dir = %dir.display(), %error, "cannot read the watched directory; will keep trying");
                    unreadable = true;
                }
            }
            Err(error) => tracing::warn!(%error, "watch scan failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_greatest_complete_checkpoint_after_the_cursor() {
        let tmp = tempfile::tempdir().unwrap();
        let mk = |name: &str, manifest: bool| {
            let d = tmp.path().join(name);
            std::fs::create_dir(&d).unwrap();
            if manifest {
                std::fs::write(d.join("manifest.json"), "{}").unwrap();
            }
        };
        let none = HashSet::new();
        assert_eq!(newest_checkpoint(tmp.path(), None, &none).unwrap(), None);
        mk("step-0001", true);
        mk("step-0003", false);
        mk("step-0002", true);
        std::fs::write(tmp.path().join("step-0009"), "a file").unwrap();
        let name = |after: Option<&str>, skip: &HashSet<String>| {
            newest_checkpoint(tmp.path(), after, skip)
                .unwrap()
                .map(|(n, _)| n)
        };
        assert_eq!(name(None, &none).as_deref(), Some("step-0002"));
        assert_eq!(name(Some("step-0001"), &none).as_deref(), Some("step-0002"));
        assert_eq!(name(Some("step-0002"), &none), None);
        let skip = HashSet::from(["step-0002".to_owned()]);
        assert_eq!(name(None, &skip).as_deref(), Some("step-0001"));
        assert!(newest_checkpoint(&tmp.path().join("missing"), None, &none).is_err());
    }
}
