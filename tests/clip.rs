//! Gradient clipping by global norm in the trainer: the norm it reports is
//! that of the step's gradients computed independently (plain, accumulated,
//! fp16 loss-scaled, sharded over 2 ranks at every ZeRO stage), a clipped
//! step is the step of the gradients times the clip coefficient, for each
//! optimizer, and clipping changes the step when the norm exceeds the limit.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use oomfix::strategies::adamw::{FusedAdamW, ParamsAdamW};
use oomfix::strategies::clip::clip_coefficient;
use oomfix::strategies::{
    Attention, Checkpointing, Execution, OptimizerImpl, Plan, Precision, Sharding,
};
use oomfix::train::data::DataSource;
use oomfix::train::{build_model, compute_dtype, TrainOptions, Trainer};

const DATA_SEED: u64 = 11;

fn plan(grad_accum: usize, precision: Precision, optimizer: OptimizerImpl) -> Plan {
    Plan {
        micro_batch: 2,
        grad_accum,
        precision,
        checkpoint: Checkpointing::None,
        attention: Attention::Composed,
        optimizer,
        ..Plan::baseline(2 * grad_accum, 16)
    }
}

fn sharded(plan: Plan, world: usize, stage: u8) -> Plan {
    Plan {
        shard: Sharding::new(world, stage),
        ..plan
    }
}

/// Options with an AdamW epsilon large enough that the update depends on
/// the gradients' scale (with 1e-8, Adam's first step is nearly lr·sign(g)).
fn options(max_grad_norm: Option<f64>) -> TrainOptions {
    let mut o = TrainOptions::default();
    o.adamw = ParamsAdamW {
        lr: 1e-2,
        eps: 1e-2,
        weight_decay: 0.0,
        ..Default::default()
    };
    o.max_grad_norm = max_grad_norm;
    o
}

/// The mean gradients of the first step of `plan` at `world` ranks, computed
/// here: the same model (seed 0, as the trainer's default), the step's
/// `world × grad_accum` micro-batches of the synthetic data, the loss
/// scaled by `loss_scale` and the gradients divided by it in f64.
fn reference_grads(plan: &Plan, world: usize, loss_scale: f64) -> (Vec<Var>, Vec<Vec<f64>>) {
    let config = common::tiny_llama();
    let dtype = compute_dtype(plan.precision);
    let model = build_model(&config, None, dtype, &Device::Cpu, 0).unwrap();
    let mut data = DataSource::synthetic(DATA_SEED);
    let micro_batches = world * plan.grad_accum;
    let mut sums: Vec<Vec<f64>> = Vec::new();
    for _ in 0..micro_batches {
        let windows = data.next_windows(plan.micro_batch, plan.seq_len, config.vocab);
        let batch = oomfix::train::batch_from_windows(
            config.family,
            config.vocab,
            &windows,
            plan.micro_batch,
            plan.seq_len,
            0,
            &Device::Cpu,
        )
        .unwrap();
        let exec = Execution::default().loss_scale(loss_scale);
        let out = model.forward_backward(&batch, &exec).unwrap();
        sums.resize(out.grads.len(), Vec::new());
        for (sum, g) in sums.iter_mut().zip(&out.grads) {
            let v = common::values(g);
            sum.resize(v.len(), 0.0);
            for (s, x) in sum.iter_mut().zip(v) {
                *s += f64::from(x) / loss_scale / micro_batches as f64;
            }
        }
    }
    let vars = model.named_vars().iter().map(|(_, v)| v.clone()).collect();
    (vars, sums)
}

fn norm_of(grads: &[Vec<f64>]) -> f64 {
    grads.iter().flatten().map(|x| x * x).sum::<f64>().sqrt()
}

fn first_step(plan: Plan, options: &TrainOptions) -> (oomfix::train::StepStats, Vec<Vec<f32>>) {
    let mut t = Trainer::new(&common::tiny_llama(), plan, &Device::Cpu, options).unwrap();
    let stats = t.step(&mut DataSource::synthetic(DATA_SEED)).unwrap();
    let weights = t
        .model()
        .vars()
        .iter()
        .map(|v| common::values(v.as_tensor()))
        .collect();
    (stats, weights)
}

fn assert_close(got: f64, want: f64, rel: f64, what: &str) {
    assert!(
        (got - want).abs() <= rel * want,
        "{what}: norm {got}, computed independently {want}"
    );
}

