//! ZeRO stages 1-3 over in-process ranks give the same training as one rank.

mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use common::{assert_close, det, values};
use oomfix_strategies::accumulate::collect_grads;
use oomfix_strategies::adamw::{ParamsAdamW, STEP_KEY};
use oomfix_strategies::shard::{
    partition, Comm, ShardedOptimizer, ThreadComm, ZeroStage, DEFAULT_BUCKET_BYTES,
};

const GLOBAL_BATCH: usize = 8;
const STEPS: u64 = 5;

/// Parameters of a 4 -> 6 -> 2 MLP: w1, b1, w2, b2 (sizes 24, 6, 12, 2).
fn init_params() -> Vec<Var> {
    [
        det((6, 4), 1),
        (det(6, 2) * 0.1).unwrap(),
        det((2, 6), 3),
        (det(2, 4) * 0.1).unwrap(),
    ]
    .iter()
    .map(|t| Var::from_tensor(t).unwrap())
    .collect()
}

/// Mean-squared error of the MLP on (x, y), mean over the rows given.
fn loss(p: &[Var], x: &Tensor, y: &Tensor) -> Tensor {
    let h = x
        .matmul(&p[0].as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(p[1].as_tensor())
        .unwrap()
        .tanh()
        .unwrap();
    let out = h
        .matmul(&p[2].as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(p[3].as_tensor())
        .unwrap();
    (out - y).unwrap().sqr().unwrap().mean_all().unwrap()
}

fn batch(step: u64) -> (Tensor, Tensor) {
    (
        det((GLOBAL_BATCH, 4), 100 + step),
        det((GLOBAL_BATCH, 2), 200 + step),
    )
}

fn adamw() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.05,
        weight_decay: 0.01,
        ..Default::default()
    }
}

/// `f` on each rank of a [`ThreadComm`] group of `world` threads: the
/// results in rank order.
fn on_ranks<T: Send>(world: usize, f: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(world)
            .into_iter()
            .map(|comm| s.spawn(move || f(comm)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Trains on `world` threads at `stage`, with each rank's optimizer on the
/// host when `offload`; every rank sees its slice of each global batch.
/// Returns each rank's final parameters (gathered for stage 3) and its
/// optimizer state shard.
fn train(
    world: usize,
    stage: ZeroStage,
    offload: bool,
) -> Vec<(Vec<Tensor>, HashMap<String, Tensor>)> {
    on_ranks(world, |comm| {
        let rank = comm.rank();
        let params = init_params();
        let mut opt = if offload {
            ShardedOptimizer::offloaded(comm, params.clone(), adamw(), stage, DEFAULT_BUCKET_BYTES)
        } else {
            ShardedOptimizer::new(comm, params.clone(), adamw(), stage)
        }
        .unwrap();
        assert_eq!(opt.is_offloaded(), offload);
        // Offloaded, a rank's fp32 weights of record are masters of
        // their own (the host's), one per owned parameter.
        for (i, p) in params.iter().enumerate() {
            let record = opt.weights_of_record(i);
            assert_eq!(record.is_some(), opt.owners()[i] == rank);
            let separate = record.is_some_and(|m| m.as_tensor().id() != p.as_tensor().id());
            assert_eq!(separate, offload && record.is_some());
        }
        let rows = GLOBAL_BATCH / world;
        for step in 0..STEPS {
            opt.gather_params().unwrap();
            let (x, y) = batch(step);
            let (x, y) = (
                x.narrow(0, rank * rows, rows).unwrap(),
                y.narrow(0, rank * rows, rows).unwrap(),
            );
            let store = loss(&params, &x, &y).backward().unwrap();
            let grads = collect_grads(&store, &params).unwrap();
            drop(store);
            opt.release_params().unwrap();
            opt.step(grads).unwrap();
            assert_eq!(opt.is_released(), stage == ZeroStage::Parameters);
        }
        opt.gather_params().unwrap();
        let state = opt.optimizer().state_tensors().unwrap();
        (
            params
                .iter()
                .map(|p| p.as_detached_tensor())
                .collect::<Vec<_>>(),
            state,
        )
    })
}

/// The same training with one rank, no sharding machinery: plain FusedAdamW on
/// the whole batch. Returns the parameters and the optimizer state.
fn reference() -> (Vec<Tensor>, HashMap<String, Tensor>) {
    let params = init_params();
    let mut opt = oomfix_strategies::adamw::FusedAdamW::new(params.clone(), adamw()).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step);
        opt.step(&collect_grads(&loss(&params, &x, &y).backward().unwrap(), &params).unwrap())
            .unwrap();
    }
    (
        params.iter().map(|p| p.as_detached_tensor()).collect(),
        opt.state_tensors().unwrap(),
    )
}

#[test]
fn every_stage_and_world_size_matches_one_rank() {
    let (want, want_state) = reference();
    // training moved the parameters, so equality below is not trivial
    assert!(values(&want[0]).unwrap() != values(&init_params()[0].as_detached_tensor()).unwrap());
    for stage in [
        ZeroStage::OptimizerState,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ] {
        for (world, offload) in [(1, false), (2, false), (4, false), (2, true), (4, true)] {
            let mut state_keys = 0;
            for (rank, (got, state)) in train(world, stage, offload).iter().enumerate() {
                let what = format!("{stage:?}, world {world}, offload {offload}, rank {rank}");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(g, w, 1e-5, &format!("{what}, param {i}"));
                }
                // the moments scale with the gradient (AdamW's step nearly does not):
                // they check that gradients are averaged, not summed
                for (key, t) in state.iter().filter(|(k, _)| k.as_str() != STEP_KEY) {
                    assert_close(t, &want_state[key], 1e-5, &format!("{what}, {key}"));
                    state_keys += 1;
                }
            }
            // each parameter's state lives on exactly one rank
            assert_eq!(state_keys, 2 * want.len(), "{stage:?}, world {world}");
        }
    }
}

