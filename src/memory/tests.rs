use super::*;
use crate::spec::{ModelConfig, ModelSpec};
use oomfix_strategies::shard::DEFAULT_BUCKET_BYTES;
use oomfix_strategies::{
    Attention, Checkpointing, OptimizerImpl, Pipeline, Plan, Precision, SearchContext, Sharding,
};
use proptest::prelude::*;
use proptest::strategy::Strategy;

fn spec_for(i: usize) -> ModelSpec {
    let cfg = match i % 3 {
        0 => ModelConfig::gpt2_small(),
        1 => ModelConfig::tinyllama_1_1b(),
        _ => ModelConfig::bert_base(),
    };
    ModelSpec::from_config("test", cfg)
}

fn arb_plan() -> impl Strategy<Value = Plan> {
    (
        1usize..16,
        1usize..8,
        1usize..9,
        0usize..3,
        0usize..4,
        any::<bool>(),
        0usize..3,
        1usize..5,
        0u8..4,
    )
        .prop_map(
            |(mb, acc, s, prec, ck, flash, optimizer, world, stage)| Plan {
                micro_batch: mb,
                grad_accum: acc,
                seq_len: 64 * s,
                precision: [Precision::F32, Precision::Bf16, Precision::F16][prec],
                checkpoint: [
                    Checkpointing::None,
                    Checkpointing::Every(4),
                    Checkpointing::Every(2),
                    Checkpointing::Every(1),
                ][ck],
                attention: if flash {
                    Attention::Flash
                } else {
                    Attention::Composed
                },
                optimizer: [
                    OptimizerImpl::CandleAdamW,
                    OptimizerImpl::FusedAdamW,
                    OptimizerImpl::OffloadedAdamW,
                ][optimizer],
                shard: Sharding::new(world, if world > 1 { stage } else { 0 }),
                ..Plan::baseline(1, 64)
            },
        )
}

