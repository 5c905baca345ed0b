//! GPU experiments on cuda:0, printed as markdown tables:
//!
//! 1. numerical match of the CUDA fused AdamW step with the CPU one over ten
//!    steps, per parameter/gradient dtype pair;
//!    Then gradient accumulation on CUDA (in place) against the CPU's, four
//!    micro-batches and the mean, per accumulator/gradient dtype pair;
//! 2. fused AdamW bandwidth against a device-to-device copy of the same bytes,
//!    and `candle_nn::AdamW` on the same update;
//! 3. GPT-2 small training steps through `Trainer`: the pool's high-water
//!    marks against the memory model's estimate, and the step time;
//! 4. the fused cross-entropy on CUDA: loss and logits gradient against
//!    candle_nn's composed loss on the CPU, then time and pool transient of
//!    forward+backward against the composed loss at GPT-2's vocabulary;
//! 5. the fused layer ops (norms, biased linear, GELU, SwiGLU, RoPE, the
//!    embedding lookup, the attention probabilities, the LM loss in chunks
//!    of tokens) on CUDA against the same ops on the CPU (output and
//!    every input's gradient), then the time of forward+backward against the
//!    composed candle expressions at GPT-2 small's shapes;
//! 6. the offloaded AdamW (`cpu-adamw`) with its vars on CUDA against the same
//!    optimizer with its vars on the CPU (bit for bit), then its step time at
//!    TinyLlama-1.1B's parameter shapes against the fused AdamW on the device.
//!
//! `SECTIONS=5` (a comma list) runs only those sections. Build with
//! `scripts/build-cuda.sh --features cuda --example gpu_bench`;
//! results and the command are in docs/gpu-bench.md.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Storage, Tensor, Var};
use oomfix::strategies::accumulate::GradAccumulator;
use oomfix::strategies::adamw::{FusedAdamW, ParamsAdamW};
use oomfix::strategies::offload::OffloadedAdamW;
use oomfix::strategies::{Checkpointing, OptimizerImpl, Precision};
use oomfix::track::cuda::{is_out_of_memory, reset_peaks, trim, PoolStats};
use oomfix::train::data::DataSource;
use oomfix::train::{TrainOptions, Trainer};
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Plan, Target};

const GIB: f64 = (1u64 << 30) as f64;

