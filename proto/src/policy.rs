//! Policy announcements: which version of a policy the inference servers serve now.
//!
//! A publisher (`tapline-trainer publish`) claims version N with a create-only put of
//! `{prefix}/policies/NAME/v{N:020}.json` (so two publishers cannot both announce N),
//! loads the adapter on every inference server under the served name `NAME@vN`, then
//! overwrites `{prefix}/policies/NAME.json` with the announcement (a late overwrite by a
//! slower publisher of an older version is possible; running sidecars ignore it, since
//! versions only go up). Sidecars started with
//! `--policy NAME` poll that object and send calls for the policy to the announced
//! served name, recording `policy_version = N` on each.
//!
//! ```json
//! {"format": "tapline.policy.v1", "name": "coder", "version": 7,
//!  "served_model": "coder@v7", "adapter": "/adapters/coder/v7", "checkpoint": null,
//!  "run": "run-2026-12-03", "manifest_sha256": "…", "time": "2026-12-03T18:00:00Z"}
//! ```

use object_store::path::Path;
use serde::{Deserialize, Serialize};

/// The `format` of an announcement.
pub const FORMAT: &str = "tapline.policy.v1";

/// Directory of the announcements under a store prefix.
pub const POLICIES_DIR: &str = "policies";

/// Longest policy name.
pub const MAX_NAME_LEN: usize = 64;

/// What [`validate_name`] accepts, for error messages.
pub const NAME_RULE: &str =
    "a policy name is 1 to 64 characters of A-Z a-z 0-9 - _ . and is not . or ..";

/// Whether `name` can name a policy (it becomes part of a key and of a model name).
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?} is not a policy name: {NAME_RULE}"))
    }
}

/// Where the announcement of policy `name` lives under `prefix`.
pub fn announcement_path(prefix: &Path, name: &str) -> Path {
    prefix.child(POLICIES_DIR).child(format!("{name}.json"))
}

/// The model name version `version` of policy `name` is served under: `NAME@vN`.
pub fn served_model(name: &str, version: u64) -> String {
    format!("{name}@v{version}")
}

/// The announcement object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement {
    /// Always [`FORMAT`].
    pub format: String,
    /// The policy.
    pub name: String,
    /// Its version, from 1, strictly increasing.
    pub version: u64,
    /// The model name the inference servers serve this version under.
    pub served_model: String,
    /// Path of the adapter directory, as the servers loaded it.
    #[serde(default)]
    pub adapter: Option<String>,
    /// Path of a full checkpoint, as the servers loaded it.
    #[serde(default)]
    pub checkpoint: Option<String>,
    /// The training run that made it.
    #[serde(default)]
    pub run: String,
    /// SHA-256 of the run manifest (`manifest.json`) of the published directory.
    #[serde(default)]
    pub manifest_sha256: String,
    /// When it was announced (RFC 3339, UTC).
    #[serde(default)]
    pub time: String,
}

impl Announcement {
    /// Parses and checks an announcement of policy `name`: the format, the name, a
    /// version from 1 and a served name that is a valid model name.
    pub fn parse(bytes: &[u8], name: &str) -> Result<Announcement, String> {
        let a: Announcement = serde_json::from_slice(bytes)
            .map_err(|e| format!("the announcement of policy {name:?} is not valid JSON: {e}"))?;
        if a.format != FORMAT {
            return Err(format!(
                "the announcement of policy {name:?} has format {:?}, not {FORMAT:?}",
                a.format
            ));
        }
        if a.name != name {
            return Err(format!(
                "the announcement under policy {name:?} names policy {:?}",
                a.name
            ));
        }
        if a.version == 0 {
            return Err(format!(
                "the announcement of policy {name:?} has version 0; versions start at 1"
            ));
        }
        if a.served_model.is_empty()
            || a.served_model.len() > 256
            || a.served_model
                .bytes()
                .any(|b| b.is_ascii_control() || b == b'"' || b == b'\\')
        {
            return Err(format!(
                "the announcement of policy {name:?} has an unusable served_model {:?}",
                a.served_model
            ));
        }
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keys_and_served_models() {
        assert!(validate_name("coder-7b.lora_2").is_ok());
        for bad in ["", ".", "..", "a/b", "a b", "x@v1", &"n".repeat(65)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            announcement_path(&Path::from("runs/a"), "coder").as_ref(),
            "runs/a/policies/coder.json"
        );
        assert_eq!(served_model("coder", 12), "coder@v12");
    }

    #[test]
    fn announcements_are_checked() {
        let good = Announcement {
            format: FORMAT.into(),
            name: "coder".into(),
            version: 3,
            served_model: "coder@v3".into(),
            adapter: Some("/adapters/coder/v3".into()),
            checkpoint: None,
            run: "r".into(),
            manifest_sha256: "00".into(),
            time: "2026-12-03T18:00:00Z".into(),
        };
        let bytes = serde_json::to_vec(&good).unwrap();
        assert_eq!(Announcement::parse(&bytes, "coder").unwrap(), good);
        assert!(
            Announcement::parse(&bytes, "other")
                .unwrap_err()
                .contains("names policy")
        );
        for (field, value) in [
            ("format", serde_json::json!("v0")),
            ("version", serde_json::json!(0)),
            ("served_model", serde_json::json!("a\"b")),
        ] {
            let mut v = serde_json::to_value(&good).unwrap();
            v[field] = value;
            let err = Announcement::parse(&serde_json::to_vec(&v).unwrap(), "coder").unwrap_err();
            assert!(err.contains(field) || err.contains("format"), "{err}");
        }
        assert!(
            Announcement::parse(b"{", "coder")
                .unwrap_err()
                .contains("not valid JSON")
        );
    }
}
