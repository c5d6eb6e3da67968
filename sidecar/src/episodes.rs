//! Episodes known to this sidecar and the attribution of calls to them.
//!
//! Attribution, first match wins (DESIGN.md): the path prefix `/e/{episode_id}/`, the
//! `x-tapline-episode-id` header, the episode bound to this sidecar, else unattributed.
//! Task, group and tags come from `x-tapline-*` headers when present, else from the
//! episode as it was created.
//!
//! The table (open episodes, the binding, ended and call-only episodes with their call
//! numbers) is kept in a journal beside the spool ([`journal`]) when the sidecar opens
//! it with [`Episodes::open`], so that a restart goes on accepting rewards and ends for
//! the episodes that were open, and keeps answering 409 for the ones that ended.
//! Every change is applied to the table and written to the journal under one lock, in
//! the same order.

pub mod journal;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use journal::{Entry, Journal, SEQ_BLOCK};

/// What the sidecar remembers of an episode it created.
#[derive(Debug, Clone, Default)]
pub struct EpisodeInfo {
    /// Task id.
    pub task_id: String,
    /// Group id.
    pub group_id: String,
    /// The metadata the episode was created with.
    pub tags: BTreeMap<String, String>,
    /// Number of calls attributed so far (the next call's `seq`).
    pub calls: u32,
    /// Records of this episode that had to be dropped.
    pub dropped_records: u64,
}

/// Why a reward or an end cannot be taken for an episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotOpen {
    /// This sidecar never created the episode (or was restarted on another spool
    /// directory since, or forgot it among more than 10,000 ended ones).
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

/// One episode in the table.
#[derive(Debug, Clone)]
struct Slot {
    info: EpisodeInfo,
    /// Call numbers reserved in the journal: `info.calls` stays at or below it.
    reserved: u32,
    /// The last call, reward or creation (for `--episode-ttl-secs`).
    active: Instant,
}