fn main() -> Result<()> {
    let device = Device::new_cuda(0)?;
    let cuda = device.as_cuda_device()?.clone();
    let ctx = cuda.cuda_stream().context().clone();
    let name = ctx.name().unwrap_or_else(|_| "?".into());
    let (free, total) = ctx.mem_get_info()?;
    println!(
        "# gpu_bench on {name}: {:.1} GiB total, {:.1} GiB free",
        total as f64 / GIB,
        free as f64 / GIB
    );
    let backtrace = std::env::var_os("RUST_BACKTRACE");
    println!(
        "RUST_BACKTRACE: {backtrace:?} (unset it: candle captures a backtrace into every error)\n"
    );

    // SECTIONS=5 (a comma list) runs only those sections; the others print empty.
    let sections = std::env::var("SECTIONS").unwrap_or_default();
    let want = |n: &str| sections.is_empty() || sections.split(',').any(|s| s.trim() == n);
    let numeric = when(want("1"), || numeric_match(&device))?;
    let accumulated = when(want("1"), || accumulate_match(&device))?;
    let bandwidth = when(want("2"), || bandwidth(&device))?;
    let training = when(want("3"), || training(&device))?;
    let loss = when(want("4"), || loss_rows(&device))?;
    let (fused_match, fused_time) = when(want("5"), || fused_rows(&device))?;
    let (offload_match, offload_time) = when(want("6"), || offload_rows(&device))?;
    let stats = PoolStats::read(&cuda)?;
    let outside = (stats.device_total - stats.device_free).saturating_sub(stats.reserved);

    println!("\n## 1. CUDA vs CPU fused AdamW, 10 steps, 1,000,003 elements\n");
    println!("| param | grad | grad offset | path | max rel err p | max rel err m | max rel err v | elements differing (p, m, v) |");
    println!("|---|---|---:|---|---:|---:|---:|---|");
    numeric.iter().for_each(|r| println!("{r}"));
    println!("\n### Gradient accumulation, CUDA in place vs CPU: two rounds of 4 micro-batches of 1,000,003 elements and the mean\n");
    println!("| accumulator | gradient | max rel err | elements differing |");
    println!("|---|---|---:|---:|");
    for (acc, grad, (err, differing)) in &accumulated {
        println!("| {acc:?} | {grad:?} | {err:.2e} | {differing} |");
    }
    println!("\n## 2. Bandwidth (median of timed steps after one warm-up)\n");
    println!(
        "| what | elements | bytes moved / element | ms | GB/s | vs copy | pool transient GiB |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let copy = bandwidth.first().map_or(f64::NAN, |r| r.gbs());
    bandwidth.iter().for_each(|r| println!("{}", r.row(copy)));
    println!("\n## 3. GPT-2 small (124M) training steps, seq 1024\n");
    println!("| plan | resident GiB | used high GiB | reserved high GiB | estimate GiB | estimate - runtime GiB | est/used - 1 | step ms (median of 3, after step 1) | first step s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    training.iter().for_each(|r| println!("{r}"));
    println!(
        "\n## 4. Fused cross-entropy vs candle_nn's composed loss (logits f32-cast), V = 50,257\n"
    );
    println!("| logits dtype | rows | loss abs err vs CPU composed | grad max abs err vs CPU composed | fused ms | composed ms | fused transient GiB | composed transient GiB |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    loss.iter().for_each(|r| println!("{r}"));
    println!("\n## 5. Fused layer ops, CUDA vs CPU: max |difference| / max |CPU value|, inputs [4, 256, 768]\n");
    println!("| op | dtype | output | input gradients |");
    println!("|---|---|---:|---|");
    fused_match.iter().for_each(|r| println!("{r}"));
    println!("\n### Forward+backward time, fused vs composed from candle ops, bf16, n = 8192 rows (median of 5)\n");
    println!("| op | fused ms | composed ms | composed / fused |");
    println!("|---|---:|---:|---:|");
    fused_time.iter().for_each(|r| println!("{r}"));
    println!(
        "\n## 6. Offloaded AdamW: vars on CUDA vs vars on the CPU, 3 steps, transposed gradients\n"
    );
    println!("| dtype | elements | weights differing | masters differing |");
    println!("|---|---:|---:|---:|");
    offload_match.iter().for_each(|r| println!("{r}"));
    println!("\n### Step time at TinyLlama-1.1B's parameter shapes, bf16 vars on CUDA (median of 3 after one warm-up)\n");
    println!("| optimizer | parameters | step ms | of which weights back up (convert + copy) ms |");
    println!("|---|---:|---:|---:|");
    offload_time.iter().for_each(|r| println!("{r}"));
    println!(
        "\nDevice memory outside the pool at the end (context, modules, library workspaces): {:.2} GiB; the model's runtime term: {:.2} GiB",
        outside as f64 / GIB,
        Target::Cuda(0).runtime_bytes() as f64 / GIB
    );
    Ok(())
}

/// `f()` for a wanted section, else its empty result.
fn when<T: Default>(wanted: bool, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if wanted {
        f()
    } else {
        Ok(T::default())
    }
}

fn sync(device: &Device) -> Result<()> {
    Ok(device.synchronize()?)
}

/// Runs `f` `reps` times, each between device synchronisations; the median in ms.
fn median_ms(device: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        sync(device)?;
        let start = Instant::now();
        f()?;
        sync(device)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

// ---------------------------------------------------------------------------
// 1. Numerical match.

struct MatchRow {
    param: DType,
    grad: DType,
    offset: usize,
    errs: [f64; 3],
    differing: [usize; 3],
}

impl std::fmt::Display for MatchRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = if self.offset % 4 == 0 {
            "4-wide"
        } else {
            "scalar"
        };
        let [p, m, v] = self.errs;
        let [dp, dm, dv] = self.differing;
        write!(
            f,
            "| {:?} | {:?} | {} | {path} | {p:.2e} | {m:.2e} | {v:.2e} | {dp}, {dm}, {dv} |",
            self.param, self.grad, self.offset
        )
    }
}

/// Largest elementwise relative error of `a` against the reference `b`, and
/// how many elements differ at all.
fn compare(a: &Tensor, b: &Tensor) -> Result<(f64, usize)> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    let mut worst = 0f64;
    let mut differing = 0;
    for (&x, &y) in a.iter().zip(&b) {
        if x.to_bits() != y.to_bits() {
            differing += 1;
            let rel = if y == 0.0 {
                f64::INFINITY
            } else {
                ((x - y) as f64 / y as f64).abs()
            };
            worst = worst.max(if rel.is_nan() { f64::INFINITY } else { rel });
        }
    }
    Ok((worst, differing))
}

fn numeric_match(device: &Device) -> Result<Vec<MatchRow>> {
    const N: usize = 1_000_003;
    let cases = [
        (DType::F32, DType::F32, 0),
        (DType::F32, DType::BF16, 0),
        (DType::F32, DType::F16, 0),
        (DType::BF16, DType::BF16, 0),
        (DType::BF16, DType::F32, 0),
        (DType::F16, DType::F16, 0),
        (DType::F32, DType::F32, 1),
        (DType::BF16, DType::BF16, 3),
    ];
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut rows = Vec::new();
    for (param, grad, offset) in cases {
        eprintln!("numeric match: {param:?} params, {grad:?} grads, gradient offset {offset}");
        let p0 = Tensor::randn(0f32, 1.0, N, &Device::Cpu)?.to_dtype(param)?;
        let cpu_var = Var::from_tensor(&p0)?;
        let gpu_var = Var::from_tensor(&p0.to_device(device)?)?;
        let mut cpu = FusedAdamW::new(vec![cpu_var.clone()], params.clone())?;
        let mut gpu = FusedAdamW::new(vec![gpu_var.clone()], params.clone())?;
        for step in 0..10 {
            // Gradients of changing scale; a leading offset makes an unaligned view.
            let scale = 10f64.powi(step % 5 - 2);
            let full =
                (Tensor::randn(0f32, 1.0, N + offset, &Device::Cpu)? * scale)?.to_dtype(grad)?;
            let g_cpu = full.narrow(0, offset, N)?;
            let g_gpu = full.to_device(device)?.narrow(0, offset, N)?;
            cpu.step(&[g_cpu])?;
            gpu.step(&[g_gpu])?;
        }
        let (cs, gs) = (cpu.state_tensors()?, gpu.state_tensors()?);
        let (ep, dp) = compare(gpu_var.as_tensor(), cpu_var.as_tensor())?;
        let (em, dm) = compare(&gs["0.m"], &cs["0.m"])?;
        let (ev, dv) = compare(&gs["0.v"], &cs["0.v"])?;
        rows.push(MatchRow {
            param,
            grad,
            offset,
            errs: [ep, em, ev],
            differing: [dp, dm, dv],
        });
    }
    Ok(rows)
}

/// Accumulator dtype, gradient dtype, and (max relative error, elements differing).
type AccumulateRow = (DType, DType, (f64, usize));

/// Sums four micro-batches of random gradients with [`GradAccumulator`] on the
/// CPU and on `device`, takes the mean, twice (the second round runs in the
/// first one's sums: CUDA kernels assign, add, scale), and compares, per dtype
/// pair.
fn accumulate_match(device: &Device) -> Result<Vec<AccumulateRow>> {
    const N: usize = 1_000_003;
    let pairs = [
        (DType::F32, DType::F32),
        (DType::F32, DType::BF16),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
    ];
    let mut rows = Vec::new();
    for (acc_dtype, grad) in pairs {
        eprintln!("accumulation match: {acc_dtype:?} sums of {grad:?} gradients");
        let mut cpu = GradAccumulator::with_dtype(acc_dtype);
        let mut gpu = GradAccumulator::with_dtype(acc_dtype);
        let (mut worst, mut differing) = (0f64, 0);
        // Two rounds: the second writes into the first one's sums (assign, add, scale).
        for _round in 0..2 {
            for _ in 0..4 {
                let g = Tensor::randn(0f32, 1.0, N, &Device::Cpu)?.to_dtype(grad)?;
                gpu.add(vec![g.to_device(device)?])?;
                cpu.add(vec![g])?;
            }
            let (c, g) = (cpu.finish(0.25)?, gpu.finish(0.25)?);
            let (err, diff) = compare(&g[0], &c[0])?;
            worst = worst.max(err);
            differing += diff;
        }
        rows.push((acc_dtype, grad, (worst, differing)));
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------
// 2. Bandwidth.

struct BandwidthRow {
    what: String,
    elements: usize,
    bytes_per_element: usize,
    ms: f64,
    transient: Option<u64>,
}

impl BandwidthRow {
    fn gbs(&self) -> f64 {
        (self.elements * self.bytes_per_element) as f64 / (self.ms * 1e-3) / 1e9
    }
    fn row(&self, copy_gbs: f64) -> String {
        let transient = self
            .transient
            .map_or("-".into(), |b| format!("{:.2}", b as f64 / GIB));
        format!(
            "| {} | {:.2e} | {} | {:.2} | {:.0} | {:.0}% | {transient} |",
            self.what,
            self.elements as f64,
            self.bytes_per_element,
            self.ms,
            self.gbs(),
            100.0 * self.gbs() / copy_gbs
        )
    }
}

/// Device-to-device copy (`cuMemcpyDtoDAsync`) of `bytes` bytes, read plus written.
fn copy_row(device: &Device, bytes: usize) -> Result<BandwidthRow> {
    let cuda = device.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let n = bytes / 2 / 4;
    let src = Tensor::randn(0f32, 1.0, n, device)?;
    let (storage, _) = src.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        bail!("source is not on the GPU")
    };
    let src = storage.as_cuda_slice::<f32>()?;
    // SAFETY: the destination is only written (by the copy), never read.
    let mut dst = unsafe { stream.alloc::<f32>(n) }?;
    stream.memcpy_dtod(src, &mut dst)?;
    let ms = median_ms(device, 10, || Ok(stream.memcpy_dtod(src, &mut dst)?))?;
    Ok(BandwidthRow {
        what: "device-to-device copy".into(),
        elements: n,
        bytes_per_element: 8,
        ms,
        transient: None,
    })
}

/// One optimizer over one parameter of `n` elements: its median step time and
/// the pool's transient during a step (high-water minus resident).
fn optimizer_row(
    device: &Device,
    what: &str,
    n: usize,
    (param, grad): (DType, DType),
    fused: bool,
    reps: usize,
) -> Result<BandwidthRow> {
    let cuda = device.as_cuda_device()?;
    let var = Var::from_tensor(&Tensor::randn(0f32, 1.0, n, device)?.to_dtype(param)?)?;
    let g = (Tensor::randn(0f32, 1.0, n, device)? * 1e-2)?.to_dtype(grad)?;
    let params = ParamsAdamW::default();
    let mut step: Box<dyn FnMut() -> Result<()>> = if fused {
        let mut opt = FusedAdamW::new(vec![var.clone()], params)?;
        let g = g.clone();
        Box::new(move || Ok(opt.step(std::slice::from_ref(&g))?))
    } else {
        use candle_nn::Optimizer;
        let mut opt = candle_nn::AdamW::new(vec![var.clone()], params)?;
        let mut store = Tensor::new(0f32, device)?.backward()?;
        store.insert(var.as_tensor(), g.clone());
        Box::new(move || Ok(opt.step(&store)?))
    };
    step()?; // warm-up: kernel compilation and module load, state allocation
    let resident = PoolStats::read(cuda)?.used;
    reset_peaks(cuda)?;
    step()?;
    let transient = PoolStats::read(cuda)?.used_high.saturating_sub(resident);
    let ms = median_ms(device, reps, &mut step)?;
    let bytes_per_element = {
        let (p, g) = (param.size_in_bytes(), grad.size_in_bytes());
        // read p, g, m, v; write p, m, v (fp32 moments)
        2 * p + g + 16
    };
    Ok(BandwidthRow {
        what: what.into(),
        elements: n,
        bytes_per_element,
        ms,
        transient: Some(transient),
    })
}

fn bandwidth(device: &Device) -> Result<Vec<BandwidthRow>> {
    const BIG: usize = 1_000_000_000;
    const SMALL: usize = 250_000_000;
    let cuda = device.as_cuda_device()?;
    let f32s = (DType::F32, DType::F32);
    let runs = [
        ("fused AdamW, fp32 p/g", BIG, f32s, true, 10),
        (
            "fused AdamW, bf16 p/g",
            BIG,
            (DType::BF16, DType::BF16),
            true,
            10,
        ),
        (
            "fused AdamW, fp32 p, bf16 g",
            BIG,
            (DType::F32, DType::BF16),
            true,
            10,
        ),
        ("fused AdamW, fp32 p/g", SMALL, f32s, true, 10),
        ("candle_nn::AdamW, fp32 p/g", SMALL, f32s, false, 5),
    ];
    eprintln!("bandwidth: device-to-device copy");
    let mut rows = vec![copy_row(device, 28 * BIG)?];
    for (what, n, dtypes, fused, reps) in runs {
        trim(cuda)?;
        eprintln!("bandwidth: {what}, {n} elements");
        match optimizer_row(device, what, n, dtypes, fused, reps) {
            Ok(row) => rows.push(row),
            Err(e) => eprintln!("  failed: {e:#}"),
        }
    }
    trim(cuda)?;
    Ok(rows)
}

// ---------------------------------------------------------------------------
// 3. GPT-2 small training steps.

struct TrainRow {
    label: String,
    result: std::result::Result<TrainMeasure, String>,
    estimate: u64,
}

struct TrainMeasure {
    resident: u64,
    used_high: u64,
    reserved_high: u64,
    step_ms: f64,
    first_s: f64,
}

impl std::fmt::Display for TrainRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let est = self.estimate as f64 / GIB;
        let est_tensors = (self.estimate - Target::Cuda(0).runtime_bytes()) as f64 / GIB;
        match &self.result {
            Ok(m) => {
                let used = m.used_high as f64 / GIB;
                write!(
                    f,
                    "| {} | {:.2} | {used:.2} | {:.2} | {est:.2} | {est_tensors:.2} | {:+.1}% | {:.0} | {:.1} |",
                    self.label,
                    m.resident as f64 / GIB,
                    m.reserved_high as f64 / GIB,
                    100.0 * (est_tensors / used - 1.0),
                    m.step_ms,
                    m.first_s
                )
            }
            Err(e) => write!(
                f,
                "| {} | {e} | | | {est:.2} | {est_tensors:.2} | | | |",
                self.label
            ),
        }
    }
}

