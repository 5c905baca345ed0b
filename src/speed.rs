//! The step-time model: `(ModelSpec, Plan, Target) -> StepTime`.
//!
//! A plan's optimizer step is counted as work ([`StepWork`]) — matrix-product
//! FLOPs of the forward, the backward and the recomputation, attention's
//! FLOPs (composed or flash), the bytes elementwise ops move, the optimizer
//! step's bytes (fused, unfused or on the host with the copies over the
//! bus), the collectives' bytes per ZeRO stage, the micro-batches' fixed
//! costs — and divided by a target's throughputs ([`Throughput`]), whose
//! values were fitted to measured steps (each constant names the run).
//!
//! The model ranks plans: the search returns the fitting plan with the
//! lowest modelled time per optimizer step, the global batch being the same
//! for all of them. Its error against measured steps is in docs/sweep.md.

use crate::block::{Block, Dims};
use crate::spec::{Family, ModelSpec, VOCAB_ALIGN};
use crate::target::Target;
use oomfix_strategies::lora::BasePrecision;
use oomfix_strategies::{
    Attention, Checkpointing, Execution, ModelFacts, Part, Plan, Precision, Strategy,
};
use serde::Serialize;
use std::sync::Arc;

/// The work of one optimizer step of a plan on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct StepWork {
    /// Matrix-product FLOPs (forward, backward and recomputation) outside attention.
    pub matmul_flops: f64,
    /// Attention's FLOPs (scores and their product with the values), forward,
    /// backward and recomputation.
    pub attention_flops: f64,
    /// Bytes read and written by elementwise ops (norms, activations, the
    /// loss, copies), forward, backward and recomputation.
    pub elementwise_bytes: f64,
    /// Bytes a loss computed in chunks of tokens moves besides the unchunked
    /// pass's work: the output embedding read again by each chunk's
    /// products, its gradient summed chunk by chunk (0 unchunked).
    pub loss_chunk_bytes: f64,
    /// Bytes the composed attention's probabilities (`b·H·s²` per block)
    /// move through their softmax and its backward; 0 with flash attention
    /// and for Gemma (whose scores count in [`Self::unfused_bytes`]).
    pub probabilities_bytes: f64,
    /// Bytes moved through score- and logits-sized tensors by what is
    /// composed from candle ops one op at a time, counted op by op:
    /// Gemma's attention between its two products, Gemma 2's logit
    /// soft-cap; 0 for the other families.
    pub unfused_bytes: f64,
    /// Bytes the optimizer step moves on the device (fused: each state tensor
    /// read and written once; `candle_nn::AdamW`: its elementwise ops'
    /// full-size outputs), plus the accumulation of gradients between
    /// micro-batches.
    pub optimizer_bytes: f64,
    /// Bytes over the host bus (gradients down and weights up, offloaded).
    pub host_bus_bytes: f64,
    /// Parameters the host's AdamW steps (offloaded).
    pub host_parameters: f64,
    /// Bytes each rank's collectives move ([`collective_bytes`]).
    pub collective_bytes: f64,
    /// Forward and backward passes of a micro-batch (fixed costs: graph
    /// building, kernel launches).
    pub micro_batches: f64,
    /// Whether matrix products run in 16 bits.
    pub half: bool,
}

/// A target's throughputs: what the step-time model divides [`StepWork`] by.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Throughput {
    /// fp32 matrix-product FLOP/s.
    pub matmul_f32: f64,
    /// 16-bit matrix-product FLOP/s (the CPU widens to f32 and back).
    pub matmul_half: f64,
    /// Attention FLOP/s.
    pub attention: f64,
    /// Elementwise bytes per second.
    pub elementwise: f64,
    /// Bytes per second of the composed attention's probabilities.
    pub probabilities: f64,
    /// Bytes per second of [`StepWork::unfused_bytes`].
    pub unfused: f64,
    /// Bytes per second of a chunked loss's extra weight traffic
    /// ([`StepWork::loss_chunk_bytes`]): not fitted to chunked steps, but
    /// the rate of the target's other streaming work over whole tensors.
    pub loss_chunks: f64,
    /// Optimizer-step bytes per second.
    pub optimizer: f64,
    /// Host bus bytes per second.
    pub host_bus: f64,
    /// Parameters per second the host's AdamW steps.
    pub host_adamw: f64,
    /// Collective bytes per second per rank.
    pub collective: f64,
    /// Seconds of fixed cost per micro-batch.
    pub micro_batch_seconds: f64,
}

