//! Helpers shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Shape, Tensor};
use oomfix_strategies::adamw::ParamsAdamW;

/// Deterministic pseudo-random values in [-1, 1) (a hash of index and seed).
pub fn det<S: Into<Shape>>(shape: S, seed: u64) -> Tensor {
    let shape = shape.into();
    let data: Vec<f32> = (0..shape.elem_count() as u64)
        .map(|i| {
            let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 31;
            x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 29;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// max |a - b| / max |b|, computed in f64.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let diff = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    diff / scale.max(1e-30)
}

/// Asserts `rel_err(a, b) <= tol` with a readable message.
pub fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    let e = rel_err(a, b);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
}

/// Flattened f32 values.
pub fn values(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// AdamW hyper-parameters of the optimizer tests: every term of the update matters.
pub fn adamw_params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.05,
    }
}
