//! What one optimizer step trains on: sequences with their advantages and loss weights,
//! grouped into micro-batches (one forward/backward each) and mini-batches (one step).
//! The pipeline makes them; the backend (`nn::train`) and the writer (`output`) read
//! them. A leaf below both, so the backend does not depend on the pipeline.

use crate::merge::Sequence;
use crate::schedule;

/// One training sequence with everything the backend needs.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSequence {
    /// Episode it belongs to.
    pub episode_id: String,
    /// Task of the episode.
    pub task_id: String,
    /// Group of the episode.
    pub group_id: String,
    /// The episode's combined reward.
    pub reward: f64,
    /// Tokens, loss mask, logprobs and the calls in it.
    pub sequence: Sequence,
    /// Advantage of each token (0 where the loss mask is 0).
    pub advantages: Vec<f64>,
    /// Loss weight of each token (0 where the loss mask is 0).
    pub weights: Vec<f64>,
}

/// One micro-batch: sequences whose lengths sum to at most the token budget.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatch {
    /// Its sequences, longest first.
    pub sequences: Vec<TrainSequence>,
    /// Run it with recompute (layers recomputed in the backward pass): set by the
    /// memory fit (`nn::memory::fit`) where it would not fit otherwise.
    pub recompute: bool,
}

/// One mini-batch: one optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct MiniBatch {
    /// Its micro-batches.
    pub micro_batches: Vec<MicroBatch>,
    /// The normalizers its weights were computed with.
    pub normalizer: schedule::Normalizer,
}
