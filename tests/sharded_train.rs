//! The trainer at world size N (ranks as threads over `ThreadComm`) takes the
//! steps of one rank with the same global batch, at every ZeRO stage, and its
//! checkpoint directory resumes at another world size.

mod common;

use candle_core::Device;
use oomfix::strategies::shard::{Comm, ThreadComm};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};
use oomfix::train::data::DataSource;
use oomfix::train::{TrainOptions, Trainer};

const STEPS: usize = 3;

/// micro-batch 1, 2 micro-batches per rank: a global batch of 2 × world.
fn plan(world: usize, stage: u8, grad_accum: usize) -> Plan {
    Plan {
        micro_batch: 1,
        grad_accum,
        precision: Precision::F32,
        checkpoint: Checkpointing::None,
        attention: Attention::Composed,
        optimizer: OptimizerImpl::FusedAdamW,
        shard: Sharding::new(world, stage),
        ..Plan::baseline(2 * world, 16)
    }
}

/// The tiny Llama's trainer of `plan` on one rank.
fn one_rank(plan: Plan, options: &TrainOptions) -> Trainer {
    Trainer::new(&common::tiny_llama(), plan, &Device::Cpu, options).unwrap()
}

fn losses(trainer: &mut Trainer) -> Vec<f32> {
    let mut data = DataSource::synthetic(11);
    (0..STEPS)
        .map(|_| trainer.step(&mut data).unwrap().loss)
        .collect()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-6))
}

#[test]
fn every_stage_at_2_and_4_ranks_takes_the_one_rank_steps() {
    // Weight decay large enough to show in the losses: biases and norm
    // scales are exempt on every rank as on one.
    let mut options = TrainOptions::default();
    options.adamw.lr = 1e-2;
    options.adamw.weight_decay = 0.5;
    for world in [2, 4] {
        let mut one = one_rank(plan(1, 0, 2 * world), &options);
        let want = losses(&mut one);
        assert!(
            want[STEPS - 1] < want[0],
            "training lowers the loss: {want:?}"
        );
        for stage in 1..=3 {
            let got = on_ranks(plan(world, stage, 2), &options, |t| {
                assert_eq!(t.world_size(), world);
                losses(t)
            });
            for (rank, l) in got.iter().enumerate() {
                assert!(
                    close(l, &want),
                    "world {world}, stage {stage}, rank {rank}: {l:?} vs {want:?}"
                );
            }
        }
    }
}

/// Also with the optimizer offloaded: each rank keeps its share's masters
/// and moments on the host (one process's offloaded steps are those of
/// fused AdamW over fp32 masters, bit for bit).
#[test]
fn mixed_precision_ranks_keep_the_masters_of_their_share_and_take_the_one_rank_steps() {
    let bf16 = |p: Plan| Plan {
        precision: Precision::Bf16,
        ..p
    };
    let offloaded = |p: Plan| Plan {
        optimizer: OptimizerImpl::OffloadedAdamW,
        ..bf16(p)
    };
    let mut options = TrainOptions::default();
    options.adamw.lr = 1e-2;
    let mut one = one_rank(bf16(plan(1, 0, 4)), &options);
    let want = losses(&mut one);
    let vars = one.model().vars().len();
    let masters = |t: &Trainer| {
        t.parameter_buffers()
            .iter()
            .filter(|(n, _)| n.starts_with("master."))
            .count()
    };
    assert_eq!(masters(&one), vars, "one rank keeps every master");
    let moved = want
        .iter()
        .map(|l| ((l - want[0]) / want[0]).abs())
        .fold(0.0, f32::max);
    assert!(moved > 2e-3, "the steps move the loss: {want:?}");
    let sharded = (1..=3)
        .map(|stage| bf16(plan(2, stage, 2)))
        .chain([offloaded(plan(2, 1, 2)), offloaded(plan(2, 3, 2))]);
    for ranks_plan in sharded {
        let stage = format!("{}, {}", ranks_plan.shard.stage, ranks_plan.optimizer);
        let got = on_ranks(ranks_plan, &options, |t| (losses(t), masters(t)));
        let kept: Vec<usize> = got.iter().map(|g| g.1).collect();
        assert_eq!(
            kept.iter().sum::<usize>(),
            vars,
            "stage {stage}: each master on one rank, {kept:?}"
        );
        assert!(kept.iter().all(|&k| k > 0), "stage {stage}: {kept:?}");
        // bf16 weights: the ranks sum the gradients in another order (the
        // losses differ by ~1.3e-4 relative), and the losses move by ~3e-3,
        // so steps that left the weights alone would fail.
        for (rank, (l, _)) in got.iter().enumerate() {
            let worst = l
                .iter()
                .zip(&want)
                .map(|(a, b)| ((a - b) / b).abs())
                .fold(0.0, f32::max);
            assert!(
                worst < 1e-3,
                "stage {stage}, rank {rank}: {l:?} vs {want:?}"
            );
        }
    }
}