impl Throughput {
    /// The calibrated throughputs of `target`.
    ///
    /// Both fitted by non-negative least squares (`scripts/fit-speed.py`) to
    /// measured whole steps: the CPU's to the sweep of docs/sweep.md (every
    /// configuration of GPT-2 and Llama shapes on 2 cores), CUDA's to the
    /// H200's steps of docs/speed-cuda-rows.csv. The fitted rates are
    /// effective ones: a term's rate absorbs what the others leave out (the
    /// H200's elementwise rate comes out at 683 GB/s, below the 1634 GB/s an
    /// elementwise op alone reaches).
    pub fn of(target: &Target) -> Throughput {
        match target {
            Target::Cpu => CPU,
            Target::Cuda(_) => CUDA_H200,
        }
    }

    /// Seconds of `work`, term by term.
    pub fn seconds(&self, work: &StepWork) -> StepTime {
        let matmul_rate = if work.half {
            self.matmul_half
        } else {
            self.matmul_f32
        };
        let compute = work.matmul_flops / matmul_rate
            + work.attention_flops / self.attention
            + work.elementwise_bytes / self.elementwise
            + work.probabilities_bytes / self.probabilities
            + work.unfused_bytes / self.unfused
            + work.loss_chunk_bytes / self.loss_chunks
            + work.micro_batches * self.micro_batch_seconds;
        let optimizer =
            work.optimizer_bytes / self.optimizer + work.host_parameters / self.host_adamw;
        let transfers = work.host_bus_bytes / self.host_bus;
        let collectives = work.collective_bytes / self.collective;
        StepTime {
            compute,
            optimizer,
            transfers,
            collectives,
            total: compute + optimizer + transfers + collectives,
        }
    }
}

/// Fitted by `scripts/fit-speed.py --fix optimizer=2.083e10` to the sweep of
/// docs/sweep.md run on the idle build machine on 2026-12-05 (128
/// configurations of GPT-2 and Llama shapes, the shortest of five steps
/// each, 2 cores): relative error of the fit median 13.7%, max 38.2%.
/// Attention's and the elementwise kernels' own terms got no weight (their
/// cost is inside the others). Left free, the optimizer's term got none
/// either (fused AdamW measured 0.97× candle's at the median, within the
/// noise of single pairs), so it is held at the rate an earlier fit gave it:
/// the model still ranks fused AdamW, which moves fewer bytes, ahead. The
/// host rates are nominal: the CPU's host is its device. The collective
/// rate is Open MPI's between 2 ranks on the same 2 cores, fitted (least
/// squares through the origin) to the time rank 0 spent in collectives in
/// the six runs of `scripts/zero-stages.sh` (GPT-2 small, fp32, 4
/// micro-batches a rank, stages 1-3, with and without checkpointing;
/// docs/zero-stages-cpu.md, 2026-12-05) against [`collective_bytes`]:
/// 0.74 GB/s, each run off by 18-81% (all-reduces ran faster per byte than
/// reductions, whose time includes waiting for the other rank's backward).
const CPU: Throughput = Throughput {
    matmul_f32: 5.888e10,
    matmul_half: 2.734e10,
    attention: f64::INFINITY,
    elementwise: f64::INFINITY,
    probabilities: 6.471e9,
    // Fitted (least squares of the relative error) to six Gemma steps on 2
    // cores, 2026-12-06: `--verify` of scripts/make-hub-shape.py's Gemma 3
    // and Gemma 2 shapes cut to 4 blocks of 256 (8 heads of 32, vocabulary
    // 4096), 2 × 512 and 2 × 1024 tokens in fp32, 2 × 1024 in bf16, against
    // the rest of the model: errors +0 to +21% in fp32, −28% and −35% in
    // bf16 (where a Llama of the same shape is −59%); without the term the
    // six were −74% to −86%.
    unfused: 2.21e9,
    // The optimizer step's rate: bytes streamed through whole fp32 tensors
    // (the elementwise ops' own rate got no weight in the fit).
    loss_chunks: 2.083e10,
    optimizer: 2.083e10,
    host_bus: 10e9,
    host_adamw: 1e9,
    collective: 7.37e8,
    micro_batch_seconds: 1.180e-2,
};