impl Slot {
    fn new(info: EpisodeInfo) -> Slot {
        Slot {
            reserved: info.calls,
            info,
            active: Instant::now(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Open episodes created here.
    episodes: HashMap<String, Slot>,
    /// Episodes that ended here, or that calls named without creating them here: their
    /// calls keep counting (and keep task and group) without reopening anything.
    /// Bounded: cleared when it reaches [`MAX_OTHER_EPISODES`].
    others: HashMap<String, Slot>,
    /// Which of `others` ended here (the rest were only named by calls).
    ended: HashSet<String>,
    bound: Option<String>,
    unattributed_calls: u32,
    /// Where changes are written; `None` for a table in memory only.
    journal: Option<Journal>,
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
    fn remember_other(&mut self, episode_id: &str, slot: Slot) {
        if self.others.len() >= MAX_OTHER_EPISODES && !self.others.contains_key(episode_id) {
            self.others.clear();
            self.ended.clear();
        }
        self.others.insert(episode_id.to_owned(), slot);
    }

    /// Applies one change, live or read back from the journal. The live operations
    /// below are made of these, so a replay ends where the live table was.
    fn apply(&mut self, entry: Entry) {
        match entry {
            Entry::Open {
                id,
                task,
                group,
                tags,
                bound,
                calls,
                dropped,
            } => {
                self.ended.remove(&id);
                self.others.remove(&id);
                let slot = Slot::new(EpisodeInfo {
                    task_id: task,
                    group_id: group,
                    tags,
                    calls,
                    dropped_records: dropped,
                });
                if bound {
                    self.bound = Some(id.clone());
                }
                self.episodes.insert(id, slot);
            }
            Entry::Known {
                id,
                task,
                group,
                calls,
                ended,
            } => {
                let slot = Slot::new(EpisodeInfo {
                    task_id: task,
                    group_id: group,
                    calls,
                    ..Default::default()
                });
                self.remember_other(&id, slot);
                if ended {
                    self.ended.insert(id);
                }
            }
            Entry::Calls { id, upto } => {
                if !self.episodes.contains_key(&id) && !self.others.contains_key(&id) {
                    self.remember_other(&id, Slot::new(EpisodeInfo::default()));
                }
                if let Some(slot) = self.episodes.get_mut(&id).or(self.others.get_mut(&id)) {
                    slot.reserved = slot.reserved.max(upto);
                }
            }
            Entry::Dropped { id, count } => {
                if let Some(slot) = self.episodes.get_mut(&id) {
                    slot.info.dropped_records = count;
                }
            }
            Entry::End { id } => {
                if let Some(slot) = self.episodes.remove(&id) {
                    if self.bound.as_deref() == Some(id.as_str()) {
                        self.bound = None;
                    }
                    self.remember_other(&id, slot);
                    self.ended.insert(id);
                }
            }
        }
    }

    /// Writes a change to the journal (if any), then applies it.
    fn change(&mut self, entry: Entry) {
        if let Some(journal) = &mut self.journal {
            journal.append(&entry);
        }
        self.apply(entry);
        if self.journal.as_ref().is_some_and(Journal::wants_compaction) {
            let snapshot = self.snapshot();
            if let Some(journal) = &mut self.journal {
                journal.compact(snapshot);
            }
        }
    }

    /// The whole table as entries: what a compacted journal holds.
    fn snapshot(&self) -> Vec<Entry> {
        let mut out = Vec::with_capacity(self.episodes.len() + self.others.len());
        for (id, slot) in &self.others {
            out.push(Entry::Known {
                id: id.clone(),
                task: slot.info.task_id.clone(),
                group: slot.info.group_id.clone(),
                calls: slot.reserved,
                ended: self.ended.contains(id),
            });
        }
        for (id, slot) in &self.episodes {
            out.push(Entry::Open {
                id: id.clone(),
                task: slot.info.task_id.clone(),
                group: slot.info.group_id.clone(),
                tags: slot.info.tags.clone(),
                bound: self.bound.as_deref() == Some(id.as_str()),
                calls: slot.reserved,
                dropped: slot.info.dropped_records,
            });
        }
        out
    }

    fn open_entry(&self, id: &str, info: &EpisodeInfo, bound: bool) -> Entry {
        Entry::Open {
            id: id.to_owned(),
            task: info.task_id.clone(),
            group: info.group_id.clone(),
            tags: info.tags.clone(),
            bound,
            calls: info.calls,
            dropped: info.dropped_records,
        }
    }
}

/// What [`Episodes::open`] found in the journal.
#[derive(Debug, Clone, Default)]
pub struct Restored {
    /// Open episodes restored.
    pub open: usize,
    /// Ended and call-only episodes remembered.
    pub known: usize,
    /// The bound episode, if one was.
    pub bound: Option<String>,
    /// What reading the file found.
    pub recovery: journal::Recovery,
}

/// How the journal is doing, for health and `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct JournalHealth {
    /// Bytes in the journal.
    pub bytes: u64,
    /// Writes that failed since start.
    pub errors: u64,
    /// The last failure.
    pub last_error: Option<String>,
}

/// The episode registry.
#[derive(Debug, Default)]
pub struct Episodes {
    state: Mutex<State>,
}

impl Episodes {
    /// Opens the table kept in `dir` (the spool directory), restoring what an earlier
    /// run of the sidecar left there. Open episodes count as active from now on.
    pub fn open(dir: &Path) -> io::Result<(Episodes, Restored)> {
        let (mut journal, entries, recovery) = Journal::open(dir)?;
        let mut state = State::default();
        for entry in entries {
            state.apply(entry);
        }
        // Numbers up to the reservation may have been handed out before the restart.
        for slot in state.episodes.values_mut().chain(state.others.values_mut()) {
            slot.info.calls = slot.info.calls.max(slot.reserved);
        }
        // Start from a snapshot: the file holds what the table holds, nothing older.
        journal.compact(state.snapshot());
        let restored = Restored {
            open: state.episodes.len(),
            known: state.others.len(),
            bound: state.bound.clone(),
            recovery,
        };
        state.journal = Some(journal);
        Ok((
            Episodes {
                state: Mutex::new(state),
            },
            restored,
        ))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a new episode; binds it when asked (replacing an earlier binding).
    pub fn create(&self, episode_id: &str, info: EpisodeInfo, bind: bool) {
        let mut state = self.lock();
        let entry = state.open_entry(episode_id, &info, bind);
        state.change(entry);
    }

    /// Closes an open episode and unbinds it. Returns what was known of it and whether it
    /// was bound (for [`Episodes::reopen`]), or why it cannot be ended: one end per
    /// episode, taken atomically, so two concurrent ends cannot both write an End record.
    pub fn end(&self, episode_id: &str) -> Result<(EpisodeInfo, bool), NotOpen> {
        self.end_when(episode_id, |_| true)
    }

    /// [`Episodes::end`], only if the episode is open and has been idle for longer than
    /// `ttl` (checked under the same lock as the end).
    pub fn end_idle(&self, episode_id: &str, ttl: Duration) -> Option<(EpisodeInfo, bool)> {
        self.end_when(episode_id, |slot| slot.active.elapsed() > ttl)
            .ok()
    }

    fn end_when(
        &self,
        episode_id: &str,
        when: impl FnOnce(&Slot) -> bool,
    ) -> Result<(EpisodeInfo, bool), NotOpen> {
        let mut state = self.lock();
        let Some(slot) = state.episodes.get(episode_id) else {
            return Err(state.not_open(episode_id));
        };
        if !when(slot) {
            return Err(NotOpen::Unknown);
        }
        let info = slot.info.clone();
        let was_bound = state.bound.as_deref() == Some(episode_id);
        state.change(Entry::End {
            id: episode_id.to_owned(),
        });
        Ok((info, was_bound))
    }

    /// Undoes [`Episodes::end`] when its End record could not be queued, so the harness
    /// can end the episode again. Calls attributed in between keep their numbers.
    pub fn reopen(&self, episode_id: &str, was_bound: bool) {
        let mut state = self.lock();
        let info = state
            .others
            .get(episode_id)
            .map(|s| s.info.clone())
            .unwrap_or_default();
        let bind = was_bound && state.bound.is_none();
        let entry = state.open_entry(episode_id, &info, bind);
        state.change(entry);
    }

    /// Whether a reward can be taken for the episode: it was created here and is open.
    /// Counts as activity (for [`Episodes::idle`]).
    pub fn check_open(&self, episode_id: &str) -> Result<(), NotOpen> {
        let mut state = self.lock();
        match state.episodes.get_mut(episode_id) {
            Some(slot) => {
                slot.active = Instant::now();
                Ok(())
            }
            None => Err(state.not_open(episode_id)),
        }
    }

    /// The episode, if this sidecar created it and it has not ended.
    pub fn get(&self, episode_id: &str) -> Option<EpisodeInfo> {
        self.lock().episodes.get(episode_id).map(|s| s.info.clone())
    }

    /// The bound episode, if any.
    pub fn bound(&self) -> Option<String> {
        self.lock().bound.clone()
    }

    /// Counts a record of the episode that had to be dropped.
    pub fn note_dropped(&self, episode_id: &str) {
        let mut state = self.lock();
        let Some(slot) = state.episodes.get(episode_id) else {
            return;
        };
        let count = slot.info.dropped_records + 1;
        state.change(Entry::Dropped {
            id: episode_id.to_owned(),
            count,
        });
    }

    /// Number of open episodes.
    pub fn open_count(&self) -> usize {
        self.lock().episodes.len()
    }

    /// Open episodes with no call, reward or creation for longer than `ttl`.
    pub fn idle(&self, ttl: Duration) -> Vec<String> {
        let state = self.lock();
        let mut idle: Vec<(Instant, String)> = state
            .episodes
            .iter()
            .filter(|(_, slot)| slot.active.elapsed() > ttl)
            .map(|(id, slot)| (slot.active, id.clone()))
            .collect();
        idle.sort();
        idle.into_iter().map(|(_, id)| id).collect()
    }

    /// The journal's file to fsync, if anything changed since the last call.
    pub fn sync_job(&self) -> Option<io::Result<std::fs::File>> {
        self.lock().journal.as_mut().and_then(Journal::sync_job)
    }

    /// How the journal is doing; `None` for a table in memory only.
    pub fn journal_health(&self) -> Option<JournalHealth> {
        self.lock().journal.as_ref().map(|j| JournalHealth {
            bytes: j.bytes(),
            errors: j.errors,
            last_error: j.last_error.clone(),
        })
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
        if !state.episodes.contains_key(&episode_id) && !state.others.contains_key(&episode_id) {
            state.remember_other(&episode_id, Slot::new(EpisodeInfo::default()));
        }
        let Some(slot) = state
            .episodes
            .get_mut(&episode_id)
            .or(state.others.get_mut(&episode_id))
        else {
            // Unreachable: inserted just above.
            return Attribution::default();
        };
        let seq = slot.info.calls;
        slot.info.calls = seq.saturating_add(1);
        slot.active = Instant::now();
        let task_id = hints.task_id.unwrap_or_else(|| slot.info.task_id.clone());
        let group_id = hints.group_id.unwrap_or_else(|| slot.info.group_id.clone());
        if slot.info.calls > slot.reserved && state.journal.is_some() {
            let upto = slot.reserved.max(seq).saturating_add(SEQ_BLOCK);
            state.change(Entry::Calls {
                id: episode_id.clone(),
                upto,
            });
        }
        Attribution {
            task_id,
            group_id,
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
        assert_eq!(eps.open_count(), 0);
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

    fn call(eps: &Episodes, id: &str) -> u32 {
        eps.attribute(Hints {
            path_episode: Some(id.into()),
            ..Default::default()
        })
        .seq
    }

    #[test]
    fn a_restart_keeps_open_episodes_the_binding_and_the_ended_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (eps, restored) = Episodes::open(dir.path()).unwrap();
        assert_eq!(restored.open, 0);
        let mut tagged = info("ta");
        tagged.tags.insert("k".into(), "v".into());
        eps.create("a", tagged, true);
        eps.create("b", info("tb"), false);
        eps.create("c", info("tc"), false);
        let before: Vec<u32> = (0..3).map(|_| call(&eps, "a")).collect();
        let foreign = call(&eps, "foreign");
        eps.note_dropped("c");
        let late = call(&eps, "b");
        eps.end("b").unwrap();
        drop(eps); // as a SIGKILL would: nothing is flushed on the way out

        let (eps, restored) = Episodes::open(dir.path()).unwrap();
        assert_eq!((restored.open, restored.bound.as_deref()), (2, Some("a")));
        let a = eps.get("a").unwrap();
        assert_eq!((a.task_id.as_str(), a.tags["k"].as_str()), ("ta", "v"));
        assert_eq!(eps.check_open("a"), Ok(()));
        assert_eq!(eps.check_open("b").unwrap_err(), NotOpen::Ended);
        assert_eq!(eps.get("c").unwrap().dropped_records, 1);
        let next = call(&eps, "a");
        assert!(
            next > *before.last().unwrap(),
            "call numbers never repeat: {next} after {before:?}"
        );
        assert_eq!(
            eps.attribute(Hints::default()).episode_id,
            "a",
            "the binding survives"
        );
        assert!(call(&eps, "foreign") > foreign);
        assert!(
            call(&eps, "b") > late,
            "a late call to an ended episode numbers on"
        );
        let (ended, was_bound) = eps.end("a").unwrap();
        assert!(was_bound);
        assert!(ended.calls >= 5);
    }

    #[test]
    fn call_numbers_rise_across_many_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let (eps, _) = Episodes::open(dir.path()).unwrap();
        eps.create("a", info("t"), false);
        drop(eps);
        let mut last = None;
        for _ in 0..5 {
            let (eps, _) = Episodes::open(dir.path()).unwrap();
            for _ in 0..(SEQ_BLOCK + 3) {
                let seq = call(&eps, "a");
                assert!(last.is_none_or(|l| seq > l), "{seq} after {last:?}");
                last = Some(seq);
            }
        }
    }

    #[test]
    fn the_journal_stays_small_and_restores_after_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let (eps, _) = Episodes::open(dir.path()).unwrap();
        for i in 0..20_000 {
            let id = format!("episode-{i}");
            eps.create(&id, info("t"), false);
            if i % 100 != 0 {
                eps.end(&id).unwrap();
            }
        }
        let bytes = eps.journal_health().unwrap().bytes;
        assert!(bytes < 8 << 20, "journal of {bytes} bytes");
        drop(eps);
        let (eps, restored) = Episodes::open(dir.path()).unwrap();
        assert_eq!(restored.open, 200);
        assert_eq!(eps.check_open("episode-19900"), Ok(()));
        assert_eq!(eps.check_open("episode-19999").unwrap_err(), NotOpen::Ended);
    }

    #[test]
    fn idle_lists_episodes_past_the_ttl() {
        let eps = Episodes::default();
        eps.create("old", info("t"), false);
        std::thread::sleep(Duration::from_millis(30));
        eps.create("new", info("t"), false);
        assert_eq!(eps.idle(Duration::from_millis(20)), ["old"]);
        call(&eps, "old");
        assert!(eps.idle(Duration::from_millis(20)).is_empty());
    }
}
