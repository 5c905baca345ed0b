//! Activation terms: what the trainer's forward keeps alive for backward, and
//! what the backward adds on top.
//!
//! candle keeps every op output on the path from a parameter to the loss until
//! the loss is dropped. The counts below follow the op-by-op tables in
//! [`crate::train`] (`n = b·s` tokens, `h` hidden, `I` MLP size, `H` heads,
//! `kv = kv_heads·head_dim`, `V` vocabulary, `P` the vocabulary padded to a
//! multiple of [`VOCAB_ALIGN`]). Values are in the compute dtype `c` unless
//! marked f32: the fused norms compute in f32 inside the op and keep only
//! their output in `c`; the loss's per-row values are f32.
//!
//! The backward does not hold all of this at once with all gradients. It
//! crosses three moments that can each hold the step's peak (see
//! [`Activations`]): the loss and the head first, when no parameter gradient
//! exists yet; then the blocks, last to first, each adding its gradients; then
//! the embedding lookup, when every other gradient exists.
//!
//! The plan's [`Attention`] decides what a block's attention keeps. Composed,
//! it keeps the probabilities, one `[b,H,s,s]` tensor
//! ([`oomfix_strategies::nn::ops::attention_probs`]); with [`Attention::Flash`] it
//! keeps none: the op holds its inputs (the same q, k, v copies the composed
//! form makes), its output (the same size as the composed context) and one
//! f32 log-sum-exp per query row and head. Neither builds a mask.

use crate::block::{Block, Dims};
use crate::spec::{Family, ModelSpec};
use oomfix_strategies::nn::ops::PROBS_BACKWARD_CHUNKS;
use oomfix_strategies::{Checkpointing, Execution, Part, Plan, Precision};

/// Activation bytes of one micro-batch on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Activations {
    /// Kept from the forward: alive at the end of the forward (with
    /// checkpointing, the stem and the segment outputs).
    pub kept: u64,
    /// The backward through the loss and the head, before any parameter
    /// gradient exists.
    pub loss: Moment,
    /// The backward through a block, at the first block (the last one the
    /// backward reaches): every gradient but the embedding lookup's exists.
    pub blocks: Moment,
    /// The backward of the embedding lookup, at its end: every gradient exists.
    pub embedding: Moment,
    /// With checkpointing, the checkpointed segment inputs still alive while
    /// the backward recomputes the last segment (the first it reaches), on
    /// top of [`Activations::blocks`]: every segment's input but the first's
    /// (the stem's output, which `blocks` counts). By the first block's
    /// backward they are gone, but there most gradients exist; under LoRA
    /// or at long sequences this earlier moment is the larger.
    pub later_segment_inputs: u64,
    /// Segment inputs kept in host memory instead
    /// ([`oomfix_strategies::offload_activations`]).
    pub host: u64,
}

/// What the backward holds at one moment, besides weights, optimizer state
/// and parameter gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Moment {
    /// Forward tensors still alive.
    pub activations: u64,
    /// The backward's working tensors at that moment.
    pub transient: u64,
}

impl Moment {
    /// Both together.
    pub fn total(&self) -> u64 {
        self.activations + self.transient
    }
}

impl Activations {
    /// The largest working set of the backward's three moments.
    pub fn backward_transient(&self) -> u64 {
        self.loss
            .transient
            .max(self.blocks.transient)
            .max(self.embedding.transient)
    }
}

/// The backward of the linked candle-core, which decides the backward's
/// working sets (`vendor/README.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backward {
    /// A tensor's first gradient stored as it is: the workspace's patched
    /// candle-core, which the other terms of this module were fitted on.
    FirstGradientAsIs,
    /// Every first gradient added to a tensor of zeros: candle-core 0.11 as
    /// released, which a crate depending on oomfix links. Two more
    /// gradient-sized tensors (the zeros and the sum) at each edge while the
    /// backward crosses it: the `STOCK_*` terms.
    ZerosPlusGradient,
}

impl Backward {
    /// The linked candle-core's
    /// ([`oomfix_strategies::model::first_gradient_stored_as_is`], probed
    /// once per process).
    pub fn linked() -> Backward {
        if oomfix_strategies::model::first_gradient_stored_as_is() {
            Backward::FirstGradientAsIs
        } else {
            Backward::ZerosPlusGradient
        }
    }
}

