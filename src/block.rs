//! One description of a transformer block: the matrix products it makes and
//! the tensors its forward keeps for the backward, per family, as the
//! families' code in [`crate::train`] runs them.
//!
//! The memory model ([`crate::memory`]) sums the kept tensors' bytes; the
//! step-time model ([`crate::speed`]) counts the products' multiply-adds and
//! the kept tensors' elements as the elementwise ops' traffic. Both read this
//! one list, so a family's block is written down once, here.
//!
//! Sizes are of one micro-batch (`n = b·s` tokens, `h` hidden, `I` MLP size,
//! `H` heads of `d`, `q = H·d`, `kv = kv_heads·d`), values in the compute
//! dtype unless marked f32.
//!
//! ```
//! use oomfix::block::Block;
//! use oomfix::strategies::{Execution, Plan};
//! use oomfix::ModelSpec;
//!
//! let spec = ModelSpec::default_model(); // GPT-2 small
//! let plan = Plan::baseline(1, 128);
//! let block = Block::describe(&spec, &plan, &Execution::for_plan(&plan, oomfix::facts::builtins()));
//! // c_attn, the attention's c_proj, c_fc and the MLP's c_proj.
//! assert_eq!(block.macs(), 128 * (4 * 768 * 768 + 2 * 768 * 3072));
//! assert!(block.kept.iter().any(|t| t.name == "probabilities"));
//! ```

use crate::spec::{Family, ModelSpec, VOCAB_ALIGN};
use oomfix_strategies::chunked_loss::chunk_rows;
use oomfix_strategies::{
    Attention, Checkpointing, Execution, Part, PartRun, Parts, Plan, SegmentInputs,
};

/// How a kept tensor's size grows with the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// One row per token: `[n, width]`.
    Tokens,
    /// One value per query, key and head: `[b, H, s, s]`.
    Scores,
    /// One value per query and head: `[b, H, s]`.
    Rows,
}

/// One tensor a block's forward keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tensor {
    /// What it is, as the family's code names it.
    pub name: &'static str,
    /// Elements in one micro-batch.
    pub elements: u64,
    /// Kept in f32 whatever the compute dtype.
    pub f32: bool,
    /// How its size grows with the sequence.
    pub extent: Extent,
    /// The part of the block that makes it.
    pub part: Part,
}

impl Tensor {
    /// Its bytes with a compute dtype of `c` bytes.
    pub fn bytes(&self, c: u64) -> u64 {
        self.elements * if self.f32 { 4 } else { c }
    }
}

/// One matrix product of a block: `rows` rows of `inputs` values times a
/// `[inputs, outputs]` weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Product {
    /// The projection's name.
    pub name: &'static str,
    /// Rows multiplied: the tokens, or the routed rows of an expert.
    pub rows: u64,
    /// Input features.
    pub inputs: u64,
    /// Output features.
    pub outputs: u64,
    /// The part of the block it belongs to.
    pub part: Part,
}

/// One block of a model under a plan: its products, what its forward
/// makes, and how each of its parts runs between forward and backward (the
/// fixes' [`Execution::parts`]).
///
/// A part that is not kept ([`PartRun::Recomputed`] or
/// [`PartRun::Tiled`]) keeps two `[n, h]` in place of its tensors: its
/// output, which the op standing for the part holds, and the op's copy of
/// it, which the residual add holds. Its tensors exist again in its
/// backward, whole or one tile's share, and its forward runs once more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The matrix products of the forward, outside attention's two.
    pub products: Vec<Product>,
    /// The tensors the forward makes, each kept for the backward unless its
    /// part is recomputed.
    pub kept: Vec<Tensor>,
    /// How each part runs. A tile of the whole micro-batch or more is no
    /// tile: such a part is kept.
    pub parts: Parts,
    /// Tokens of the micro-batch (`n`).
    pub tokens: u64,
    /// The hidden size: the width of a part's output.
    pub hidden: u64,
}

impl Block {
    /// The block of `spec` for one micro-batch of `plan`, its parts run as
    /// `exec` says. Empty for a model given as code ([`Family::Generic`]
    /// is described as GPT-2's block, which the memory model does not use).
    pub fn describe(spec: &ModelSpec, plan: &Plan, exec: &Execution) -> Block {
        describe(&Dims::new(spec, plan, exec), spec.config.family, exec.parts)
    }

