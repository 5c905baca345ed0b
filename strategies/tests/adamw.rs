//! FusedAdamW against a plain-tensor reference, candle_nn::AdamW and hand-computed numbers.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use common::{assert_close, det, values};
use oomfix_strategies::adamw::{FusedAdamW, ParamsAdamW, STEP_KEY};

fn params() -> ParamsAdamW {
    common::adamw_params()
}

/// Textbook AdamW over plain tensor ops, f32 state.
struct Reference {
    p: Tensor,
    m: Tensor,
    v: Tensor,
    t: i32,
    c: ParamsAdamW,
}

impl Reference {
    fn new(p: &Tensor, c: ParamsAdamW) -> Self {
        let z = p.zeros_like().unwrap().to_dtype(DType::F32).unwrap();
        Reference {
            p: p.clone(),
            m: z.clone(),
            v: z,
            t: 0,
            c,
        }
    }

    /// One step; the parameter is computed in f32 and stored back in its own dtype.
    fn step(&mut self, g: &Tensor) {
        let c = &self.c;
        self.t += 1;
        let g = g.to_dtype(DType::F32).unwrap();
        self.m = ((&self.m * c.beta1).unwrap() + (&g * (1.0 - c.beta1)).unwrap()).unwrap();
        self.v =
            ((&self.v * c.beta2).unwrap() + (g.sqr().unwrap() * (1.0 - c.beta2)).unwrap()).unwrap();
        let m_hat = (&self.m * (1.0 / (1.0 - c.beta1.powi(self.t)))).unwrap();
        let v_hat = (&self.v * (1.0 / (1.0 - c.beta2.powi(self.t)))).unwrap();
        let update = (m_hat / (v_hat.sqrt().unwrap() + c.eps).unwrap()).unwrap();
        let p = self.p.to_dtype(DType::F32).unwrap();
        let p = ((p * (1.0 - c.lr * c.weight_decay)).unwrap() - (update * c.lr).unwrap()).unwrap();
        self.p = p.to_dtype(self.p.dtype()).unwrap();
    }
}

/// A gradient that depends on the parameter and the step, like a real one.
fn grad(p: &Tensor, step: u64, i: u64) -> Tensor {
    let p = p.to_dtype(DType::F32).unwrap();
    ((&p * 0.3).unwrap() + det(p.shape(), step * 100 + i)).unwrap()
}

/// Runs FusedAdamW and the reference for 100 steps on vars of `dtype` with grads of
/// `grad_dtype`; returns the worst relative error over params and moments.
fn against_reference(dtype: DType, grad_dtype: DType, tol: f64) {
    // [40_000] is larger than one chunk, so its update runs on several threads.
    let shapes: [&[usize]; 5] = [&[1], &[7], &[3, 5], &[2, 3, 4], &[40_000]];
    let vars: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| Var::from_tensor(&det(*s, 7 + i as u64).to_dtype(dtype).unwrap()).unwrap())
        .collect();
    let mut refs: Vec<Reference> = vars
        .iter()
        .map(|v| Reference::new(&v.as_detached_tensor().copy().unwrap(), params()))
        .collect();
    let mut opt = FusedAdamW::new(vars.clone(), params()).unwrap();
    for step in 0..100 {
        let grads: Vec<Tensor> = vars
            .iter()
            .enumerate()
            .map(|(i, v)| {
                grad(v.as_tensor(), step, i as u64)
                    .to_dtype(grad_dtype)
                    .unwrap()
            })
            .collect();
        opt.step(&grads).unwrap();
        for (r, g) in refs.iter_mut().zip(&grads) {
            r.step(g);
        }
    }
    assert_eq!(opt.step_count(), 100);
    let state = opt.state_tensors().unwrap();
    for (i, (v, r)) in vars.iter().zip(&refs).enumerate() {
        assert_eq!(v.dtype(), dtype);
        assert_close(v.as_tensor(), &r.p, tol, &format!("param {i}"));
        assert_close(&state[&format!("{i}.m")], &r.m, tol, &format!("m {i}"));
        assert_close(&state[&format!("{i}.v")], &r.v, tol, &format!("v {i}"));
        assert_eq!(state[&format!("{i}.m")].dtype(), DType::F32);
    }
}

