//! File descriptors: at start the sidecar raises its soft `RLIMIT_NOFILE` to the hard
//! limit, and refuses to start when `--max-connections` cannot be served within it.
//!
//! Most systems start processes with a soft limit of 1024 open files and a far higher
//! hard one; 1024 connections (the default `--max-connections`) each with an upstream
//! connection would run out, and `accept` would fail under load instead of the 503 that
//! `--max-connections` promises. The count of what one sidecar holds:
//!
//! - per served connection, the client's socket and at most one upstream connection;
//! - [`crate::server`]'s connections answered 503 beyond the maximum (64) and its idle
//!   upstream connections (128);
//! - [`OWN_FDS`] for the rest: the listener, the spool's open file, the episode
//!   journal, the store's connections, the runtime's epoll and event fds, stdio.

use anyhow::bail;
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Descriptors held besides connections.
pub const OWN_FDS: u64 = 64;
const REFUSING: u64 = crate::server::MAX_REFUSING_CONNECTIONS as u64;
const IDLE_UPSTREAM: u64 = crate::server::MAX_IDLE_UPSTREAM as u64;

/// Descriptors a sidecar serving `max_connections` connections may hold at once.
pub fn needed(max_connections: usize) -> u64 {
    2 * max_connections as u64 + REFUSING + IDLE_UPSTREAM + OWN_FDS
}

/// What [`raise`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised {
    /// The soft limit before.
    pub before: Option<u64>,
    /// The soft limit now (`None`: unlimited).
    pub now: Option<u64>,
    /// Descriptors needed.
    pub needed: u64,
}

/// Whether `limit` (`None`: unlimited) holds what `max_connections` need; the error
/// names both and what to do.
pub fn check(limit: Option<u64>, max_connections: usize) -> anyhow::Result<()> {
    let needed = needed(max_connections);
    match limit {
        Some(limit) if limit < needed => bail!(
            "invalid setting `max-connections`: {max_connections} connections need up to \
             {needed} open files (a client and an upstream socket each, plus {} for the \
             sidecar itself), but this process may open only {limit} (RLIMIT_NOFILE, hard \
             limit): lower --max-connections to at most {}, or raise the hard limit \
             (`ulimit -Hn`, LimitNOFILE= in systemd, --ulimit nofile= for containers)",
            REFUSING + IDLE_UPSTREAM + OWN_FDS,
            limit.saturating_sub(REFUSING + IDLE_UPSTREAM + OWN_FDS) / 2,
        ),
        _ => Ok(()),
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, then checks that it holds what
/// `max_connections` need.
pub fn raise(max_connections: usize) -> anyhow::Result<Raised> {
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    let mut now = current;
    if current != maximum {
        match setrlimit(
            Resource::Nofile,
            Rlimit {
                current: maximum,
                maximum,
            },
        ) {
            Ok(()) => now = maximum,
            Err(error) => tracing::warn!(%error, ?current, ?maximum, "cannot raise RLIMIT_NOFILE"),
        }
    }
    check(now, max_connections)?;
    Ok(Raised {
        before: current,
        now,
        needed: needed(max_connections),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_fits_common_hard_limits_but_not_the_usual_soft_one() {
        assert_eq!(needed(1024), 2048 + 256);
        assert!(check(Some(1024), 1024).is_err());
        assert!(check(Some(524_288), 1024).is_ok());
        assert!(check(None, usize::MAX / 4).is_ok());
    }

    #[test]
    fn the_error_names_the_setting_the_limit_and_a_maximum_that_fits() {
        let message = check(Some(1000), 1024).unwrap_err().to_string();
        assert!(message.contains("max-connections"), "{message}");
        assert!(message.contains("only 1000"), "{message}");
        let fits = (1000 - 256) / 2;
        assert!(message.contains(&format!("at most {fits}")), "{message}");
        assert!(check(Some(1000), fits).is_ok());
        assert!(check(Some(1000), fits + 1).is_err());
    }
}