    /// Whether `part` is recomputed in the backward (whole or in tiles).
    pub fn recomputes(&self, part: Part) -> bool {
        self.parts.of(part) != PartRun::Kept
    }

    /// Tokens `part`'s backward crosses at once: a tile's, else the
    /// micro-batch's.
    pub fn rows_at_once(&self, part: Part) -> u64 {
        match self.parts.of(part) {
            PartRun::Tiled(tile) => (tile as u64).min(self.tokens),
            _ => self.tokens,
        }
    }

    /// Bytes kept with a compute dtype of `c` bytes: the tensors of the
    /// kept parts, and two `[n, h]` for each recomputed one.
    pub fn kept_bytes(&self, c: u64) -> u64 {
        let kept: u64 = self
            .kept
            .iter()
            .filter(|t| !self.recomputes(t.part))
            .map(|t| t.bytes(c))
            .sum();
        let outputs = [Part::Attention, Part::Mlp]
            .into_iter()
            .filter(|&p| self.recomputes(p))
            .count() as u64;
        kept + outputs * 2 * self.tokens * self.hidden * c
    }

    /// Bytes of `part`'s tensors that its backward recomputes and holds at
    /// once: all of them, or one tile's share (0 when the part is kept).
    pub fn recomputed_bytes(&self, part: Part, c: u64) -> u64 {
        if !self.recomputes(part) {
            return 0;
        }
        let all: u64 = self
            .kept
            .iter()
            .filter(|t| t.part == part)
            .map(|t| t.bytes(c))
            .sum();
        all * self.rows_at_once(part) / self.tokens.max(1)
    }

    /// Multiply-adds of the recomputed parts' products: what the backward
    /// runs once more.
    pub fn recomputed_macs(&self) -> u64 {
        self.products
            .iter()
            .filter(|p| self.recomputes(p.part))
            .map(|p| p.rows * p.inputs * p.outputs)
            .sum()
    }

    /// Elements of the recomputed parts' tensors of one row per token (see
    /// [`token_elements`](Self::token_elements)).
    pub fn recomputed_elements(&self) -> u64 {
        self.kept
            .iter()
            .filter(|t| self.recomputes(t.part) && t.extent == Extent::Tokens)
            .map(|t| t.elements)
            .sum()
    }

    /// Multiply-adds of the forward's products.
    pub fn macs(&self) -> u64 {
        self.products
            .iter()
            .map(|p| p.rows * p.inputs * p.outputs)
            .sum()
    }

    /// Elements of the kept tensors of one row per token
    /// ([`Extent::Tokens`]): what the elementwise ops between the products
    /// write, and the backward reads.
    pub fn token_elements(&self) -> u64 {
        self.kept
            .iter()
            .filter(|t| t.extent == Extent::Tokens)
            .map(|t| t.elements)
            .sum()
    }
}

/// The sizes one micro-batch works with.
pub(crate) struct Dims {
    pub n: u64,
    pub s: u64,
    pub h: u64,
    pub i: u64,
    pub kv: u64,
    /// `H·d`: the queries' width (the hidden size unless `head_dim` says otherwise).
    pub q: u64,
    /// Llama-style: RMSNorm outputs of q and k (Qwen3).
    pub qk_norm: bool,
    /// Llama-style: fused `qkv_proj` and `gate_up_proj` (Phi-3).
    pub fused: bool,
    pub heads: u64,
    pub head_dim: u64,
    pub v: u64,
    /// The vocabulary the head's products use, padded to a multiple of
    /// [`VOCAB_ALIGN`].
    pub p: u64,
    pub flash: bool,
    /// Rows per chunk of the LM loss when it runs in chunks
    /// ([`oomfix_strategies::chunked_loss`]); `None`: the whole logits.
    pub chunk: Option<u64>,
    /// Rows of the head weight's gradient a chunked loss sums at once.
    pub weight_rows: u64,
    /// The compute dtype is 16-bit (f32 copies are real copies).
    pub half: bool,
    /// Llama-style with partial rotary: the rotated part of each head
    /// (`None`: the whole head).
    pub rotary: Option<u64>,
    /// A mixture of experts: `(experts, experts per token, one expert's
    /// MLP size)`.
    pub moe: Option<(u64, u64, u64)>,
    /// Gemma 2 / 3: their terms ([`gemma`]).
    pub gemma: Option<GemmaDims>,
    /// The stem has no graph: its embeddings are frozen (LoRA), so with the
    /// segments' inputs on the host its output goes there too.
    pub frozen_stem: bool,
}

