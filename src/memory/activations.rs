//! Activation terms: what the trainer's forward keeps alive for backward.
//!
//! candle keeps every op output on the path from a parameter to the loss until
//! the loss is dropped, so the terms below count op outputs of the trainable
//! models in [`crate::train`], one by one, in units of values:
//!
//! * `bsh`  — a `[b, s, hidden]` tensor,
//! * `bsi`  — a `[b, s, intermediate]` tensor,
//! * `bss`  — a `[b, heads, s, s]` attention matrix,
//! * `bsv`  — a `[b, s, vocab]` logits-sized tensor.
//!
//! Values are in the compute dtype except where noted (the loss runs in fp32).

use crate::spec::{Family, ModelSpec};
use oomfix_strategies::Plan;

/// Activation bytes of one step on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Activations {
    /// Kept from the forward until backward ends.
    pub kept: u64,
    /// Allocated by the backward on top of `kept` (the largest working set).
    pub backward_transient: u64,
}

/// Op outputs one transformer block keeps, in units of `[b,s,h]`, `[b,s,i]`,
/// `[b,s,kv]` (kv = kv_heads × head_dim) and `[b,heads,s,s]` tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockTerms {
    /// Outputs the size of the hidden state.
    pub bsh: u64,
    /// Outputs the size of the MLP's inner activation.
    pub bsi: u64,
    /// Outputs the size of the key/value projections.
    pub bskv: u64,
    /// Attention score-sized outputs (scores, scaled, masked, softmax steps).
    pub bss: u64,
}

/// GPT-2 block: ln_1 (5: centred, squared, normalised, scaled, shifted), c_attn
/// (2: matmul, bias), q/k/v head split (3 contiguous copies), k transposed (1),
/// attention output + merge (2), c_proj (2), residual (1), ln_2 (5), c_fc (2 bsi),
/// gelu (1 bsi), mlp c_proj (2), residual (1); scores: matmul, scale, mask,
/// max-shift, exp, normalise (6 bss).
pub const GPT2_BLOCK: BlockTerms = BlockTerms { bsh: 3 + 2 * 3 + 3 + 1 + 2 + 2 + 1 + 5 + 2 + 1 + 2, bsi: 3, bskv: 0, bss: 6 };

/// Llama block: input RMSNorm (3: squared, normalised, scaled), q proj (1), k/v
/// proj (2 bskv), RoPE on q (4) and k (4 bskv), head split copies (q 1, k/v 2 bskv),
/// GQA repeat (k/v to full heads: 2 when kv_heads < heads), attention output +
/// merge (2), o_proj (1), residual (1), post RMSNorm (3), gate/up (2 bsi), silu (2
/// bsi: sigmoid and product), gate*up (1 bsi), down (1), residual (1); scores: 6 bss.
pub const LLAMA_BLOCK: BlockTerms = BlockTerms { bsh: 3 + 1 + 4 + 1 + 2 + 1 + 1 + 3 + 1 + 1, bsi: 5, bskv: 2 + 4 + 2, bss: 6 };

/// BERT block (post-LN): q/k/v (2 each: matmul, bias), head split (3), output
/// merge (2), dense (2), residual (1), LayerNorm (5), intermediate (2 bsi), gelu
/// (1 bsi), output dense (2), residual (1), LayerNorm (5); scores: matmul, scale,
/// padding mask, max-shift, exp, normalise (6 bss).
pub const BERT_BLOCK: BlockTerms = BlockTerms { bsh: 6 + 3 + 2 + 2 + 1 + 5 + 2 + 1 + 5, bsi: 3, bskv: 0, bss: 6 };

/// Outputs of the loss per logits element, in fp32: the fp32 logits (a copy
/// under mixed precision), the max-shifted logits, their exp, and the log-softmax.
pub const LOSS_BSV_F32: u64 = 3;

/// fp32 `[b,s,v]` tensors alive at once when the backward goes through the loss
/// (the gradient of the log-softmax, of the shift, and of the logits).
pub const LOSS_BACKWARD_BSV_F32: u64 = 3;