proptest! {
    /// Every strategy's tighten step never raises the estimate by more than the
    /// fix's own documented fixed cost, which can outweigh what it saves when
    /// activations are tiny:
    /// * accumulate, going from one to several micro-batches: the accumulated
    ///   gradient set carried between micro-batches, and in the first step
    ///   one new sum beside the sums it replaces;
    /// * precision: under the unfused candle AdamW an fp32 copy of the
    ///   gradient being stepped (4 bytes x the largest tensor), and the fp32
    ///   master weights beyond what halving the weights saves: at the loss
    ///   backward no gradient exists yet, so halving the gradients does not
    ///   offset them there; on the CPU also the f32 copies its bf16 matrix
    ///   products make (`widen_cpu_bf16_matmuls`), which can outweigh the
    ///   halved logits now that the loss's backward holds no zero tensors;
    /// * flash-attention: its backward's f32 working set, which at short
    ///   sequences is larger than the probabilities it no longer keeps;
    /// * shard: the collective backend's buffers for its largest bucket,
    ///   and at stage 1 the owned share of the reduced gradients beside the
    ///   local sums, which outweigh what stage 1 saves where nothing it
    ///   divides is on the device (an offloaded optimizer), and on CUDA
    ///   NCCL's communicator;
    /// * checkpoint and accumulate, on CUDA: what the pool keeps of the
    ///   buffers a recomputed or repeated pass frees (`pool_slack`).
    /// Every other step must not raise it at all.
    #[test]
    fn tightening_never_raises_the_estimate(plan in arb_plan(), i in 0usize..3, target in prop_oneof![Just(Target::Cpu), Just(Target::Cuda(0))]) {
        let spec = spec_for(i);
        let mut ctx = SearchContext::new(plan.global_batch(), spec.config.layers);
        ctx.gpus = 4;
        ctx.host_offload = target.has_host_memory();
        let estimate = MemoryModel.estimate(&spec, &plan, &target);
        let before = estimate.peak;
        for s in Pipeline::default().strategies() {
            if let Some(next) = s.tighten(&plan, &ctx) {
                let next_estimate = MemoryModel.estimate(&spec, &next, &target);
                let after = next_estimate.peak;
                let allowance = match s.name() {
                    "precision" => {
                        let grad = if plan.optimizer == OptimizerImpl::CandleAdamW { 4 * spec.largest_tensor() } else { 0 };
                        let master = next_estimate.master_weights.saturating_sub(estimate.weights - next_estimate.weights);
                        let mut widened = Activations::default();
                        if target == Target::Cpu {
                            widen_cpu_bf16_matmuls(&mut widened, &spec, &next, &builtin_execution(&next));
                        }
                        grad + master + widened.backward_transient()
                    }
                    "accumulate" if plan.grad_accum == 1 => {
                        // the sums, and the first step's first new sum beside them
                        let acc = next_estimate.accumulated_gradients;
                        acc + spec.largest_tensor() * (acc / spec.parameters())
                    }
                    "flash-attention" => super::activations::flash_backward_bytes(&spec, &next),
                    // Logits smaller than the hidden states (a vocabulary
                    // below the hidden size): what the chunked loss holds
                    // itself (the hidden states' gradient beside one chunk)
                    // may outweigh the logits it saves.
                    "chunked-loss" => {
                        let exec = builtin_execution(&next);
                        let mut widened = activation_bytes(&spec, &next, &exec);
                        if target == Target::Cpu {
                            widen_cpu_bf16_matmuls(&mut widened, &spec, &next, &exec);
                        }
                        widened.loss.transient
                    }
                    "shard" => next_estimate.collective_buffers + next_estimate.gradients.div_ceil(ctx.gpus as u64) + next_estimate.communicator,
                    _ => 0,
                } + match s.name() {
                    "checkpoint" | "accumulate" => next_estimate.pool_slack.saturating_sub(estimate.pool_slack),
                    _ => 0,
                };
                // a fixed cost may cross one more allocator page
                let allowance = if allowance > 0 { target.round_up(allowance) + target.round_up(1) } else { 0 };
                prop_assert!(after <= before + allowance, "{} raised {} -> {} ({plan} -> {next})", s.name(), before, after);
            }
        }
    }

    /// A larger micro-batch never lowers the estimate.
    #[test]
    fn more_micro_batch_never_lowers_it(plan in arb_plan(), i in 0usize..3, extra in 1usize..8) {
        let spec = spec_for(i);
        let bigger = Plan { micro_batch: plan.micro_batch + extra, ..plan };
        let a = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
        let b = MemoryModel.estimate(&spec, &bigger, &Target::Cpu);
        prop_assert!(b.peak >= a.peak);
        prop_assert!(activation_bytes(&spec, &bigger, &builtin_execution(&bigger)).kept >= activation_bytes(&spec, &plan, &builtin_execution(&plan)).kept);
    }

    /// Sharding over N divides exactly the components of its stage.
    #[test]
    fn sharding_divides_what_it_should(plan in arb_plan(), i in 0usize..3, n in 2usize..9) {
        let spec = spec_for(i);
        let one = Plan { shard: Sharding::NONE, grad_accum: 2, ..plan };
        let one_b = MemoryModel.estimate(&spec, &one, &Target::Cpu);
        for stage in 1..=3u8 {
            let sharded = Plan { shard: Sharding::new(n, stage), ..one };
            let b = MemoryModel.estimate(&spec, &sharded, &Target::Cpu);
            let n = n as u64;
            prop_assert_eq!(b.optimizer_state, one_b.optimizer_state.div_ceil(n));
            prop_assert_eq!(b.master_weights, one_b.master_weights.div_ceil(n));
            let acc = if stage >= 2 { one_b.accumulated_gradients.div_ceil(n) } else { one_b.accumulated_gradients };
            prop_assert_eq!(b.accumulated_gradients, acc);
            prop_assert_eq!(activation_bytes(&spec, &sharded, &builtin_execution(&sharded)), activation_bytes(&spec, &one, &builtin_execution(&one)));
            // What sharding adds: the collectives' buffers, and at stage 1 the
            // owned share of the reduced gradients beside the local sums.
            let share = if stage == 1 { one_b.gradients.div_ceil(n) } else { 0 };
            prop_assert!(b.peak <= one_b.peak + b.collective_buffers + share, "{} vs {}", b.peak, one_b.peak);
            // Stage 3 with checkpointed segments keeps its share of the weights,
            // plus the others' shares of what one segment uses.
            let units = stage == 3 && one.checkpoint.segments(spec.config.layers).iter().any(|s| !s.is_empty());
            if units {
                prop_assert!(b.weights <= one_b.weights, "{} vs {}", b.weights, one_b.weights);
                prop_assert!(b.weights >= one_b.weights.div_ceil(n));
            } else {
                prop_assert_eq!(b.weights, one_b.weights);
            }
        }
    }
}

