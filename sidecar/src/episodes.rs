//! Episodes known to this sidecar and the attribution of calls to them.
//!
//! Attribution, first match wins (DESIGN.md): the path prefix `/e/{episode_id}/`, the
//! `x-tapline-episode-id` header, the episode bound to this sidecar, else unattributed.
//! Task, group and tags come from `x-tapline-*` headers when present, else from the
//! episode as it was created.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// What the sidecar remembers of an episode it created.
#[derive(Debug, Clone, Default)]
pub struct EpisodeInfo {
    /// Task id.
    pub task_id: String,
    /// Group id.
    pub group_id: String,
    /// Number of calls attributed so far (the next call's `seq`).
    pub calls: u32,
    /// Records of this episode that had to be dropped.
    pub dropped_records: u64,
}

/// Why a reward or an end cannot be taken for an episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotOpen {
    /// This sidecar never created the episode (or was restarted since, or forgot it
    /// among more than 10,000 ended ones).
    Unknown,
    /// The episode was created here and has ended.
    Ended,
}

/// Attribution hints found on one request.
#[derive(Debug, Clone, Default)]
pub struct Hints {
    /// Episode id from the `/e/{id}/` path prefix.
    pub path_episode: Option<String>,
    /// `x-tapline-episode-id`.
    pub header_episode: Option<String>,
    /// `x-tapline-task-id`.
    pub task_id: Option<String>,
    /// `x-tapline-group-id`.
    pub group_id: Option<String>,
    /// `x-tapline-tag-<key>` headers.
    pub tags: BTreeMap<String, String>,
}

/// The result of attributing one call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attribution {
    /// Episode id; empty when unattributed.
    pub episode_id: String,
    /// Task id.
    pub task_id: String,
    /// Group id.
    pub group_id: String,
    /// Position of the call in its episode.
    pub seq: u32,
    /// Tags.
    pub tags: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
struct State {
    /// Open episodes created here.
    episodes: HashMap<String, EpisodeInfo>,
    /// Episodes that ended here, or that calls named without creating them here: their
    /// calls keep counting (and keep task and group) without reopening anything.
    /// Bounded: cleared when it reaches [`MAX_OTHER_EPISODES`].
    others: HashMap<String, EpisodeInfo>,
    /// Which of `others` ended here (the rest were only named by calls).
    ended: std::collections::HashSet<String>,
    bound: Option<String>,
    unattributed_calls: u32,
}

/// Most ended or foreign episodes remembered for call numbering.
const MAX_OTHER_EPISODES: usize = 10_000;

impl State {
    fn not_open(&self, episode_id: &str) -> NotOpen {
        if self.ended.contains(episode_id) {
            NotOpen::Ended
        } else {
            NotOpen::Unknown
        }
    }

    /// Remembers an ended or foreign episode, forgetting all of them first when the
    /// bound is reached.
    fn remember_other(&mut self, episode_id: &str, info: EpisodeInfo) {
        if self.others.len() >= MAX_OTHER_EPISODES && !self.others.contains_key(episode_id) {
            self.others.clear();
            self.ended.clear();
        }
        self.others.insert(episode_id.to_owned(), info);
    }
}

/// The episode registry.
#[derive(Debug, Default)]
pub struct Episodes {
    state: Mutex<State>,
}

impl Episodes {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a new episode; binds it when asked (replacing an earlier binding).
    pub fn create(&self, episode_id: &str, info: EpisodeInfo, bind: bool) {
        let mut state = self.lock();
        state.ended.remove(episode_id);
        state.episodes.insert(episode_id.to_owned(), info);
        if bind {
            state.bound = Some(episode_id.to_owned());
        }
    }

    /// Closes an open episode and unbinds it. Returns what was known of it and whether it
    /// was bound (for [`Episodes::reopen`]), or why it cannot be ended: one end per
    /// episode, taken atomically, so two concurrent ends cannot both write an End record.
    pub fn end(&self, episode_id: &str) -> Result<(EpisodeInfo, bool), NotOpen> {
        let mut state = self.lock();
        let Some(info) = state.episodes.remove(episode_id) else {
            return Err(state.not_open(episode_id));
        };
        let was_bound = state.bound.as_deref() == Some(episode_id);
        if was_bound {
            state.bound = None;
        }
        state.remember_other(episode_id, info.clone());
        state.ended.insert(episode_id.to_owned());
        Ok((info, was_bound))
    }

    /// Undoes [`Episodes::end`] when its End record could not be queued, so the harness
    /// can end the episode again. Calls attributed in between keep their numbers.
    pub fn reopen(&self, episode_id: &str, was_bound: bool) {
        let mut state = self.lock();
        state.ended.remove(episode_id);
        let info = state.others.remove(episode_id).unwrap_or_default();
        state.episodes.insert(episode_id.to_owned(), info);
        if was_bound && state.bound.is_none() {
            state.bound = Some(episode_id.to_owned());
        }
    }

    /// Whether a reward can be taken for the episode: it was created here and is open.
    pub fn check_open(&self, episode_id: &str) -> Result<(), NotOpen> {
        let state = self.lock();
        if state.episodes.contains_key(episode_id) {
            Ok(())
        } else {
            Err(state.not_open(episode_id))
        }
    }

    /// The episode, if this sidecar created it and it has not ended.
    pub fn get(&self, episode_id: &str) -> Option<EpisodeInfo> {
        self.lock().episodes.get(episode_id).cloned()
    }

    /// The bound episode, if any.
    pub fn bound(&self) -> Option<String> {
        self.lock().bound.clone()
    }

    /// Counts a record of the episode that had to be dropped.
    pub fn note_dropped(&self, episode_id: &str) {
        if let Some(info) = self.lock().episodes.get_mut(episode_id) {
            info.dropped_records += 1;
        }
    }