/// Fitted by `scripts/fit-speed.py --fix matmul_half=7.34e14` to 65
/// measured H200 steps: the 17 of docs/speed-cuda-rows.csv (docs/gpu-side-by-side.md,
/// run Q: GPT-2 small and medium, TinyLlama-1.1B, fp32 and bf16, composed
/// and flash attention, checkpointed or not, accumulated or not) and the 48
/// of the GPT-2 small sweep at micro-batches 1, 2 and 4 (docs/sweep-cuda-gpt2.log;
/// candle's AdamW and fused AdamW; `sweep --device cuda:0 --measured-log`):
/// relative error of the fit median 3.7%, max 31.3%. The bf16 matrix-product
/// rate is held at 734 TFLOP/s, a bf16 4096³ matmul through candle on the H200: left
/// free, the fit traded it against the elementwise rate to 2.4 PFLOP/s, more
/// than the H200 has. The host bus and the host's AdamW rate are fitted to
/// offloaded steps against fused ones of the same plans
/// (`scripts/offload-timing.sh`, docs/offload-timing.txt: GPT-2 small and a
/// TinyLlama-1.1B shape in fp32 and bf16, on an H100 machine with 16 host
/// cores, 2026-12-06): the fp32 step moves 4 more bytes per parameter over
/// the bus than the bf16 one, which gives 39.8 and 47.9 GB/s, and the rest
/// 4.05e9 and 4.48e9 parameters stepped per second on the host; the means
/// are kept. NVLink's per-rank collective bandwidth (~300 GB/s) is nominal:
/// the sharded steps timed (docs/zero-stages-gpu.md) ran 2 ranks on one GPU.
const CUDA_H200: Throughput = Throughput {
    matmul_f32: 4.709e13,
    matmul_half: 7.34e14,
    // Fitted (least squares through the origin) to what five long steps
    // left over with attention free: Llama-3.1-8B's shape under QLoRA r 32,
    // batch 1, bf16, every block checkpointed, flash attention, at 16,384,
    // 25,129, 28,769, 32,768 and 49,640 tokens on an H100 80GB HBM3
    // (docs/long-context.md; 2.06 to 16.46 s a step above the rest of the
    // model, 171 to 196 T a second each). The steps above, at 1024 and 2048
    // tokens, gave it no weight: attention was a few percent of them. Not
    // measured on the H200, whose tensor cores are the H100's.
    attention: 1.934e14,
    elementwise: 6.065e11,
    probabilities: 4.731e12,
    // Not fitted: the elementwise rate, which the same candle kernels
    // reach in the steps above. Gemma 3 1B (2 × 4 × 1024 tokens, bf16,
    // composed attention, fused AdamW) is modelled at 552 ms with it
    // (313 ms without), measured 633 ms on an H100 (docs/accuracy-families.md),
    // whose memory is slower than the H200's these rates are fitted to.
    unfused: 6.065e11,
    // Nominal: the H200's memory bandwidth (4.8 TB/s). A chunk's products
    // are bound by reading the weight, at the rate the memory gives.
    loss_chunks: 4.8e12,
    optimizer: 5.584e11,
    host_bus: 44e9,
    host_adamw: 4.27e9,
    collective: 300e9,
    micro_batch_seconds: 8.898e-3,
};