/// What a Gemma model adds to a Llama-style one's activations.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmaDims {
    /// Attention scores soft-capped (Gemma 2).
    pub attn_cap: bool,
    /// Logits soft-capped (Gemma 2).
    pub final_cap: bool,
    /// Kinds of blocks with their own RoPE tables and mask: 2 when sliding
    /// blocks compute another attention than the full ones (a window shorter
    /// than the sequence, or a RoPE base of their own), else 1.
    pub kinds: u64,
}

impl Dims {
    pub fn new(spec: &ModelSpec, plan: &Plan, exec: &Execution) -> Dims {
        let c = &spec.config;
        Dims {
            n: (plan.micro_batch * plan.seq_len) as u64,
            s: plan.seq_len as u64,
            h: c.hidden as u64,
            i: c.intermediate as u64,
            kv: (c.kv_heads * c.head_dim()) as u64,
            q: (c.heads * c.head_dim()) as u64,
            qk_norm: c.settings.qk_norm,
            fused: c.settings.fused_projections,
            heads: c.heads as u64,
            head_dim: c.head_dim() as u64,
            v: c.vocab as u64,
            p: c.vocab.next_multiple_of(VOCAB_ALIGN) as u64,
            flash: exec.attention == Attention::Flash,
            chunk: exec.loss_chunk_bytes.map(|bytes| {
                let p = c.vocab.next_multiple_of(VOCAB_ALIGN);
                let dtype = oomfix_strategies::model::dtype_of(plan.precision);
                let n = plan.micro_batch * plan.seq_len;
                chunk_rows(bytes, p, dtype).min(n.max(1)) as u64
            }),
            weight_rows: exec.loss_chunk_bytes.map_or(0, |bytes| {
                let row = (c.hidden.max(1) as u64) * plan.precision.compute_bytes();
                (bytes / row)
                    .max(1)
                    .min(c.vocab.next_multiple_of(VOCAB_ALIGN) as u64)
            }),
            half: plan.precision.compute_bytes() < 4,
            rotary: (c.rotary_dim() != c.head_dim()).then_some(c.rotary_dim() as u64),
            moe: c.settings.moe.as_ref().map(|m| {
                (
                    m.experts as u64,
                    m.top_k as u64,
                    m.expert_intermediate as u64,
                )
            }),
            gemma: c.settings.gemma.as_ref().map(|g| {
                let sliding = g.sliding_layers.iter().any(|&x| x);
                let window = c.settings.sliding_window.is_some_and(|w| w < plan.seq_len);
                GemmaDims {
                    attn_cap: g.attn_softcap.is_some(),
                    final_cap: g.final_softcap.is_some(),
                    kinds: if sliding && (window || g.local_rope_theta.is_some()) {
                        2
                    } else {
                        1
                    },
                }
            }),
            frozen_stem: plan.lora.is_some(),
        }
    }
    /// Bytes of the checkpointed segments' inputs kept in host memory per
    /// micro-batch ([`oomfix_strategies::SegmentInputs::OnHost`]): every
    /// segment's input but the first's, and the first's too where the stem
    /// has no graph ([`frozen_stem`](Self::frozen_stem)), `[n, h]` in the
    /// compute dtype each; 0 when they stay on the device.
    pub fn offloaded_inputs(&self, layers: usize, exec: &Execution, c: u64) -> u64 {
        match exec.checkpoint {
            Checkpointing::Every(k) if k > 0 && exec.segment_inputs == SegmentInputs::OnHost => {
                let segments = layers.div_ceil(k) as u64;
                (segments - u64::from(!self.frozen_stem)) * self.n * self.h * c
            }
            _ => 0,
        }
    }
    /// `[b, H, s, s]` elements.
    pub fn scores(&self) -> u64 {
        self.n * self.heads * self.s
    }
    /// The key and value heads.
    fn kv_heads(&self) -> u64 {
        self.kv / self.head_dim.max(1)
    }
}

