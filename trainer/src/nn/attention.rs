//! Causal self-attention over a [`Layout`]: what keeps each token inside its own
//! sequence.
//!
//! - padded rows: one `scaled_dot_product_attention` with `is_causal` over `[b, h, t, d]`;
//! - a packed row: the queries, keys and values split at the sequence boundaries
//!   (`split_with_sizes`, whose backward concatenates the gradients instead of adding a
//!   zero-filled copy per piece) and one causal SDPA per sequence, concatenated back. No
//!   score between two sequences is ever computed, so a token cannot see another
//!   sequence, and the work is `Σ len²`, not `(Σ len)²`.
//!
//! Per-sequence SDPA is the path on CPU and on CUDA. libtorch's variable-length kernels
//! (`_flash_attention_forward` with cumulative sequence lengths) are not bound by tch in
//! a form whose backward works, so on CUDA this loop launches one flash kernel per
//! sequence; a varlen bridge would replace the loop (issue 30), not the layout.

use tch::Tensor;

use super::packing::Layout;

/// Causal attention of `q`, `k`, `v` (`[b, heads, t, head_dim]`, keys and values already
/// repeated to every head) laid out as `layout`; `[b, heads, t, head_dim]`.
pub fn causal(q: &Tensor, k: &Tensor, v: &Tensor, layout: &Layout) -> Tensor {
    let sdpa = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let t = q.size()[2];
        Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, t > 1, None, false)
    };
    match layout {
        Layout::Packed(lens) if lens.len() > 1 => {
            let qs = q.split_with_sizes(lens, 2);
            let ks = k.split_with_sizes(lens, 2);
            let vs = v.split_with_sizes(lens, 2);
            let outs: Vec<Tensor> = qs
                .iter()
                .zip(&ks)
                .zip(&vs)
                .map(|((q, k), v)| sdpa(q, k, v))
                .collect();
            Tensor::cat(&outs, 2)
        }
        _ => sdpa(q, k, v),
    }
}