/// Modelled seconds of one optimizer step, by part.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct StepTime {
    /// Forward, backward and recomputation of every micro-batch.
    pub compute: f64,
    /// The optimizer step (and the gradient accumulation).
    pub optimizer: f64,
    /// Copies over the host bus.
    pub transfers: f64,
    /// Collectives between ranks.
    pub collectives: f64,
    /// The whole step.
    pub total: f64,
}

/// Modelled time of one optimizer step of `plan` with `fixes` (e.g.
/// [`crate::facts::builtins`]) on `target`.
pub fn step_time(
    spec: &ModelSpec,
    plan: &Plan,
    fixes: &[Arc<dyn Strategy>],
    target: &Target,
) -> StepTime {
    Throughput::of(target).seconds(&step_work(spec, plan, fixes))
}

/// The work of one optimizer step of `plan` on one rank with `fixes`: the
/// passes as their execution hooks make them (what they recompute, how they
/// compute attention), the optimizer step as their time hooks
/// ([`crate::facts::step_cost`]).
pub fn step_work(spec: &ModelSpec, plan: &Plan, fixes: &[Arc<dyn Strategy>]) -> StepWork {
    let exec = &Execution::for_plan(plan, fixes);
    let cost = crate::facts::step_cost(spec, plan, fixes);
    let c = &spec.config;
    let (b, s) = (plan.micro_batch as f64, plan.seq_len as f64);
    let n = b * s;
    let (h, layers) = (c.hidden as f64, c.layers as f64);
    let heads = c.heads as f64;
    let padded_vocab = c.vocab.next_multiple_of(VOCAB_ALIGN) as f64;
    let bytes = plan.precision.compute_bytes() as f64;
    let accum = plan.grad_accum as f64;
    let facts = crate::facts::trained_facts(spec, plan, fixes);
    let params = facts.parameters as f64;
    // Under LoRA the frozen weights get no gradient: a block's and the
    // head's products run forward and for the input gradient only.
    let weight_gradients = if plan.lora.is_some() { 0.0 } else { 1.0 };

    // Matrix products of a block (as its description lists them) and of the
    // head (per token), as multiply-adds.
    let block = Block::describe(spec, plan, exec);
    let block_macs = block.macs() as f64;
    let head_macs = padded_vocab * h + if c.family == Family::Bert { h * h } else { 0.0 };
    // Attention's q·kᵀ and P·v per block; causal flash skips the masked half.
    let causal = c.family != Family::Bert;
    let attention_macs = 2.0 * b * heads * s * s * c.head_dim() as f64;
    let flash = exec.attention == Attention::Flash;
    let attention_pass = if flash && causal {
        attention_macs
    } else {
        2.0 * attention_macs
    };
    // Backward is two passes' worth; flash's backward recomputes the
    // probabilities (one more pass).
    let attention_backward = if flash { 3.0 } else { 2.0 };
    let recompute = match exec.checkpoint {
        Checkpointing::Every(k) if k > 0 => 1.0,
        _ => 0.0,
    };
    // A recomputed part's backward runs its forward once more (a tiled
    // one's, tile by tile).
    let matmul_flops = 2.0
        * (block_macs * layers * (2.0 + weight_gradients + recompute)
            + block.recomputed_macs() as f64 * layers
            + n * head_macs * (2.0 + weight_gradients))
        + lora_matmul_flops(plan, &facts, n, recompute);
    // The attention part recomputed on its own runs attention once more.
    let attention_recompute = recompute
        + if block.recomputes(Part::Attention) {
            1.0
        } else {
            0.0
        };
    let attention_flops =
        layers * attention_pass * (1.0 + attention_backward + attention_recompute);

    // Elementwise traffic: the block's kept tensors of one row per token
    // written in forward, read and written in backward, again when recomputed.
    let block_elements = block.token_elements() as f64;
    let head_elements = n * padded_vocab * 2.0 + n * h * 2.0;
    let elementwise_bytes = bytes
        * (layers * block_elements * (3.0 + 2.0 * recompute)
            + 2.0 * layers * block.recomputed_elements() as f64
            + head_elements * 3.0)
        + dequantized_bytes(plan, &facts, recompute);
    let loss_chunk_bytes = chunked_loss_bytes(spec, plan, exec, weight_gradients);
    let unfused_bytes = gemma_unfused_bytes(spec, plan, attention_recompute);
    let probabilities_bytes = if flash || c.settings.gemma.is_some() {
        0.0
    } else {
        bytes * layers * 5.0 * b * heads * s * s * (3.0 + 2.0 * attention_recompute)
    };

    // The optimizer step, as the fixes' time hooks cost it.
    let stepped = cost.stepped_parameters;
    let mut optimizer_bytes = stepped * cost.device_bytes_per_parameter;
    // Accumulation: each later micro-batch's gradients added into the sums.
    optimizer_bytes += (accum - 1.0).max(0.0) * params * bytes * 3.0;
    // Segment inputs kept on the host go down in the forward and come back
    // for their recompute, each micro-batch; the compute waits for them.
    let offloaded = Dims::new(spec, plan, exec).offloaded_inputs(
        c.layers,
        exec,
        plan.precision.compute_bytes(),
    ) as f64;
    let host_bus_bytes = stepped * cost.bus_bytes_per_parameter + accum * 2.0 * offloaded;
    let host_parameters = if cost.on_host { stepped } else { 0.0 };
    let collective_bytes = collective_bytes(spec, plan, exec, &facts);
    StepWork {
        matmul_flops: accum * matmul_flops,
        attention_flops: accum * attention_flops,
        elementwise_bytes: accum * elementwise_bytes,
        loss_chunk_bytes: accum * loss_chunk_bytes,
        probabilities_bytes: accum * probabilities_bytes,
        unfused_bytes: accum * unfused_bytes,
        optimizer_bytes,
        host_bus_bytes,
        host_parameters,
        collective_bytes,
        micro_batches: accum,
        half: plan.precision != Precision::F32,
    }
}