// The stock backward's terms (`Backward::ZerosPlusGradient`) were fitted on
// the CPU accuracy matrix run against candle-core 0.11.1 as released:
// `cargo run --manifest-path tests/stock-candle/Cargo.toml --example accuracy
// -- --models gpt2-small,llama-small,bert-small,gpt2-tiny,llama-tiny,bert-tiny`
// (the workspace's `examples/accuracy.rs`, built outside its `[patch]`),
// with `--explain` for where the peaks are; `--cache FILE` and then
// `--cache-only` re-estimate without measuring again. On its 180
// configurations the patched terms gave median |error| 1.5%, max 36.1% (52
// above 8%: stock peaks are higher, most at attention over long
// sequences); these give median 0.5%, max 4.6%. Each replaces the patched
// backward's count of the same name.

/// Stock: logits-sized tensors alive at once while the backward crosses the
/// loss: the fused cross-entropy's gradient of the logits, the zeros and
/// their sum. Fitted: the loss-moment peaks of fp32 gpt2-tiny, llama-tiny
/// and bert-tiny with flash attention at 4 × 128.
pub const STOCK_LOSS_BACKWARD_NV: u64 = 3;

/// Stock: output-embedding-sized tensors alive at once while the backward
/// makes the LM head's weight gradient: the product's `[h,V]`, then the
/// transpose's step holding it beside zeros and their sum `[V,h]`. Counted
/// from candle's backward, not fitted separately.
pub const STOCK_HEAD_WEIGHT_BACKWARD_COPIES: u64 = 3;

/// Stock: score-sized (`[b,H,s,s]`) tensors alive at once while the backward
/// crosses one composed attention, in place of the patched backward's `dP`
/// and one group of `dS`: `dP`, its zeros and its sum, then the sum beside
/// `P·v`'s second product and the probabilities op's `dS`. Fitted: fp32
/// gpt2-tiny, llama-tiny and bert-tiny at 4 × 128 and 1 × 256 (3.6–4.0
/// scores above the patched peaks, which hold `dP` and a quarter of `dS`).
pub const STOCK_ATTENTION_BACKWARD_SCORES: u64 = 5;

/// Stock: `[n,h]` tensors in the compute dtype alive while the backward
/// crosses one flash attention, on top of the op's own working set: the
/// zeros and sums of its q, k, v gradients and of the output's. Fitted: fp32
/// gpt2-tiny and llama-tiny with flash attention and checkpointing at
/// 4 × 128 and 1 × 256 (7–9 `[n,h]` above the patched peaks).
pub const STOCK_FLASH_BACKWARD_NH: u64 = 8;

/// Stock: `[n,I]` tensors the backward adds while crossing one MLP, to
/// [`mlp_backward_ni`]: the zeros and the sum of the activation's input
/// gradient. Fitted: fp32 gpt2-small-ish at 4 × 128, the one row of the
/// matrix where the MLP's backward is the peak (3.7% under with 2; 4 puts
/// the flash-attention rows of the tiny models 9–12% over).
pub const STOCK_MLP_BACKWARD_NI: u64 = 2;

/// Stock: token-embedding-sized tensors alive at the end of an untied
/// embedding lookup's backward besides every parameter gradient: the
/// scattered gradient's zeros and sum (a tied one adds to the head's
/// gradient either way). Counted from candle's backward, not fitted
/// separately.
pub const STOCK_UNTIED_EMBEDDING_COPIES: u64 = 2;

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
        Values {
            c: self.c + o.c,
            f32: self.f32 + o.f32,
        }
    }
}

/// A norm (layer or RMS) on `[n, h]`: its output only.
fn norm(d: &Dims) -> Values {
    Values {
        c: d.n * d.h,
        f32: 0,
    }
}

/// The embedding stem, plus what one forward builds once and every block holds
/// (Llama's RoPE tables).
fn stem(family: Family, d: &Dims) -> Values {
    match family {
        Family::Gpt2 | Family::Generic => Values {
            c: 2 * d.n * d.h,
            f32: 0,
        },
        // Gemma: the embedding and its √hidden multiple; per kind of block,
        // RoPE tables and the `[s,s]` mask.
        Family::Llama if d.gemma.is_some() => {
            let kinds = d.gemma.map_or(1, |g| g.kinds);
            Values {
                c: 2 * d.n * d.h + kinds * d.s * d.s,
                f32: kinds * 4 * d.s * d.head_dim,
            }
        }
        Family::Llama => Values {
            c: d.n * d.h,
            f32: 4 * d.s * d.head_dim,
        },
        Family::Bert => Values {
            c: 2 * d.n * d.h + d.s * d.h,
            f32: 0,
        }
        .add(norm(d)),
    }
}