#[test]
fn zero_3_gathers_the_weights_outside_the_blocks_and_one_segment() {
    let spec = ModelSpec::default_model();
    let (p, block) = (spec.parameters(), spec.config.block_parameters());
    assert_eq!(block, 7_087_872, "GPT-2 small's block");
    let outside = p - 12 * block;
    let plan = |checkpoint| Plan {
        checkpoint,
        shard: Sharding::new(4, 3),
        ..Plan::baseline(8, 128)
    };
    let weights = |c| MemoryModel.estimate(&spec, &plan(c), &Target::Cpu).weights;
    assert_eq!(weights(Checkpointing::None), 4 * p);
    for k in [1, 2, 12] {
        let segment = 4 * k as u64 * block;
        assert_eq!(
            weights(Checkpointing::Every(k)),
            ((4 * p).div_ceil(4) + 4 * outside + segment - segment / 4).min(4 * p),
            "segments of {k}"
        );
    }
}

/// With checkpointed segments, ZeRO 2 and 3 reduce each segment's gradients
/// once its backward made them: the backward's gradients are at most those
/// outside the blocks, one segment's and the rank's share of the blocks'
/// (in the accumulated sums when there are several micro-batches), and a
/// reduction moves one segment's (or the outside's) buckets only.
#[test]
fn zero_2_and_3_reduce_each_segments_gradients() {
    let spec = ModelSpec::default_model();
    let (p, block) = (spec.parameters(), spec.config.block_parameters());
    let outside = p - 12 * block;
    let plan = |stage, checkpoint, grad_accum| Plan {
        checkpoint,
        grad_accum,
        micro_batch: 8 / grad_accum,
        shard: Sharding::new(4, stage),
        ..Plan::baseline(8, 128)
    };
    let estimate =
        |stage, c, accum| MemoryModel.estimate(&spec, &plan(stage, c, accum), &Target::Cpu);
    for stage in [1, 2, 3] {
        assert_eq!(
            estimate(stage, Checkpointing::None, 1).gradients,
            4 * p,
            "stage {stage}"
        );
    }
    assert_eq!(estimate(1, Checkpointing::Every(1), 1).gradients, 4 * p);
    for stage in [2, 3] {
        for k in [1, 2] {
            let segment = 4 * k as u64 * block;
            let share = (4 * 12 * block).div_ceil(4);
            let every = Checkpointing::Every(k);
            let what = format!("stage {stage}, segments of {k}");
            assert_eq!(
                estimate(stage, every, 1).gradients,
                4 * outside + segment + share,
                "{what}"
            );
            assert_eq!(
                estimate(stage, every, 2).gradients,
                4 * outside + segment,
                "{what}"
            );
        }
    }
    // A segment's reduction moves that segment's gradients only: with a
    // small vocabulary and bf16, one block's are less than a full bucket.
    let small = ModelSpec::from_config(
        "test",
        ModelConfig {
            vocab: 64,
            ..ModelConfig::gpt2_small()
        },
    );
    let bf16 = |checkpoint| Plan {
        precision: Precision::Bf16,
        ..plan(2, checkpoint, 1)
    };
    let full = (DEFAULT_BUCKET_BYTES / 2) as u64;
    let fixes = Pipeline::default();
    let s = state_bytes(&small, &bf16(Checkpointing::None), fixes.strategies());
    assert_eq!((s.collective_bucket, s.reduction_bucket), (full, full));
    let s = state_bytes(&small, &bf16(Checkpointing::Every(1)), fixes.strategies());
    assert_eq!((s.collective_bucket, s.reduction_bucket), (full, block));
}