fn plans() -> Vec<(String, Plan)> {
    let base = Plan::baseline(8, 1024);
    let with = |precision, checkpoint, optimizer, micro_batch| Plan {
        precision,
        checkpoint,
        optimizer,
        micro_batch,
        ..base
    };
    let (none, every) = (Checkpointing::None, Checkpointing::Every(1));
    let (candle, fused) = (OptimizerImpl::CandleAdamW, OptimizerImpl::FusedAdamW);
    let list = vec![
        with(Precision::F32, none, candle, 8),
        with(Precision::F32, none, fused, 8),
        with(Precision::Bf16, none, candle, 8),
        with(Precision::Bf16, none, fused, 8),
        with(Precision::Bf16, every, fused, 8),
        with(Precision::F32, every, fused, 8),
        with(Precision::Bf16, every, fused, 1),
    ];
    list.into_iter()
        .map(|p| {
            let ckpt = if p.checkpoint == none {
                "no ckpt"
            } else {
                "ckpt every block"
            };
            (
                format!(
                    "b={} {} {} {}",
                    p.micro_batch, p.precision, ckpt, p.optimizer
                ),
                p,
            )
        })
        .collect()
}

fn measure_plan(device: &Device, plan: Plan) -> oomfix::Result<TrainMeasure> {
    let cuda = device.as_cuda_device()?;
    let mut trainer = Trainer::new(
        &ModelConfig::gpt2_small(),
        plan,
        device,
        &TrainOptions::default(),
    )?;
    let mut data = DataSource::synthetic(0);
    let start = Instant::now();
    trainer.step(&mut data)?;
    device.synchronize()?;
    let first_s = start.elapsed().as_secs_f64();
    let resident = PoolStats::read(cuda)?.used;
    reset_peaks(cuda)?;
    let mut times = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        trainer.step(&mut data)?;
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let stats = PoolStats::read(cuda)?;
    Ok(TrainMeasure {
        resident,
        used_high: stats.used_high,
        reserved_high: stats.reserved_high,
        step_ms: times[1],
        first_s,
    })
}

