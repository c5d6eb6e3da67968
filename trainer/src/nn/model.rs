//! Llama / Qwen2 / Qwen3 decoder in libtorch, following transformers' code exactly:
//! rotate-half RoPE with fp32 frequencies (Llama 3 rescaling when configured), RMSNorm
//! upcast to fp32 then multiplied by the weight in the model dtype, GQA by repeating
//! key/value heads, Qwen3's per-head q/k RMSNorm before RoPE, SiLU-gated MLP.
//!
//! Parameters are plain tensors named as in the HF checkpoint
//! ([`Transformer::named_parameters`]); the optimizer and the checkpoint writer work on
//! those names. The trunk ([`Transformer::trunk`]) and the head
//! ([`Transformer::head_logprobs`]) are separate so that the update can run the head in
//! chunks and recompute layers (see `nn::train`).

use std::path::Path;

use tch::{Device, Kind, Tensor};

use super::LoadError;
use super::attention;
use super::config::TransformerConfig;
use super::packing::Layout;
use super::weights::{Checkpoint, WeightsError};

/// Gives the tensor of a name with a shape (from a checkpoint, or random).
pub type TensorSource<'a> = dyn FnMut(&str, &[i64]) -> Result<Tensor, WeightsError> + 'a;

/// A projection: the base weight (and bias), plus a LoRA adapter when one is attached.
#[derive(Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    lora: Option<Lora>,
}

/// A LoRA adapter of one projection, as PEFT defines it: `y = W x + s · B (A x)` with
/// `A` `[r, in]`, `B` `[out, r]` and `s = alpha / r` (`alpha / √r` with rsLoRA). The
/// adapter keeps its own dtype (fp32): the input is cast to it and the sum cast back to
/// the base output's dtype, as PEFT's `lora.Linear.forward` does.
#[derive(Debug)]
pub struct Lora {
    /// `lora_A.weight`, `[r, in]`.
    pub a: Tensor,
    /// `lora_B.weight`, `[out, r]`.
    pub b: Tensor,
    /// `alpha / r` (or `alpha / √r`).
    pub scaling: f64,
}

impl Linear {
    fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear {
            weight,
            bias,
            lora: None,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let y = x.linear(&self.weight, self.bias.as_ref());
        match &self.lora {
            None => y,
            Some(l) => {
                let kind = y.kind();
                let delta = x
                    .to_kind(l.a.kind())
                    .linear::<Tensor>(&l.a, None)
                    .linear::<Tensor>(&l.b, None)
                    * l.scaling;
                (delta + y).to_kind(kind)
            }
        }
    }

    /// `[out, in]`.
    fn shape(&self) -> (i64, i64) {
        let s = self.weight.size();
        (s[0], s[1])
    }
}

pub use super::options::LORA_TARGETS;

/// PEFT's name of an adapter tensor: `base_model.model.model.layers.{layer}.{module}.{leaf}.lora_{A|B}.weight`.
pub fn peft_lora_name(layer: usize, leaf: &str, which: char) -> String {
    let module = LORA_TARGETS
        .iter()
        .find(|(l, _)| *l == leaf)
        .map_or("self_attn", |(_, m)| *m);
    format!("base_model.model.model.layers.{layer}.{module}.{leaf}.lora_{which}.weight")
}

/// One decoder layer's weights.
#[derive(Debug)]
pub struct Layer {
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// Keys and values of earlier positions, per layer (`[batch, kv_heads, positions, head_dim]`).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: i64,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> i64 {
        self.len
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The RoPE tables and the layout of one input, shared by every layer run over it
/// ([`Transformer::positions`]).
#[derive(Debug)]
pub struct Positions {
    cos: Tensor,
    sin: Tensor,
    layout: Layout,
}

/// The model: configuration, device, dtype and weights.
#[derive(Debug)]
pub struct Transformer {
    /// Its configuration.
    pub config: TransformerConfig,
    device: Device,
    kind: Kind,
    embed_tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// `None` when tied to the embedding.
    lm_head: Option<Tensor>,
    inv_freq: Tensor,
}

/// `cat(-x2, x1)` over the last dimension.
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[x2.neg(), x1], -1)
}

/// transformers' RMSNorm: normalize in fp32, cast back, multiply by the weight.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let xf = x.to_kind(Kind::Float);
    let variance = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let normed = &xf * (variance + eps).rsqrt();
    weight * normed.to_kind(kind)
}