#[test]
fn mixed_precision_model_state_is_16_bytes_per_parameter_with_fused_adamw() {
    let spec = spec_for(0);
    let p = spec.parameters();
    let plan = Plan {
        precision: Precision::Bf16,
        optimizer: OptimizerImpl::FusedAdamW,
        ..Plan::baseline(1, 128)
    };
    let b = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
    assert_eq!(
        b.weights + b.master_weights + b.gradients + b.optimizer_state,
        16 * p
    );
    assert_eq!(b.optimizer_transient, 0);
}

#[test]
fn checkpointing_keeps_only_segment_inputs() {
    let spec = spec_for(0);
    let plain = Plan::baseline(4, 512);
    let a = activation_bytes(&spec, &plain, &builtin_execution(&plain));
    let every = |k| {
        let plan = Plan {
            checkpoint: Checkpointing::Every(k),
            ..plain
        };
        activation_bytes(&spec, &plan, &builtin_execution(&plan)).kept
    };
    let bsh = 4 * 512 * 768 * 4;
    assert_eq!(every(1) - every(2), 6 * bsh); // 12 segment inputs instead of 6
    assert!(a.kept > 10 * every(1));
}

#[test]
fn flash_attention_keeps_nothing_quadratic_in_the_sequence() {
    for i in 0..3 {
        let spec = spec_for(i);
        for checkpoint in [Checkpointing::None, Checkpointing::Every(1)] {
            let bytes = |attention, s| {
                let plan = Plan {
                    attention,
                    checkpoint,
                    ..Plan::baseline(4, s)
                };
                let a = activation_bytes(&spec, &plan, &builtin_execution(&plan));
                a.kept + a.blocks.total()
            };
            // Every flash term of the blocks is linear in the sequence length
            // (the head's weight gradient, the embedding's copies and a padded
            // output embedding are constants).
            let flash = |s| bytes(Attention::Flash, s);
            assert_eq!(
                flash(1024) - flash(512),
                2 * (flash(512) - flash(256)),
                "{i} {checkpoint}"
            );
            assert!(
                bytes(Attention::Flash, 512) <= bytes(Attention::Composed, 512),
                "{i} {checkpoint}"
            );
        }
        // Without checkpointing every block's scores are kept: composed grows faster.
        let kept = |attention, s| {
            let plan = Plan {
                attention,
                ..Plan::baseline(2, s)
            };
            activation_bytes(&spec, &plan, &builtin_execution(&plan)).kept
        };
        assert!(
            kept(Attention::Composed, 1024) > 2 * kept(Attention::Composed, 512),
            "{i}"
        );
        assert!(
            kept(Attention::Flash, 512) < kept(Attention::Composed, 512),
            "{i}"
        );
    }
}

#[test]
fn the_loss_backward_holds_no_gradient() {
    // A large vocabulary on a small model: the loss's [n,V] working set is the
    // largest of the step, and no parameter gradient exists yet when it is alive.
    let spec = ModelSpec::from_config(
        "t",
        ModelConfig {
            vocab: 50_000,
            ..ModelConfig::gpt2(2, 128, 2)
        },
    );
    let plan = Plan {
        checkpoint: Checkpointing::Every(1),
        optimizer: OptimizerImpl::FusedAdamW,
        ..Plan::baseline(8, 256)
    };
    let b = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
    let exec = builtin_execution(&plan);
    let mut a = activation_bytes(&spec, &plan, &exec);
    // The CPU target's terms of the head's backward.
    add_cpu_head_backward(&mut a, &spec, &plan, &exec, Backward::linked());
    assert_eq!(b.peak_phase, PeakMoment::LossBackward);
    assert_eq!(b.peak, b.weights + b.optimizer_state + a.loss.total());
    assert!(b
        .peak_components()
        .iter()
        .all(|(name, _)| *name != "gradients"));
    // Later moments hold the gradients, but not the loss's working set.
    assert!(a.blocks.total() + b.gradients < a.loss.total());
}

