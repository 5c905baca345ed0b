//! Gradient accumulation: k micro-batches averaged equal one big batch.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, det, values};
use oomfix_strategies::accumulate::{collect_grads, GradAccumulator};
use oomfix_strategies::adamw::{FusedAdamW, ParamsAdamW};

/// Gradients of the mean-squared error of the linear model `x w^T + b` on (x, y).
fn grads_on(w: &Var, b: &Var, x: &Tensor, y: &Tensor) -> Vec<Tensor> {
    let pred = x
        .matmul(&w.as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(b.as_tensor())
        .unwrap();
    let loss = (pred - y).unwrap().sqr().unwrap().mean_all().unwrap();
    collect_grads(&loss.backward().unwrap(), &[w.clone(), b.clone()]).unwrap()
}

#[test]
fn micro_batches_average_to_the_full_batch() {
    let (x, y) = (det((8, 5), 1), det((8, 3), 2));
    let w = Var::from_tensor(&det((3, 5), 3)).unwrap();
    let b = Var::from_tensor(&det(3, 4)).unwrap();
    let full = grads_on(&w, &b, &x, &y);

    for k in [1usize, 2, 4, 8] {
        let micro = 8 / k;
        let mut acc = GradAccumulator::new();
        for i in 0..k {
            let (xi, yi) = (
                x.narrow(0, i * micro, micro).unwrap(),
                y.narrow(0, i * micro, micro).unwrap(),
            );
            acc.add(grads_on(&w, &b, &xi, &yi)).unwrap();
        }
        assert_eq!(acc.micro_batches(), k);
        let avg = acc.finish(1.0 / k as f64).unwrap();
        for (a, f) in avg.iter().zip(&full) {
            assert_close(a, f, 1e-5, &format!("k = {k}"));
        }

        // and the same AdamW update from identical parameters
        let step = |grads: &[Tensor]| -> Vec<Vec<f32>> {
            let vars = [
                Var::from_tensor(&w.as_detached_tensor()).unwrap(),
                Var::from_tensor(&b.as_detached_tensor()).unwrap(),
            ];
            let mut opt = FusedAdamW::new(
                vars.to_vec(),
                ParamsAdamW {
                    lr: 0.1,
                    ..Default::default()
                },
            )
            .unwrap();
            opt.step(grads).unwrap();
            vars.iter()
                .map(|v| values(v.as_tensor()).unwrap())
                .collect()
        };
        let (pa, pf) = (step(&avg), step(&full));
        for (a, f) in pa.iter().zip(&pf) {
            let (a, f) = (
                Tensor::new(a.as_slice(), &Device::Cpu).unwrap(),
                Tensor::new(f.as_slice(), &Device::Cpu).unwrap(),
            );
            assert_close(&a, &f, 1e-5, &format!("AdamW after k = {k}"));
        }
    }
}

#[test]
fn in_place_sums_never_touch_the_callers_tensors() {
    let g = det((4, 4), 9);
    let before = values(&g).unwrap();
    let mut acc = GradAccumulator::new();
    // the same tensor three times: the first add keeps it, so later sums must not write into it
    for _ in 0..3 {
        acc.add(vec![g.clone()]).unwrap();
    }
    let sum = acc.finish(1.0).unwrap();
    assert_eq!(values(&g).unwrap(), before);
    assert_close(&sum[0], &(&g * 3.0).unwrap(), 1e-7, "sum of three");
    // a transposed (non-contiguous) gradient is summed by position, not by storage order
    let mut acc = GradAccumulator::new();
    for s in 0..3 {
        acc.add(vec![det((4, 4), s).t().unwrap()]).unwrap();
    }
    let want = ((det((4, 4), 0) + det((4, 4), 1)).unwrap() + det((4, 4), 2))
        .unwrap()
        .t()
        .unwrap();
    assert_close(
        &acc.finish(0.5).unwrap()[0],
        &(want * 0.5).unwrap(),
        1e-7,
        "transposed",
    );
}

#[test]
fn bf16_grads_accumulate_in_f32() {
    // 40_000 elements: more than one chunk, so the in-place kernels run on several threads
    let parts: Vec<Tensor> = (0..6)
        .map(|s| det(40_000, s).to_dtype(DType::BF16).unwrap())
        .collect();
    let mut acc = GradAccumulator::with_dtype(DType::F32);
    for p in &parts {
        acc.add(vec![p.clone()]).unwrap();
    }
    let got = acc.finish(1.0 / 6.0).unwrap().remove(0);
    assert_eq!(got.dtype(), DType::F32);
    let mut want = parts[0].to_dtype(DType::F32).unwrap();
    for p in &parts[1..] {
        want = (want + p.to_dtype(DType::F32).unwrap()).unwrap();
    }
    assert_close(&got, &(want / 6.0).unwrap(), 1e-6, "f32 mean of bf16 grads");
    // the input tensors are untouched
    assert_eq!(parts[0].dtype(), DType::BF16);
}

#[test]
fn rejects_mismatched_micro_batches() {
    let mut acc = GradAccumulator::new();
    assert!(GradAccumulator::new().finish(1.0).is_err());
    acc.add(vec![det(3, 1), det((2, 2), 2)]).unwrap();
    assert!(acc.add(vec![det(3, 1)]).is_err());
    assert!(acc.add(vec![det(3, 1), det(4, 2)]).is_err());
    assert_eq!(acc.micro_batches(), 1);
    acc.add(vec![det(3, 1), det((2, 2), 2)]).unwrap();
    let out = acc.finish(0.5).unwrap();
    assert_close(&out[0], &det(3, 1), 1e-7, "mean of equal grads");
}

#[test]
fn missing_gradient_is_an_error() {
    let (a, unused) = (
        Var::new(&[1f32], &Device::Cpu).unwrap(),
        Var::new(&[2f32], &Device::Cpu).unwrap(),
    );
    let store = a.as_tensor().sum_all().unwrap().backward().unwrap();
    assert!(collect_grads(&store, std::slice::from_ref(&a)).is_ok());
    assert!(collect_grads(&store, &[a, unused]).is_err());
}

/// Address of a CPU f32 tensor's storage.
fn data_ptr(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => panic!("expected a CPU f32 tensor"),
    }
}

