//! Loss scaling, master weights and a short mixed-precision training run.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{assert_close, det, values};
use oomfix_strategies::adamw::{FusedAdamW, ParamsAdamW};
use oomfix_strategies::precision::{cast_var_map, LossScaler, LossScalerConfig, MasterWeights};

#[test]
fn loss_scaler_backoff_and_growth_sequence() {
    let mut s = LossScaler::new(LossScalerConfig {
        growth_interval: 3,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.scale(), 65536.0);
    let mut seen = vec![];
    // finite x3 -> grow; inf -> back off; finite x2, inf -> back off (count restarts); finite x3 -> grow
    for found_inf in [
        false, false, false, true, false, false, true, false, false, false,
    ] {
        s.update(found_inf);
        seen.push(s.scale());
    }
    let k = 65536.0;
    assert_eq!(seen, [k, k, 2.0 * k, k, k, k, k / 2.0, k / 2.0, k / 2.0, k]);
    assert_eq!(s.growth_tracker(), 0);
    s.update(false);
    assert_eq!(s.growth_tracker(), 1);

    let defaults = LossScalerConfig::default();
    assert_eq!(
        (
            defaults.growth_factor,
            defaults.backoff_factor,
            defaults.growth_interval
        ),
        (2.0, 0.5, 2000)
    );
    for bad in [
        LossScalerConfig {
            init_scale: 0.0,
            ..defaults
        },
        LossScalerConfig {
            growth_factor: 1.0,
            ..defaults
        },
        LossScalerConfig {
            backoff_factor: 1.0,
            ..defaults
        },
        LossScalerConfig {
            growth_interval: 0,
            ..defaults
        },
    ] {
        assert!(LossScaler::new(bad).is_err(), "{bad:?}");
    }
    assert!(s.restore(f64::INFINITY, 0).is_err());
    s.restore(1024.0, 5).unwrap();
    assert_eq!((s.scale(), s.growth_tracker()), (1024.0, 5));
}

/// A loss scaler starting at `init_scale`, otherwise as by default.
fn scaler(init_scale: f64) -> LossScaler {
    LossScaler::new(LossScalerConfig {
        init_scale,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn unscale_divides_and_detects_inf_and_nan() {
    let s = scaler(1024.0);
    let dev = Device::Cpu;
    let mut grads = vec![
        Tensor::new(&[1024f32, -2048.0], &dev).unwrap(),
        Tensor::new(&[512f32, 256.0], &dev)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap(),
        det((2, 3), 1).t().unwrap(), // non-contiguous input
    ];
    let third = (grads[2].clone() / 1024.0).unwrap();
    assert!(s.unscale_and_check(&mut grads).unwrap());
    assert_eq!(values(&grads[0]).unwrap(), [1.0, -2.0]);
    assert_eq!(grads[1].dtype(), DType::F16);
    assert_eq!(values(&grads[1]).unwrap(), [0.5, 0.25]);
    assert_close(&grads[2], &third, 1e-7, "transposed grad");

    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        let mut grads = vec![
            Tensor::new(&[1f32, 2.0], &dev).unwrap(),
            Tensor::new(&[0f32, bad, 1.0], &dev).unwrap(),
        ];
        assert!(
            !s.unscale_and_check(&mut grads).unwrap(),
            "{bad} not detected"
        );
        // also when the bad value is in a 16-bit tensor
        let mut grads = vec![grads[1].to_dtype(DType::BF16).unwrap()];
        assert!(
            !s.unscale_and_check(&mut grads).unwrap(),
            "{bad} not detected in bf16"
        );
    }
    // f16 overflow: 60000 * 1024 does not fit, but the scaled grad already holds inf
    let mut grads = vec![Tensor::new(&[60000f32], &dev)
        .unwrap()
        .affine(1024.0, 0.0)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap()];
    assert!(!s.unscale_and_check(&mut grads).unwrap());
    // large finite f16 values whose sum would overflow f16 are still finite
    let one = scaler(1.0);
    let mut grads = vec![Tensor::full(60000f32, 64, &dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap()];
    assert!(one.unscale_and_check(&mut grads).unwrap());
}

#[test]
fn scaled_loss_scales_the_gradients() {
    let s = scaler(8.0);
    let w = Var::new(&[3f32], &Device::Cpu).unwrap();
    let loss = w.as_tensor().sqr().unwrap().sum_all().unwrap();
    let store = s.scale_loss(&loss).unwrap().backward().unwrap();
    let mut grads = vec![store.get(w.as_tensor()).unwrap().clone()];
    assert_eq!(values(&grads[0]).unwrap(), [48.0]);
    assert!(s.unscale_and_check(&mut grads).unwrap());
    assert_eq!(values(&grads[0]).unwrap(), [6.0]);
}

#[test]
fn master_weights_round_trip() {
    let dev = Device::Cpu;
    let x = det((3, 4), 5);
    let bf = Var::from_tensor(&x.to_dtype(DType::BF16).unwrap()).unwrap();
    let h = Var::from_tensor(&x.to_dtype(DType::F16).unwrap()).unwrap();
    let f = Var::from_tensor(&x).unwrap();
    let mw = MasterWeights::new(vec![bf.clone(), h.clone(), f.clone()]).unwrap();
    let masters = mw.master_vars();
    assert!(masters.iter().all(|m| m.dtype() == DType::F32));
    // masters start as the exact widening of the compute values
    assert_eq!(
        values(masters[0].as_tensor()).unwrap(),
        values(bf.as_tensor()).unwrap()
    );
    assert_eq!(
        values(masters[1].as_tensor()).unwrap(),
        values(h.as_tensor()).unwrap()
    );
    // the f32 var is its own master: same storage
    masters[2].set(&det((3, 4), 6)).unwrap();
    assert_eq!(
        values(f.as_tensor()).unwrap(),
        values(&det((3, 4), 6)).unwrap()
    );

    // set the masters, sync, and the compute vars hold the rounded masters
    let y = (det((3, 4), 7) * 3.0).unwrap();
    masters[0].set(&y).unwrap();
    masters[1].set(&y).unwrap();
    mw.sync_to_compute().unwrap();
    assert_eq!(bf.dtype(), DType::BF16);
    assert_eq!(
        values(bf.as_tensor()).unwrap(),
        values(&y.to_dtype(DType::BF16).unwrap()).unwrap()
    );
    assert_eq!(
        values(h.as_tensor()).unwrap(),
        values(&y.to_dtype(DType::F16).unwrap()).unwrap()
    );
    // the master keeps full precision
    assert_eq!(values(masters[0].as_tensor()).unwrap(), values(&y).unwrap());

    // grads come back in compute dtype, or widened on request
    let loss = (bf
        .as_tensor()
        .sum_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        + h.as_tensor()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
        + f.as_tensor().sum_all().unwrap())
    .unwrap();
    let store = loss.backward().unwrap();
    let g = mw.grads(&store, None).unwrap();
    assert_eq!(
        [g[0].dtype(), g[1].dtype(), g[2].dtype()],
        [DType::BF16, DType::F16, DType::F32]
    );
    let g = mw.grads(&store, Some(DType::F32)).unwrap();
    assert!(g.iter().all(|g| g.dtype() == DType::F32));
    // a var outside the graph has no gradient: a clear error
    let unused = Var::zeros(2, DType::BF16, &dev).unwrap();
    let mw2 = MasterWeights::new(vec![unused]).unwrap();
    assert!(mw2.grads(&store, None).is_err());
    assert!(MasterWeights::new(vec![Var::zeros(2, DType::U32, &dev).unwrap()]).is_err());
}

#[test]
fn cast_var_map_converts_float_vars() {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let w = vb
        .get_with_hints((2, 3), "w", candle_nn::Init::Const(0.5))
        .unwrap();
    assert_eq!(w.dtype(), DType::F32);
    cast_var_map(&vm, DType::BF16).unwrap();
    let vb = VarBuilder::from_varmap(&vm, DType::BF16, &dev);
    let w = vb.get((2, 3), "w").unwrap();
    assert_eq!(w.dtype(), DType::BF16);
    assert_eq!(values(&w).unwrap(), [0.5; 6]);
    assert!(vm.all_vars().iter().all(|v| v.dtype() == DType::BF16));
}

/// bf16 compute with f32 masters, loss scaling and FusedAdamW on the masters
/// fits a linear regression about as well as an f32 run.
#[test]
fn mixed_precision_training_tracks_f32() {
    let (x, w_true) = (det((32, 4), 1), det((4, 1), 2));
    let y = x.matmul(&w_true).unwrap();
    let train = |dtype: DType| -> Vec<f32> {
        let w = Var::from_tensor(&Tensor::zeros((4, 1), dtype, &Device::Cpu).unwrap()).unwrap();
        let masters = MasterWeights::new(vec![w.clone()]).unwrap();
        let cfg = ParamsAdamW {
            lr: 0.05,
            weight_decay: 0.0,
            ..Default::default()
        };
        let mut opt = FusedAdamW::new(masters.master_vars().to_vec(), cfg).unwrap();
        let mut scaler = LossScaler::new(LossScalerConfig::default()).unwrap();
        let (xd, yd) = (x.to_dtype(dtype).unwrap(), y.to_dtype(dtype).unwrap());
        for _ in 0..150 {
            let pred = xd.matmul(w.as_tensor()).unwrap();
            let loss = (pred - &yd).unwrap().sqr().unwrap().mean_all().unwrap();
            let store = scaler.scale_loss(&loss).unwrap().backward().unwrap();
            let mut grads = masters.grads(&store, None).unwrap();
            drop(store);
            let finite = scaler.unscale_and_check(&mut grads).unwrap();
            if finite {
                opt.step(&grads).unwrap();
                masters.sync_to_compute().unwrap();
            }
            scaler.update(!finite);
        }
        values(masters.master_vars()[0].as_tensor()).unwrap()
    };
    let (mixed, full) = (train(DType::BF16), train(DType::F32));
    let truth = values(&w_true).unwrap();
    for i in 0..4 {
        assert!(
            (full[i] - truth[i]).abs() < 1e-2,
            "f32 run did not converge: {full:?} vs {truth:?}"
        );
        assert!(
            (mixed[i] - truth[i]).abs() < 3e-2,
            "bf16 run off: {mixed:?} vs {truth:?}"
        );
    }
}