/// The head and the loss: final norm (BERT: the MLM transform's dense, GELU
/// and norm), the output embedding padded to `[P, h]` (when the vocabulary is
/// not a multiple of [`VOCAB_ALIGN`]; BERT: and its bias), the padded logits
/// `[n, P]` in the compute dtype (BERT: with the prediction bias added in
/// place), and the fused cross-entropy's `[n]` f32 row losses and their
/// masked/averaged copies (the op keeps nothing logits-sized of its own).
/// In chunks of tokens ([`oomfix_strategies::chunked_loss`]) no logits are
/// kept: each chunk's exist only while the loss is computed
/// ([`chunked_loss_transient`]).
fn head(family: Family, d: &Dims) -> Values {
    let norm = match family {
        Family::Gpt2 | Family::Generic | Family::Llama => norm(d),
        Family::Bert => Values {
            c: 2 * d.n * d.h,
            f32: d.n,
        }
        .add(norm(d)),
    };
    let padded = if d.p == d.v { 0 } else { d.p * (d.h + 1) };
    let logits = if d.chunk.is_some() { 0 } else { d.n * d.p };
    // Gemma 2's soft-cap: the logits over the cap, their tanh and its multiple
    // (a model with a capped head has no chunked loss).
    let capped = if d.gemma.is_some_and(|g| g.final_cap) {
        3 * d.n * d.p
    } else {
        0
    };
    norm.add(Values {
        c: logits + padded + capped,
        f32: 2 * d.n,
    })
}

/// Bytes alive at once while a chunked loss
/// ([`oomfix_strategies::chunked_loss::linear_cross_entropy`]) computes a
/// chunk of `r` rows, on top of what the head keeps: the hidden states'
/// gradient `[n,h]` it fills and, when the head's weight is trained, the
/// weight's gradient `[P,h]` it sums into; then the chunk's logits and
/// their gradient `[r,P]`, or, once the logits are freed, the gradient with
/// one block of the weight's gradient (`B` rows: the gradient's `[r,B]`
/// columns copied when `B < P`, their product `[B,h]` and its sum with the
/// block `[B,h]`),
/// and for a bias (BERT) the gradient's f32 copy `[r,P]` it sums over rows.
/// With the backward of candle-core as released, handing the two gradients
/// over adds each to zeros: three of each alive at once.
fn chunked_loss_transient(
    d: &Dims,
    r: u64,
    trained_head: bool,
    bias: bool,
    c: u64,
    stock: bool,
) -> u64 {
    let (n, h, p, b) = (d.n, d.h, d.p, d.weight_rows);
    let held = n * h + if trained_head { p * h } else { 0 };
    // A block narrower than the whole gradient is copied out of it first.
    let copied = if b < p { r * b } else { 0 };
    let blocks = if trained_head { copied + 2 * b * h } else { 0 };
    let bias_f32 = if bias && c != 4 { 4 * r * p } else { 0 };
    let chunk = ((2 * r * p).max(r * p + blocks) * c).max(r * p * c + bias_f32);
    let handover = if stock { 3 * held * c } else { 0 };
    (held * c + chunk).max(handover)
}

/// Logits-sized tensors alive at once while the backward crosses Gemma 2's
/// soft-cap of the logits, besides the logits and the cap's outputs the
/// head keeps: the gradients of the capped logits and of their tanh, the
/// tanh's square and its difference from 1, their product, and the
/// gradients of the division and of the logits it sums into. Measured: 7
/// logits-sized tensors with the cross-entropy's gradient at the loss's
/// backward of the Gemma 2 shape of `tests/accuracy.rs` at 8 × 128 tokens
/// in fp32 (4 counted here made it −6.9%; 6 puts it at +0.1%).
pub const SOFTCAP_BACKWARD_NV: u64 = 6;

/// Bytes alive at once while the backward crosses one Gemma attention
/// (composed from candle ops), on top of what the block keeps: score-sized
/// gradients `[b,H,s,s]` (`P·v`'s `dP`, its f32 copy, the softmax's
/// division, exponential and subtraction backward in f32, the mask's and,
/// with a cap, the tanh's; [`GEMMA_ATTENTION_BACKWARD_BYTES_PER_SCORE`] bytes
/// per score at once), and the gradients of the block's output, the merged
/// heads and q `[n,H·d]` ×2 and of k and v `[n,kv]` ×2.
fn gemma_attention_backward(d: &Dims, c: u64) -> u64 {
    GEMMA_ATTENTION_BACKWARD_BYTES_PER_SCORE * d.scores()
        + (d.n * d.h + 2 * d.n * d.q + 2 * d.n * d.kv) * c
}

