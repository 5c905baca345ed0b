//! The offloaded AdamW against the fused AdamW on master weights in the device's own memory.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{det, values};
use oomfix_strategies::adamw::{FusedAdamW, ParamsAdamW};
use oomfix_strategies::offload::OffloadedAdamW;
use oomfix_strategies::precision::MasterWeights;

fn params() -> ParamsAdamW {
    common::adamw_params()
}

fn vars(dtype: DType) -> Vec<Var> {
    [(7, 5), (3, 4)]
        .into_iter()
        .enumerate()
        .map(|(i, shape)| Var::from_tensor(&det(shape, i as u64).to_dtype(dtype).unwrap()).unwrap())
        .collect()
}

/// Gradients of step `t`: the second one a transposed view, as the backward gives for `Linear` weights.
fn grads(t: u64, dtype: DType) -> Vec<Tensor> {
    vec![
        det((5, 7), 100 + t).to_dtype(dtype).unwrap().t().unwrap(),
        det((3, 4), 200 + t).to_dtype(dtype).unwrap(),
    ]
}

#[test]
fn matches_fused_adamw_on_device_masters_bit_for_bit() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (on_device, offloaded) = (vars(dtype), vars(dtype));
        let masters = MasterWeights::new(on_device.clone()).unwrap();
        let named = |vs: &[Var]| {
            vs.iter()
                .enumerate()
                .map(|(i, v)| (format!("p{i}"), v.clone()))
                .collect::<Vec<_>>()
        };
        let mut reference = FusedAdamW::new_named(named(masters.master_vars()), params()).unwrap();
        let mut opt = OffloadedAdamW::new(named(&offloaded), params()).unwrap();
        for t in 0..3 {
            reference.step(&grads(t, dtype)).unwrap();
            masters.sync_to_compute().unwrap();
            opt.step(grads(t, dtype)).unwrap();
            for (a, b) in on_device.iter().zip(&offloaded) {
                assert_eq!(b.dtype(), dtype);
                assert_eq!(values(a).unwrap(), values(b).unwrap(), "{dtype:?} step {t}");
            }
            for (a, b) in masters.master_vars().iter().zip(opt.master_vars()) {
                assert_eq!(
                    values(a).unwrap(),
                    values(b).unwrap(),
                    "{dtype:?} masters, step {t}"
                );
            }
        }
        let (a, b) = (
            reference.state_tensors().unwrap(),
            opt.optimizer().state_tensors().unwrap(),
        );
        for (key, t) in &a {
            assert_eq!(
                values(t).unwrap(),
                values(&b[key]).unwrap(),
                "{dtype:?} state `{key}`"
            );
        }
        assert_eq!(opt.optimizer().step_count(), 3);
    }
}

#[test]
fn masters_are_f32_copies_on_the_host() {
    let compute = vars(DType::F32);
    let opt = OffloadedAdamW::new(vec![("w".into(), compute[0].clone())], params()).unwrap();
    let master = &opt.master_vars()[0];
    assert_eq!(
        (master.dtype(), master.device().is_cpu()),
        (DType::F32, true)
    );
    // a copy of its own: changing the master leaves the compute var until the next sync
    master.set(&master.zeros_like().unwrap()).unwrap();
    assert_ne!(values(&compute[0]).unwrap(), vec![0.0; 35]);
    opt.sync_to_compute().unwrap();
    assert_eq!(values(&compute[0]).unwrap(), vec![0.0; 35]);
}

#[test]
fn bad_gradients_change_nothing() {
    let compute = vars(DType::BF16);
    let before: Vec<_> = compute.iter().map(|v| values(v).unwrap()).collect();
    let named = compute
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("p{i}"), v.clone()))
        .collect();
    let mut opt = OffloadedAdamW::new(named, params()).unwrap();
    let too_few = grads(0, DType::BF16)[..1].to_vec();
    assert!(opt.step(too_few).is_err());
    let mut wrong_shape = grads(0, DType::BF16);
    wrong_shape[1] = Tensor::zeros((4, 3), DType::BF16, &Device::Cpu).unwrap();
    assert!(opt.step(wrong_shape).is_err());
    assert_eq!(opt.optimizer().step_count(), 0);
    let after: Vec<_> = compute.iter().map(|v| values(v).unwrap()).collect();
    assert_eq!(before, after);
    let ints = Var::from_tensor(&Tensor::new(&[1u32], &Device::Cpu).unwrap()).unwrap();
    let err = OffloadedAdamW::new(vec![("i".into(), ints)], params()).unwrap_err();
    assert!(err.to_string().contains("dtype"), "{err}");
}