/// Bytes per score element that Gemma's attention moves between its two
/// products, forward and backward, one candle op at a time as
/// `train::gemma`'s attention and candle's backward run them (each op reads
/// its operands and writes its output; `c` bytes in the compute dtype, 4 in
/// the f32 softmax; a first gradient is stored, not added to zeros):
///
/// * forward: the scores written (c); with a cap, `tanh` and `×cap` (4c);
///   the mask added (3c); in 16 bits, the copy to f32 (c + 4); the row
///   maximum, its subtraction, `exp`, the row sum and the division (32);
///   in 16 bits, the copy back (4 + c); `P·v` reading the probabilities (c);
/// * backward: `dP` written and `P` read for `dv` (2c); in 16 bits, `dP`
///   to f32 (c + 4); the division's two gradients (the divisor's made
///   score-sized: zeros, `×E`, `sum²`, `÷`, `−`, then summed: 56); the row
///   sum's gradient added into `E`'s (12); `exp`'s (12); the detached
///   maximum's stray gradient (zeros, `−`: 16); in 16 bits, back to the
///   compute dtype (4 + c); with a cap, `×cap` (2c) and `tanh`'s (zeros,
///   square, `−1`, `×`, `−`: 11c); `dS` read by both products' backward (2c).
fn gemma_score_bytes(c: f64, capped: bool) -> (f64, f64) {
    let half = if c < 4.0 { 1.0 } else { 0.0 };
    let cap = if capped { 1.0 } else { 0.0 };
    let forward = 5.0 * c + 4.0 * c * cap + 32.0 + half * (2.0 * c + 8.0);
    let backward = 4.0 * c + 96.0 + half * (2.0 * c + 8.0) + 13.0 * c * cap;
    (forward, backward)
}

