//! The offload fix end to end: the planner reaches for it only where the device
//! has memory apart from the host's, and a trainer with the optimizer offloaded
//! takes exactly the steps of one with the fused AdamW on the device.

mod common;

use candle_core::Device;
use common::values;
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision};
use oomfix::train::data::DataSource;
use oomfix::train::{TrainOptions, Trainer};
use oomfix::{ModelConfig, ModelSpec, Planner, Target};

fn plan(precision: Precision, optimizer: OptimizerImpl) -> Plan {
    Plan {
        micro_batch: 2,
        grad_accum: 2,
        precision,
        checkpoint: Checkpointing::Every(1),
        attention: Attention::Flash,
        optimizer,
        ..Plan::baseline(4, 16)
    }
}

/// Losses of `steps` steps and the parameters after them, as f32 values.
fn train(trainer: &mut Trainer, data: &mut DataSource, steps: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let losses = (0..steps)
        .map(|_| trainer.step(data).unwrap().loss)
        .collect();
    let params = trainer.model().vars().iter().map(|v| values(v)).collect();
    (losses, params)
}

#[test]
fn offloaded_training_takes_the_fused_steps_exactly() {
    let options = TrainOptions::default();
    for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
        let run = |optimizer| {
            let mut trainer = Trainer::new(
                &common::tiny_llama(),
                plan(precision, optimizer),
                &Device::Cpu,
                &options,
            )
            .unwrap();
            train(&mut trainer, &mut DataSource::synthetic(7), 3)
        };
        let (fused_losses, fused_params) = run(OptimizerImpl::FusedAdamW);
        let (losses, params) = run(OptimizerImpl::OffloadedAdamW);
        assert_eq!(losses, fused_losses, "{precision}");
        assert_eq!(params, fused_params, "{precision}");
        let mut untrained = Trainer::new(
            &common::tiny_llama(),
            plan(precision, OptimizerImpl::OffloadedAdamW),
            &Device::Cpu,
            &options,
        )
        .unwrap();
        let (_, initial) = train(&mut untrained, &mut DataSource::synthetic(7), 0);
        assert_ne!(params, initial, "{precision}: the steps moved the weights");
    }
}

#[test]
fn an_offloaded_run_resumes_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run");
    let options = TrainOptions::default();
    let plan = plan(Precision::Bf16, OptimizerImpl::OffloadedAdamW);
    let new = || Trainer::new(&common::tiny_llama(), plan, &Device::Cpu, &options).unwrap();

    let mut straight = new();
    let mut data = DataSource::synthetic(3);
    let (expected, expected_params) = train(&mut straight, &mut data, 4);

    let mut first = new();
    let mut data = DataSource::synthetic(3);
    train(&mut first, &mut data, 2);
    assert!(first.saves_optimizer_state());
    first.save(&path, &data).unwrap();
    drop(first);
    let mut resumed = new();
    let mut data = DataSource::synthetic(99);
    resumed.resume(&path, &mut data).unwrap();
    let (losses, params) = train(&mut resumed, &mut data, 2);
    assert_eq!(losses, expected[2..]);
    assert_eq!(params, expected_params);
}

#[test]
fn the_planner_offloads_a_1b_llama_into_8_gib_of_one_gpu_but_not_on_the_cpu() {
    let spec = ModelSpec::from_config("tinyllama", ModelConfig::tinyllama_1_1b());
    let budget = 8 << 30;
    let gpu = Planner::new(budget)
        .target(Target::Cuda(0))
        .run(&spec)
        .unwrap();
    let chosen = gpu
        .chosen()
        .expect("a plan fits one GPU with the optimizer offloaded");
    assert_eq!(chosen.plan.optimizer, OptimizerImpl::OffloadedAdamW);
    assert!(chosen.estimate.peak <= budget);
    // master weights and AdamW state (12 bytes per parameter) are on the host
    assert!(chosen.estimate.host >= 12 * spec.parameters());
    // every fix before it was tried and did not fit
    let offload = gpu
        .attempts
        .iter()
        .position(|a| a.strategy == "offload")
        .unwrap();
    assert!(gpu.attempts[..offload].iter().all(|a| !a.fits));

    let cpu = Planner::new(budget).target(Target::Cpu).run(&spec).unwrap();
    assert!(!cpu.fits());
    assert!(cpu
        .attempts
        .iter()
        .all(|a| !a.plan.optimizer.is_offloaded()));
}
