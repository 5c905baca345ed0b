//! The fused step allocates no tensor-sized memory (its own test binary: it
//! installs a counting global allocator).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use common::{allocated, Counting};
use oomfix_strategies::adamw::{FusedAdamW, ParamsAdamW};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Bytes allocated above the level at entry, at the worst moment of `f`.
fn transient(f: impl FnOnce()) -> usize {
    allocated(f).2
}

#[test]
fn fused_step_has_no_tensor_sized_transient() {
    const N: usize = 1 << 20; // 4 MiB of f32 parameters
    let dev = Device::Cpu;
    let init = Tensor::arange(0f32, N as f32, &dev)
        .unwrap()
        .affine(1e-6, 0.0)
        .unwrap();
    let grad = init.sin().unwrap();
    let grad_bf16 = grad.to_dtype(DType::BF16).unwrap();

    let w = Var::from_tensor(&init).unwrap();
    let mut fused = FusedAdamW::new(vec![w.clone()], ParamsAdamW::default()).unwrap();
    fused.step(std::slice::from_ref(&grad)).unwrap(); // warm up the thread pool
    let f32_grads = transient(|| fused.step(std::slice::from_ref(&grad)).unwrap());
    let bf16_grads = transient(|| fused.step(std::slice::from_ref(&grad_bf16)).unwrap());

    let v = Var::from_tensor(&init).unwrap();
    let mut candle = candle_nn::AdamW::new(vec![v.clone()], ParamsAdamW::default()).unwrap();
    let loss = (v.as_tensor() * &grad).unwrap().sum_all().unwrap();
    let store = loss.backward().unwrap();
    candle.step(&store).unwrap();
    let unfused = transient(|| candle.step(&store).unwrap());

    let param_bytes = 4 * N;
    eprintln!(
        "transient per step: fused {f32_grads} B (f32 grads), {bf16_grads} B (bf16 grads); \
         candle_nn::AdamW {:.2} x the parameter's {param_bytes} B",
        unfused as f64 / param_bytes as f64
    );
    assert!(
        f32_grads < param_bytes / 100,
        "fused step allocated {f32_grads} bytes"
    );
    assert!(
        bf16_grads < param_bytes / 100,
        "fused step allocated {bf16_grads} bytes"
    );
    // the comparison shows the counter sees tensor allocations
    assert!(
        unfused > param_bytes,
        "candle_nn::AdamW allocated only {unfused} bytes"
    );
}