#[test]
fn matches_reference_f32_over_100_steps() {
    against_reference(DType::F32, DType::F32, 1e-5);
}

#[test]
fn bf16_and_f16_grads_on_f32_params_match_reference() {
    // 16-bit grads are widened exactly, so the f32 tolerance holds.
    against_reference(DType::F32, DType::BF16, 1e-5);
    against_reference(DType::F32, DType::F16, 1e-5);
}

#[test]
fn bf16_params_keep_f32_state() {
    // The parameter is rounded to bf16 after each step, in the reference too;
    // an f32 rounding difference can flip one bf16 ulp (2^-8 relative).
    against_reference(DType::BF16, DType::BF16, 1e-2);
}

#[test]
fn matches_candle_nn_adamw_over_100_steps() {
    let init: Vec<Tensor> = [(4usize, 3usize), (1, 5), (6, 6)]
        .iter()
        .enumerate()
        .map(|(i, &(r, c))| det((r, c), 40 + i as u64))
        .collect();
    let ours: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let theirs: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let mut fused = FusedAdamW::new(ours.clone(), params()).unwrap();
    let mut candle = candle_nn::AdamW::new(theirs.clone(), params()).unwrap();
    let loss = |vars: &[Var], step: u64| -> Tensor {
        // sum_i sum((w_i * target_i - 0.5)^2) with step-dependent targets
        let mut total = Tensor::new(0f32, &Device::Cpu).unwrap();
        for (i, v) in vars.iter().enumerate() {
            let target = det(v.shape(), step * 10 + i as u64);
            let d = ((v.as_tensor() * target).unwrap() - 0.5).unwrap();
            total = (total + d.sqr().unwrap().sum_all().unwrap()).unwrap();
        }
        total
    };
    for step in 0..100 {
        fused
            .step_grad_store(&loss(&ours, step).backward().unwrap())
            .unwrap();
        candle
            .step(&loss(&theirs, step).backward().unwrap())
            .unwrap();
    }
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_close(a.as_tensor(), b.as_tensor(), 1e-5, &format!("param {i}"));
    }
}

