//! How a micro-batch's sequences are laid out in the tensors the model runs
//! (`[train] packing`).
//!
//! - [`Layout::Padded`]: one sequence per row of a `[b, t]` tensor, right-padded to the
//!   longest; every row's positions run from 0 and causal attention keeps the padding out
//!   of every real position. Compute grows with `b · longest`.
//! - [`Layout::Packed`]: one row holding the sequences end to end (`[1, Σ len]`), with
//!   positions restarting at 0 at each sequence and attention confined to each sequence
//!   ([`super::attention`]). Compute grows with the tokens trained, nothing padded.
//!
//! Both give the same loss, per-token log-probs and gradients (to rounding; tested in
//! `trainer/tests/packing.rs`). [`pack`] builds the ids and the row of each loss token's
//! predicting hidden state for either layout.

use tch::{Device, Kind, Tensor};

/// How the rows of a micro-batch's ids hold its sequences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// One sequence per row, right-padded to the longest.
    Padded,
    /// One row: sequences of these lengths end to end.
    Packed(Vec<i64>),
}

impl Layout {
    /// The position of each of the `t` columns (`[t]`, int64): `0..t` when padded,
    /// restarting at 0 at each sequence when packed.
    pub fn positions(&self, t: i64, device: Device) -> Tensor {
        match self {
            Layout::Padded => Tensor::arange(t, (Kind::Int64, device)),
            Layout::Packed(lens) => {
                let mut pos = Vec::with_capacity(t.max(0) as usize);
                for &len in lens {
                    pos.extend(0..len);
                }
                Tensor::from_slice(&pos).to_device(device)
            }
        }
    }

    /// Whether the sequences are packed into one row.
    pub fn is_packed(&self) -> bool {
        matches!(self, Layout::Packed(_))
    }
}

/// A micro-batch's ids laid out, with where each sequence starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    /// The ids, row-major: `rows · columns` entries (0 in padding).
    pub ids: Vec<i64>,
    /// Rows of the ids tensor (1 when packed).
    pub rows: usize,
    /// Columns of the ids tensor (the longest sequence when padded, Σ len when packed;
    /// at least 1).
    pub columns: usize,
    /// Flat index of each sequence's first token.
    pub starts: Vec<usize>,
    /// The layout.
    pub layout: Layout,
}

impl Packing {
    /// Tokens the model computes: `rows · columns`, padding included.
    pub fn computed_tokens(&self) -> u64 {
        (self.rows * self.columns) as u64
    }
}

/// Tokens the model computes for sequences of `lens`, `packed` or padded (what
/// [`Packing::computed_tokens`] gives, without laying anything out).
pub fn computed(lens: impl Iterator<Item = usize>, packed: bool) -> u64 {
    let (mut n, mut sum, mut longest) = (0, 0, 0);
    for len in lens {
        n += 1;
        sum += len;
        longest = longest.max(len);
    }
    if packed {
        sum.max(1) as u64
    } else {
        (n.max(1) * longest.max(1)) as u64
    }
}

/// Lays out `sequences` (token ids) `packed` or padded. An empty micro-batch gives one
/// row of one padding token.
pub fn pack<'a>(
    sequences: impl ExactSizeIterator<Item = &'a [u32]> + Clone,
    packed: bool,
) -> Packing {
    let lens: Vec<usize> = sequences.clone().map(<[u32]>::len).collect();
    let (rows, columns) = if packed {
        (1, lens.iter().sum::<usize>().max(1))
    } else {
        (
            lens.len().max(1),
            lens.iter().copied().max().unwrap_or(0).max(1),
        )
    };
    let mut ids = vec![0i64; rows * columns];
    let mut starts = Vec::with_capacity(lens.len());
    let mut at = 0;
    for (i, q) in sequences.enumerate() {
        let start = if packed { at } else { i * columns };
        starts.push(start);
        for (j, id) in q.iter().enumerate() {
            ids[start + j] = i64::from(*id);
        }
        at += q.len();
    }
    let layout = if packed {
        // The padding token of an empty micro-batch is a sequence of its own.
        let lens = if at == 0 {
            vec![1]
        } else {
            lens.iter().map(|&l| l as i64).collect()
        };
        Layout::Packed(lens)
    } else {
        Layout::Padded
    };
    Packing {
        ids,
        rows,
        columns,
        starts,
        layout,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rows_hold_sequences_end_to_end() {
        let a = [5u32, 6, 7];
        let b = [8u32];
        let c = [9u32, 10];
        let seqs = [&a[..], &b[..], &c[..]];
        let p = pack(seqs.iter().copied(), true);
        assert_eq!((p.rows, p.columns), (1, 6));
        assert_eq!(p.ids, vec![5, 6, 7, 8, 9, 10]);
        assert_eq!(p.starts, vec![0, 3, 4]);
        assert_eq!(p.layout, Layout::Packed(vec![3, 1, 2]));
        assert_eq!(p.computed_tokens(), 6);
        let pos = Vec::<i64>::try_from(p.layout.positions(6, Device::Cpu)).unwrap();
        assert_eq!(pos, vec![0, 1, 2, 0, 0, 1]);

        let p = pack(seqs.iter().copied(), false);
        assert_eq!((p.rows, p.columns), (3, 3));
        assert_eq!(p.ids, vec![5, 6, 7, 8, 0, 0, 9, 10, 0]);
        assert_eq!(p.starts, vec![0, 3, 6]);
        assert_eq!(p.computed_tokens(), 9);
        assert_eq!(computed([3, 1, 2].into_iter(), false), 9);
        assert_eq!(computed([3, 1, 2].into_iter(), true), 6);
    }

    #[test]
    fn an_empty_micro_batch_is_one_padding_token() {
        let p = pack(std::iter::empty::<&[u32]>(), true);
        assert_eq!((p.rows, p.columns, p.ids.len()), (1, 1, 1));
        assert_eq!(p.layout, Layout::Packed(vec![1]));
        assert_eq!(computed(std::iter::empty(), true), 1);
        let p = pack(std::iter::empty::<&[u32]>(), false);
        assert_eq!((p.rows, p.columns, p.ids.len()), (1, 1, 1));
    }
}
