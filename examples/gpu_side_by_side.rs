//! oomfix's half of the PyTorch side-by-side on cuda:0 (scripts/side-by-side.sh
//! runs both halves and prints the tables; results in docs/gpu-side-by-side.md).
//!
//! For each configuration on the command line, trains through `Trainer`: one
//! warm-up step (module load and PTX JIT, state allocation; excluded), then the
//! pool's high-water marks are reset and `--steps` steps are measured, each
//! between device synchronisations (`Trainer::step` resets the marks at its
//! start on CUDA, so they are the last step's; steady-state steps are alike). Prints one JSON line per configuration:
//! pool used/reserved high-water marks, median step time, and the memory
//! model's estimate with and without its runtime term (the pool holds no
//! runtime, so `estimate_pool_bytes` is the figure to compare with `peak_alloc_bytes`).
//! A CUDA out-of-memory is reported as `"status":"oom"`, then the pool is trimmed.
//!
//! With `--norm MODEL`, instead times the global gradient norm over bf16
//! tensors of MODEL's parameter shapes, random values: the one-pass
//! `clip::squared_norm` against the per-tensor composition of candle ops the
//! trainer used before it (4 Mi-element slices, each converted to f32,
//! squared, summed and read back), median of 5 after one untimed run each,
//! and prints one JSON line with both times and their relative difference.
//!
//! Usage: `gpu_side_by_side [--steps N] CONFIG...`, CONFIG =
//! `MODEL:BATCH:SEQ:PRECISION:CKPT:OPTIMIZER[:ACCUM[:ATTN]]`, e.g. `gpt2:8:1024:bf16:1:fused:1:flash`:
//! MODEL gpt2 | gpt2-medium | tinyllama; PRECISION fp32 | bf16; CKPT 0 (none) or
//! k (checkpoint every k blocks); OPTIMIZER fused | candle | cpu (offloaded); ACCUM micro-batches
//! per step (default 1); ATTN composed (default) | flash.
//!
//! Build with `scripts/build-cuda.sh --example gpu_side_by_side`.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use oomfix::strategies::clip;
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Precision};
use oomfix::track::cuda::{is_out_of_memory, reset_peaks, trim, PoolStats};
use oomfix::train::data::DataSource;
use oomfix::train::{TrainOptions, Trainer};
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Plan, Target};
use serde_json::{json, Value};

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut steps = 5;
    if let Some(i) = args.iter().position(|a| a == "--steps") {
        steps = args
            .get(i + 1)
            .context("--steps needs a number")?
            .parse()
            .context("--steps needs a number")?;
        args.drain(i..i + 2);
    }
    if let Some(i) = args.iter().position(|a| a == "--norm") {
        let model = args.get(i + 1).context("--norm needs a model")?.clone();
        let line = norm_bench(&Device::new_cuda(0)?, &model)?;
        println!("{line}");
        return Ok(());
    }
    if args.is_empty() || steps == 0 {
        bail!("usage: gpu_side_by_side [--steps N>0] MODEL:BATCH:SEQ:PRECISION:CKPT:OPTIMIZER[:ACCUM]...");
    }
    let configs: Vec<(String, ModelConfig, Plan)> =
        args.iter().map(|a| parse(a)).collect::<Result<_>>()?;
    let device = Device::new_cuda(0)?;
    for (model, config, plan) in configs {
        let line = run(&device, &model, &config, plan, steps)?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    Ok(())
}