/// `[b, kv, t, d]` → `[b, kv * n_rep, t, d]`, as transformers' `repeat_kv`.
fn repeat_kv(x: &Tensor, n_rep: i64) -> Tensor {
    if n_rep == 1 {
        return x.shallow_clone();
    }
    let s = x.size();
    x.unsqueeze(2)
        .expand([s[0], s[1], n_rep, s[2], s[3]], false)
        .reshape([s[0], s[1] * n_rep, s[2], s[3]])
}

/// Inverse frequencies as transformers computes them, in fp32.
fn inv_freq(config: &TransformerConfig, device: Device) -> Tensor {
    let dim = config.head_dim;
    let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device))
        .to_kind(Kind::Float)
        / dim as f64;
    let base = Tensor::from(config.rope_theta as f32).to_device(device);
    let inv = base.pow(&exponents).reciprocal();
    match config.rope_llama3 {
        None => inv,
        Some(s) => {
            let low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
            let high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            let scaled = &inv / s.factor;
            let inv_llama = scaled.where_self(&wavelen.gt(low_freq_wavelen), &inv);
            let smooth = (wavelen.reciprocal() * s.original_max_position_embeddings
                - s.low_freq_factor)
                / (s.high_freq_factor - s.low_freq_factor);
            let smoothed =
                (smooth.ones_like() - &smooth) * &inv_llama / s.factor + &smooth * &inv_llama;
            let is_medium = wavelen
                .lt(high_freq_wavelen)
                .logical_not()
                .logical_and(&wavelen.gt(low_freq_wavelen).logical_not());
            smoothed.where_self(&is_medium, &inv_llama)
        }
    }
}