#[test]
fn weight_decay_and_bias_correction_on_one_element() {
    // p0 = 1, lr = 0.1, weight decay 0.1, betas (0.9, 0.999), eps 1e-8;
    // expected values computed by hand in f64 from the AdamW formulas.
    let c = ParamsAdamW {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let p = Var::new(&[1f32], &Device::Cpu).unwrap();
    let mut opt = FusedAdamW::new(vec![p.clone()], c).unwrap();
    let expect = [
        (0.5f32, 0.890000002f64),
        (-1.0, 0.9177103542),
        (0.25, 0.9222023168),
    ];
    for (g, want) in expect {
        opt.step(&[Tensor::new(&[g], &Device::Cpu).unwrap()])
            .unwrap();
        let got = values(p.as_tensor()).unwrap()[0] as f64;
        assert!((got - want).abs() < 1e-6, "got {got}, want {want}");
    }
    // Moments after the three steps: m = -0.0245, v = 0.00131100025.
    let state = opt.state_tensors().unwrap();
    assert!((values(&state["0.m"]).unwrap()[0] as f64 + 0.0245).abs() < 1e-7);
    assert!((values(&state["0.v"]).unwrap()[0] as f64 - 0.00131100025).abs() < 1e-9);
    assert_eq!(state[STEP_KEY].to_scalar::<i64>().unwrap(), 3);
}

#[test]
fn transposed_grad_gives_the_same_step() {
    let init = det((3, 4), 1);
    let (a, b) = (
        Var::from_tensor(&init).unwrap(),
        Var::from_tensor(&init).unwrap(),
    );
    let mut oa = FusedAdamW::new(vec![a.clone()], params()).unwrap();
    let mut ob = FusedAdamW::new(vec![b.clone()], params()).unwrap();
    let g = det((4, 3), 2).t().unwrap(); // a (3, 4) view with transposed strides
    assert!(!g.is_contiguous());
    oa.step(std::slice::from_ref(&g)).unwrap();
    ob.step(&[g.contiguous().unwrap()]).unwrap();
    assert_eq!(
        values(a.as_tensor()).unwrap(),
        values(b.as_tensor()).unwrap()
    );
}

#[test]
fn state_round_trip_continues_identically() {
    let init = [det((5, 2), 3), det(9, 4)];
    let run = |vars: &[Var], opt: &mut FusedAdamW, steps: std::ops::Range<u64>| {
        for s in steps {
            let grads: Vec<Tensor> = vars
                .iter()
                .enumerate()
                .map(|(i, v)| grad(v.as_tensor(), s, i as u64))
                .collect();
            opt.step(&grads).unwrap();
        }
    };
    let named = |vars: &[Var]| {
        vec![
            ("w".to_string(), vars[0].clone()),
            ("b".to_string(), vars[1].clone()),
        ]
    };
    let a: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let mut oa = FusedAdamW::new_named(named(&a), params()).unwrap();
    run(&a, &mut oa, 0..3);
    let state = oa.state_tensors().unwrap();
    assert!(state.contains_key("w.m") && state.contains_key("b.v"));

    // A second optimizer on copies of the parameters, restored from the checkpoint.
    let b: Vec<Var> = a
        .iter()
        .map(|v| Var::from_tensor(&v.as_detached_tensor()).unwrap())
        .collect();
    let mut ob = FusedAdamW::new_named(named(&b), params()).unwrap();
    ob.load_state(&state).unwrap();
    assert_eq!(ob.step_count(), 3);
    run(&a, &mut oa, 3..6);
    run(&b, &mut ob, 3..6);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            values(x.as_tensor()).unwrap(),
            values(y.as_tensor()).unwrap()
        );
    }

    // Missing or misshapen entries are rejected and change nothing.
    let mut bad = state.clone();
    bad.remove("b.v");
    assert!(ob.load_state(&bad).is_err());
    let mut bad = state.clone();
    bad.insert(
        "w.m".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(ob.load_state(&bad).is_err());
    assert_eq!(ob.step_count(), 6);
}

#[test]
fn rejects_bad_input_without_partial_steps() {
    let (a, b) = (
        Var::from_tensor(&det(4, 1)).unwrap(),
        Var::from_tensor(&det(2, 2)).unwrap(),
    );
    let before = values(a.as_tensor()).unwrap();
    let mut opt = FusedAdamW::new(vec![a.clone(), b.clone()], params()).unwrap();
    // second gradient has the wrong shape: the first parameter must not move
    assert!(opt.step(&[det(4, 3), det(3, 3)]).is_err());
    assert!(opt.step(&[det(4, 3)]).is_err());
    assert!(opt
        .step(&[det(4, 3), Tensor::new(&[1u32, 2], &Device::Cpu).unwrap()])
        .is_err());
    assert_eq!(values(a.as_tensor()).unwrap(), before);
    assert_eq!(opt.step_count(), 0);

    let bad = ParamsAdamW {
        beta1: 1.0,
        ..params()
    };
    assert!(FusedAdamW::new(vec![a.clone()], bad).is_err());
    let ints = Var::from_tensor(&Tensor::new(&[1u32], &Device::Cpu).unwrap()).unwrap();
    assert!(FusedAdamW::new(vec![ints], params()).is_err());
    let twice = vec![("x".to_string(), a.clone()), ("x".to_string(), b)];
    assert!(FusedAdamW::new_named(twice, params()).is_err());
}