/// Parses `MODEL:BATCH:SEQ:PRECISION:CKPT:OPTIMIZER[:ACCUM]`.
fn parse(arg: &str) -> Result<(String, ModelConfig, Plan)> {
    let f: Vec<&str> = arg.split(':').collect();
    let (model, batch, seq, precision, ckpt, optimizer, accum, attention) = match f[..] {
        [m, b, s, p, c, o] => (m, b, s, p, c, o, "1", "composed"),
        [m, b, s, p, c, o, a] => (m, b, s, p, c, o, a, "composed"),
        [m, b, s, p, c, o, a, t] => (m, b, s, p, c, o, a, t),
        _ => bail!("`{arg}` is not MODEL:BATCH:SEQ:PRECISION:CKPT:OPTIMIZER[:ACCUM[:ATTN]]"),
    };
    let attention = match attention {
        "composed" => Attention::Composed,
        "flash" => Attention::Flash,
        _ => bail!("unknown attention `{attention}` (composed, flash)"),
    };
    let config = model_config(model)?;
    let precision: Precision = precision.parse().map_err(anyhow::Error::msg)?;
    let checkpoint = match ckpt
        .parse::<usize>()
        .with_context(|| format!("checkpoint `{ckpt}`"))?
    {
        0 => Checkpointing::None,
        k => Checkpointing::Every(k),
    };
    let optimizer = match optimizer {
        "fused" => OptimizerImpl::FusedAdamW,
        "candle" => OptimizerImpl::CandleAdamW,
        "cpu" => OptimizerImpl::OffloadedAdamW,
        _ => bail!("unknown optimizer `{optimizer}` (fused, candle, cpu)"),
    };
    let plan = Plan {
        micro_batch: batch.parse().with_context(|| format!("batch `{batch}`"))?,
        grad_accum: accum
            .parse()
            .with_context(|| format!("accumulation `{accum}`"))?,
        seq_len: seq.parse().with_context(|| format!("seq `{seq}`"))?,
        precision,
        checkpoint,
        optimizer,
        attention,
        ..Plan::baseline(1, 1)
    };
    Ok((model.to_string(), config, plan))
}

/// The shape of a model named on the command line.
fn model_config(model: &str) -> Result<ModelConfig> {
    Ok(match model {
        "gpt2" => ModelConfig::gpt2_small(),
        "gpt2-medium" => ModelConfig::gpt2_medium(),
        "tinyllama" => ModelConfig::tinyllama_1_1b(),
        _ => bail!("unknown model `{model}` (gpt2, gpt2-medium, tinyllama)"),
    })
}

/// The sum of squares of `t` as the trainer took it before the one-pass
/// norm: slices of 4 Mi elements, each converted to f32, squared, summed and
/// read back to the host.
fn sliced_sum_of_squares(t: &Tensor) -> candle_core::Result<f64> {
    let flat = t.flatten_all()?;
    let n = flat.elem_count();
    let mut total = Tensor::zeros((), DType::F32, t.device())?;
    let mut start = 0;
    while start < n {
        let len = (1 << 22).min(n - start);
        let part = flat.narrow(0, start, len)?.to_dtype(DType::F32)?;
        total = (total + part.sqr()?.sum_all()?)?;
        start += len;
    }
    Ok(f64::from(total.to_scalar::<f32>()?))
}

/// Median milliseconds of 5 runs of `f` after one untimed run, each between
/// device synchronisations; and `f`'s last result.
fn time_ms(device: &Device, mut f: impl FnMut() -> Result<f64>) -> Result<(f64, f64)> {
    let mut value = f()?;
    device.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        value = f()?;
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[2], value))
}