/// The candle error inside a training error, if any.
fn candle_error(e: &oomfix::Error) -> Option<&candle_core::Error> {
    match e {
        oomfix::Error::Candle(c)
        | oomfix::Error::Strategy(oomfix::strategies::Error::Candle(c)) => Some(c),
        _ => None,
    }
}

fn training(device: &Device) -> Result<Vec<TrainRow>> {
    let cuda = device.as_cuda_device()?;
    let spec = ModelSpec::default_model();
    let mut rows = Vec::new();
    for (label, plan) in plans() {
        trim(cuda)?;
        eprintln!("training: {label}");
        let estimate = MemoryModel
            .estimate(&spec, &plan, &Target::Cuda(0))
            .allocated_peak();
        let result = measure_plan(device, plan).map_err(|e| {
            let oom = candle_error(&e).is_some_and(is_out_of_memory);
            eprintln!("  failed: {e}");
            if oom {
                "out of memory".to_string()
            } else {
                format!("error: {}", e.to_string().lines().next().unwrap_or(""))
            }
        });
        rows.push(TrainRow {
            label,
            result,
            estimate,
        });
    }
    trim(cuda).context("trimming the pool")?;
    Ok(rows)
}

// ---------------------------------------------------------------------------
// 4. Fused cross-entropy.