#[test]
fn cuda_offers_flash_attention_only_for_heads_the_kernels_take() {
    let planned = |config: ModelConfig, target: Target| {
        let spec = ModelSpec::from_config("m", config);
        crate::Planner::new(1 << 20)
            .global_batch(4)
            .seq_len(64)
            .target(target)
            .run(&spec)
            .unwrap()
            .attempts
            .iter()
            .any(|a| a.plan.attention == Attention::Flash)
    };
    // GPT-2 small: head dimension 64; 2 heads of 384: head dimension 384.
    assert!(planned(ModelConfig::gpt2_small(), Target::Cuda(0)));
    assert!(!planned(ModelConfig::gpt2(2, 768, 2), Target::Cuda(0)));
    assert!(planned(ModelConfig::gpt2(2, 768, 2), Target::Cpu));
}

/// Under LoRA a Llama-style model's untied token embedding, only looked up,
/// is host memory; tied to the output layer, or trained, it stays.
#[test]
fn a_frozen_looked_up_embedding_is_host_memory() {
    use oomfix_strategies::lora::{BasePrecision, Lora};
    let estimate = |tied: bool, lora: bool| {
        let spec =
            ModelSpec::from_config("llama", ModelConfig::llama(2, 256, 8, 2, 688, 4096, tied));
        let facts = crate::memory::model_facts(&spec);
        let plan = Plan {
            precision: Precision::Bf16,
            optimizer: OptimizerImpl::FusedAdamW,
            lora: lora.then(|| Lora::new(8, None, None, BasePrecision::Nf4, &facts).unwrap()),
            ..Plan::baseline(2, 64)
        };
        MemoryModel.estimate(&spec, &plan, &Target::Cuda(0))
    };
    let table = 4096 * 256 * 2;
    let (untied, tied) = (estimate(false, true), estimate(true, true));
    assert_eq!(untied.host, table);
    assert_eq!(tied.host, 0);
    // On the device the untied model holds its head where the tied one
    // holds the shared table: the same bytes.
    assert_eq!(untied.weights, tied.weights);
    assert_eq!(estimate(false, false).host, 0);
}

/// At long sequences a checkpointed plan's slack follows the MLP's width:
/// Llama-3.1-8B's shape at 28,769 tokens held 2.82 GiB reserved above its
/// used mark on an H100, far above the constant terms.
#[test]
fn long_checkpointed_sequences_keep_room_for_the_mlps_blocks() {
    let spec = ModelSpec::from_config(
        "l31",
        ModelConfig::llama(32, 4096, 32, 8, 14336, 128_256, false),
    );
    let plan = Plan {
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Every(1),
        attention: Attention::Flash,
        chunked_loss: true,
        ..Plan::baseline(1, 28_769)
    };
    let slack = MemoryModel
        .estimate(&spec, &plan, &Target::Cuda(0))
        .pool_slack;
    assert!(slack >= 2_820 << 20, "{slack}");
    assert!(slack <= 3_200 << 20, "{slack}");
    let short = Plan {
        seq_len: 1024,
        ..plan
    };
    let constant = 32 * (12 << 20) + (176 << 20) + (120 << 20);
    assert_eq!(
        MemoryModel
            .estimate(&spec, &short, &Target::Cuda(0))
            .pool_slack,
        constant
    );
}

