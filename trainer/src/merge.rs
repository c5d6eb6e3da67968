//! Stage 4: an episode's calls → as few token sequences as exactness allows.
//!
//! A call extends the current sequence when its prompt ids start with the sequence's
//! ids (the previous prompt + completion, and so on) exactly; the rest of its prompt
//! (tool results, the next user turn, the template's turn markers) is appended with loss
//! mask 0 and its completion with loss mask 1. Anything else — a single differing id —
//! starts a new sequence, and the break is named by [`crate::drift::classify`]. Loss is
//! only ever on tokens the model sampled.

use crate::drift::DriftKind;
use crate::tokenize::TokenizedCall;

/// The completion tokens of one call within a sequence: `start..end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSpan {
    /// The call's span id.
    pub span_id: String,
    /// Index of the call within its episode (after cleaning).
    pub call_index: usize,
    /// First completion token.
    pub start: usize,
    /// One past the last completion token.
    pub end: usize,
    /// Policy version that served the call.
    pub policy_version: String,
}

/// One training sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sequence {
    /// Token ids.
    pub token_ids: Vec<u32>,
    /// 1 where the model sampled the token, else 0.
    pub loss_mask: Vec<u8>,
    /// Inference log-probability of each sampled token, when recorded.
    pub logprobs: Vec<Option<f64>>,
    /// The calls whose completions are in the sequence, in order.
    pub spans: Vec<CallSpan>,
}

impl Sequence {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    /// Whether the sequence has no tokens.
    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }

    /// Number of tokens with loss.
    pub fn loss_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|m| **m != 0).count()
    }

    fn push_call(&mut self, call: &TokenizedCall, call_index: usize, prompt_from: usize) {
        let prompt_rest = &call.prompt_ids[prompt_from..];
        self.token_ids.extend_from_slice(prompt_rest);
        self.loss_mask
            .extend(std::iter::repeat_n(0, prompt_rest.len()));
        self.logprobs
            .extend(std::iter::repeat_n(None, prompt_rest.len()));
        let start = self.token_ids.len();
        self.token_ids.extend_from_slice(&call.completion_ids);
        self.loss_mask
            .extend(std::iter::repeat_n(1, call.completion_ids.len()));
        match &call.logprobs {
            Some(lp) => self.logprobs.extend(lp.iter().map(|l| Some(*l))),
            None => self
                .logprobs
                .extend(std::iter::repeat_n(None, call.completion_ids.len())),
        }
        self.spans.push(CallSpan {
            span_id: call.span_id.clone(),
            call_index,
            start,
            end: self.token_ids.len(),
            policy_version: call.policy_version.clone(),
        });
    }
}

/// The sequences of one episode.
#[derive(Debug, Clone, Default)]
pub struct Merged {
    /// Sequences in call order.
    pub sequences: Vec<Sequence>,
    /// Calls that extended the previous sequence.
    pub merged: u64,
    /// Why each new sequence after the first was started.
    pub breaks: Vec<DriftKind>,
}

/// Merges an episode's calls (in order). `classify(expected, actual)` names a break
/// where `actual` (the next prompt) does not start with `expected` (the sequence so far).
pub fn merge_episode(
    calls: &[TokenizedCall],
    mut classify: impl FnMut(&[u32], &[u32]) -> DriftKind,
) -> Merged {
    let mut out = Merged::default();
    let mut current: Option<Sequence> = None;
    for (index, call) in calls.iter().enumerate() {
        match current.as_mut() {
            Some(seq) if call.prompt_ids.starts_with(&seq.token_ids) => {
                let from = seq.token_ids.len();
                seq.push_call(call, index, from);
                out.merged += 1;
            }
            Some(seq) => {
                out.breaks.push(classify(&seq.token_ids, &call.prompt_ids));
                let mut next = Sequence::default();
                next.push_call(call, index, 0);
                out.sequences.extend(current.replace(next));
            }
            None => {
                let mut first = Sequence::default();
                first.push_call(call, index, 0);
                current = Some(first);
            }
        }
    }
    out.sequences.extend(current);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::{DriftCheck, IdSource};

    fn call(span: &str, prompt: &[u32], completion: &[u32]) -> TokenizedCall {
        TokenizedCall {
            span_id: span.into(),
            prompt_ids: prompt.to_vec(),
            completion_ids: completion.to_vec(),
            logprobs: Some(completion.iter().map(|c| -f64::from(*c)).collect()),
            prompt_source: IdSource::Recorded,
            completion_source: IdSource::Recorded,
            prompt_drift: DriftCheck::NotCompared,
            completion_drift: DriftCheck::NotCompared,
            policy_version: "v1".into(),
        }
    }

    #[test]
    fn exact_prefixes_merge_and_anything_else_breaks() {
        let calls = [
            call("a", &[1, 2], &[3, 4]),
            call("b", &[1, 2, 3, 4, 5], &[6]),
            // Differs in one id: a new sequence.
            call("c", &[1, 2, 3, 9, 5, 6, 7], &[8]),
            call("d", &[1, 2, 3, 9, 5, 6, 7, 8], &[]),
        ];
        let merged = merge_episode(&calls, |_, _| DriftKind::NonCanonicalBpe);
        assert_eq!(merged.merged, 2);
        assert_eq!(merged.breaks, [DriftKind::NonCanonicalBpe]);
        let [first, second] = merged.sequences.as_slice() else {
            panic!("two sequences expected: {merged:?}");
        };
        assert_eq!(first.token_ids, [1, 2, 3, 4, 5, 6]);
        assert_eq!(first.loss_mask, [0, 0, 1, 1, 0, 1]);
        assert_eq!(
            first.logprobs,
            [None, None, Some(-3.0), Some(-4.0), None, Some(-6.0)]
        );
        assert_eq!(
            first
                .spans
                .iter()
                .map(|s| (s.start, s.end))
                .collect::<Vec<_>>(),
            [(2, 4), (5, 6)]
        );
        assert_eq!(second.token_ids, [1, 2, 3, 9, 5, 6, 7, 8]);
        assert_eq!(second.loss_tokens(), 1);
        assert_eq!(second.spans.len(), 2);
    }
}