impl Layer {
    fn load(
        source: &mut TensorSource<'_>,
        c: &TransformerConfig,
        i: i64,
    ) -> Result<Self, WeightsError> {
        let mut p = |name: &str, shape: &[i64]| source(&format!("model.layers.{i}.{name}"), shape);
        let (d, h, kv, hd, f) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
        );
        let mut opt = |cond: bool, name: &str, shape: &[i64]| {
            if cond {
                p(name, shape).map(Some)
            } else {
                Ok(None)
            }
        };
        let q_bias = opt(c.qkv_bias, "self_attn.q_proj.bias", &[h * hd])?;
        let k_bias = opt(c.qkv_bias, "self_attn.k_proj.bias", &[kv * hd])?;
        let v_bias = opt(c.qkv_bias, "self_attn.v_proj.bias", &[kv * hd])?;
        let o_bias = opt(c.o_bias, "self_attn.o_proj.bias", &[d])?;
        let q_norm = opt(c.qk_norm, "self_attn.q_norm.weight", &[hd])?;
        let k_norm = opt(c.qk_norm, "self_attn.k_norm.weight", &[hd])?;
        let mut p = |name: &str, shape: &[i64]| source(&format!("model.layers.{i}.{name}"), shape);
        Ok(Layer {
            input_layernorm: p("input_layernorm.weight", &[d])?,
            post_attention_layernorm: p("post_attention_layernorm.weight", &[d])?,
            q_proj: Linear::new(p("self_attn.q_proj.weight", &[h * hd, d])?, q_bias),
            k_proj: Linear::new(p("self_attn.k_proj.weight", &[kv * hd, d])?, k_bias),
            v_proj: Linear::new(p("self_attn.v_proj.weight", &[kv * hd, d])?, v_bias),
            o_proj: Linear::new(p("self_attn.o_proj.weight", &[d, h * hd])?, o_bias),
            q_norm,
            k_norm,
            gate_proj: Linear::new(p("mlp.gate_proj.weight", &[f, d])?, None),
            up_proj: Linear::new(p("mlp.up_proj.weight", &[f, d])?, None),
            down_proj: Linear::new(p("mlp.down_proj.weight", &[d, f])?, None),
        })
    }

    fn named(&self, i: usize, out: &mut Vec<(String, Tensor)>) {
        let mut put = |name: &str, t: &Tensor| {
            out.push((format!("model.layers.{i}.{name}"), t.shallow_clone()));
        };
        put("input_layernorm.weight", &self.input_layernorm);
        put(
            "post_attention_layernorm.weight",
            &self.post_attention_layernorm,
        );
        for (name, l) in [
            ("self_attn.q_proj", &self.q_proj),
            ("self_attn.k_proj", &self.k_proj),
            ("self_attn.v_proj", &self.v_proj),
            ("self_attn.o_proj", &self.o_proj),
        ] {
            put(&format!("{name}.weight"), &l.weight);
        }
        for (name, l) in [
            ("self_attn.q_proj", &self.q_proj),
            ("self_attn.k_proj", &self.k_proj),
            ("self_attn.v_proj", &self.v_proj),
            ("self_attn.o_proj", &self.o_proj),
        ] {
            if let Some(b) = &l.bias {
                put(&format!("{name}.bias"), b);
            }
        }
        for (name, t) in [
            ("self_attn.q_norm.weight", &self.q_norm),
            ("self_attn.k_norm.weight", &self.k_norm),
        ] {
            if let Some(t) = t {
                put(name, t);
            }
        }
        put("mlp.gate_proj.weight", &self.gate_proj.weight);
        put("mlp.up_proj.weight", &self.up_proj.weight);
        put("mlp.down_proj.weight", &self.down_proj.weight);
    }

    /// The projection named by its PEFT leaf name (`q_proj`, …, `down_proj`).
    fn projection(&self, leaf: &str) -> Option<&Linear> {
        Some(match leaf {
            "q_proj" => &self.q_proj,
            "k_proj" => &self.k_proj,
            "v_proj" => &self.v_proj,
            "o_proj" => &self.o_proj,
            "gate_proj" => &self.gate_proj,
            "up_proj" => &self.up_proj,
            "down_proj" => &self.down_proj,
            _ => return None,
        })
    }

    fn projection_mut(&mut self, leaf: &str) -> Option<&mut Linear> {
        Some(match leaf {
            "q_proj" => &mut self.q_proj,
            "k_proj" => &mut self.k_proj,
            "v_proj" => &mut self.v_proj,
            "o_proj" => &mut self.o_proj,
            "gate_proj" => &mut self.gate_proj,
            "up_proj" => &mut self.up_proj,
            "down_proj" => &mut self.down_proj,
            _ => return None,
        })
    }

    /// One layer over `x` (`[b, t, d]`) at positions with the given `cos`/`sin`
    /// (`[t, head_dim]`, model dtype), its rows laid out as `layout`. With a cache
    /// (padded rows only), appends this step's keys and values and attends to everything
    /// cached.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        c: &TransformerConfig,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        layout: &Layout,
        cache: Option<&mut (Tensor, Tensor)>,
        past: i64,
    ) -> Tensor {
        let s = x.size();
        let (b, t) = (s[0], s[1]);
        let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let hn = rms_norm(x, &self.input_layernorm, c.rms_norm_eps);
        let mut q = self.q_proj.forward(&hn).view([b, t, h, hd]);
        let mut k = self.k_proj.forward(&hn).view([b, t, kv, hd]);
        let v = self
            .v_proj
            .forward(&hn)
            .view([b, t, kv, hd])
            .transpose(1, 2);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = rms_norm(&q, qn, c.rms_norm_eps);
            k = rms_norm(&k, kn, c.rms_norm_eps);
        }
        let q = q.transpose(1, 2);
        let k = k.transpose(1, 2);
        let q = &q * cos + rotate_half(&q) * sin;
        let k = &k * cos + rotate_half(&k) * sin;
        let (k, v) = match cache {
            Some(slot) => {
                let (k, v) = if past == 0 {
                    (k, v)
                } else {
                    (
                        Tensor::cat(&[&slot.0, &k], 2),
                        Tensor::cat(&[&slot.1, &v], 2),
                    )
                };
                *slot = (k.shallow_clone(), v.shallow_clone());
                (k, v)
            }
            None => (k, v),
        };
        let n_rep = h / kv;
        let k = repeat_kv(&k, n_rep);
        let v = repeat_kv(&v, n_rep);
        let attn = if past == 0 {
            attention::causal(&q, &k, &v, layout)
        } else if t == 1 {
            Tensor::scaled_dot_product_attention::<Tensor>(
                &q, &k, &v, None, 0.0, false, None, false,
            )
        } else {
            // New positions past..past+t see every cached position and the new ones up
            // to themselves.
            let total = past + t;
            let rows = Tensor::arange_start(past, total, (Kind::Int64, x.device())).unsqueeze(1);
            let cols = Tensor::arange(total, (Kind::Int64, x.device())).unsqueeze(0);
            let mask = cols.le_tensor(&rows);
            Tensor::scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, None, false)
        };
        let attn = attn.transpose(1, 2).reshape([b, t, h * hd]);
        let x = x + self.o_proj.forward(&attn);
        let hn = rms_norm(&x, &self.post_attention_layernorm, c.rms_norm_eps);
        let mlp = self
            .down_proj
            .forward(&(self.gate_proj.forward(&hn).silu() * self.up_proj.forward(&hn)));
        x + mlp
    }
}