struct LossRow {
    dtype: DType,
    rows: usize,
    loss_err: f64,
    grad_err: f64,
    ms: [f64; 2],
    transient: [u64; 2],
}

impl std::fmt::Display for LossRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "| {:?} | {} | {:.2e} | {:.2e} | {:.2} | {:.2} | {:.2} | {:.2} |",
            self.dtype,
            self.rows,
            self.loss_err,
            self.grad_err,
            self.ms[0],
            self.ms[1],
            self.transient[0] as f64 / GIB,
            self.transient[1] as f64 / GIB
        )
    }
}

/// oomfix's fused loss over all rows.
fn fused_loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    oomfix_strategies::nn::loss::cross_entropy(logits, targets, None)
}

/// The composed loss as a model would write it: cast to f32, candle_nn's cross-entropy.
fn composed_loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, targets)
}

/// Loss and gradient of `loss_fn` on `logits` (a fresh variable), on the logits' device.
fn loss_and_grad(
    logits: &Tensor,
    targets: &Tensor,
    loss_fn: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Result<(f32, Tensor)> {
    let var = Var::from_tensor(logits)?;
    let loss = loss_fn(var.as_tensor(), targets)?;
    let grads = loss.backward()?;
    let g = grads
        .get(&var)
        .context("no gradient for the logits")?
        .clone();
    Ok((loss.to_dtype(DType::F32)?.to_scalar::<f32>()?, g))
}

fn loss_rows(device: &Device) -> Result<Vec<LossRow>> {
    const V: usize = 50_257;
    let cuda = device.as_cuda_device()?;
    let mut rows = Vec::new();
    for (dtype, n) in [(DType::F32, 8192), (DType::BF16, 8192), (DType::F16, 8192)] {
        let targets: Vec<u32> = (0..n).map(|i| (i * 7919 % V) as u32).collect();
        let targets = Tensor::new(targets.as_slice(), device)?;
        let logits = (Tensor::randn(0f32, 1.0, (n, V), device)? * 3.0)?.to_dtype(dtype)?;
        // Accuracy on the first 256 rows, against the composed loss on the CPU in f32.
        let (few, few_t) = (logits.narrow(0, 0, 256)?, targets.narrow(0, 0, 256)?);
        let (l_gpu, g_gpu) = loss_and_grad(&few, &few_t, fused_loss)?;
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
        let (l_ref, g_ref) =
            loss_and_grad(&cpu(&few)?, &few_t.to_device(&Device::Cpu)?, composed_loss)?;
        let grad_err = (cpu(&g_gpu)? - g_ref)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()? as f64;
        let mut ms = [0.0; 2];
        let mut transient = [0; 2];
        let fns: [fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>; 2] =
            [fused_loss, composed_loss];
        for (i, f) in fns.into_iter().enumerate() {
            let mut step = || loss_and_grad(&logits, &targets, f).map(drop);
            step()?; // warm-up: kernel compilation and module load
            sync(device)?;
            let resident = PoolStats::read(cuda)?.used;
            reset_peaks(cuda)?;
            step()?;
            sync(device)?;
            transient[i] = PoolStats::read(cuda)?.used_high.saturating_sub(resident);
            ms[i] = median_ms(device, 5, &mut step)?;
        }
        rows.push(LossRow {
            dtype,
            rows: n,
            loss_err: (l_gpu - l_ref).abs() as f64,
            grad_err,
            ms,
            transient,
        });
    }
    Ok(rows)
}

/// One fused op and the candle expression it replaces, on a list of inputs.
struct FusedCase {
    name: &'static str,
    /// Input shapes (the first is the activation).
    shapes: fn(rows: usize) -> Vec<Vec<usize>>,
    fused: fn(&[Tensor]) -> candle_core::Result<Tensor>,
    composed: fn(&[Tensor]) -> candle_core::Result<Tensor>,
}

fn composed_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    use candle_core::D;
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let centred = match b {
        Some(_) => x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?,
        None => x,
    };
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let y = centred
        .broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .to_dtype(dtype)?
        .broadcast_mul(w)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

fn fused_cases() -> Vec<FusedCase> {
    use oomfix_strategies::nn::ops::{self, GeluForm, WeightLayout};
    const H: usize = 768;
    const I: usize = 3072;
    vec![
        FusedCase {
            name: "layer norm",
            shapes: |n| vec![vec![n, H], vec![H], vec![H]],
            fused: |t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            composed: |t| composed_norm(&t[0], &t[1], Some(&t[2])),
        },
        FusedCase {
            name: "RMS norm",
            shapes: |n| vec![vec![n, H], vec![H]],
            fused: |t| ops::rms_norm(&t[0], &t[1], 1e-5),
            composed: |t| composed_norm(&t[0], &t[1], None),
        },
        FusedCase {
            name: "linear [in,out] + bias",
            shapes: |n| vec![vec![n, H], vec![H, I], vec![I]],
            fused: |t| ops::linear(&t[0], &t[1], &t[2], WeightLayout::InOut),
            composed: |t| t[0].matmul(&t[1])?.broadcast_add(&t[2]),
        },
        FusedCase {
            name: "linear [out,in] + bias",
            shapes: |n| vec![vec![n, H], vec![I, H], vec![I]],
            fused: |t| ops::linear(&t[0], &t[1], &t[2], WeightLayout::OutIn),
            composed: |t| t[0].matmul(&t[1].t()?)?.broadcast_add(&t[2]),
        },
        FusedCase {
            name: "GELU (tanh)",
            shapes: |n| vec![vec![n, I]],
            fused: |t| ops::gelu(&t[0], GeluForm::Tanh),
            composed: |t| t[0].gelu(),
        },
        FusedCase {
            name: "GELU (erf)",
            shapes: |n| vec![vec![n, I]],
            fused: |t| ops::gelu(&t[0], GeluForm::Erf),
            composed: |t| t[0].gelu_erf(),
        },
        FusedCase {
            name: "SwiGLU",
            shapes: |n| vec![vec![n, I], vec![n, I]],
            fused: |t| ops::swiglu(&t[0], &t[1]),
            composed: |t| t[0].silu()?.mul(&t[1]),
        },
        FusedCase {
            name: "embedding lookup, 8192 ids into [8192, 768]",
            shapes: |_| vec![vec![8192, H]],
            fused: |t| ops::embedding(&t[0], &bench_ids(t[0].device())?),
            composed: |t| t[0].index_select(&bench_ids(t[0].device())?, 0),
        },
        FusedCase {
            name: "attention probabilities, causal, q and k [rows / 1024, 12, 1024, 64]",
            shapes: |n| vec![vec![(n / 1024).max(1), 12, 1024, 64]; 2],
            fused: |t| {
                let opts = ops::ProbsOptions {
                    scale: 0.125,
                    causal: true,
                };
                ops::attention_probs(&t[0], &t[1], None, None, opts)
            },
            composed: |t| composed_probs(&t[0], &t[1]),
        },
        FusedCase {
            name: "LM loss in chunks of 32 MiB of logits, [rows, 768] · [50304, 768]ᵀ (against the whole logits)",
            shapes: |n| vec![vec![n, H], vec![50304, H]],
            fused: |t| {
                use oomfix_strategies::chunked_loss::{linear_cross_entropy, LmHead, CHUNK_BYTES};
                let head = LmHead {
                    weight: &t[1],
                    bias: None,
                    classes: 50257,
                };
                let targets = lm_targets(t[0].dim(0)?, t[0].device())?;
                linear_cross_entropy(&t[0], &head, &targets, None, CHUNK_BYTES, 1.0)
            },
            composed: |t| {
                let targets = lm_targets(t[0].dim(0)?, t[0].device())?;
                let logits = t[0].matmul(&t[1].t()?)?;
                oomfix_strategies::nn::loss::cross_entropy_padded(&logits, 50257, &targets, None)
            },
        },
        FusedCase {
            name: "RoPE, heads first",
            shapes: |n| vec![vec![n / 256, 256, H]],
            fused: |t| {
                let tables = ops::RopeTables::new(t[0].dim(1)?, 64, 1e4, 1.0, t[0].device())?;
                ops::rope(&t[0], H / 64, &tables)
            },
            composed: |t| composed_rope(&t[0]),
        },
    ]
}

/// Causal `softmax(q·kᵀ/8)` composed from candle ops (the mask built on the
/// device from `tril2`).
fn composed_probs(q: &Tensor, k: &Tensor) -> candle_core::Result<Tensor> {
    let s = q.dim(2)?;
    let mask = ((Tensor::tril2(s, DType::F32, q.device())? - 1.0)? * 1e9)?.to_dtype(q.dtype())?;
    let scores = (q.matmul(&k.t()?)? * 0.125)?.broadcast_add(&mask)?;
    candle_nn::ops::softmax(&scores, candle_core::D::Minus1)
}

/// `n` targets of the LM loss case, below GPT-2's 50257 classes.
fn lm_targets(n: usize, device: &Device) -> candle_core::Result<Tensor> {
    let ids: Vec<u32> = (0..n as u32).map(|i| i * 7919 % 50257).collect();
    Tensor::from_vec(ids, n, device)
}

/// 8192 ids of the embedding case, each of 1000 rows used about eight times.
fn bench_ids(device: &Device) -> candle_core::Result<Tensor> {
    let ids: Vec<u32> = (0..8192u32).map(|i| i * 7 % 1000).collect();
    Tensor::from_vec(ids, 8192, device)
}

/// Llama's RoPE on `[b, s, H]` split into heads of 64, composed from candle
/// ops (candle's `rope_slow` after moving the heads first).
fn composed_rope(x: &Tensor) -> candle_core::Result<Tensor> {
    let (b, s, h) = x.dims3()?;
    let angles: Vec<f32> = (0..s)
        .flat_map(|p| (0..32).map(move |i| p as f32 * 1e4f32.powf(-(i as f32) / 32.0)))
        .collect();
    let angles = Tensor::from_vec(angles, (s, 32), x.device())?;
    let x = x
        .reshape((b, s, h / 64, 64))?
        .transpose(1, 2)?
        .contiguous()?;
    let table = |t: Tensor| t.to_dtype(x.dtype());
    candle_nn::rotary_emb::rope_slow(&x, &table(angles.cos()?)?, &table(angles.sin()?)?)
}

/// `f`'s output and the gradients of all `inputs` (made variables) for the
/// loss `sum(output · weights)`.
fn output_and_grads(
    f: fn(&[Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Tensor],
    weights: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tensors)?;
    let grads = y
        .mul(&weights.to_dtype(y.dtype())?)?
        .sum_all()?
        .backward()?;
    let g = vars
        .iter()
        .map(|v| grads.get(v).cloned().context("no gradient for an input"))
        .collect::<Result<Vec<_>>>()?;
    Ok((y, g))
}

/// max |a − b| / max |b|, both on the CPU in f32.
fn scaled_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    let (a, b) = (cpu(a)?, cpu(b)?);
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30);
    Ok(((a - &b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale) as f64)
}

