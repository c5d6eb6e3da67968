//! The memory budget (`--memory-budget-bytes`): how many bytes of captured bodies the
//! calls in flight and the segment builder may hold at once, in total.
//!
//! A call reserves what it holds as it reads its request (by the declared length, then
//! by what arrived) and as its response is teed into the capture (by the buffer's
//! capacity), and gives it back once its record is in the spool. When a reservation
//! is refused the call is still proxied unchanged; only its capture is cut and flagged
//! (see `proxy`). The segment builder reserves, per record, what rebuilding it costs
//! (about four times its bodies, more as a content-encoded body decodes); it waits for
//! room rather than being refused, and while it waits calls are refused first, so it
//! always makes progress.
//!
//! Invariants:
//! - `used` is the sum of the live [`Reservation`]s; dropping one gives its bytes back.
//! - A non-waiting reservation ([`Reservation::try_grow_to`]) never takes `used` above
//!   `limit` minus what a waiting builder asked for.
//! - A waiting one ([`Reservation::grow_to_waiting`]) is clamped to `limit` when asked
//!   for more than the whole budget (a record larger than the budget is built once
//!   nothing else holds memory), and after [`WAIT_AT_MOST`] it proceeds over the
//!   budget: with the `block` spool policy, calls holding the budget may be waiting for
//!   the space that only the builder's upload frees.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Default budget: fitted to the shipped pod (`examples/deploy/harness-pod.yaml`, a
/// 256Mi limit): 160 MiB of captures (six cap-size calls at once peaked at 165 MiB
/// above idle) plus ordinary traffic (~45 MiB for 512 streams) stays under the limit
/// with ~45 MiB to spare (BENCHMARKS.md, "Sidecar: memory per call").
pub const DEFAULT_BYTES: u64 = 160 << 20;

/// Longest a waiting reservation waits for room before it proceeds over the budget.
pub const WAIT_AT_MOST: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
struct Books {
    used: u64,
    /// Bytes a waiting reservation asked for and does not hold yet.
    wanted: u64,
}

/// The budget shared by the proxy and the segment builder.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    books: Mutex<Books>,
    freed: Condvar,
    /// Calls whose capture was cut because the budget was full.
    cut: AtomicU64,
    /// Times a waiting reservation proceeded over the budget after [`WAIT_AT_MOST`].
    overdrawn: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            limit,
            books: Mutex::new(Books::default()),
            freed: Condvar::new(),
            cut: AtomicU64::new(0),
            overdrawn: AtomicU64::new(0),
        })
    }

    /// The budget, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.books().used
    }

    /// Calls whose capture was cut because the budget was full.
    pub fn cut_calls(&self) -> u64 {
        self.cut.load(Ordering::Relaxed)
    }

    /// Counts one call whose capture was cut.
    pub fn count_cut(&self) {
        self.cut.fetch_add(1, Ordering::Relaxed);
    }

    /// Times the segment builder went over the budget after waiting [`WAIT_AT_MOST`].
    pub fn overdrawn(&self) -> u64 {
        self.overdrawn.load(Ordering::Relaxed)
    }

    /// Adds the budget's metrics to `out`.
    pub fn expose(&self, out: &mut crate::metrics::Exposition) {
        use crate::metrics::Gauge;
        out.gauge(
            "tapline_memory_budget_bytes",
            "Bytes of captured bodies calls and the segment builder may hold at once (--memory-budget-bytes).",
            vec![(vec![], Gauge::Int(self.limit))],
        );
        out.gauge(
            "tapline_memory_budget_used_bytes",
            "Bytes of the memory budget held now.",
            vec![(vec![], Gauge::Int(self.used()))],
        );
        out.counter(
            "tapline_memory_budget_cuts_total",
            "Calls whose capture was cut because the memory budget was held by other calls (each was proxied unchanged; its record says so).",
            vec![(vec![], self.cut_calls())],
        );
        out.counter(
            "tapline_memory_budget_overdrawn_total",
            "Times the segment builder went over the memory budget after waiting 10 s for it.",
            vec![(vec![], self.overdrawn())],
        );
    }

    /// What `/tapline/v1/health` says about the budget.
    pub fn health(&self) -> serde_json::Value {
        serde_json::json!({
            "limit_bytes": self.limit,
            "used_bytes": self.used(),
            "cut_calls": self.cut_calls(),
        })
    }

    /// A reservation of nothing, to grow.
    pub fn empty(self: &Arc<Self>) -> Reservation {
        Reservation {
            budget: self.clone(),
            bytes: 0,
        }
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        // The books are two integers updated together: a panic elsewhere cannot leave
        // them half-written.
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn give_back(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut books = self.books();
        books.used = books.used.saturating_sub(bytes);
        // Only the segment builder waits, and says so in `wanted` before it does (under
        // this lock): without a waiter there is no futex call, one per call otherwise.
        let waited_for = books.wanted > 0;
        drop(books);
        if waited_for {
            self.freed.notify_all();
        }
    }
}