/// Builds a block's lists one entry at a time.
struct Builder<'a> {
    d: &'a Dims,
    block: Block,
    /// The part the entries from here on belong to.
    part: Part,
}

impl Builder<'_> {
    /// A kept `[n, width]` tensor in the compute dtype.
    fn tokens(&mut self, name: &'static str, width: u64) -> &mut Self {
        self.kept(name, self.d.n * width, false, Extent::Tokens)
    }
    /// A kept `[n, width]` tensor in f32.
    fn tokens_f32(&mut self, name: &'static str, width: u64) -> &mut Self {
        self.kept(name, self.d.n * width, true, Extent::Tokens)
    }
    /// A kept `[b, H, s, s]` tensor.
    fn scores(&mut self, name: &'static str, f32: bool) -> &mut Self {
        self.kept(name, self.d.scores(), f32, Extent::Scores)
    }
    fn kept(&mut self, name: &'static str, elements: u64, f32: bool, extent: Extent) -> &mut Self {
        self.block.kept.push(Tensor {
            name,
            elements,
            f32,
            extent,
            part: self.part,
        });
        self
    }
    /// The entries that follow are the row-wise part's (until
    /// [`end_mlp_part`](Self::end_mlp_part)).
    fn mlp_part(&mut self) -> &mut Self {
        self.part = Part::Mlp;
        self
    }
    fn end_mlp_part(&mut self) -> &mut Self {
        self.part = Part::Attention;
        self
    }
    /// A product of every token through an `[inputs, outputs]` weight.
    fn product(&mut self, name: &'static str, inputs: u64, outputs: u64) -> &mut Self {
        let rows = self.d.n;
        self.routed(name, rows, inputs, outputs)
    }
    fn routed(&mut self, name: &'static str, rows: u64, inputs: u64, outputs: u64) -> &mut Self {
        self.block.products.push(Product {
            name,
            rows,
            inputs,
            outputs,
            part: self.part,
        });
        self
    }
    /// A norm (layer or RMS) on `[n, h]`: its output only (one fused op that
    /// recomputes its row statistics in backward).
    fn norm(&mut self, name: &'static str) -> &mut Self {
        self.tokens(name, self.d.h)
    }
    /// What attention keeps between its q, k, v copies and its context:
    /// composed, the probabilities `[b,H,s,s]`; flash, the log-sum-exp
    /// `[b,H,s]` f32 (the op keeps its inputs and output, which the families
    /// count as the copies and the context).
    fn attention_core(&mut self) -> &mut Self {
        if self.d.flash {
            let rows = self.d.n * self.d.heads;
            self.kept("log-sum-exp", rows, true, Extent::Rows)
        } else {
            self.scores("probabilities", false)
        }
    }
}

fn describe(d: &Dims, family: Family, parts: Parts) -> Block {
    // A tile of every token is no tile (`tiled_rows` runs the part whole).
    let whole = |run| match run {
        PartRun::Tiled(t) if t == 0 || t as u64 >= d.n => PartRun::Kept,
        run => run,
    };
    let mut b = Builder {
        d,
        block: Block {
            products: Vec::new(),
            kept: Vec::new(),
            parts: Parts {
                attention: whole(parts.attention),
                mlp: whole(parts.mlp),
            },
            tokens: d.n,
            hidden: d.h,
        },
        part: Part::Attention,
    };
    match (family, d.gemma) {
        (Family::Llama, Some(g)) => gemma(&mut b, g),
        (Family::Llama, None) => llama(&mut b),
        (Family::Gpt2 | Family::Generic, _) => gpt2(&mut b),
        (Family::Bert, _) => bert(&mut b),
    }
    b.block
}