#[test]
fn the_norm_is_that_of_the_steps_gradients() {
    for (name, plan, rel) in [
        (
            "plain",
            plan(1, Precision::F32, OptimizerImpl::FusedAdamW),
            1e-5,
        ),
        (
            "accumulated",
            plan(3, Precision::F32, OptimizerImpl::FusedAdamW),
            1e-5,
        ),
        // The unscaled gradients are f16 values: their rounding is the difference.
        (
            "fp16",
            plan(2, Precision::F16, OptimizerImpl::FusedAdamW),
            2e-3,
        ),
    ] {
        let scale = if plan.precision == Precision::F16 {
            oomfix::strategies::precision::LossScalerConfig::default().init_scale
        } else {
            1.0
        };
        let want = norm_of(&reference_grads(&plan, 1, scale).1);
        let (stats, _) = first_step(plan, &options(None));
        assert!(!stats.skipped, "{name}: the first step overflowed");
        assert_close(stats.grad_norm, want, rel, name);
        // Clipping does not change the norm reported (that before clipping).
        let (clipped, _) = first_step(plan, &options(Some(want / 10.0)));
        assert_eq!(clipped.grad_norm, stats.grad_norm, "{name}");
    }
}

#[test]
fn a_clipped_step_is_the_step_of_the_scaled_gradients() {
    for optimizer in [
        OptimizerImpl::FusedAdamW,
        OptimizerImpl::CandleAdamW,
        OptimizerImpl::OffloadedAdamW,
    ] {
        let plan = plan(2, Precision::F32, optimizer);
        let (vars, grads) = reference_grads(&plan, 1, 1.0);
        let norm = norm_of(&grads);
        let max = norm / 4.0;
        let (_, unclipped) = first_step(plan, &options(None));
        let (stats, clipped) = first_step(plan, &options(Some(max)));
        // The reference: fused AdamW given the gradients times the coefficient.
        let coefficient = clip_coefficient(stats.grad_norm, max);
        assert!(coefficient < 0.3, "{optimizer:?}: {coefficient}");
        let scaled: Vec<Tensor> = grads
            .iter()
            .zip(&vars)
            .map(|(g, v)| {
                let g: Vec<f32> = g.iter().map(|&x| (x * coefficient) as f32).collect();
                Tensor::from_vec(g, v.shape(), &Device::Cpu).unwrap()
            })
            .collect();
        let mut reference = FusedAdamW::new(vars.clone(), options(None).adamw).unwrap();
        reference.step(&scaled).unwrap();
        let mut largest_change = 0f32;
        for (i, v) in vars.iter().enumerate() {
            let want = common::values(&v.as_tensor().to_dtype(DType::F32).unwrap());
            for ((c, w), u) in clipped[i].iter().zip(&want).zip(&unclipped[i]) {
                assert!(
                    (c - w).abs() <= 1e-6,
                    "{optimizer:?}, var {i}: clipped {c}, reference {w}"
                );
                largest_change = largest_change.max((c - u).abs());
            }
        }
        // Clipping on and off differ when the norm exceeds the limit.
        assert!(largest_change > 1e-4, "{optimizer:?}: {largest_change}");
    }
}

#[test]
fn two_ranks_report_and_clip_the_global_norm_at_every_stage() {
    let one_rank = plan(4, Precision::F32, OptimizerImpl::FusedAdamW);
    let per_rank = plan(2, Precision::F32, OptimizerImpl::FusedAdamW);
    let want = norm_of(&reference_grads(&per_rank, 2, 1.0).1);
    let clip = Some(want / 3.0);
    // One rank with the whole global batch: the norms and losses of 3 clipped steps.
    let mut t = Trainer::new(
        &common::tiny_llama(),
        one_rank,
        &Device::Cpu,
        &options(clip),
    )
    .unwrap();
    let mut data = DataSource::synthetic(DATA_SEED);
    let single: Vec<(f32, f64)> = (0..3)
        .map(|_| {
            let s = t.step(&mut data).unwrap();
            (s.loss, s.grad_norm)
        })
        .collect();
    assert_close(single[0].1, want, 1e-5, "one rank");
    for stage in 1..=3u8 {
        let got: Vec<Vec<(f32, f64)>> = common::on_thread_ranks(2, |comm| {
            let mut t = Trainer::new_sharded(
                &common::tiny_llama(),
                sharded(per_rank, 2, stage),
                &Device::Cpu,
                &options(clip),
                comm,
            )
            .unwrap();
            let mut data = DataSource::synthetic(DATA_SEED);
            (0..3)
                .map(|_| {
                    let s = t.step(&mut data).unwrap();
                    (s.loss, s.grad_norm)
                })
                .collect()
        });
        for (rank, steps) in got.iter().enumerate() {
            for (k, ((loss, norm), (want_loss, want_norm))) in steps.iter().zip(&single).enumerate()
            {
                let what = format!("stage {stage}, rank {rank}, step {}", k + 1);
                assert_close(*norm, *want_norm, 1e-5, &what);
                assert!(
                    (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
                    "{what}: loss {loss} vs {want_loss}"
                );
            }
        }
    }
}