fn fused_rows(device: &Device) -> Result<(Vec<String>, Vec<String>)> {
    let mut matches = Vec::new();
    for case in fused_cases() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let shapes = (case.shapes)(4 * 256);
            let inputs = shapes
                .iter()
                .map(|s| Tensor::randn(0f32, 1.0, s.as_slice(), &Device::Cpu)?.to_dtype(dtype))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let out_shape = (case.fused)(&inputs)?.shape().clone();
            let weights = Tensor::randn(0f32, 1.0, &out_shape, &Device::Cpu)?;
            let (y_cpu, g_cpu) = output_and_grads(case.fused, &inputs, &weights)?;
            let on_gpu = inputs
                .iter()
                .map(|t| t.to_device(device))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let (y_gpu, g_gpu) =
                output_and_grads(case.fused, &on_gpu, &weights.to_device(device)?)?;
            let grads = g_gpu
                .iter()
                .zip(&g_cpu)
                .map(|(a, b)| scaled_diff(a, b).map(|e| format!("{e:.1e}")))
                .collect::<Result<Vec<_>>>()?;
            matches.push(format!(
                "| {} | {dtype:?} | {:.1e} | {} |",
                case.name,
                scaled_diff(&y_gpu, &y_cpu)?,
                grads.join(", ")
            ));
        }
    }
    let mut times = Vec::new();
    for case in fused_cases() {
        let inputs = (case.shapes)(8192)
            .iter()
            .map(|s| Tensor::randn(0f32, 1.0, s.as_slice(), device)?.to_dtype(DType::BF16))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let out_shape = (case.fused)(&inputs)?.shape().clone();
        let weights = Tensor::randn(0f32, 1.0, &out_shape, device)?;
        let mut ms = [0.0; 2];
        for (i, f) in [case.fused, case.composed].into_iter().enumerate() {
            let mut step = || output_and_grads(f, &inputs, &weights).map(drop);
            step()?; // warm-up: kernel compilation and module load
            ms[i] = median_ms(device, 5, &mut step)?;
        }
        times.push(format!(
            "| {} | {:.2} | {:.2} | {:.2} |",
            case.name,
            ms[0],
            ms[1],
            ms[1] / ms[0]
        ));
    }
    Ok((matches, times))
}