/// GPT-2 (`src/train/gpt2.rs`): ln_1; c_attn `[n,3h]`; q, k, v contiguous
/// copies; attention core; context; merged, c_proj, residual; ln_2; c_fc,
/// gelu `[n,I]`; c_proj, residual.
fn gpt2(b: &mut Builder) {
    let (h, i) = (b.d.h, b.d.i);
    b.product("c_attn", h, 3 * h).product("attn.c_proj", h, h);
    b.mlp_part()
        .product("c_fc", h, i)
        .product("mlp.c_proj", i, h)
        .end_mlp_part();
    b.norm("ln_1")
        .tokens("c_attn", 3 * h)
        .tokens("q", h)
        .tokens("k", h)
        .tokens("v", h)
        .attention_core()
        .tokens("context", h)
        .tokens("merged", h)
        .tokens("attn.c_proj", h)
        .tokens("attn residual", h)
        .mlp_part()
        .norm("ln_2")
        .tokens("c_fc", i)
        .tokens("gelu", i)
        .tokens("mlp.c_proj", h)
        .end_mlp_part()
        .tokens("mlp residual", h);
}

/// BERT (`src/train/bert.rs`): q, k, v; their contiguous copies; attention
/// core; context; merged, dense, residual; LayerNorm; intermediate, gelu
/// `[n,I]`; dense, residual; LayerNorm.
fn bert(b: &mut Builder) {
    let (h, i) = (b.d.h, b.d.i);
    b.product("query", h, h)
        .product("key", h, h)
        .product("value", h, h)
        .product("attention.output.dense", h, h)
        .mlp_part()
        .product("intermediate.dense", h, i)
        .product("output.dense", i, h)
        .end_mlp_part();
    b.tokens("query", h)
        .tokens("key", h)
        .tokens("value", h)
        .tokens("q", h)
        .tokens("k", h)
        .tokens("v", h)
        .attention_core()
        .tokens("context", h)
        .tokens("merged", h)
        .tokens("attention.output.dense", h)
        .tokens("attention residual", h)
        .norm("attention.output.LayerNorm")
        .mlp_part()
        .tokens("intermediate.dense", i)
        .tokens("gelu", i)
        .tokens("output.dense", h)
        .tokens("output residual", h)
        .norm("output.LayerNorm");
}

/// The projections of a Llama-style attention: q `[h,q]`, k and v `[h,kv]`
/// (one fused `qkv_proj` does the same work), o `[q,h]`.
fn attention_products(b: &mut Builder) {
    let (h, q, kv) = (b.d.h, b.d.q, b.d.kv);
    b.product("q_proj", h, q)
        .product("k_proj", h, kv)
        .product("v_proj", h, kv)
        .product("o_proj", q, h);
}

