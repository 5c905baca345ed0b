//! Activation terms: what the trainer's forward keeps alive for backward, and
//! what the backward adds on top.
//!
//! candle keeps every op output on the path from a parameter to the loss until
//! the loss is dropped. The counts below follow the op-by-op tables in
//! [`crate::train`] (`n = b·s` tokens, `h` hidden, `I` MLP size, `H` heads,
//! `kv = kv_heads·head_dim`, `V` vocabulary). Values are in the compute dtype
//! `c` unless marked f32: norms and the loss run in f32, so under mixed
//! precision they add cast copies.
//!
//! The plan's [`Attention`] decides what a block's attention keeps. Composed
//! from candle ops it keeps several `[b,H,s,s]` tensors; with
//! [`Attention::Flash`] it keeps none: the op holds its inputs (the same q, k, v
//! copies the composed form makes), its output (the same size as the composed
//! context) and one f32 log-sum-exp per query row and head, and no causal mask
//! is built.

use crate::spec::{Family, ModelSpec};
use oomfix_strategies::{Attention, Checkpointing, Plan};

/// Activation bytes of one micro-batch on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Activations {
    /// Kept from the forward until the backward ends.
    pub kept: u64,
    /// Allocated by the backward on top of `kept` and the parameter gradients
    /// (its largest working set).
    pub backward_transient: u64,
}

/// Bytes as `(compute-dtype values, f32 values)` for a compute dtype of `c` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Values {
    c: u64,
    f32: u64,
}

impl Values {
    fn bytes(self, c: u64) -> u64 {
        self.c * c + self.f32 * 4
    }
    fn add(self, o: Values) -> Values {
        Values { c: self.c + o.c, f32: self.f32 + o.f32 }
    }
}

/// The sizes one micro-batch works with.
struct Dims {
    n: u64,
    s: u64,
    h: u64,
    i: u64,
    kv: u64,
    heads: u64,
    head_dim: u64,
    v: u64,
    mixed: bool,
    flash: bool,
}

impl Dims {
    fn new(spec: &ModelSpec, plan: &Plan) -> Dims {
        let c = &spec.config;
        Dims {
            n: (plan.micro_batch * plan.seq_len) as u64,
            s: plan.seq_len as u64,
            h: c.hidden as u64,
            i: c.intermediate as u64,
            kv: (c.kv_heads * c.head_dim()) as u64,
            heads: c.heads as u64,
            head_dim: c.head_dim() as u64,
            v: c.vocab as u64,
            mixed: plan.precision.is_mixed(),
            flash: plan.attention == Attention::Flash,
        }
    }
    /// `[b, H, s, s]` elements.
    fn scores(&self) -> u64 {
        self.n * self.heads * self.s
    }
    /// Layer norm on `[n, h]`: centred, squared, normalised (f32), scaled and
    /// shifted (c), six `[n,1]` f32 statistics; mixed adds the f32 input cast
    /// and the cast back.
    fn layer_norm(&self) -> Values {
        let m = u64::from(self.mixed);
        Values { c: (2 + m) * self.n * self.h, f32: (3 + m) * self.n * self.h + 6 * self.n }
    }
    /// RMS norm on `[n, h]`: squared, normalised (f32), × weight (c), four
    /// `[n,1]` f32 statistics; mixed adds the two casts.
    fn rms_norm(&self) -> Values {
        let m = u64::from(self.mixed);
        Values { c: (1 + m) * self.n * self.h, f32: (2 + m) * self.n * self.h + 4 * self.n }
    }
}

/// What one block's attention keeps between its q, k, v copies and its context
/// (or the flash op's output), both counted in [`block`].
///
/// Composed: the scores, the masked scores (BERT: no mask), the softmax's three
/// tensors and its row maximum and sum, and the stray gradients of the
/// broadcast mask and of the broadcast row maximum (BERT: the maximum only).
/// Flash: the log-sum-exp `[b,H,s]` f32.
fn attention_core(family: Family, d: &Dims) -> Values {
    if d.flash {
        return Values { c: 0, f32: d.n * d.heads };
    }
    let masked = u64::from(family != Family::Bert);
    Values { c: (4 + masked) * d.scores() + 2 * d.n * d.heads + (1 + masked) * d.scores(), f32: 0 }
}

/// What one transformer block keeps.
fn block(family: Family, qkv_bias: bool, d: &Dims) -> Values {
    let (n, h, i, kv) = (d.n, d.h, d.i, d.kv);
    let core = attention_core(family, d);
    match family {
        // ln_1; c_attn matmul + bias [n,3h]×2; q scaled (or contiguous), k, v
        // copies; attention core; context; merged, c_proj, bias, residual;
        // ln_2; c_fc, bias, gelu [n,I]×3; c_proj, bias, residual.
        Family::Gpt2 | Family::Generic => Values { c: 17 * n * h + 3 * n * i, f32: 0 }
            .add(core)
            .add(d.layer_norm())
            .add(d.layer_norm()),
        // rms; q [n,h]; k, v [n,kv]×2; v copy; RoPE q ×4, k ×4; attention
        // core; context; merged, o_proj, residual; rms; gate, up, silu, product
        // [n,I]×4; down, residual; the stray gradients of the four broadcast
        // RoPE tables (q and k, cos and sin).
        Family::Llama => {
            let bias = if qkv_bias { n * h + 2 * n * kv } else { 0 };
            let rope_stray = 2 * n * h + 2 * n * kv;
            Values { c: 11 * n * h + 7 * n * kv + 4 * n * i + bias + rope_stray, f32: 0 }
                .add(core)
                .add(d.rms_norm())
                .add(d.rms_norm())
        }
        // q/k/v matmul + bias ×6; q scaled (or contiguous), k, v copies;
        // attention core; context; merged, dense, bias, residual; LN;
        // intermediate, bias, gelu ×3; dense, bias, residual; LN.
        Family::Bert => Values { c: 17 * n * h + 3 * n * i, f32: 0 }
            .add(core)
            .add(d.layer_norm())
            .add(d.layer_norm()),
    }
}