impl Transformer {
    /// Loads `dir` (config.json + safetensors) onto `device` in `kind`.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self, LoadError> {
        let config = TransformerConfig::load(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Ok(Self::from_checkpoint(config, &ckpt, device, kind)?)
    }

    /// Builds the model from an indexed checkpoint.
    pub fn from_checkpoint(
        config: TransformerConfig,
        ckpt: &Checkpoint,
        device: Device,
        kind: Kind,
    ) -> Result<Self, WeightsError> {
        let model = Self::from_source(config, device, kind, &mut |name, shape| {
            ckpt.load(name, shape, kind, device)
        })?;
        let known: std::collections::BTreeSet<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        if let Some(extra) = ckpt
            .names()
            .find(|n| !known.contains(*n) && !n.ends_with("rotary_emb.inv_freq"))
            && !(model.config.tie_word_embeddings && *extra == *"lm_head.weight")
        {
            return Err(WeightsError::Mismatch {
                message: format!(
                    "the checkpoint has a tensor {extra} that a {} model with this config.json does not use",
                    model.config.arch.name()
                ),
            });
        }
        Ok(model)
    }

    /// Builds the model from `source(name, shape)`, which gives each tensor on `device`
    /// in `kind`.
    pub fn from_source(
        config: TransformerConfig,
        device: Device,
        kind: Kind,
        source: &mut TensorSource<'_>,
    ) -> Result<Self, WeightsError> {
        let (v, d) = (config.vocab_size, config.hidden_size);
        let embed_tokens = source("model.embed_tokens.weight", &[v, d])?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| Layer::load(source, &config, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = source("model.norm.weight", &[d])?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(source("lm_head.weight", &[v, d])?)
        };
        let inv_freq = inv_freq(&config, device);
        Ok(Transformer {
            config,
            device,
            kind,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    /// A model with random weights of `config`'s shape (normal, std 0.02; norms 1): for
    /// benchmarks, where only the shape matters.
    pub fn random(config: TransformerConfig, device: Device, kind: Kind, seed: u64) -> Self {
        tch::manual_seed(seed as i64);
        let result = Self::from_source(config, device, kind, &mut |name, shape| {
            let t = if name.ends_with("norm.weight") {
                Tensor::ones(shape, (kind, device))
            } else {
                Tensor::randn(shape, (kind, device)) * 0.02
            };
            Ok(t)
        });
        match result {
            Ok(model) => model,
            Err(_) => unreachable!("the random source never fails"),
        }
    }

    /// The device the weights are on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The weights' dtype.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Every parameter with its HF name (handles sharing the weights and their gradients).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![(
            "model.embed_tokens.weight".to_owned(),
            self.embed_tokens.shallow_clone(),
        )];
        for (i, layer) in self.layers.iter().enumerate() {
            layer.named(i, &mut out);
        }
        out.push(("model.norm.weight".into(), self.norm.shallow_clone()));
        if let Some(head) = &self.lm_head {
            out.push(("lm_head.weight".into(), head.shallow_clone()));
        }
        out
    }

    /// Turns gradient tracking on or off for the trainable parameters
    /// ([`Self::trainable_parameters`]); with an adapter attached the base weights stay
    /// frozen.
    pub fn set_requires_grad(&mut self, on: bool) {
        for (_, t) in self.trainable_parameters() {
            let _ = t.set_requires_grad(on);
        }
    }

    /// What an update trains: the adapters when LoRA is attached, else every weight.
    pub fn trainable_parameters(&self) -> Vec<(String, Tensor)> {
        if self.has_lora() {
            self.named_adapters()
        } else {
            self.named_parameters()
        }
    }