/// `--norm MODEL`: the global gradient norm over bf16 tensors of the model's
/// parameter shapes, one pass against the sliced composition.
fn norm_bench(device: &Device, model: &str) -> Result<Value> {
    let config = model_config(model)?;
    let grads = config
        .tensors()
        .iter()
        .map(|(_, shape)| {
            Tensor::randn(0f32, 1e-3, shape.as_slice(), device)?.to_dtype(DType::BF16)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let elements: usize = grads.iter().map(Tensor::elem_count).sum();
    let (one_pass_ms, one_pass) = time_ms(device, || Ok(clip::squared_norm(&grads)?))?;
    let (sliced_ms, sliced) = time_ms(device, || {
        Ok(grads
            .iter()
            .map(sliced_sum_of_squares)
            .sum::<candle_core::Result<f64>>()?)
    })?;
    Ok(json!({
        "side": "norm",
        "model": model,
        "tensors": grads.len(),
        "elements": elements,
        "one_pass_ms": one_pass_ms,
        "sliced_ms": sliced_ms,
        "relative_difference": (one_pass - sliced).abs() / sliced,
    }))
}

/// Measures one configuration; the JSON line to print.
fn run(
    device: &Device,
    model: &str,
    config: &ModelConfig,
    plan: Plan,
    steps: usize,
) -> Result<Value> {
    let cuda = device.as_cuda_device()?;
    let spec = ModelSpec::from_config(model, config.clone());
    let estimate = MemoryModel.estimate(&spec, &plan, &Target::Cuda(0));
    let ckpt = match plan.checkpoint {
        Checkpointing::None => 0,
        Checkpointing::Every(k) => k,
    };
    let mut line = json!({
        "side": "oomfix",
        "model": model,
        "batch": plan.micro_batch,
        "accum": plan.grad_accum,
        "seq": plan.seq_len,
        "precision": plan.precision.as_str(),
        "ckpt": ckpt,
        "optimizer": plan.optimizer.as_str(),
        "attn": if plan.attention == Attention::Flash { "flash" } else { "composed" },
        "params": spec.parameters(),
        "estimate_bytes": estimate.peak,
        "estimate_pool_bytes": estimate.allocated_peak().saturating_sub(estimate.runtime),
        "estimate_phase": estimate.peak_phase.to_string(),
        "modelled_ms": 1e3 * MemoryModel.step_time(&spec, &plan, &Target::Cuda(0)).total,
    });
    trim(cuda)?;
    eprintln!("oomfix: {model} {plan}");
    let outcome = measure(device, config, plan, steps);
    trim(cuda)?;
    let fields = match outcome {
        Ok(m) => m,
        Err(e) => {
            let oom = candle_error(&e).is_some_and(is_out_of_memory);
            eprintln!("  {}: {e}", if oom { "out of memory" } else { "failed" });
            let high = PoolStats::read(cuda)?;
            json!({
                "status": if oom { "oom" } else { "error" },
                "error": e.to_string().lines().next().unwrap_or("").to_string(),
                "peak_alloc_bytes_before_failure": high.used_high,
            })
        }
    };
    let stats = PoolStats::read(cuda)?;
    fields
        .as_object()
        .into_iter()
        .flatten()
        .for_each(|(k, v)| line[k] = v.clone());
    line["outside_pool_bytes"] =
        json!((stats.device_total - stats.device_free).saturating_sub(stats.reserved));
    Ok(line)
}

/// Warm-up step, then `steps` measured steps after resetting the pool's peaks.
fn measure(
    device: &Device,
    config: &ModelConfig,
    plan: Plan,
    steps: usize,
) -> oomfix::Result<Value> {
    let cuda = device.as_cuda_device()?;
    let mut trainer = Trainer::new(config, plan, device, &TrainOptions::default())?;
    let mut data = DataSource::synthetic(0);
    let start = Instant::now();
    trainer.step(&mut data)?;
    device.synchronize()?;
    let first_s = start.elapsed().as_secs_f64();
    let resident = PoolStats::read(cuda)?.used;
    reset_peaks(cuda)?;
    let mut times = Vec::with_capacity(steps);
    let mut loss = f32::NAN;
    for _ in 0..steps {
        let start = Instant::now();
        loss = trainer.step(&mut data)?.loss;
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let stats = PoolStats::read(cuda)?;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(json!({
        "status": "ok",
        "peak_alloc_bytes": stats.used_high,
        "peak_reserved_bytes": stats.reserved_high,
        "resident_bytes": resident,
        "step_ms": sorted[sorted.len() / 2],
        "step_ms_all": times,
        "first_step_s": first_s,
        "loss": loss,
    }))
}

/// The candle error inside a training error, if any.
fn candle_error(e: &oomfix::Error) -> Option<&candle_core::Error> {
    match e {
        oomfix::Error::Candle(c)
        | oomfix::Error::Strategy(oomfix::strategies::Error::Candle(c)) => Some(c),
        _ => None,
    }
}