    /// Number of open episodes.
    pub fn open(&self) -> usize {
        self.lock().episodes.len()
    }

    /// Attributes one call and advances its episode's call counter.
    pub fn attribute(&self, hints: Hints) -> Attribution {
        let mut state = self.lock();
        let episode_id = hints
            .path_episode
            .or(hints.header_episode)
            .or_else(|| state.bound.clone())
            .unwrap_or_default();
        if episode_id.is_empty() {
            let seq = state.unattributed_calls;
            state.unattributed_calls = seq.wrapping_add(1);
            return Attribution {
                seq,
                task_id: hints.task_id.unwrap_or_default(),
                group_id: hints.group_id.unwrap_or_default(),
                tags: hints.tags,
                ..Default::default()
            };
        }
        let state = &mut *state;
        let info = match state.episodes.get_mut(&episode_id) {
            Some(info) => info,
            None => {
                if !state.others.contains_key(&episode_id) {
                    state.remember_other(&episode_id, EpisodeInfo::default());
                }
                state.others.entry(episode_id.clone()).or_default()
            }
        };
        let seq = info.calls;
        info.calls = seq.saturating_add(1);
        Attribution {
            task_id: hints.task_id.unwrap_or_else(|| info.task_id.clone()),
            group_id: hints.group_id.unwrap_or_else(|| info.group_id.clone()),
            episode_id,
            seq,
            tags: hints.tags,
        }
    }
}

/// What [`valid_episode_id`] accepts, for error messages.
pub const EPISODE_ID_RULE: &str =
    "an episode id is 1 to 128 characters of A-Z a-z 0-9 - _ . and is not . or ..";

/// Whether `id` can be an episode id, in the `/e/{id}/` path, the `x-tapline-episode-id`
/// header and the control API alike: 1 to 128 characters from `A-Z a-z 0-9 - _ .`, and
/// not `.` or `..` (a client normalizes `/e/../v1` to `/v1`, and the call would escape
/// its episode).
pub fn valid_episode_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(task: &str) -> EpisodeInfo {
        EpisodeInfo {
            task_id: task.into(),
            group_id: "g".into(),
            ..Default::default()
        }
    }

    #[test]
    fn path_beats_header_beats_binding() {
        let eps = Episodes::default();
        eps.create("bound", info("tb"), true);
        eps.create("p", info("tp"), false);
        let a = eps.attribute(Hints {
            path_episode: Some("p".into()),
            header_episode: Some("h".into()),
            ..Default::default()
        });
        assert_eq!(
            (a.episode_id.as_str(), a.task_id.as_str(), a.seq),
            ("p", "tp", 0)
        );
        let a = eps.attribute(Hints {
            header_episode: Some("h".into()),
            ..Default::default()
        });
        assert_eq!(a.episode_id, "h");
        let a = eps.attribute(Hints::default());
        assert_eq!((a.episode_id.as_str(), a.task_id.as_str()), ("bound", "tb"));
        let a = eps.attribute(Hints {
            task_id: Some("override".into()),
            ..Default::default()
        });
        assert_eq!((a.task_id.as_str(), a.seq), ("override", 1));
        eps.end("bound").unwrap();
        assert_eq!(eps.attribute(Hints::default()).episode_id, "");
    }

    #[test]
    fn late_and_foreign_calls_do_not_reopen_episodes() {
        let eps = Episodes::default();
        eps.create("a", info("t"), false);
        eps.attribute(Hints {
            path_episode: Some("a".into()),
            ..Default::default()
        });
        eps.end("a").unwrap();
        let late = eps.attribute(Hints {
            path_episode: Some("a".into()),
            ..Default::default()
        });
        assert_eq!(
            (late.seq, late.task_id.as_str()),
            (1, "t"),
            "a late call continues the numbering"
        );
        eps.attribute(Hints {
            path_episode: Some("never-created".into()),
            ..Default::default()
        });
        assert_eq!(eps.open(), 0);
        assert!(
            eps.get("a").is_none(),
            "an ended episode can be created again"
        );
    }

    #[test]
    fn an_episode_ends_once_and_unknown_ones_not_at_all() {
        let eps = Episodes::default();
        eps.create("a", info("t"), true);
        assert_eq!(eps.check_open("a"), Ok(()));
        assert_eq!(eps.end("nobody").unwrap_err(), NotOpen::Unknown);
        eps.attribute(Hints {
            header_episode: Some("named-by-a-call".into()),
            ..Default::default()
        });
        assert_eq!(
            eps.check_open("named-by-a-call").unwrap_err(),
            NotOpen::Unknown,
            "an episode only named by calls was not created here"
        );
        let (ended, was_bound) = eps.end("a").unwrap();
        assert_eq!((ended.task_id.as_str(), was_bound), ("t", true));
        assert_eq!(eps.end("a").unwrap_err(), NotOpen::Ended);
        assert_eq!(eps.check_open("a").unwrap_err(), NotOpen::Ended);
        // An End record that could not be queued: the episode is open and bound again.
        eps.reopen("a", true);
        assert_eq!(eps.check_open("a"), Ok(()));
        assert_eq!(eps.bound().as_deref(), Some("a"));
        eps.end("a").unwrap();
        // Created again under the same id: open again.
        eps.create("a", info("t2"), false);
        assert_eq!(eps.check_open("a"), Ok(()));
    }

    #[test]
    fn call_numbers_count_per_episode() {
        let eps = Episodes::default();
        eps.create("a", info("t"), false);
        let seqs: Vec<u32> = (0..3)
            .map(|_| {
                eps.attribute(Hints {
                    path_episode: Some("a".into()),
                    ..Default::default()
                })
                .seq
            })
            .collect();
        assert_eq!(seqs, [0, 1, 2]);
    }
}