    /// Whether a LoRA adapter is attached.
    pub fn has_lora(&self) -> bool {
        self.layers.iter().any(|l| {
            LORA_TARGETS
                .iter()
                .any(|(leaf, _)| l.projection(leaf).is_some_and(|p| p.lora.is_some()))
        })
    }

    /// Attaches a LoRA adapter of rank `rank` to every projection named in `targets`
    /// (PEFT leaf names, see [`LORA_TARGETS`]) of every layer; `source(name, shape)`
    /// gives each adapter tensor by its PEFT name ([`peft_lora_name`]) in fp32.
    pub fn attach_lora(
        &mut self,
        targets: &[String],
        rank: i64,
        scaling: f64,
        source: &mut TensorSource<'_>,
    ) -> Result<(), WeightsError> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (leaf, _) in LORA_TARGETS {
                if !targets.iter().any(|t| t == leaf) {
                    continue;
                }
                let Some(proj) = layer.projection_mut(leaf) else {
                    continue;
                };
                let (out, inp) = proj.shape();
                let a = source(&peft_lora_name(i, leaf, 'A'), &[rank, inp])?;
                let b = source(&peft_lora_name(i, leaf, 'B'), &[out, rank])?;
                proj.lora = Some(Lora { a, b, scaling });
            }
        }
        Ok(())
    }

    /// Every adapter tensor with its PEFT name, in layer order.
    pub fn named_adapters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (leaf, _) in LORA_TARGETS {
                if let Some(l) = layer.projection(leaf).and_then(|p| p.lora.as_ref()) {
                    out.push((peft_lora_name(i, leaf, 'A'), l.a.shallow_clone()));
                    out.push((peft_lora_name(i, leaf, 'B'), l.b.shallow_clone()));
                }
            }
        }
        out
    }

    /// Folds every adapter into its base weight (`W + s · B A`, computed in fp32 and
    /// cast to the weight's dtype, as PEFT's `merge_and_unload`) and removes it.
    pub fn merge_lora(&mut self) {
        tch::no_grad(|| {
            for layer in &mut self.layers {
                for (leaf, _) in LORA_TARGETS {
                    let Some(proj) = layer.projection_mut(leaf) else {
                        continue;
                    };
                    if let Some(l) = proj.lora.take() {
                        let delta =
                            l.b.to_kind(Kind::Float).matmul(&l.a.to_kind(Kind::Float)) * l.scaling;
                        let merged =
                            (proj.weight.to_kind(Kind::Float) + delta).to_kind(proj.weight.kind());
                        proj.weight = merged;
                    }
                }
            }
        });
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// `cos`, `sin` for positions `start..start+len`, `[len, head_dim]` in the model dtype.
    fn rope(&self, start: i64, len: i64) -> (Tensor, Tensor) {
        self.rope_at(&Tensor::arange_start(
            start,
            start + len,
            (Kind::Int64, self.device),
        ))
    }

    /// `cos`, `sin` at each position of `positions` (`[t]`, int64), `[t, head_dim]` in
    /// the model dtype.
    fn rope_at(&self, positions: &Tensor) -> (Tensor, Tensor) {
        let pos = positions.to_kind(Kind::Float);
        let freqs = pos.unsqueeze(1).matmul(&self.inv_freq.unsqueeze(0));
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos().to_kind(self.kind), emb.sin().to_kind(self.kind))
    }

    /// The positions of an input of `t` columns laid out as `layout`, computed once for
    /// every layer that runs over it.
    pub fn positions(&self, layout: &Layout, t: i64) -> Positions {
        let (cos, sin) = match layout {
            Layout::Padded => self.rope(0, t),
            Layout::Packed(_) => self.rope_at(&layout.positions(t, self.device)),
        };
        Positions {
            cos,
            sin,
            layout: layout.clone(),
        }
    }

    /// Token embeddings of `ids` (`[b, t]`, int64 on the model's device).
    pub fn embed(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, ids, -1, false, false)
    }

    /// Runs layers `range` over `x` (`[b, t, d]`) at `positions` (made for its `t`).
    pub fn layers_forward(
        &self,
        x: &Tensor,
        positions: &Positions,
        range: std::ops::Range<usize>,
    ) -> Tensor {
        let mut x = x.shallow_clone();
        for layer in &self.layers[range] {
            x = layer.forward(
                &self.config,
                &x,
                &positions.cos,
                &positions.sin,
                &positions.layout,
                None,
                0,
            );
        }
        x
    }

    /// Every layer over `ids` (`[b, t]`), one sequence per row from position 0: the
    /// hidden states before the final norm, `[b, t, d]`.
    pub fn trunk(&self, ids: &Tensor) -> Tensor {
        self.trunk_in(ids, &Layout::Padded)
    }

    /// Every layer over `ids` (`[b, t]`) laid out as `layout`.
    pub fn trunk_in(&self, ids: &Tensor, layout: &Layout) -> Tensor {
        let positions = self.positions(layout, ids.size()[1]);
        self.layers_forward(&self.embed(ids), &positions, 0..self.layers.len())
    }

    /// Runs `ids` (`[b, t]`) through the model with a cache, returning the hidden states
    /// before the final norm.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Tensor {
        let t = ids.size()[1];
        let past = cache.len;
        let (cos, sin) = self.rope(past, t);
        if cache.layers.is_empty() {
            cache.layers = (0..self.layers.len())
                .map(|_| (Tensor::new(), Tensor::new()))
                .collect();
        }
        let mut x = self.embed(ids);
        for (layer, slot) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.forward(
                &self.config,
                &x,
                &cos,
                &sin,
                &Layout::Padded,
                Some(slot),
                past,
            );
        }
        cache.len += t;
        x
    }

    /// Logits (fp32) of hidden states `h` (`[n, d]`, before the final norm).
    pub fn logits(&self, h: &Tensor) -> Tensor {
        let hn = rms_norm(h, &self.norm, self.config.rms_norm_eps);
        let w = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        hn.linear::<Tensor>(w, None).to_kind(Kind::Float)
    }

    /// Log-probability of `targets` (`[n]`) after hidden states `h` (`[n, d]`), computed
    /// `chunk` rows at a time so that no `[n, vocab]` fp32 tensor exists; with
    /// `entropy`, also the entropy of each row's distribution.
    pub fn head_logprobs(
        &self,
        h: &Tensor,
        targets: &Tensor,
        chunk: i64,
        entropy: bool,
    ) -> (Tensor, Option<Tensor>) {
        let n = h.size()[0];
        let mut lps = Vec::new();
        let mut ents = Vec::new();
        let mut start = 0;
        while start < n {
            let len = chunk.min(n - start);
            let logits = self.logits(&h.narrow(0, start, len));
            let logp = logits.log_softmax(-1, Kind::Float);
            let tgt = targets.narrow(0, start, len).unsqueeze(1);
            lps.push(logp.gather(1, &tgt, false).squeeze_dim(1));
            if entropy {
                ents.push(-(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Float));
            }
            start += len;
        }
        if lps.is_empty() {
            let empty = Tensor::zeros([0], (Kind::Float, self.device));
            return (empty.shallow_clone(), entropy.then_some(empty));
        }
        (Tensor::cat(&lps, 0), entropy.then(|| Tensor::cat(&ents, 0)))
    }

    /// Per-token log-probabilities of one sequence: entry `t - 1` is log p(ids[t] |
    /// ids[..t]), for t = 1..len. No gradient.
    pub fn sequence_logprobs(&self, ids: &[u32], chunk: i64) -> Result<Vec<f32>, String> {
        self.check_ids(ids)?;
        if ids.len() < 2 {
            return Ok(Vec::new());
        }
        tch::no_grad(|| {
            let t: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
            let input = Tensor::from_slice(&t).to_device(self.device);
            let n = t.len() as i64;
            let h = self
                .trunk(&input.unsqueeze(0))
                .squeeze_dim(0)
                .narrow(0, 0, n - 1);
            let targets = input.narrow(0, 1, n - 1);
            let (lp, _) = self.head_logprobs(&h, &targets, chunk, false);
            Vec::<f32>::try_from(lp.to_device(Device::Cpu)).map_err(|e| e.to_string())
        })
    }

    /// Refuses ids outside the vocabulary (libtorch would abort on them).
    pub fn check_ids(&self, ids: &[u32]) -> Result<(), String> {
        match ids
            .iter()
            .find(|&&i| i64::from(i) >= self.config.vocab_size)
        {
            Some(bad) => Err(format!(
                "token id {bad} is outside the model's vocabulary of {}",
                self.config.vocab_size
            )),
            None => Ok(()),
        }
    }
}
