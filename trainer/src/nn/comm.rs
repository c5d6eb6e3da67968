//! What a rank sends into collectives ([`Comm`]): below both the optimizers
//! ([`super::optim`], whose replicated AdamW all-reduces its gradients) and the data
//! parallel layer ([`super::dist`]), so that neither imports the other for it.

use std::time::Instant;

/// Communication of a run: bytes this rank sent into collectives, and their seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Comm {
    /// Bytes of tensors handed to collectives (each counted once, as sent).
    pub bytes: u64,
    /// Seconds inside collectives (waiting for the slowest rank included).
    pub seconds: f64,
    /// Collective calls.
    pub calls: u64,
}

impl Comm {
    /// Runs the collective `f`, which sends `bytes`, counting it.
    pub(crate) fn time<T>(
        &mut self,
        bytes: i64,
        f: impl FnOnce() -> Result<T, tapline_c10d::Error>,
    ) -> Result<T, tapline_c10d::Error> {
        let started = Instant::now();
        let out = f();
        self.seconds += started.elapsed().as_secs_f64();
        self.bytes += u64::try_from(bytes).unwrap_or(0);
        self.calls += 1;
        out
    }
}