/// Bytes per score element alive at once in a Gemma attention's backward
/// (`gemma_attention_backward`), fp32 and bf16 alike. Fitted on the CPU
/// on the Gemma 2 and 3 shapes of `tests/accuracy.rs` at 2 × 256 tokens
/// (4 blocks, and the same with 2 blocks to separate what each block adds,
/// 2026-12-06): 4.4 f32 scores in fp32, 5.2 f32-sized in bf16 beside the
/// strays (`gemma_stray_gradients`); 19 bytes (4.75 f32) sits between.
pub const GEMMA_ATTENTION_BACKWARD_BYTES_PER_SCORE: u64 = 19;

/// Stray gradients one Gemma attention's backward leaves in candle's
/// gradient store until the backward ends: candle stores a gradient for an
/// operand off the graph too, here the broadcast mask (score-sized, in the
/// compute dtype) and the detached row maximum's broadcast (score-sized,
/// f32). Measured: 2 f32 scores more per block in fp32, 1.5 in bf16.
fn gemma_stray_gradients(d: &Dims, c: u64) -> u64 {
    d.scores() * (c + 4)
}

/// Logits-sized tensors in the compute dtype alive at once while the backward
/// crosses the loss, on top of the logits the head keeps: the fused
/// cross-entropy's gradient of the logits, stored as it is (the vendored
/// candle-core stores a first gradient without adding it to zeros).
pub const LOSS_BACKWARD_NV: u64 = 1;

/// `[n,h]` tensors alive while a checkpointed segment is differentiated,
/// besides the segment's own: the upstream gradient `grad_y`, which the
/// segment's output takes as its gradient as it is
/// ([`oomfix_strategies::checkpoint`]'s seed), and what the blocks' backward
/// holds beside the gradient it passes on. Fitted: the CPU accuracy matrix's
/// checkpointed rows (llama-tiled and gpt2-tiled at 1 × 1024, the 8-block
/// LoRA Llama at 1 × 2048); the surrogate `(y·grad_y).sum()` the seed
/// replaced held 6 (its product, ones and `grad_y`'s stray gradient), and
/// those rows' peaks fell by 2–3 `[n,h]` without it.
pub const SEGMENT_BACKWARD_NH: u64 = 3;

/// Output-embedding-sized (`[V,h]`) tensors alive at once while the backward
/// makes the LM head's weight gradient, in the compute dtype.
///
/// candle differentiates `x · Wᵀ` in two steps: the matrix product's makes
/// `xᵀ·grad` `[h,V]` and stores it; the transpose's step holds it while it
/// stores a contiguous copy of its transpose, `[V,h]`.
pub const HEAD_WEIGHT_BACKWARD_COPIES: u64 = 2;

/// Token-embedding-sized tensors alive at the end of a tied embedding
/// lookup's backward besides every parameter gradient.
///
/// The lookup's backward ([`oomfix_strategies::nn::ops::embedding`]) makes the
/// scattered gradient `[V,h]`; an untied table takes it as its gradient (no
/// extra), a tied one's gradient store adds it to the output head's: the
/// head's gradient and the scattered one are alive beside the sum.
pub const EMBEDDING_BACKWARD_COPIES: u64 = 2;

/// `EMBEDDING_BACKWARD_COPIES` for a tied embedding; for an untied one none
/// (patched) or `STOCK_UNTIED_EMBEDDING_COPIES` (stock).
pub fn embedding_backward_copies(spec: &ModelSpec, backward: Backward) -> u64 {
    let tied = match spec.config.family {
        Family::Gpt2 | Family::Bert => true,
        Family::Llama => spec.config.tied_embeddings,
        Family::Generic => false,
    };
    match (tied, backward) {
        (true, _) => EMBEDDING_BACKWARD_COPIES,
        (false, Backward::FirstGradientAsIs) => 0,
        (false, Backward::ZerosPlusGradient) => STOCK_UNTIED_EMBEDDING_COPIES,
    }
}

/// The part of the scores whose `dS` the composed attention's backward holds
/// at once: the `b·KV` key heads go in
/// [`PROBS_BACKWARD_CHUNKS`](oomfix_strategies::nn::ops::PROBS_BACKWARD_CHUNKS)
/// groups; the first (largest) group's share of `[b,H,s,s]`.
fn scores_chunk(d: &Dims) -> u64 {
    let heads = ((d.n / d.s.max(1)) * (d.kv / d.head_dim.max(1))).max(1);
    d.scores() / heads * heads.div_ceil(PROBS_BACKWARD_CHUNKS as u64)
}