#[test]
fn cuda_plans_keep_room_for_the_pools_slack() {
    let spec = spec_for(0);
    let plan = Plan {
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Every(1),
        ..Plan::baseline(8, 1024)
    };
    let cpu = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
    let cuda = MemoryModel.estimate(&spec, &plan, &Target::Cuda(0));
    // Per block, for recomputation, and for a pass repeated.
    let slack = spec.config.layers as u64 * (12 << 20) + (176 << 20) + (120 << 20);
    assert_eq!((cpu.pool_slack, cuda.pool_slack), (0, slack));
    assert_eq!(cpu.allocated_peak(), cpu.peak);
    assert_eq!(cuda.peak - cuda.allocated_peak(), slack);
    assert!(cuda.peak_components().contains(&("pool_slack", slack)));
    // Without recomputation or accumulation only the blocks' part is left.
    let plain = MemoryModel.estimate(&spec, &Plan::baseline(8, 1024), &Target::Cuda(0));
    assert_eq!(plain.pool_slack, spec.config.layers as u64 * (12 << 20));
    let accumulated = Plan {
        grad_accum: 2,
        ..Plan::baseline(4, 1024)
    };
    let accumulated = MemoryModel.estimate(&spec, &accumulated, &Target::Cuda(0));
    assert_eq!(accumulated.pool_slack - plain.pool_slack, 120 << 20);
    // A budget between the live bytes and live bytes + slack does not fit
    // (no headroom: the budget is the estimate itself).
    let fits = |budget: u64| {
        crate::Planner::new(budget)
            .headroom(crate::Headroom::NONE)
            .global_batch(8)
            .seq_len(1024)
            .pipeline(Pipeline::new())
            .target(Target::Cuda(0))
            .run(&spec)
            .unwrap()
            .fits()
    };
    let baseline = MemoryModel.estimate(&spec, &Plan::baseline(8, 1024), &Target::Cuda(0));
    assert!(!fits(baseline.allocated_peak()));
    assert!(fits(baseline.peak));
}

#[test]
fn sharded_cuda_plans_keep_room_for_nccls_communicator() {
    let spec = spec_for(0);
    let one = Plan::baseline(8, 1024);
    let sharded = Plan {
        shard: Sharding::new(2, 2),
        ..one
    };
    let channels = crate::target::nccl_channels();
    let nccl = (316 << 20) + channels * (18 << 20);
    let cuda = MemoryModel.estimate(&spec, &sharded, &Target::Cuda(0));
    assert_eq!(cuda.communicator, nccl);
    assert!(cuda.peak_components().contains(&("communicator", nccl)));
    assert_eq!(
        MemoryModel
            .estimate(&spec, &one, &Target::Cuda(0))
            .communicator,
        0
    );
    assert_eq!(
        MemoryModel
            .estimate(&spec, &sharded, &Target::Cpu)
            .communicator,
        0
    );
}

#[test]
fn offloading_moves_master_weights_and_optimizer_state_to_the_host() {
    for i in 0..3 {
        let spec = spec_for(i);
        let p = spec.parameters();
        for precision in [Precision::F32, Precision::Bf16] {
            // no checkpointing: the backward, not the step, holds the peak
            let fused = Plan {
                precision,
                optimizer: OptimizerImpl::FusedAdamW,
                ..Plan::baseline(2, 512)
            };
            let offloaded = Plan {
                optimizer: OptimizerImpl::OffloadedAdamW,
                ..fused
            };
            // the CPU's estimate is not rounded to pool pages: exact differences
            let a = MemoryModel.estimate(&spec, &fused, &Target::Cpu);
            let b = MemoryModel.estimate(&spec, &offloaded, &Target::Cpu);
            let cb = precision.compute_bytes();
            assert_eq!((a.host, b.host), (0, 12 * p + cb * p));
            assert_eq!((b.master_weights, b.optimizer_state), (0, 0));
            assert_eq!(b.optimizer_transient, cb * spec.largest_tensor());
            assert_eq!(
                (b.weights, b.gradients, b.activations),
                (a.weights, a.gradients, a.activations)
            );
            assert_ne!(a.peak_phase, PeakMoment::OptimizerStep);
            assert_eq!(b.peak_phase, a.peak_phase);
            // On the CPU the host is the same memory: the peak holds it.
            assert_eq!(
                a.peak + b.host - b.peak,
                a.master_weights + a.optimizer_state
            );
            // Sharded, each rank offloads the masters, moments and staging
            // tensors of its own share only (ShardedOptimizer::offloaded).
            let sharded = Plan {
                shard: Sharding::new(2, 1),
                ..offloaded
            };
            let c = MemoryModel.estimate(&spec, &sharded, &Target::Cpu);
            assert_eq!(c.host, (12 * p).div_ceil(2) + (cb * p).div_ceil(2));
        }
    }
}