#[test]
fn greedy_partition_largest_first() {
    // sizes of w1, b1, w2, b2
    assert_eq!(partition(&[24, 6, 12, 2], 1).unwrap(), [0, 0, 0, 0]);
    // 24 -> r0; 12 -> r1; 6 -> r1 (12 < 24); 2 -> r1 (18 < 24)
    assert_eq!(partition(&[24, 6, 12, 2], 2).unwrap(), [0, 1, 1, 1]);
    assert_eq!(partition(&[24, 6, 12, 2], 4).unwrap(), [0, 2, 1, 3]);
    // more ranks than parameters: the extra ranks own nothing
    assert_eq!(partition(&[5, 5], 3).unwrap(), [0, 1]);
    assert!(partition(&[1], 0).is_err());
}

#[test]
fn stage3_frees_non_owned_parameters_between_steps() {
    let finals = on_ranks(2, |comm| {
        let rank = comm.rank();
        let params = init_params();
        let opt =
            ShardedOptimizer::new(comm, params.clone(), adamw(), ZeroStage::Parameters).unwrap();
        assert!(opt.is_released());
        let x = Tensor::ones((1, 6), candle_core::DType::F32, &Device::Cpu).unwrap();
        for (p, &owner) in params.iter().zip(opt.owners()) {
            let used = p
                .as_tensor()
                .broadcast_mul(&x.narrow(1, 0, p.dims()[p.rank() - 1]).unwrap());
            // an owned parameter is usable; a freed one gives an error, not a value
            assert_eq!(used.is_ok(), owner == rank, "rank {rank}, owner {owner}");
        }
        let mut opt = opt;
        opt.gather_params().unwrap();
        params
            .iter()
            .map(|p| values(p.as_tensor()).unwrap())
            .collect::<Vec<_>>()
    });
    // gathered parameters are the initial ones on both ranks
    let init: Vec<_> = init_params()
        .iter()
        .map(|p| values(p.as_tensor()).unwrap())
        .collect();
    assert_eq!(finals, [init.clone(), init]);
}

#[test]
fn thread_comm_collectives() {
    let results = on_ranks(3, |c| {
        let r = c.rank() as f32;
        let t = Tensor::new(&[r, 10.0 * r], &Device::Cpu).unwrap();
        let all = values(&c.all_reduce_sum(&t).unwrap()).unwrap();
        let reduced = c.reduce_sum(&t, 1).unwrap().map(|t| values(&t).unwrap());
        let bcast = values(&c.broadcast(&t, 2).unwrap()).unwrap();
        let gathered: Vec<_> = c
            .all_gather(&t)
            .unwrap()
            .iter()
            .map(|t| values(t).unwrap())
            .collect();
        let bad_root = c.broadcast(&t, 3).is_err();
        let bad_shape = c.broadcast(
            &Tensor::zeros(c.rank() + 1, candle_core::DType::F32, &Device::Cpu).unwrap(),
            0,
        );
        (all, reduced, bcast, gathered, bad_root, bad_shape.is_err())
    });
    for (rank, (all, reduced, bcast, gathered, bad_root, bad_shape)) in
        results.into_iter().enumerate()
    {
        assert_eq!(all, [3.0, 30.0]);
        assert_eq!(reduced, (rank == 1).then(|| vec![3.0, 30.0]));
        assert_eq!(bcast, [2.0, 20.0]);
        assert_eq!(gathered, [vec![0.0, 0.0], vec![1.0, 10.0], vec![2.0, 20.0]]);
        assert!(bad_root);
        assert_eq!(bad_shape, rank != 0, "only receivers of another shape fail");
    }
}

#[test]
fn mismatched_ranks_fail_on_every_rank() {
    let outcomes = on_ranks(2, |comm| {
        let mut params = init_params();
        if comm.rank() == 1 {
            params.pop();
        }
        ShardedOptimizer::new(comm, params, adamw(), ZeroStage::Gradients).is_err()
    });
    assert_eq!(outcomes, [true, true]);
    assert!(ZeroStage::try_from(4).is_err());
    assert_eq!(ZeroStage::try_from(2).unwrap(), ZeroStage::Gradients);
}