/// Bytes alive at once while the backward crosses one composed attention, on
/// top of what the block keeps: the probabilities' gradient `dP` (from
/// `P·v`'s backward, score-sized) and one group's `dS` ([`scores_chunk`]);
/// beside them gradients of the block's output `[n,h]`, of the merged heads and of q
/// `[n,H·d]` ×2, and of k and v `[n,kv]` ×2 (on the CPU, a tiny GPT-2's
/// attention backward holds 2 scores and 6–7 `[n,h]`; 3 + 2 fits the whole
/// CPU accuracy matrix best, checkpointed segments' surrogate terms
/// overlapping the rest; the groups' `dq` and `dk` are among those, and are
/// joined once the last group's `dS` is gone).
fn composed_backward(d: &Dims) -> u64 {
    d.scores() + scores_chunk(d) + d.n * d.h + 2 * d.n * d.q + 2 * d.n * d.kv
}

/// Bytes alive at once while the backward crosses one flash attention, on top
/// of what the block keeps: the op's f32 copies of q, o and the output's
/// gradient `[n,H·d]` ×3 and of k, v `[n,kv]` ×2, and its f32 gradients of q and,
/// per query head, of k and v `[n,H·d]` ×3.
fn flash_backward(d: &Dims) -> u64 {
    4 * (6 * d.n * d.q + 2 * d.n * d.kv)
}

/// [`flash_backward`]'s bytes for `plan` on `spec`: at short sequences this
/// f32 working set is larger than the probabilities flash attention saves.
#[cfg(test)]
pub(crate) fn flash_backward_bytes(spec: &ModelSpec, plan: &Plan) -> u64 {
    flash_backward(&Dims::new(spec, plan, &super::builtin_execution(plan)))
}

/// `[n, I]`-sized tensors alive at once while the backward crosses one MLP,
/// on top of what the block keeps. GELU (GPT-2, BERT): the activation's
/// upstream gradient and the fused op's input gradient. SwiGLU (Llama): the
/// upstream gradient and the stacked gate and up gradients (two).
pub fn mlp_backward_ni(family: Family) -> u64 {
    match family {
        Family::Gpt2 | Family::Generic | Family::Bert => 2,
        Family::Llama => 3,
    }
}

/// `[n,I]` tensors a fused `gate_up_proj`'s MLP (Phi-3) adds to
/// [`mlp_backward_ni`] while its backward crosses the split: candle's
/// backward of each of the two slices pads its `[n,I]` gradient with zeros
/// into an `[n,2I]` tensor, and the two are summed into the projection's
/// output gradient. Measured: Phi-3's shape of `tests/accuracy.rs` (4
/// blocks of 256, MLP 688) at 8 × 128 tokens in fp32 holds 4 `[n,2I]` and 2
/// `[n,I]` at the MLP's backward where the unfused Llama of that shape holds
/// 3 `[n,I]`. Fitted: 5 puts that shape's plans at 2 × 64, 8 × 128 and
/// 1 × 256 tokens (fp32 and bf16, checkpointed or not) within −0.5% and
/// +2.6% (it was −5.3% at 8 × 128 without it; the 7 counted over-estimates
/// the checkpointed plans by 6.9%, the recomputation's tensors being freed
/// before the split's).
pub const FUSED_MLP_BACKWARD_NI: u64 = 5;