/// The bytes of one micro-batch that Gemma moves through what it composes
/// from candle ops one at a time ([`StepWork::unfused_bytes`]): every
/// block's scores ([`gemma_score_bytes`], the forward again when
/// recomputed) and, with Gemma 2's logit soft-cap, the padded logits
/// `[n, P]` divided, `tanh`'d and multiplied forward (6c a logit), and
/// back through the three (15c: `tanh`'s backward as in the scores'). 0
/// for the other families.
fn gemma_unfused_bytes(spec: &ModelSpec, plan: &Plan, recompute: f64) -> f64 {
    let c = &spec.config;
    let Some(gemma) = &c.settings.gemma else {
        return 0.0;
    };
    let cb = plan.precision.compute_bytes() as f64;
    let (b, s) = (plan.micro_batch as f64, plan.seq_len as f64);
    let scores = b * c.heads as f64 * s * s * c.layers as f64;
    let (forward, backward) = gemma_score_bytes(cb, gemma.attn_softcap.is_some());
    let logits = match gemma.final_softcap {
        Some(_) => b * s * c.vocab.next_multiple_of(VOCAB_ALIGN) as f64 * 21.0 * cb,
        None => 0.0,
    };
    scores * (forward * (1.0 + recompute) + backward) + logits
}

/// What computing the loss in chunks of tokens
/// ([`oomfix_strategies::chunked_loss`]) moves besides the unchunked pass's
/// work: the head's products are the same FLOPs (none is recomputed), but
/// each chunk after the first reads the whole `[P, h]` output embedding
/// again for its logits and for its input gradient, and, when the weight is
/// trained, each chunk's share of its gradient is summed into it (written,
/// read and copied back: four more passes over `[P, h]`). 0 unchunked.
fn chunked_loss_bytes(
    spec: &ModelSpec,
    plan: &Plan,
    exec: &Execution,
    weight_gradients: f64,
) -> f64 {
    let Some(bytes) = exec.loss_chunk_bytes else {
        return 0.0;
    };
    let c = &spec.config;
    let p = c.vocab.next_multiple_of(VOCAB_ALIGN);
    let n = plan.micro_batch * plan.seq_len;
    let dtype = oomfix_strategies::model::dtype_of(plan.precision);
    let rows = oomfix_strategies::chunked_loss::chunk_rows(bytes, p, dtype).min(n.max(1));
    let chunks = n.div_ceil(rows.max(1)) as f64;
    let weight = (p * c.hidden) as f64 * plan.precision.compute_bytes() as f64;
    (chunks - 1.0).max(0.0) * (2.0 + 4.0 * weight_gradients) * weight
}

/// The adapters' products per micro-batch: `x·Aᵀ` and its product with `Bᵀ`
/// forward, both gradients and the input's backward (`r·(in + out)`
/// multiply-adds per token and adapted projection, three times, and once
/// more when recomputed).
fn lora_matmul_flops(plan: &Plan, facts: &ModelFacts, n: f64, recompute: f64) -> f64 {
    let Some(lora) = plan.lora else { return 0.0 };
    let per_token: u64 = lora
        .adapted(facts)
        .map(|l| u64::from(lora.rank) * (l.inputs + l.outputs))
        .sum();
    2.0 * n * per_token as f64 * facts.layers as f64 * (3.0 + recompute)
}

/// The traffic of converting frozen weights to the compute dtype per
/// micro-batch under LoRA, one at a time (NF4; a 16-bit base is kept in
/// the compute dtype and used as stored): each block projection read as stored (double-quantized NF4:
/// its absmax values restored to fp32 first), written and read again in
/// the compute dtype, in the forward, for the input gradient and when
/// recomputed.
fn dequantized_bytes(plan: &Plan, facts: &ModelFacts, recompute: f64) -> f64 {
    let Some(lora) = plan.lora else { return 0.0 };
    if oomfix_strategies::lora::dequantized_bytes(plan, &lora, facts) == 0 {
        return 0.0;
    }
    let cb = plan.precision.compute_bytes();
    let per_block: u64 = facts
        .linears()
        .map(|l| {
            let elements = l.inputs * l.outputs;
            // Double quantization first restores the fp32 absmax values.
            let absmax = match lora.base {
                BasePrecision::Nf4Double => 8 * elements.div_ceil(64),
                _ => 0,
            };
            lora.base.weight_bytes(elements) + absmax + 2 * cb * elements
        })
        .sum();
    per_block as f64 * facts.layers as f64 * (2.0 + recompute)
}