#[test]
fn a_new_round_reuses_the_owned_sums() {
    let mean = |a: u64, b: u64| ((det(5, a) + det(5, b)).unwrap() * 0.5).unwrap();
    let mut acc = GradAccumulator::new();
    acc.add(vec![det(5, 0)]).unwrap();
    acc.add(vec![det(5, 1)]).unwrap();
    let first = acc.finish(0.5).unwrap().remove(0);
    assert_close(&first, &mean(0, 1), 1e-7, "first round");
    let storage = data_ptr(&first);
    drop(first);
    // The second round starts from zero, in the same storage.
    acc.add(vec![det(5, 2)]).unwrap();
    acc.add(vec![det(5, 3)]).unwrap();
    let second = acc.finish(0.5).unwrap().remove(0);
    assert_close(&second, &mean(2, 3), 1e-7, "second round");
    assert_eq!(data_ptr(&second), storage);
    drop(second);
    // A round cut short (a failed step) is forgotten after restart.
    acc.add(vec![det(5, 4)]).unwrap();
    acc.restart();
    acc.add(vec![det(5, 5)]).unwrap();
    acc.add(vec![det(5, 6)]).unwrap();
    assert_close(
        &acc.finish(0.5).unwrap()[0],
        &mean(5, 6),
        1e-7,
        "after restart",
    );
}

#[test]
fn one_micro_batch_hands_back_the_gradients_and_keeps_nothing() {
    let g = det(5, 0);
    let before = values(&g).unwrap();
    let mut acc = GradAccumulator::new();
    acc.add(vec![g.clone()]).unwrap();
    let out = acc.finish(1.0).unwrap();
    assert_eq!(data_ptr(&out[0]), data_ptr(&g), "no copy");
    drop(out);
    // The next round must not write into the caller's gradient.
    acc.add(vec![det(5, 1)]).unwrap();
    acc.add(vec![det(5, 2)]).unwrap();
    acc.finish(1.0).unwrap();
    assert_eq!(values(&g).unwrap(), before);
}