/// Raises the loss's and the blocks' working sets to what candle's CPU backend
/// needs to multiply bf16 matrices: it has no bf16 kernel, so it widens both
/// operands' storages to f32, multiplies into an f32 output and narrows that
/// back. At the loss the largest product is the head's weight gradient
/// `xᵀ·grad` (`[n,h]`, `[n,V]` → `[h,V]`; under LoRA, whose head is
/// frozen, the input gradient `[n,h]`), made while the logits' gradient
/// `[n,V]` (bf16) is alive (BERT's decoder, one fused op, makes both of its
/// products in one step: two f32 copies of the gradient are alive at once);
/// in a block it is an MLP projection's weight gradient (`[n,h]`, `[n,I]`,
/// `[h,I]`), beside the `[n,I]` input gradient, with one more f32 `[n,I]`:
/// the matrix kernel's packed copy of the transposed `[n,I]` operand.
pub fn widen_cpu_bf16_matmuls(
    act: &mut Activations,
    spec: &ModelSpec,
    plan: &Plan,
    exec: &Execution,
) {
    let c = &spec.config;
    if plan.precision != Precision::Bf16 || c.family == Family::Generic {
        return;
    }
    let d = Dims::new(spec, plan, exec);
    let (nh, nv, vh, ni, hi) = (d.n * d.h, d.n * d.p, d.p * d.h, d.n * d.i, d.h * d.i);
    let widened_grads = if c.family == Family::Bert { 2 } else { 1 };
    // A frozen head (LoRA) makes no weight gradient: its largest product is
    // the input gradient `grad·W` (`[n,V]`, `[V,h]` → `[n,h]`), narrowed to
    // a bf16 `[n,h]`.
    let product = if plan.lora.is_some() { nh } else { vh };
    let loss = match d.chunk {
        None => 2 * nv + 4 * (widened_grads * nv + nh + vh) + 2 * product,
        // In chunks: the hidden states' gradient and (trained head) the
        // weight's, beside the largest product's widened operands, the
        // weight `[P,h]` and a chunk's logits or their gradient `[r,P]`,
        // its f32 output and the chunk's bf16 logits or gradient.
        Some(r) => {
            let held = nh + if plan.lora.is_none() { vh } else { 0 };
            2 * held + 2 * r * d.p + 4 * (r * d.p + vh + r * d.h)
        }
    };
    let mut block = 2 * ni + 4 * (nh + 2 * ni + hi) + 2 * hi;
    if !d.flash {
        // The attention core's backward: `P·v`'s backward makes `dP` as an
        // f32 product beside its bf16 copy (no `dS` yet); then each group's
        // `dS` gets an f32 copy for its products.
        let chunk = scores_chunk(&d);
        let backward = composed_backward(&d);
        block = block
            .max(2 * (backward - chunk) + 4 * d.scores())
            .max(2 * backward + 4 * chunk);
    }
    act.loss.transient = act.loss.transient.max(loss);
    act.blocks.transient = act.blocks.transient.max(block);
}

/// Register-tile rows and columns of gemm's f32 kernel on x86-64 (AVX2/FMA:
/// three vectors of 8 by 4 columns), the tile [`cpu_matmul_workspace`]'s
/// panel sizes are computed for.
const GEMM_TILE: (usize, usize) = (24, 4);

/// Bytes of the packed operand panel the CPU matrix kernel (gemm, which
/// candle-core calls) allocates while making a `[rows, cols]` product over
/// `k`, in values of `value_bytes`. candle asks gemm for the transposed
/// product, so the panel holds `kc × nc` values of the operand `rows` comes
/// from (when `cols` spans more than two register tiles): `kc` at most `k`
/// (512 for longer sums), `nc` at most `rows` and
/// bounded by the L3 cache this machine reports (gemm's own
/// `kernel_params`, from the same cache sizes). The head's weight gradient
/// `dyᵀ·x` over the tokens has `rows` = the vocabulary: 10 MB at 8 × 128
/// tokens of a 5,000-word head, up to the L3 cache's size for a larger one,
/// so the term depends on the machine.
pub fn cpu_matmul_workspace(rows: u64, cols: u64, k: u64, value_bytes: u64) -> u64 {
    let (rows, cols, k) = (rows as usize, cols as usize, k as usize);
    let (mr, nr) = GEMM_TILE;
    // gemm packs the panel only for more than two register tiles of `cols`.
    if rows == 0 || k == 0 || cols <= 2 * mr {
        return 0;
    }
    let p = gemm_common::cache::kernel_params(cols, rows, k, mr, nr, value_bytes as usize);
    (p.kc * p.nc.min(rows.next_multiple_of(nr))) as u64 * value_bytes
}