/// The embedding stem, plus what one forward builds once and every block holds
/// (the composed attention's causal mask, RoPE tables).
fn stem(family: Family, d: &Dims) -> Values {
    let mask = if d.flash { 0 } else { d.s * d.s };
    match family {
        Family::Gpt2 | Family::Generic => Values { c: 2 * d.n * d.h + mask, f32: 0 },
        Family::Llama => Values { c: d.n * d.h + mask + 4 * d.s * d.head_dim, f32: 0 },
        Family::Bert => Values { c: 2 * d.n * d.h + d.s * d.h, f32: 0 }.add(d.layer_norm()),
    }
}

/// The head and the loss: final norm (BERT: the MLM transform), logits in the
/// compute dtype (BERT: + prediction bias), and the fused cross-entropy's `[n]`
/// f32 row losses and their masked/averaged copies (the op keeps nothing
/// logits-sized of its own).
fn head(family: Family, d: &Dims) -> Values {
    let nv = d.n * d.v;
    let norm = match family {
        Family::Gpt2 | Family::Generic => d.layer_norm(),
        Family::Llama => d.rms_norm(),
        Family::Bert => Values { c: 3 * d.n * d.h, f32: d.n }.add(d.layer_norm()),
    };
    let logits = if family == Family::Bert { 2 * nv } else { nv };
    norm.add(Values { c: logits, f32: 2 * d.n })
}

/// Logits-sized tensors in the compute dtype alive at once while the backward
/// crosses the loss, on top of the logits the head keeps: the fused
/// cross-entropy's gradient of the logits, the zeros candle's backward adds a
/// tensor's first gradient to, and their sum (measured on the CPU with a
/// 50,257-token head: 4.07 logits-sized tensors at the peak, the kept logits included).
pub const LOSS_BACKWARD_NV: u64 = 3;

/// Token-embedding-sized tensors the backward of the embedding lookup allocates
/// at its end, when every other gradient already exists: the zeros it scatters
/// into and the scattered result (or, for a tied embedding, the sum with the
/// head's gradient).
pub const EMBEDDING_BACKWARD_COPIES: u64 = 2;

/// Score-sized tensors alive at once while the backward crosses one composed
/// attention (the softmax's quotient rule and exp terms; measured: 8 on top of
/// what the block keeps).
pub const ATTENTION_BACKWARD_SCORES: u64 = 8;

/// Bytes alive at once while the backward crosses one flash attention, on top
/// of what the block keeps: the op's f32 copies of q, o and the output's
/// gradient `[n,h]` ×3 and of k, v `[n,kv]` ×2, and its f32 gradients of q and,
/// per query head, of k and v `[n,h]` ×3.
fn flash_backward(d: &Dims) -> u64 {
    4 * (6 * d.n * d.h + 2 * d.n * d.kv)
}

/// `[n, I]`-sized tensors alive at once while the backward crosses one MLP:
/// candle's GELU (tanh form, GPT-2), SiLU-gated (Llama) and GELU (erf form,
/// BERT) derivatives, measured on top of what the block keeps.
pub fn mlp_backward_ni(family: Family) -> u64 {
    match family {
        Family::Gpt2 | Family::Generic => 20,
        Family::Llama => 14,
        Family::Bert => 17,
    }
}

/// Activation bytes of one micro-batch under `plan`'s checkpointing.
///
/// Without checkpointing everything is kept until the backward ends, and the
/// backward's largest extra working set is at the loss or in a block. With
/// segments of `k` blocks, the forward keeps the stem and one `[n,h]` tensor
/// per segment; the backward first holds the head, then one recomputed segment
/// at a time.
pub fn activation_bytes(spec: &ModelSpec, plan: &Plan) -> Activations {
    let cfg = &spec.config;
    if cfg.family == Family::Generic || cfg.layers == 0 {
        return Activations::default();
    }
    let c = plan.precision.compute_bytes();
    let d = Dims::new(spec, plan);
    let layers = cfg.layers as u64;
    let stem = stem(cfg.family, &d).bytes(c);
    let block = block(cfg.family, cfg.qkv_bias, &d).bytes(c);
    let head = head(cfg.family, &d).bytes(c);
    let head_backward = LOSS_BACKWARD_NV * d.n * d.v * c;
    let attention_backward =
        if d.flash { flash_backward(&d) } else { ATTENTION_BACKWARD_SCORES * d.scores() * c };
    let block_backward = attention_backward.max(mlp_backward_ni(cfg.family) * d.n * d.i * c);
    let embedding_backward = EMBEDDING_BACKWARD_COPIES * d.v * d.h * c;
    match plan.checkpoint {
        Checkpointing::Every(k) if k > 0 => {
            let k = (k as u64).min(layers);
            let segments = layers.div_ceil(k);
            Activations {
                kept: stem + segments * d.n * d.h * c,
                backward_transient: (head + head_backward).max(k * block + block_backward).max(embedding_backward),
            }
        }
        _ => Activations {
            kept: stem + layers * block + head,
            backward_transient: head_backward.max(block_backward).max(embedding_backward),
        },
    }
}