/// With checkpointed segments, stages 2 and 3 reduce each segment's
/// gradients once its backward made them (more, smaller collectives: the
/// same gradient bytes), and stage 3 gathers each block's parameters only
/// while its segment runs (more parameter bytes): the same steps either way.
#[test]
fn stages_2_and_3_with_checkpointing_work_block_by_block_and_take_the_one_rank_steps() {
    let every_block = |p: Plan| Plan {
        checkpoint: Checkpointing::Every(1),
        ..p
    };
    let options = TrainOptions::default();
    let mut one = one_rank(every_block(plan(1, 0, 4)), &options);
    let want = losses(&mut one);
    let step = |t: &mut Trainer| {
        let mut data = DataSource::synthetic(11);
        (0..STEPS)
            .map(|_| t.step(&mut data).unwrap())
            .map(|s| (s.collectives, s.loss))
            .unzip::<_, _, Vec<_>, Vec<_>>()
    };
    for stage in [2, 3] {
        let whole = on_ranks(plan(2, stage, 2), &options, step);
        let units = on_ranks(every_block(plan(2, stage, 2)), &options, step);
        for (rank, ((whole, _), (units, l))) in whole.iter().zip(&units).enumerate() {
            let what = format!("stage {stage}, rank {rank}: {units:?} vs {whole:?}");
            assert!(units[1].calls > whole[1].calls, "{what}");
            if stage == 2 {
                assert_eq!(units[1].bytes, whole[1].bytes, "{what}");
            } else {
                // Per micro-batch, each block is gathered for its forward and
                // again for its recomputation, instead of all parameters once a step.
                assert!(units[1].bytes > whole[1].bytes, "{what}");
            }
            assert!(
                close(l, &want),
                "stage {stage}, rank {rank}: {l:?} vs {want:?}"
            );
        }
    }
}

#[test]
fn a_plan_for_another_world_size_is_refused() {
    let options = TrainOptions::default();
    let comm: Box<dyn Comm> = Box::new(ThreadComm::group(1).pop().unwrap());
    let err = Trainer::new_sharded(
        &common::tiny_llama(),
        plan(2, 1, 2),
        &Device::Cpu,
        &options,
        comm,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("2 ranks"), "{err}");
    assert!(err.is_input());
    let err = Trainer::new(&common::tiny_llama(), plan(2, 1, 2), &Device::Cpu, &options)
        .err()
        .unwrap();
    assert!(err.is_input(), "{err}");
}

/// Runs `f` on each rank of a trainer of `plan` (its world size of threads
/// over `ThreadComm`); gives back each rank's result.
fn on_ranks<R: Send>(
    plan: Plan,
    options: &TrainOptions,
    f: impl Fn(&mut Trainer) -> R + Sync,
) -> Vec<R> {
    common::on_thread_ranks(plan.shard.world_size, |comm| {
        let llama = common::tiny_llama();
        let mut t = Trainer::new_sharded(&llama, plan, &Device::Cpu, options, comm).unwrap();
        f(&mut t)
    })
}

#[test]
fn a_sharded_run_saves_one_directory_that_resumes_at_another_world_size() {
    let options = TrainOptions::default();
    let one = || one_rank(plan(1, 0, 4), &options);
    let want = losses(&mut one());
    let dir = tempfile::tempdir().unwrap();
    for stage in [1, 3] {
        // Two steps on 2 ranks, saved; the last step on 1 rank, from the directory.
        let ck = dir.path().join(format!("stage{stage}"));
        let first = on_ranks(plan(2, stage, 2), &TrainOptions::default(), |t| {
            let mut data = DataSource::synthetic(11);
            let l: Vec<f32> = (0..2).map(|_| t.step(&mut data).unwrap().loss).collect();
            t.save(&ck, &data).unwrap();
            l
        });
        assert!(close(&first[0], &want[..2]), "{first:?} vs {want:?}");
        let mut resumed = one();
        let mut data = DataSource::synthetic(99);
        let saved_plan = resumed.resume(&ck, &mut data).unwrap();
        assert_eq!(saved_plan.shard.world_size, 2);
        let last = resumed.step(&mut data).unwrap().loss;
        assert!(
            close(&[last], &want[2..]),
            "stage {stage}: {last} vs {want:?}"
        );

        // And back: 1 rank's directory resumed on 2 ranks, each taking its share.
        let ck1 = dir.path().join(format!("one{stage}"));
        let mut first = one();
        let mut data = DataSource::synthetic(11);
        first.step(&mut data).unwrap();
        first.step(&mut data).unwrap();
        first.save(&ck1, &data).unwrap();
        let last = on_ranks(plan(2, stage, 2), &TrainOptions::default(), |t| {
            let mut data = DataSource::synthetic(5);
            t.resume(&ck1, &mut data).unwrap();
            t.step(&mut data).unwrap().loss
        });
        for l in last {
            assert!(close(&[l], &want[2..]), "stage {stage}: {l} vs {want:?}");
        }
    }
}