/// The CPU's terms of the head's backward while the whole logits' gradient
/// is alive, in fp32 or fp16 (bf16's widened products are counted by
/// [`widen_cpu_bf16_matmuls`], fitted on measured peaks that hold them):
///
/// - the matrix kernel's packing panel ([`cpu_matmul_workspace`]) of the
///   head's largest product: the weight gradient over the `n` tokens
///   (BERT's `[P,h]`, large; the others' `[h,P]`, one row panel of `h`), or
///   under LoRA, whose head is frozen, the input gradient `dy·W` (`[n,h]`
///   over the `P` words);
/// - BERT's decoder with its bias is one op
///   ([`oomfix_strategies::nn::ops::linear`]) whose backward makes the
///   `[P,h]` weight gradient once, where the loss's working set counts
///   `HEAD_WEIGHT_BACKWARD_COPIES` (a product and its transpose) for
///   every family: one fewer on the CPU with `backward`'s
///   [`Backward::FirstGradientAsIs`] (measured on all-MiniLM-L6-v2; the
///   CUDA rows of BERT, 0.5–4.1% under with both, keep them).
///
/// The loss in chunks makes small products and is left as it is.
pub fn add_cpu_head_backward(
    act: &mut Activations,
    spec: &ModelSpec,
    plan: &Plan,
    exec: &Execution,
    backward: Backward,
) {
    let c = &spec.config;
    if c.family == Family::Generic || c.layers == 0 || plan.precision == Precision::Bf16 {
        return;
    }
    let d = Dims::new(spec, plan, exec);
    if d.chunk.is_some() {
        return;
    }
    let value_bytes = plan.precision.compute_bytes();
    let panel = if plan.lora.is_some() {
        cpu_matmul_workspace(d.n, d.h, d.p, value_bytes)
    } else if c.family == Family::Bert {
        // The decoder with its bias is one op that makes `dyᵀ·x`, `[P,h]`.
        cpu_matmul_workspace(d.p, d.h, d.n, value_bytes)
    } else {
        // `x·Wᵀ`'s backward makes `xᵀ·dy`, `[h,P]`, then its transpose.
        cpu_matmul_workspace(d.h, d.p, d.n, value_bytes)
    };
    let made_once = if c.family == Family::Bert
        && plan.lora.is_none()
        && backward == Backward::FirstGradientAsIs
    {
        d.p * d.h * value_bytes
    } else {
        0
    };
    act.loss.transient = (act.loss.transient + panel).saturating_sub(made_once);
}

/// What a LoRA adapter's backward adds while it crosses a projection:
/// `x·Aᵀ` recomputed and its gradient, `[n, r]` each. The adapted projection
/// is one op (the frozen product and the adapter's) that keeps only its
/// input and output, as a plain projection does, so a LoRA block keeps what
/// a fully trained one keeps.
fn adapters_backward(d: &Dims, plan: &Plan, c: u64) -> u64 {
    plan.lora
        .map_or(0, |lora| 2 * d.n * u64::from(lora.rank) * c)
}

/// Activation bytes of one micro-batch under `plan`'s checkpointing, at each
/// moment of the backward.
///
/// Without checkpointing the forward's tensors stay until the backward ends.
/// At the loss, the backward adds its working set (the logits' gradient, then
/// the head's weight gradient). At the first block, the working set is the
/// larger of its MLP's backward and its attention core's; at the embedding,
/// the lookup's.
///
/// With segments of `k` blocks, the forward keeps the stem and one `[n,h]`
/// tensor per segment. The loss's moment holds those and the head's tensors
/// (the segment outputs are all still there). At the first segment's
/// recompute only the stem remains of them; the segment's `k` blocks' tensors
/// are alive with the upstream gradient `grad_y` and what the backward holds
/// beside it (`SEGMENT_BACKWARD_NH`, 3), and the
/// stem's backward runs inside that same recomputed graph.
///
/// The backward's working sets are those of the linked candle-core
/// ([`Backward::linked`]; [`activation_bytes_for`] takes one).
///
/// What the pass recomputes and how it computes attention are `exec`'s (the
/// fixes' execution hooks made it from the plan: [`Execution::for_plan`]);
/// the micro-batch, sequence length and compute dtype are the plan's.
pub fn activation_bytes(spec: &ModelSpec, plan: &Plan, exec: &Execution) -> Activations {
    activation_bytes_for(spec, plan, exec, Backward::linked())
}

