//! The longest sequence that fits, as planned (`Planner::longest`, what
//! `--seq-len longest` runs), for the long-context table of
//! docs/long-context.md: Llama-3.1-8B's shape (32 blocks of 4096, 8 KV
//! heads, MLP 14336, vocabulary 128,256, a context of 131,072) under QLoRA
//! (r 32 on every linear projection of the blocks, NF4 base, batch 1) at
//! 8-80 GiB on one CUDA device, beside the lengths Unsloth publishes for the
//! same run; and full fine-tuning of Llama-3.2-1B's and Llama-3.1-8B's
//! shapes at 80 GiB. Estimates only: no step runs.
//!
//! ```sh
//! cargo run --release --example longest
//! ```

use oomfix::strategies::lora::{BasePrecision, Lora};
use oomfix::strategies::Pipeline;
use oomfix::units::group_digits;
use oomfix::{ModelConfig, ModelSpec, Pins, Planner, SearchResult};

/// Unsloth's longest Llama-3.1-8B QLoRA context by GPU memory (GB), from its
/// published long-context table.
const UNSLOTH: [(u64, u64); 6] = [
    (8, 2_972),
    (12, 21_848),
    (16, 40_724),
    (24, 78_475),
    (40, 153_977),
    (80, 342_733),
];

fn llama(layers: usize, hidden: usize, intermediate: usize, tied: bool) -> ModelConfig {
    ModelConfig {
        max_positions: 131_072,
        ..ModelConfig::llama(layers, hidden, 32, 8, intermediate, 128_256, tied)
    }
}

fn row(result: &SearchResult) -> (String, String) {
    let longest = result.longest.as_ref().and_then(|l| l.seq_len);
    let chosen = result.chosen();
    (
        longest.map_or("nothing fits".into(), |n| group_digits(n as u64)),
        chosen.map_or(String::new(), |a| {
            format!("{:.0} tokens/s; {}", a.tokens_per_second(), a.plan)
        }),
    )
}

fn main() -> oomfix::Result<()> {
    let spec = ModelSpec::from_config("Llama-3.1-8B shape", llama(32, 4096, 14336, false));
    let facts = oomfix::memory::model_facts(&spec);
    println!("QLoRA r 32, all linear projections, NF4 base, batch 1, one CUDA device\n");
    println!("| budget | Unsloth | oomfix longest | modelled speed; plan | without offload-activations |");
    println!("|---:|---:|---:|---|---:|");
    let without: Vec<&str> = Pipeline::default()
        .names()
        .into_iter()
        .filter(|n| *n != "offload-activations")
        .collect();
    for (gib, unsloth) in UNSLOTH {
        let search = |pipeline: Pipeline| {
            let mut pins = Pins::default();
            pins.lora = Some(Lora::new(32, None, None, BasePrecision::Nf4, &facts)?);
            pins.base_precision = Some(BasePrecision::Nf4);
            Planner::new(gib << 30)
                .global_batch(1)
                .host_budget(64 << 30)
                .pins(pins)
                .pipeline(pipeline)
                .longest(&spec)
        };
        let (longest, plan) = row(&search(Pipeline::default())?);
        let (kept, _) = row(&search(Pipeline::from_names(&without)?)?);
        println!(
            "| {gib} GiB | {} | {longest} | {plan} | {kept} |",
            group_digits(unsloth)
        );
    }
    println!("\nFull fine-tuning, batch 1, 80 GiB, 512 GiB of host memory\n");
    println!("| model | oomfix longest | modelled speed; plan |");
    println!("|---|---:|---|");
    for (name, config) in [
        ("Llama-3.2-1B shape", llama(16, 2048, 8192, true)),
        ("Llama-3.1-8B shape", llama(32, 4096, 14336, false)),
    ] {
        let spec = ModelSpec::from_config(name, config);
        let result = Planner::new(80 << 30)
            .global_batch(1)
            .host_budget(512 << 30)
            .longest(&spec)?;
        let (longest, plan) = row(&result);
        println!("| {name} | {longest} | {plan} |");
    }
    Ok(())
}
