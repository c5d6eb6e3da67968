//! Choosing the next token from one row of logits: greedy, or temperature and top-p
//! sampling driven by a small seeded PRNG, so that a seed gives the same tokens on every
//! run and every device (the logits permitting). Also the log-probability of a token
//! under the unmodified distribution (temperature 1, no top-p), which is what the server
//! reports, as vLLM does by default.
//!
//! Pure and infallible: NaN logits count as minus infinity.

/// Below this temperature sampling is greedy (as vLLM).
const GREEDY_BELOW: f64 = 1e-5;

/// SplitMix64: tiny, fast, and good enough for sampling.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The seed of the `n`-th request that brought none, from the server's seed.
pub fn derived_seed(server_seed: u64, n: u64) -> u64 {
    let mut rng = Rng::new(server_seed ^ n.wrapping_mul(0xD1B5_4A32_D192_ED03));
    rng.next_u64()
}

fn finite(x: f32) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else {
        f64::from(x)
    }
}

/// The index of the largest logit (the first one on ties), or `None` when every logit
/// is minus infinity or NaN.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, &x) in logits.iter().enumerate() {
        let x = finite(x);
        if x > f64::NEG_INFINITY && best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i)
}

/// Picks a token: greedy when `temperature` is (nearly) 0, else a draw from
/// softmax(logits / temperature) restricted to the smallest set of most likely tokens
/// whose probability reaches `top_p`. `None` when no token has a finite logit.
pub fn sample(logits: &[f32], temperature: f64, top_p: f64, rng: &mut Rng) -> Option<usize> {
    let best = argmax(logits)?;
    if temperature < GREEDY_BELOW {
        return Some(best);
    }
    let max = f64::from(logits[best]);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&x| ((finite(x) - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let u = rng.next_f64();
    if top_p >= 1.0 {
        let target = u * total;
        let mut acc = 0.0;
        for (i, w) in weights.iter().enumerate() {
            acc += w;
            if acc > target && *w > 0.0 {
                return Some(i);
            }
        }
        // Rounding left the target just above the sum: the last token with weight.
        return weights.iter().rposition(|w| *w > 0.0).or(Some(best));
    }
    let mut order: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0.0).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    let mut kept = 0.0;
    let mut cut = order.len();
    for (n, &i) in order.iter().enumerate() {
        kept += weights[i];
        if kept >= top_p * total {
            cut = n + 1;
            break;
        }
    }
    let nucleus = &order[..cut];
    let mass: f64 = nucleus.iter().map(|&i| weights[i]).sum();
    let target = u * mass;
    let mut acc = 0.0;
    for &i in nucleus {
        acc += weights[i];
        if acc > target {
            return Some(i);
        }
    }
    nucleus.last().copied()
}

/// log softmax(logits)[index], in f64.
pub fn logprob(logits: &[f32], index: usize) -> f64 {
    let max = logits
        .iter()
        .map(|&x| finite(x))
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let sum: f64 = logits.iter().map(|&x| (finite(x) - max).exp()).sum();
    finite(logits[index]) - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), Some(1));
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), None);
        let mut rng = Rng::new(0);
        assert_eq!(sample(&[0.0, 5.0, 1.0], 0.0, 1.0, &mut rng), Some(1));
    }

    #[test]
    fn sampling_is_deterministic_per_seed_and_follows_the_distribution() {
        let logits = [0.0f32, (2.0f32).ln(), f32::NEG_INFINITY, f32::NAN];
        let draw = |seed: u64| {
            let mut rng = Rng::new(seed);
            (0..3000)
                .map(|_| sample(&logits, 1.0, 1.0, &mut rng).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let d = draw(7);
        assert!(d.iter().all(|&i| i < 2), "never a -inf or NaN token");
        let ones = d.iter().filter(|&&i| i == 1).count() as f64 / d.len() as f64;
        assert!((ones - 2.0 / 3.0).abs() < 0.05, "{ones}");
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // Probabilities 0.5, 0.3, 0.2: top_p 0.5 keeps only the first, 0.6 the first two.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut rng = Rng::new(1);
        for _ in 0..200 {
            assert_eq!(sample(&logits, 1.0, 0.5, &mut rng), Some(0));
            assert!(sample(&logits, 1.0, 0.6, &mut rng).unwrap() < 2);
        }
    }

    #[test]
    fn logprob_is_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = [1.0f64, 2.0, 3.0].iter().map(|x| x.exp()).sum();
        assert!((logprob(&logits, 2) - (3.0 - z.ln())).abs() < 1e-12);
        assert_eq!(logprob(&[f32::NEG_INFINITY, 0.0], 0), f64::NEG_INFINITY);
    }

    #[test]
    fn derived_seeds_differ() {
        assert_ne!(derived_seed(0, 0), derived_seed(0, 1));
        assert_ne!(derived_seed(0, 0), derived_seed(1, 0));
        assert_eq!(derived_seed(3, 4), derived_seed(3, 4));
    }
}