/// A Llama-style block (`src/train/llama.rs`): input RMSNorm; q `[n,q]`, k
/// and v `[n,kv]` (biases, if any, added in place); with q/k norm (Qwen3),
/// their outputs; v's copy; RoPE of q and k (fused, heads first); attention
/// core; context and merged heads `[n,q]`; o_proj, residual; RMSNorm; gate,
/// up, SwiGLU `[n,I]`; down, residual.
///
/// - Fused projections (Phi-3: one output of q, k, v; one of gate and up):
///   the contiguous copies RoPE makes of q and k, the copy splitting v's
///   heads, and SwiGLU's copies of gate and up.
/// - Partial rotary (`r` of each head's `d`): per head of q and k, the
///   rotated part's copy and its RoPE `[n,r]` each besides the joined head
///   (in place of RoPE's output); with fused projections the copy of q and k
///   before the split stands in for RoPE's copy.
/// - A mixture of experts (as transformers' eager MoE computes it), in place
///   of gate, up and SwiGLU: the router's logits `[n,E]` and their f32
///   softmax; for each of the `n·k` routed rows, its gathered input `[h]`,
///   gate, up, activation and product `[I_e]`, the expert's output and its
///   weighted copy `[h]`.
fn llama(b: &mut Builder) {
    let d = b.d;
    let (h, i, q, kv) = (d.h, d.i, d.q, d.kv);
    attention_products(b);
    b.norm("input_layernorm")
        .tokens("q_proj", q)
        .tokens("k_proj", kv)
        .tokens("v_proj", kv);
    if d.qk_norm {
        b.tokens("q_norm", q).tokens("k_norm", kv);
    }
    b.tokens("v copy", kv);
    if d.fused {
        b.tokens("q copy", q)
            .tokens("k copy", kv)
            .tokens("v split", kv);
    }
    b.tokens("q rope", q).tokens("k rope", kv);
    if let Some(r) = d.rotary {
        let heads = d.heads + d.kv_heads();
        b.tokens("rotated part", r * heads)
            .tokens("rotated part's rope", r * heads);
    }
    b.attention_core()
        .tokens("context", q)
        .tokens("merged", q)
        .tokens("o_proj", h)
        .tokens("attention residual", h)
        .mlp_part()
        .norm("post_attention_layernorm");
    match d.moe {
        None => {
            b.product("gate_proj", h, i)
                .product("up_proj", h, i)
                .product("down_proj", i, h);
            b.tokens("gate_proj", i)
                .tokens("up_proj", i)
                .tokens("swiglu", i);
            if d.fused {
                b.tokens("gate copy", i).tokens("up copy", i);
            }
        }
        Some((e, k, x)) => {
            let routed = d.n * k;
            b.product("router", h, e)
                .routed("experts' gate_proj", routed, h, x)
                .routed("experts' up_proj", routed, h, x)
                .routed("experts' down_proj", routed, x, h);
            b.tokens("router logits", e)
                .tokens_f32("router softmax", e)
                .tokens("routed inputs", k * h)
                .tokens("experts' gate, up, activation, product", 4 * k * x)
                .tokens("experts' outputs, weighted", 2 * k * h);
        }
    }
    b.tokens("down_proj", h)
        .end_mlp_part()
        .tokens("mlp residual", h);
}

/// A Gemma 2 / 3 block (`src/train/gemma.rs`'s `Block` and `attend`): four
/// norms `[n,h]`; q `[n,q]`, k, v `[n,kv]` (Gemma 3: and their norms); v's
/// copy and RoPE of q and k; the composed attention's score-sized tensors
/// (scores; with a cap, tanh and its multiple; masked; 16-bit: their f32
/// copy; shifted, exponentials, probabilities in f32; 16-bit: the
/// probabilities' copy) and its row maximum and sum `[b,H,s]` f32; context
/// and merged heads `[n,q]`; o_proj and residual, down_proj and residual
/// `[n,h]`; gate, up, GeLU and product `[n,I]`.
fn gemma(b: &mut Builder, g: GemmaDims) {
    let d = b.d;
    let (h, i, q, kv) = (d.h, d.i, d.q, d.kv);
    attention_products(b);
    b.mlp_part()
        .product("gate_proj", h, i)
        .product("up_proj", h, i)
        .product("down_proj", i, h)
        .end_mlp_part();
    b.norm("input_layernorm")
        .tokens("q_proj", q)
        .tokens("k_proj", kv)
        .tokens("v_proj", kv);
    if d.qk_norm {
        b.tokens("q_norm", q).tokens("k_norm", kv);
    }
    b.tokens("v copy", kv)
        .tokens("q rope", q)
        .tokens("k rope", kv)
        .scores("scores", false);
    if g.attn_cap {
        b.scores("capped tanh", false)
            .scores("capped scores", false);
    }
    b.scores("masked", false);
    if d.half {
        b.scores("masked f32", true);
    }
    b.scores("shifted", true)
        .scores("exponentials", true)
        .scores("probabilities f32", true);
    if d.half {
        b.scores("probabilities", false);
    }
    let rows = d.n * d.heads;
    b.kept("row maximum", rows, true, Extent::Rows)
        .kept("row sum", rows, true, Extent::Rows)
        .tokens("context", q)
        .tokens("merged", q)
        .tokens("o_proj", h)
        .norm("post_attention_layernorm")
        .tokens("attention residual", h)
        .mlp_part()
        .norm("pre_feedforward_layernorm")
        .tokens("gate_proj", i)
        .tokens("up_proj", i)
        .tokens("gelu", i)
        .tokens("gated", i)
        .tokens("down_proj", h)
        .norm("post_feedforward_layernorm")
        .end_mlp_part()
        .tokens("mlp residual", h);
}
