//! What a forward pass of the families keeps alive until backward, tensor
//! by tensor: the tables the memory model's activations follow.
//!
//! candle's graph holds every op's inputs, so every op output on the path from a
//! parameter to the loss lives until the loss and the gradient store are dropped.
//! The tables list every tensor with its own storage that one forward creates
//! (views: reshapes of contiguous tensors, transposes, narrows, broadcasts, own no
//! storage and are omitted). `b` batch, `s` sequence, `h` hidden, `H` heads, `KV`
//! key/value heads, `d` head size (`h = H·d`), `I` MLP inner size, `V` vocabulary,
//! `n = b·s`. `c` is the compute dtype (the weights' dtype), `f32` is always f32;
//! entries marked *16-bit* exist only when `c` is bf16/f16 (with f32 compute
//! the cast is a no-op), and `[n,1]` row statistics are listed together.
//!
//! Layer norm (LN, GPT-2 and BERT) and RMS norm (RMS, Llama) on `[n, h]`: the
//! output `[n,h]` c only (statistics in f32 inside the op, recomputed in
//! backward). A projection with a bias keeps only its output (the bias is
//! added in place); GELU and SwiGLU keep only their output.
//!
//! Attention probabilities
//! ([`attention_probs`](oomfix_strategies::nn::ops::attention_probs)): the
//! scores `q·kᵀ` are made into `softmax(scores·scale + mask)` in place, so the op keeps one
//! `[b,H,s,s]` tensor; the mask is applied by position (causal) or by the
//! batch's key flags, never built.
//!
//! ## GPT-2 (per block)
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `ln_1` | LN of `[n,h]` | as above |
//! | `c_attn` (matmul + bias in place) | `[n,3h]` | c |
//! | q, k, v contiguous copies | `[b,H,s,d]` ×3 | c |
//! | probabilities (scale `1/√d` and causal mask inside) | `[b,H,s,s]` | c |
//! | context `P v` | `[b,H,s,d]` | c |
//! | heads merged (copy) | `[n,h]` | c |
//! | `attn.c_proj` | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `ln_2` | LN of `[n,h]` | as above |
//! | `c_fc`, GELU | `[n,I]` ×2 | c |
//! | `mlp.c_proj` | `[n,h]` | c |
//! | residual (block output) | `[n,h]` | c |
//!
//! Stem: `wte` rows `[n,h]` c; + `wpe` rows (a narrow, no copy) `[n,h]` c.
//!
//! ## Llama (per block)
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `input_layernorm` | RMS of `[n,h]` | as above |
//! | `q_proj` (+ bias in place with `qkv_bias`) | `[n,h]` | c |
//! | `k_proj`, `v_proj` (+ bias each) | `[n,KV·d]` ×2 | c |
//! | v contiguous copy | `[b,KV,s,d]` | c |
//! | RoPE on q (attention scale folded in the tables; fused, heads moved first) | `[b,H,s,d]` | c |
//! | RoPE on k | `[b,KV,s,d]` | c |
//! | probabilities (grouped: `[b,KV,(H/KV)·s,s]`; causal mask inside) | `[b,H,s,s]` | c |
//! | context | `[b,H,s,d]` | c |
//! | heads merged (copy) | `[n,h]` | c |
//! | `o_proj` matmul | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `post_attention_layernorm` | RMS of `[n,h]` | as above |
//! | `gate_proj`, `up_proj` matmuls, SwiGLU `SiLU(gate)·up` | `[n,I]` ×3 | c |
//! | `down_proj` matmul | `[n,h]` | c |
//! | residual (block output) | `[n,h]` | c |
//!
//! With a `head_dim` that is not `h/H` the query-sized rows (`q_proj`, RoPE
//! on q, context, heads merged) are `[n,H·d]` rather than `[n,h]`. Qwen3's
//! RMSNorm over each head of q and k (`q_norm`, `k_norm`, before RoPE) adds
//! their outputs `[n,H·d]` and `[n,KV·d]` c. RoPE scaling changes only the
//! tables' values (`yarn`'s attention factor is folded into both tables).
//!
//! Partial rotary (Phi-4-mini) copies the rotated part of each head of q
//! and k `[n,H·r]`, `[n,KV·r]`, turns it (the same size again) and joins
//! it to the rest (`[n,H·d]`, `[n,KV·d]` in place of RoPE's output).
//!
//! Gemma 2 / 3 (`gemma.rs`) add to a Llama block two norms
//! (`pre_feedforward_layernorm`, `post_feedforward_layernorm`, `[n,h]`
//! each), a GeLU and its product with up in place of SwiGLU (`[n,I]` ×2),
//! Gemma 3's q/k norms, and compose attention: the scores `[b,H,s,s]` c,
//! with a cap their tanh and its multiple (c ×2), the masked scores c, with
//! 16-bit compute their f32 copy, the shifted scores, exponentials and
//! probabilities f32 ×3, with 16-bit compute the probabilities' copy c, the
//! row maximum and sum `[b,H,s]` f32. Its stem keeps the embedding rows and
//! their √hidden multiple `[n,h]` ×2 and, per kind of block (full, sliding),
//! RoPE tables and an `[s,s]` mask c; Gemma 2's head soft-caps the logits
//! (`[n,P]` ×3 more).
//!
//! Keys and values are never repeated for grouped-query attention: each group's
//! queries are multiplied with the shared key/value head directly.
//! Stem: `embed_tokens` rows `[n,h]` c. Once per forward: RoPE tables `[s,d]` ×4 f32 (cos/sin, and both scaled
//! for the queries: flash attention is then called with scale 1).
//!
//! ## BERT (per block)
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `query`, `key`, `value` (matmul + bias in place) | `[n,h]` ×3 | c |
//! | q, k, v contiguous copies | `[b,H,s,d]` ×3 | c |
//! | probabilities (scale `1/√d` and key padding inside) | `[b,H,s,s]` | c |
//! | context | `[b,H,s,d]` | c |
//! | heads merged (copy) | `[n,h]` | c |
//! | `attention.output.dense` | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `attention.output.LayerNorm` | LN of `[n,h]` | as above |
//! | `intermediate.dense`, GELU (erf) | `[n,I]` ×2 | c |
//! | `output.dense` | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `output.LayerNorm` (block output) | LN of `[n,h]` | as above |
//!
//! Stem: word rows `[n,h]` c; position rows + token-type row (`[s,h]` c, not
//! `[n,h]`); sum `[n,h]` c; embeddings LN of `[n,h]`. Once per forward, with an
//! `attention_mask`: its key flags `[b,s]` as bytes.
//!
//! ## Flash attention
//!
//! With [`Attention::Flash`] the rows from the probabilities to the context
//! (`P v`) become one op: it keeps its inputs (the q, k, v
//! copies above), its output `[b,H,s,d]` c (in place of the context) and a
//! log-sum-exp `[b,H,s]` f32 (plus, with a padding mask, one byte per key). No
//! `[b,H,s,s]` tensor exists: GPT-2 and Llama attend
//! causally, BERT passes the batch's `attention_mask` as key padding. Its
//! backward recomputes the probabilities block by block; its working set is
//! f32 copies of q, k, v, the output and its gradient, the f32 gradient of q,
//! and per query head f32 gradients of k and v.
//!
//! ## Head and loss
//!
//! | family | tensor | shape | dtype |
//! |---|---|---|---|
//! | GPT-2 | `ln_f` | LN of `[n,h]` | as above |
//! | Llama | `model.norm` | RMS of `[n,h]` | as above |
//! | BERT | `transform.dense`, GELU (erf) | `[n,h]` ×2 | c |
//! | BERT | `transform.LayerNorm` | LN of `[n,h]` | as above |
//! | all, `V` not a multiple of 64 | the output embedding padded with zero rows (BERT: and its bias) | `[P,h]` | c |
//! | all | logits (matmul with the tied embedding or `lm_head`; BERT: + `cls.predictions.bias` in place) | `[n,P]` | c |
//! | all | nll ([`loss::cross_entropy`]: one fused op, nothing `[n,V]` of its own) | `[n]` | f32 |
//! | with a `loss_mask` (always for BERT) | nll × mask | `[n]` | f32 |
//! | all | sum, mean | scalar ×2 | f32 |
//!
//! With the loss in chunks of tokens ([`Execution::loss_chunk_bytes`],
//! [`oomfix_strategies::chunked_loss`]) the logits are never kept: the loss
//! op keeps its inputs (the final norm's output, the output embedding,
//! padded or not) and makes, chunk by chunk, each chunk's logits `[r,P]` c
//! and their gradient `[r,P]` c (freed with the chunk), the hidden states'
//! gradient `[n,h]` c and, for a trained head, the weight's gradient
//! `[P,h]` c, which it hands to the backward; the per-row losses `[n]` f32
//! as above.
//!
//! `P` is `V` rounded up to a multiple of [`VOCAB_ALIGN`](crate::spec::VOCAB_ALIGN) (64): the padded
//! columns are masked out of the loss, and the products around the logits run
//! on aligned kernels. The loss's backward writes the logits' gradient `[n,P]`
//! c in one pass (it recomputes each row's log-sum-exp from the kept logits;
//! zero in the padding).
//!
//! Summed, per block (elements; the row max of each softmax included): GPT-2
//! `14·n·h + 2·n·I + 5·b·H·s² + 2·b·H·s`; Llama `13·n·h + 7·n·KV·d + 3·n·I +
//! 5·b·H·s² + 2·b·H·s`; BERT `14·n·h + 2·n·I + 4·b·H·s² + 2·b·H·s` (`+ b·H·s²`
//! with a padding mask); the once-per-forward masks and RoPE tables come on top.
//! With flash attention the `b·H·s²` and `2·b·H·s` terms are replaced by `b·H·s`
//! f32 values (the log-sum-exp).
//!
//! ## Checkpointing
//!
//! With [`Checkpointing::Every`]`(k)` the blocks' tables above exist for one segment
//! of `k` blocks at a time, during that segment's forward and again during its
//! recompute in backward. What stays from the forward is the stem (its tables
//! above) and, for `m` segments, `m` tensors `[n,h]` c: a fresh `Var` holding each
//! segment's output (the next segment's input, or the head's input for the last).
//! The head's tables live only during the head's backward, before any segment is
//! recomputed. While a segment is differentiated, the upstream gradient `[n,h]` c
//! and the surrogate's product `y·grad_y` `[n,h]` c are alive besides its tables.

#[cfg(doc)]
use oomfix_strategies::{nn::loss, Attention, Checkpointing, Execution};