/// A random gradient of `shape` in `dtype` on `device`; a matrix's as a
/// transposed view, as the backward gives `Linear` weights' gradients.
fn random_grad(shape: &[usize], dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    match shape {
        [r, c] => Tensor::randn(0f32, 1.0, (*c, *r), device)?
            .to_dtype(dtype)?
            .t(),
        _ => Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype),
    }
}

/// Vars with their names, as optimizers take them.
type NamedVars = Vec<(String, Var)>;

/// Section 6: the offloaded AdamW with CUDA vars against itself with CPU vars
/// (same values and gradients: the same host arithmetic, so equal bit for bit),
/// then step times at TinyLlama-1.1B's shapes against the fused AdamW on the device.
fn offload_rows(device: &Device) -> Result<(Vec<String>, Vec<String>)> {
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let shapes: [&[usize]; 3] = [&[512, 384], &[384], &[1000, 64]];
    let mut matches = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        eprintln!("offload match: {dtype:?}");
        let init: Vec<Tensor> = (shapes.iter())
            .map(|&s| Tensor::randn(0f32, 1.0, s, &Device::Cpu)?.to_dtype(dtype))
            .collect::<candle_core::Result<_>>()?;
        let vars = |d: &Device| -> Result<NamedVars> {
            (init.iter().enumerate())
                .map(|(i, t)| Ok((format!("p{i}"), Var::from_tensor(&t.to_device(d)?)?)))
                .collect()
        };
        let (on_cpu, on_gpu) = (vars(&Device::Cpu)?, vars(device)?);
        let mut cpu = OffloadedAdamW::new(on_cpu.clone(), params.clone())?;
        let mut gpu = OffloadedAdamW::new(on_gpu.clone(), params.clone())?;
        for _ in 0..3 {
            let grads: Vec<Tensor> = (shapes.iter())
                .map(|&s| random_grad(s, dtype, &Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            let on_device = (grads.iter())
                .map(|g| g.to_device(device))
                .collect::<candle_core::Result<Vec<_>>>()?;
            cpu.step(grads)?;
            gpu.step(on_device)?;
        }
        let (mut weights, mut masters, mut elements) = (0, 0, 0);
        for ((_, c), (_, g)) in on_cpu.iter().zip(&on_gpu) {
            weights += compare(&g.flatten_all()?, &c.flatten_all()?)?.1;
            elements += c.elem_count();
        }
        for (c, g) in cpu.master_vars().iter().zip(gpu.master_vars()) {
            masters += compare(&g.flatten_all()?, &c.flatten_all()?)?.1;
        }
        matches.push(format!(
            "| {dtype:?} | {elements} | {weights} | {masters} |"
        ));
    }

    let config = ModelConfig::tinyllama_1_1b();
    let make = || -> Result<(NamedVars, Vec<Tensor>)> {
        let mut vars = Vec::new();
        let mut grads = Vec::new();
        for (name, shape) in config.tensors() {
            vars.push((name, Var::zeros(shape.as_slice(), DType::BF16, device)?));
            grads.push(random_grad(&shape, DType::BF16, device)?);
        }
        Ok((vars, grads))
    };
    let mut times = Vec::new();
    {
        eprintln!("offload timing: offloaded AdamW at TinyLlama's shapes");
        let (vars, grads) = make()?;
        let count: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
        let mut opt = OffloadedAdamW::new(vars, params.clone())?;
        opt.step(grads.clone())?;
        let step = median_ms(device, 3, || Ok(opt.step(grads.clone())?))?;
        let up = median_ms(device, 3, || Ok(opt.sync_to_compute()?))?;
        times.push(format!(
            "| offloaded (cpu-adamw) | {count} | {step:.0} | {up:.0} |"
        ));
    }
    {
        eprintln!("offload timing: fused AdamW on the device at TinyLlama's shapes");
        let (vars, grads) = make()?;
        let count: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
        let masters: NamedVars = (vars.into_iter())
            .map(|(n, v)| Ok((n, Var::from_tensor(&v.to_dtype(DType::F32)?)?)))
            .collect::<Result<_>>()?;
        let mut opt = FusedAdamW::new_named(masters, params)?;
        opt.step(&grads)?;
        let step = median_ms(device, 3, || Ok(opt.step(&grads)?))?;
        times.push(format!(
            "| fused, on the device (fp32 masters there) | {count} | {step:.1} | – |"
        ));
    }
    Ok((matches, times))
}