/// Bytes held against a [`MemoryBudget`]; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Grows to `total` bytes if the budget has room now; `false` (and nothing changed)
    /// when it has not. Asking for no more than is held always succeeds.
    pub fn try_grow_to(&mut self, total: u64) -> bool {
        let Some(more) = total.checked_sub(self.bytes).filter(|m| *m > 0) else {
            return true;
        };
        let mut books = self.budget.books();
        let room = self
            .budget
            .limit
            .saturating_sub(books.used)
            .saturating_sub(books.wanted);
        if more > room {
            return false;
        }
        books.used += more;
        self.bytes = total;
        true
    }

    /// Grows towards `total` bytes as far as the budget has room now; returns what is
    /// held then.
    pub fn grow_up_to(&mut self, total: u64) -> u64 {
        let Some(more) = total.checked_sub(self.bytes).filter(|m| *m > 0) else {
            return self.bytes;
        };
        let mut books = self.budget.books();
        let room = self
            .budget
            .limit
            .saturating_sub(books.used)
            .saturating_sub(books.wanted);
        let granted = more.min(room);
        books.used += granted;
        self.bytes += granted;
        self.bytes
    }

    /// Grows to `total` bytes (at most the whole budget), waiting for room; see the
    /// module's invariants. For the segment builder's blocking thread, never for a
    /// task on the runtime.
    pub fn grow_to_waiting(&mut self, total: u64) {
        let total = total.min(self.budget.limit.max(self.bytes));
        let Some(more) = total.checked_sub(self.bytes).filter(|m| *m > 0) else {
            return;
        };
        let deadline = Instant::now() + WAIT_AT_MOST;
        let mut books = self.budget.books();
        books.wanted += more;
        loop {
            let room = self.budget.limit.saturating_sub(books.used);
            if more <= room {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                self.budget.overdrawn.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    wanted = more,
                    used = books.used,
                    limit = self.budget.limit,
                    "the segment builder waited {WAIT_AT_MOST:?} for the memory budget and goes over it (calls holding it may be waiting for spool space: see --spool-full-policy)"
                );
                break;
            }
            books = self
                .budget
                .freed
                .wait_timeout(books, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        books.wanted -= more;
        books.used += more;
        self.bytes = total;
    }

    /// Gives back what is held above `total`.
    pub fn shrink_to(&mut self, total: u64) {
        if total < self.bytes {
            self.budget.give_back(self.bytes - total);
            self.bytes = total;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_add_up_to_the_limit_and_give_back_when_dropped() {
        let budget = MemoryBudget::new(100);
        let mut a = budget.empty();
        let mut b = budget.empty();
        assert!(a.try_grow_to(60));
        assert!(!b.try_grow_to(41), "60 + 41 is over 100");
        assert_eq!(b.bytes(), 0, "a refused reservation holds nothing");
        assert!(b.try_grow_to(40));
        assert_eq!(budget.used(), 100);
        assert!(a.try_grow_to(60), "what is held is always granted");
        a.shrink_to(10);
        assert_eq!(budget.used(), 50);
        drop(b);
        assert_eq!(budget.used(), 10);
        assert!(a.try_grow_to(100));
        let mut c = budget.empty();
        assert_eq!(c.grow_up_to(5), 0, "nothing left");
        a.shrink_to(97);
        assert_eq!(c.grow_up_to(5), 3, "what is left");
        assert_eq!(budget.used(), 100);
        drop(c);
        drop(a);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_waiting_reservation_gets_what_calls_free_and_calls_yield_to_it() {
        let budget = MemoryBudget::new(100);
        let mut call = budget.empty();
        assert!(call.try_grow_to(80));
        let waiter = {
            let budget = budget.clone();
            std::thread::spawn(move || {
                let mut r = budget.empty();
                // More than the whole budget: clamped to it.
                r.grow_to_waiting(500);
                r.bytes()
            })
        };
        // Once the builder waits, a new call is refused even where the free bytes
        // would hold it: the builder is served first.
        let started = Instant::now();
        while budget.books().wanted == 0 {
            assert!(started.elapsed() < Duration::from_secs(5), "never waited");
            std::thread::yield_now();
        }
        let mut other = budget.empty();
        assert!(!other.try_grow_to(10));
        drop(call);
        assert_eq!(waiter.join().unwrap(), 100);
        assert_eq!(budget.used(), 0);
        assert_eq!(budget.overdrawn(), 0);
    }
}