/// The workspace links the patched candle-core; the stock backward's
/// working sets are larger at every moment, the forward's tensors the same.
#[test]
fn the_stock_backward_holds_more_at_every_moment() {
    assert_eq!(Backward::linked(), Backward::FirstGradientAsIs);
    for i in 0..3 {
        let spec = spec_for(i);
        for attention in [Attention::Composed, Attention::Flash] {
            let plan = Plan {
                attention,
                ..Plan::baseline(2, 256)
            };
            let exec = builtin_execution(&plan);
            let patched = activation_bytes_for(&spec, &plan, &exec, Backward::FirstGradientAsIs);
            let stock = activation_bytes_for(&spec, &plan, &exec, Backward::ZerosPlusGradient);
            assert_eq!(patched, activation_bytes(&spec, &plan, &exec));
            assert_eq!(stock.kept, patched.kept);
            assert!(stock.loss.transient > patched.loss.transient);
            assert!(stock.blocks.transient > patched.blocks.transient, "{plan}");
            assert!(stock.embedding.transient >= patched.embedding.transient);
        }
    }
}

/// The plan's bucket size bounds what a collective moves, and so the
/// buffers the estimate counts for it (a tensor larger than the bucket
/// travels alone).
#[test]
fn the_bucket_size_bounds_the_collective_buckets() {
    let spec = ModelSpec::from_config(
        "test",
        ModelConfig {
            vocab: 64,
            ..ModelConfig::gpt2_small()
        },
    );
    let plan = |bucket_bytes| Plan {
        shard: Sharding {
            bucket_bytes,
            ..Sharding::new(4, 2)
        },
        ..Plan::baseline(8, 128)
    };
    let fixes = Pipeline::default();
    let bucket = |bytes| state_bytes(&spec, &plan(bytes), fixes.strategies()).collective_bucket;
    assert_eq!(
        bucket(DEFAULT_BUCKET_BYTES),
        (DEFAULT_BUCKET_BYTES / 4) as u64
    );
    assert_eq!(bucket(16 << 20), 4 << 20);
    assert_eq!(bucket(1024), spec.largest_tensor());
}

/// LoRA on Llama-3-8B's shape (the same plan trained fully, and with
/// adapters on a bf16 and on an NF4 base).
mod lora {
    use super::*;
    use oomfix_strategies::lora::{BasePrecision, Lora};

    fn llama3_8b() -> ModelSpec {
        ModelSpec::from_config(
            "llama-3-8b shape",
            ModelConfig::llama(32, 4096, 32, 8, 14336, 128256, false),
        )
    }

    fn with(spec: &ModelSpec, plan: Plan, base: Option<BasePrecision>) -> Plan {
        let facts = model_facts(spec);
        Plan {
            lora: base.map(|b| Lora::new(16, None, None, b, &facts).unwrap()),
            ..plan
        }
    }

    #[test]
    fn the_blocks_linear_projections_are_read_from_the_tensors() {
        let facts = model_facts(&llama3_8b());
        let linears: Vec<(&str, u64, u64)> = facts
            .linears()
            .map(|l| (l.name, l.inputs, l.outputs))
            .collect();
        assert_eq!(
            linears,
            [
                ("q_proj", 4096, 4096),
                ("k_proj", 4096, 1024),
                ("v_proj", 4096, 1024),
                ("o_proj", 4096, 4096),
                ("gate_proj", 4096, 14336),
                ("up_proj", 4096, 14336),
                ("down_proj", 14336, 4096),
            ]
        );
        // GPT-2's Conv1D weights are [in, out]; two projections are c_proj.
        let gpt2 = model_facts(&ModelSpec::default_model());
        let names: Vec<(&str, u64, u64)> = gpt2
            .linears()
            .map(|l| (l.name, l.inputs, l.outputs))
            .collect();
        assert_eq!(
            names,
            [
                ("c_attn", 768, 2304),
                ("c_proj", 768, 768),
                ("c_fc", 768, 3072),
                ("c_proj", 3072, 768)
            ]
        );
    }