/// A [`Comm`] that counts the collectives it passes on.
struct Counting<C> {
    inner: C,
    calls: std::sync::atomic::AtomicUsize,
}

impl<C: Comm> Comm for Counting<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> oomfix_strategies::Result<Tensor> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.all_reduce_sum(t)
    }
    fn reduce_sum(&self, t: &Tensor, root: usize) -> oomfix_strategies::Result<Option<Tensor>> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.reduce_sum(t, root)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> oomfix_strategies::Result<Tensor> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.broadcast(t, root)
    }
    fn all_gather(&self, t: &Tensor) -> oomfix_strategies::Result<Vec<Tensor>> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.all_gather(t)
    }
}

/// Collectives of one step at `bucket_bytes`, on 2 ranks at stage 2, and the
/// parameters after it (rank 0's).
fn one_step_calls(bucket_bytes: usize) -> (usize, Vec<Vec<f32>>) {
    let out = on_ranks(2, |inner| {
        let rank = inner.rank();
        let comm = Counting {
            inner,
            calls: 0.into(),
        };
        let params = init_params();
        let mut opt = ShardedOptimizer::with_buckets(
            comm,
            params.clone(),
            adamw(),
            ZeroStage::Gradients,
            bucket_bytes,
        )
        .unwrap();
        let (x, y) = batch(0);
        let (x, y) = (
            x.narrow(0, rank * 4, 4).unwrap(),
            y.narrow(0, rank * 4, 4).unwrap(),
        );
        let grads = collect_grads(&loss(&params, &x, &y).backward().unwrap(), &params).unwrap();
        let before = opt.comm().calls.load(std::sync::atomic::Ordering::SeqCst);
        opt.step(grads).unwrap();
        let calls = opt.comm().calls.load(std::sync::atomic::Ordering::SeqCst) - before;
        let values: Vec<_> = params
            .iter()
            .map(|p| values(p.as_tensor()).unwrap())
            .collect();
        (calls, values)
    });
    out.into_iter().next().unwrap()
}

#[test]
fn gradients_and_parameters_travel_in_buckets() {
    // Owners on 2 ranks: w1 (24) -> 0; w2, b1, b2 (12, 6, 2) -> 1.
    // Large buckets: one reduce and one broadcast per owner.
    let (calls, big) = one_step_calls(1 << 20);
    assert_eq!(calls, 4);
    // 1-byte buckets: one bucket per parameter, one reduce and one broadcast each.
    let (calls, small) = one_step_calls(1);
    assert_eq!(calls, 8);
    // 64 bytes per bucket: rank 1's vars in order are b1 (24 bytes), w2 (48), b2 (8):
    // b1 alone (b1 + w2 is 72), then w2 and b2 together; w1 (96) is rank 0's only bucket.
    let (calls, mid) = one_step_calls(64);
    assert_eq!(calls, 2 * 3);
    assert_eq!(big, small);
    assert_eq!(big, mid);
}

/// Stages 2 and 3 reduce every micro-batch at once: what a rank then holds is
/// the mean gradient of the global batch for the parameters it owns, and
/// nothing for the others.
#[test]
fn micro_batches_reduced_one_by_one_leave_each_rank_its_share() {
    let params = init_params();
    let (x, y) = batch(0);
    let want = collect_grads(&loss(&params, &x, &y).backward().unwrap(), &params).unwrap();
    let (world, micro) = (2, 2);
    for stage in [ZeroStage::Gradients, ZeroStage::Parameters] {
        let per_rank = on_ranks(world, |comm| {
            let rank = comm.rank();
            let params = init_params();
            let mut opt = ShardedOptimizer::new(comm, params.clone(), adamw(), stage).unwrap();
            opt.gather_params().unwrap();
            let rows = GLOBAL_BATCH / world / micro;
            let (x, y) = batch(0);
            for k in 0..micro {
                let at = (rank * micro + k) * rows;
                let l = loss(
                    &params,
                    &x.narrow(0, at, rows).unwrap(),
                    &y.narrow(0, at, rows).unwrap(),
                );
                opt.reduce(collect_grads(&l.backward().unwrap(), &params).unwrap())
                    .unwrap();
            }
            let owned: Vec<usize> = (0..params.len())
                .filter(|&i| opt.owners()[i] == rank)
                .collect();
            (owned, opt.take_reduced(1.0 / micro as f64).unwrap())
        });
        let mut seen = 0;
        for (rank, (owned, grads)) in per_rank.iter().enumerate() {
            assert_eq!(
                owned.len(),
                grads.len(),
                "{stage:?} rank {rank}: one sum per owned parameter"
            );
            for (&i, g) in owned.iter().zip(grads) {
                assert_close(
                    g,
                    &want[i],
                    1e-5,
                    &format!("{stage:?} rank {rank} param {i}"),
                );
            }
            seen += owned.len();
        }
        assert_eq!(seen, params.len(), "every parameter is owned once");
    }
}