/// [`activation_bytes`] with the working sets of `backward`.
pub fn activation_bytes_for(
    spec: &ModelSpec,
    plan: &Plan,
    exec: &Execution,
    backward: Backward,
) -> Activations {
    let stock = backward == Backward::ZerosPlusGradient;
    let cfg = &spec.config;
    if cfg.family == Family::Generic || cfg.layers == 0 {
        return Activations::default();
    }
    let c = plan.precision.compute_bytes();
    let d = Dims::new(spec, plan, exec);
    let layers = cfg.layers as u64;
    let stem = stem(cfg.family, &d).bytes(c);
    let described = Block::describe(spec, plan, exec);
    let block = described.kept_bytes(c);
    let head = head(cfg.family, &d).bytes(c);
    // The loss's working set, then the head's weight gradient (with the
    // logits' gradient it is made from).
    let (loss_nv, mut head_copies) = if stock {
        (STOCK_LOSS_BACKWARD_NV, STOCK_HEAD_WEIGHT_BACKWARD_COPIES)
    } else {
        (LOSS_BACKWARD_NV, HEAD_WEIGHT_BACKWARD_COPIES)
    };
    // Under LoRA the head and the embedding are frozen: no weight gradient
    // of the head, no backward of the lookup.
    if plan.lora.is_some() {
        head_copies = 0;
    }
    let cap_nv = if d.gemma.is_some_and(|g| g.final_cap) {
        SOFTCAP_BACKWARD_NV
    } else {
        0
    };
    let loss_transient = match d.chunk {
        None => ((loss_nv + cap_nv) * d.n * d.p).max(d.n * d.p + head_copies * d.p * d.h) * c,
        Some(r) => chunked_loss_transient(
            &d,
            r,
            plan.lora.is_none(),
            cfg.family == Family::Bert,
            c,
            stock,
        ),
    };
    let attention_backward = match (d.flash, stock) {
        (false, _) if d.gemma.is_some() => gemma_attention_backward(&d, c),
        (true, false) => flash_backward(&d),
        (true, true) => flash_backward(&d) + STOCK_FLASH_BACKWARD_NH * d.n * d.h * c,
        (false, false) => composed_backward(&d) * c,
        (false, true) => {
            let beside = composed_backward(&d) - d.scores() - scores_chunk(&d);
            (STOCK_ATTENTION_BACKWARD_SCORES * d.scores() + beside) * c
        }
    };
    let mlp_ni = mlp_backward_ni(cfg.family)
        + if stock { STOCK_MLP_BACKWARD_NI } else { 0 }
        + if d.fused { FUSED_MLP_BACKWARD_NI } else { 0 };
    // The backward crosses a block's MLP, then its attention core.
    // A mixture of experts' backward crosses one expert at a time: its
    // share of the routed rows, n·k/E with balanced routing.
    let mlp_rows = d.moe.map_or(d.n, |(e, k, _)| (d.n * k).div_ceil(e.max(1)));
    // A recomputed part's backward holds its tensors made again (a tiled
    // one's, one tile's share), and the MLP's backward crosses the rows the
    // part runs at once.
    let rows = mlp_rows * described.rows_at_once(Part::Mlp) / d.n.max(1);
    let mlp_backward = mlp_ni * rows.max(1) * d.i * c + described.recomputed_bytes(Part::Mlp, c);
    let attention_backward = attention_backward + described.recomputed_bytes(Part::Attention, c);
    let block_transient = attention_backward.max(mlp_backward) + adapters_backward(&d, plan, c);
    let embedding_transient = match plan.lora {
        Some(_) => 0,
        None => embedding_backward_copies(spec, backward) * d.v * d.h * c,
    };
    // Gemma's strays, one set per block the backward has crossed.
    let stray = if d.gemma.is_some() && !d.flash {
        gemma_stray_gradients(&d, c)
    } else {
        0
    };
    match exec.checkpoint {
        Checkpointing::Every(k) if k > 0 => {
            let k = (k as u64).min(layers);
            let segment_outputs = layers.div_ceil(k) * d.n * d.h * c;
            let surrogate = SEGMENT_BACKWARD_NH * d.n * d.h * c;
            let recomputed = stem + k * block + surrogate;
            // Offloaded, the device keeps the last segment's output (the
            // head's input) and, while a later segment is recomputed, its
            // input brought back; else every later segment's input. Under
            // LoRA the stem has no graph and waits on the host too, so a
            // later segment's recompute holds one input, as the first's does.
            let input = d.n * d.h * c;
            let host = d.offloaded_inputs(cfg.layers, exec, c);
            let stem_on_host = if host > 0 && d.frozen_stem { input } else { 0 };
            let segment_outputs = segment_outputs - (host - stem_on_host);
            let stem_kept = stem - stem_on_host;
            Activations {
                later_segment_inputs: match (host, stem_on_host) {
                    (0, _) => segment_outputs - input,
                    (_, 0) => input,
                    _ => 0,
                },
                host,
                kept: stem_kept + segment_outputs,
                loss: Moment {
                    activations: stem_kept + segment_outputs + head,
                    transient: loss_transient,
                },
                blocks: Moment {
                    activations: recomputed,
                    transient: block_transient + k * stray,
                },
                embedding: Moment {
                    activations: recomputed,
                    transient: embedding_transient + k * stray,
                },
            }
        }
        _ => {
            let kept = stem + layers * block + head;
            Activations {
                later_segment_inputs: 0,
                host: 0,
                kept,
                loss: Moment {
                    activations: kept,
                    transient: loss_transient,
                },
                blocks: Moment {
                    activations: kept,
                    transient: block_transient + layers * stray,
                },
                embedding: Moment {
                    activations: kept,
                    transient: embedding_transient + layers * stray,
                },
            }
        }
    }
}