    #[test]
    fn frozen_weights_lower_the_state_and_keep_the_activations() {
        let spec = llama3_8b();
        let plan = Plan {
            micro_batch: 1,
            grad_accum: 8,
            precision: Precision::Bf16,
            checkpoint: Checkpointing::Every(1),
            attention: Attention::Flash,
            optimizer: OptimizerImpl::FusedAdamW,
            ..Plan::baseline(8, 1024)
        };
        let target = Target::Cuda(0);
        let full = MemoryModel.estimate(&spec, &plan, &target);
        let bf16 = MemoryModel.estimate(
            &spec,
            &with(&spec, plan, Some(BasePrecision::Bf16)),
            &target,
        );
        let nf4 =
            MemoryModel.estimate(&spec, &with(&spec, plan, Some(BasePrecision::Nf4)), &target);
        let p = spec.parameters();
        let adapters = 41_943_040u64;
        // Fully trained: bf16 weights and gradients, fp32 masters and moments.
        assert_eq!(full.weights, 2 * p);
        assert_eq!(full.optimizer_state, 8 * p);
        // LoRA: the adapters' state only, the frozen base in 16 bits, its
        // token embedding (only looked up) on the host.
        let embedding = 2 * 128_256 * 4096;
        assert_eq!(bf16.weights, 2 * p + 2 * adapters - embedding);
        assert_eq!(bf16.host, embedding);
        assert_eq!(bf16.gradients, 2 * adapters);
        assert_eq!(bf16.master_weights, 4 * adapters);
        assert_eq!(bf16.optimizer_state, 8 * adapters);
        assert_eq!(bf16.accumulated_gradients, 2 * adapters);
        assert!(
            nf4.weights < bf16.weights / 2,
            "{} {}",
            nf4.weights,
            bf16.weights
        );
        assert!(nf4.peak < bf16.peak && bf16.peak < full.peak);
        // The frozen head makes no weight gradient, so the loss's moment
        // holds less; a block's moment holds the adapters' [n, r] pair and,
        // with NF4, one dequantized projection (gate_proj, bf16) besides.
        let lora = with(&spec, plan, Some(BasePrecision::Nf4));
        let act_full = activation_bytes(&spec, &plan, &builtin_execution(&plan));
        let act_lora = activation_bytes(&spec, &lora, &builtin_execution(&lora));
        assert_eq!(act_lora.kept, act_full.kept);
        assert!(act_lora.loss.transient < act_full.loss.transient);
        assert_eq!(
            act_lora.blocks.transient,
            act_full.blocks.transient + 2 * 1024 * 16 * 2
        );
        let (_, s) = trained_state(
            &spec,
            &with(&spec, plan, Some(BasePrecision::Nf4)),
            &oomfix_strategies::builtins(),
        );
        assert_eq!(s.pass_transient, 2 * 4096 * 14336);
    }

    #[test]
    fn zero_shards_and_offload_move_the_adapters_never_the_frozen_base() {
        let spec = llama3_8b();
        let base = Plan {
            micro_batch: 1,
            grad_accum: 4,
            precision: Precision::Bf16,
            checkpoint: Checkpointing::Every(1),
            optimizer: OptimizerImpl::FusedAdamW,
            ..Plan::baseline(8, 512)
        };
        let lora = with(&spec, base, Some(BasePrecision::Nf4));
        let fixes = oomfix_strategies::builtins();
        let (_, one) = trained_state(&spec, &lora, &fixes);
        let zero3 = Plan {
            shard: Sharding::new(2, 3),
            grad_accum: 2,
            ..lora
        };
        let (_, sharded) = trained_state(&spec, &zero3, &fixes);
        let frozen = one.weights - 2 * 41_943_040;
        // ZeRO 3 shards the adapters between steps (2 bytes each over 2
        // ranks); every rank keeps the whole frozen base.
        assert_eq!(sharded.step_weights, frozen + 41_943_040);
        assert_eq!(sharded.optimizer_state, 8 * 41_943_040 / 2);
        let offloaded = Plan {
            optimizer: OptimizerImpl::OffloadedAdamW,
            ..lora
        };
        let (_, off) = trained_state(&spec, &offloaded, &fixes);
        assert_eq!((off.master_weights, off.optimizer_state), (0, 0));
        assert_eq!(off.host, 14 * 41_943_040 + 2 * 128_256 * 4096);
        assert_eq!(off.weights, one.weights);
    }
}