/// Block-sized gradients alive at once while the backward crosses one block
/// (the incoming gradient, the one being formed, and one op temporary).
pub const BLOCK_BACKWARD_BSH: u64 = 3;

fn block_terms(family: Family) -> BlockTerms {
    match family {
        Family::Gpt2 => GPT2_BLOCK,
        Family::Llama => LLAMA_BLOCK,
        Family::Bert => BERT_BLOCK,
        // Unknown architectures: assume a GPT-2-like block.
        Family::Generic => GPT2_BLOCK,
    }
}

/// Values one block keeps for a micro-batch.
pub fn block_values(spec: &ModelSpec, plan: &Plan) -> u64 {
    let c = &spec.config;
    let (b, s) = (plan.micro_batch as u64, plan.seq_len as u64);
    let t = block_terms(c.family);
    let kv = (c.kv_heads * c.head_dim()) as u64;
    b * s * (t.bsh * c.hidden as u64 + t.bsi * c.intermediate as u64 + t.bskv * kv)
        + t.bss * b * c.heads as u64 * s * s
}

/// Values the embedding stem keeps: token lookup, position lookup and sum
/// (GPT-2, BERT: +token type and the embedding LayerNorm), Llama: the lookup.
pub fn stem_values(spec: &ModelSpec, plan: &Plan) -> u64 {
    let bsh = (plan.micro_batch * plan.seq_len * spec.config.hidden) as u64;
    match spec.config.family {
        Family::Gpt2 | Family::Generic => 3 * bsh,
        Family::Llama => bsh,
        Family::Bert => 9 * bsh,
    }
}

/// Head and loss: final norm (GPT-2 5, Llama 3, BERT MLM transform 8 bsh) and the
/// logits in the compute dtype, plus [`LOSS_BSV_F32`] fp32 logits-sized tensors.
/// Returns `(compute-dtype values, fp32 values)`.
pub fn head_values(spec: &ModelSpec, plan: &Plan) -> (u64, u64) {
    let c = &spec.config;
    let bs = (plan.micro_batch * plan.seq_len) as u64;
    let norm = match c.family {
        Family::Gpt2 | Family::Generic => 5,
        Family::Llama => 3,
        Family::Bert => 8,
    };
    let bsv = bs * c.vocab as u64;
    (norm * bs * c.hidden as u64 + bsv, LOSS_BSV_F32 * bsv)
}

/// Activation bytes for `plan`, following its checkpointing policy.
///
/// Without checkpointing everything is kept; the backward's largest working
/// set is at the loss. With checkpointing in segments of `k` blocks, only the
/// segment inputs (one `[b,s,h]` each) are kept across the step; the backward
/// then holds either the head (first) or one recomputed segment at a time.
pub fn activation_bytes(spec: &ModelSpec, plan: &Plan) -> Activations {
    let c = &spec.config;
    if c.family == Family::Generic || c.layers == 0 {
        return Activations::default();
    }
    let cb = plan.precision.compute_bytes();
    let bsh = (plan.micro_batch * plan.seq_len * c.hidden) as u64;
    let bsv = (plan.micro_batch * plan.seq_len * c.vocab) as u64;
    let stem = stem_values(spec, plan) * cb;
    let block = block_values(spec, plan) * cb;
    let (head_c, head_f32) = head_values(spec, plan);
    let head = head_c * cb + head_f32 * 4;
    let head_backward = LOSS_BACKWARD_BSV_F32 * bsv * 4;
    let block_backward = BLOCK_BACKWARD_BSH * bsh * cb;
    let layers = c.layers as u64;
    match plan.checkpoint {
        oomfix_strategies::Checkpointing::None => Activations {
            kept: stem + layers * block + head,
            backward_transient: head_backward.max(block_backward),
        },
        oomfix_strategies::Checkpointing::Every(k) => {
            let k = (k.max(1) as u64).min(layers);
            let segments = layers.div_ceil(k);
            Activations {
                kept: stem + segments * bsh * cb,
                backward_transient: (head + head_backward).max(k * block + block_backward),
            }
        }
    }
}
