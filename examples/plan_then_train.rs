//! A training loop that asks oomfix for a plan, then trains with it.
//!
//! ```sh
//! cargo run --release --example plan_then_train
//! ```
//!
//! The model here is a small GPT-2; with your own `.safetensors` file use
//! `oomfix::inspect(path)` for the spec and `TrainOptions::weights` to start
//! from its weights.

use candle_core::Device;
use oomfix::train::{data::DataSource, TrainOptions, Trainer};
use oomfix::{ModelConfig, ModelSpec, Planner, Target};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = ModelConfig {
        vocab: 2048,
        max_positions: 256,
        ..ModelConfig::gpt2(4, 128, 4)
    };
    let spec = ModelSpec::from_config("example gpt2", config.clone());

    // 1. Ask for the fastest plan that fits 256 MiB on this machine's CPU.
    let result = Planner::new(256 << 20)
        .global_batch(16)
        .seq_len(128)
        .target(Target::Cpu)
        .run(&spec)?;
    for a in &result.attempts {
        println!(
            "{:<18} {}  estimated {} bytes, fits: {}",
            a.strategy, a.plan, a.estimate.peak, a.fits
        );
    }
    let plan = result.chosen().ok_or("nothing fits in 256 MiB")?.plan;
    println!("training with: {plan}");

    // 2. Train with exactly that plan: micro-batches, precision, checkpointing
    //    and optimizer as chosen.
    let mut trainer = Trainer::new(&config, plan, &Device::Cpu, &TrainOptions::default())?;
    let mut data = DataSource::synthetic(0);
    for _ in 0..5 {
        let s = trainer.step(&mut data)?;
        println!(
            "step {}: loss {:.4}, {:.0} tokens/s",
            trainer.steps(),
            s.loss,
            s.tokens as f64 / s.seconds
        );
    }
    Ok(())
}