/// The bytes one rank's collectives move in a step of `plan`, as the trainer
/// runs them, with ring algorithms (an all-reduce of `B` bytes moves
/// `2B(N−1)/N` per rank; a reduction to one rank, a broadcast or an
/// all-gather `B(N−1)/N`), Ψ being the parameters' bytes in the compute
/// dtype:
///
/// * ZeRO 1 all-reduces the step's summed gradients once (2Ψ) and each
///   owner broadcasts its updated parameters (Ψ): 3Ψ, where ZeRO's
///   reduce-scatter and all-gather would move 2Ψ;
/// * ZeRO 2 reduces every micro-batch's gradients to their owners (Ψ each)
///   and broadcasts the updated parameters (Ψ);
/// * ZeRO 3 reduces as ZeRO 2 and gathers the parameters for the passes:
///   all of them once a step (Ψ), or with checkpointed segments those
///   outside the blocks once and each block's before its forward and again
///   before its recomputation, every micro-batch;
/// * without ZeRO, data parallel ranks all-reduce the summed gradients (2Ψ).
///
/// `facts` are what the plan trains ([`crate::facts::trained_facts`]): every
/// parameter's gradient is reduced, or under LoRA the adapters'.
pub fn collective_bytes(
    spec: &ModelSpec,
    plan: &Plan,
    exec: &Execution,
    facts: &ModelFacts,
) -> f64 {
    let world = plan.shard.world_size.max(1) as f64;
    if world <= 1.0 {
        return 0.0;
    }
    let psi = facts.parameters as f64 * plan.precision.compute_bytes() as f64;
    let accum = plan.grad_accum as f64;
    let blocks = (facts.block_parameters as f64 * spec.config.layers as f64
        / facts.parameters.max(1) as f64)
        .min(1.0)
        * psi;
    let gathered = match exec.checkpoint {
        Checkpointing::Every(k) if k > 0 => (psi - blocks) + 2.0 * accum * blocks,
        _ => psi,
    };
    let volume = match plan.shard.stage {
        0 => 2.0 * psi,
        1 => 3.0 * psi,
        2 => accum * psi + psi,
        _ => accum * psi + gathered,
    };
    volume * (world - 1.0) / world
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::builtins;
    use crate::spec::ModelConfig;
    use oomfix_strategies::OptimizerImpl;

    fn spec() -> ModelSpec {
        ModelSpec::from_config("gpt2", ModelConfig::gpt2_small())
    }

    /// The work of `plan` with the built-in fixes.
    fn work(spec: &ModelSpec, plan: &Plan) -> StepWork {
        step_work(spec, plan, builtins())
    }

    #[test]
    fn checkpointing_costs_a_forward_and_fused_adamw_is_cheaper() {
        let spec = spec();
        let plain = Plan::baseline(8, 1024);
        let t = |p: &Plan| step_time(&spec, p, builtins(), &Target::Cuda(0)).total;
        let ck = Plan {
            checkpoint: Checkpointing::Every(1),
            ..plain
        };
        assert!(t(&ck) > t(&plain));
        let fused = Plan {
            optimizer: OptimizerImpl::FusedAdamW,
            ..plain
        };
        assert!(t(&fused) < t(&plain));
        let w = work(&spec, &plain);
        let wc = work(&spec, &ck);
        // One more forward of the blocks: matmuls up by a third of the blocks' share at most.
        assert!(wc.matmul_flops > w.matmul_flops && wc.matmul_flops < w.matmul_flops * 4.0 / 3.0);
    }

    #[test]
    fn the_global_batch_costs_about_the_same_in_any_split() {
        let spec = spec();
        let whole = work(&spec, &Plan::baseline(8, 512));
        let split = work(
            &spec,
            &Plan {
                micro_batch: 1,
                grad_accum: 8,
                ..Plan::baseline(8, 512)
            },
        );
        assert!((whole.matmul_flops - split.matmul_flops).abs() < 1.0);
        assert!(split.micro_batches == 8.0 && split.optimizer_bytes > whole.optimizer_bytes);
    }

    /// A TinyLlama shape with Gemma's settings: version 2 soft-caps scores
    /// and logits.
    fn gemma(version: u8) -> ModelSpec {
        let mut c = ModelConfig::tinyllama_1_1b();
        c.settings.gemma = Some(crate::spec::GemmaSettings {
            version,
            query_pre_attn_scalar: 64.0,
            attn_softcap: (version == 2).then_some(50.0),
            final_softcap: (version == 2).then_some(30.0),
            sliding_layers: vec![true, false],
            local_rope_theta: None,
        });
        ModelSpec::from_config("gemma", c)
    }

    #[test]
    fn gemmas_attention_is_counted_op_by_op() {
        let plain = Plan {
            precision: Precision::Bf16,
            ..Plan::baseline(2, 1024)
        };
        let llama = work(
            &ModelSpec::from_config("llama", ModelConfig::tinyllama_1_1b()),
            &plain,
        );
        let (g3, g2) = (work(&gemma(3), &plain), work(&gemma(2), &plain));
        assert_eq!(llama.unfused_bytes, 0.0);
        assert_eq!(g3.probabilities_bytes, 0.0);
        // Every score moves more bytes op by op than through the fused softmax.
        assert!(g3.unfused_bytes > 5.0 * llama.probabilities_bytes);
        // The caps add tanh on the scores and on the logits.
        assert!(g2.unfused_bytes > g3.unfused_bytes);
        let t = |w: &StepWork| Throughput::of(&Target::Cuda(0)).seconds(w).total;
        assert!(t(&g3) > t(&llama));
        // Recomputation runs the scores' forward again, not their backward.
        let ck = work(
            &gemma(3),
            &Plan {
                checkpoint: Checkpointing::Every(1),
                ..plain
            },
        );
        let (forward, backward) = gemma_score_bytes(2.0, false);
        let scores = 2.0 * 32.0 * 1024.0 * 1024.0 * 22.0;
        assert_eq!(g3.unfused_bytes, scores * (forward + backward));
        assert_eq!(ck.unfused_bytes - g3.unfused_bytes, scores * forward);
    }

    #[test]
    fn collectives_move_what_each_zero_stage_runs() {
        let spec = spec();
        let psi = spec.parameters() as f64 * 4.0;
        let blocks = (spec.config.block_parameters() * spec.config.layers as u64) as f64 * 4.0;
        let plan = |stage, grad_accum, checkpoint| Plan {
            micro_batch: 8 / grad_accum,
            grad_accum,
            checkpoint,
            shard: oomfix_strategies::Sharding::new(8, stage),
            ..Plan::baseline(8, 512)
        };
        let none = Checkpointing::None;
        let every = Checkpointing::Every(1);
        for (stage, accum, checkpoint, volume) in [
            (1, 1, none, 3.0 * psi),
            (1, 4, none, 3.0 * psi),
            (2, 1, none, 2.0 * psi),
            (2, 4, none, 5.0 * psi),
            (3, 1, none, 2.0 * psi),
            (3, 4, none, 5.0 * psi),
            (3, 1, every, psi + (psi - blocks) + 2.0 * blocks),
            (3, 4, every, 4.0 * psi + (psi - blocks) + 8.0 * blocks),
        ] {
            let w = work(&spec, &plan(stage, accum, checkpoint));
            let want = volume * 7.0 / 8.0;
            assert!(
                (w.collective_bytes - want).abs() < 1.0,
                "stage {stage}, {accum} micro-batches, {checkpoint:?}: {} vs {want}",
                w.collective_bytes
            );
        }
    }
}
