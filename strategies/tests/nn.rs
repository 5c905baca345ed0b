//! The trainable layers of `oomfix_strategies::nn` against their `candle_nn`
//! namesakes (or the composed math where `candle_nn` has no backward): the
//! same tensors from the same `VarBuilder`, the same output, and a nonzero
//! gradient for every parameter (matching the composed form's).

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::ops::{layer_norm_slow, rms_norm_slow};
use candle_nn::{VarBuilder, VarMap};
use oomfix_strategies::{compare, nn};

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    compare::max_diff(a, b).unwrap() as f32
}

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

/// The output of `f` on `inputs` (made variables) and the gradient of
/// `sum(f(inputs)·probe)` for each input.
fn run(
    inputs: &[Tensor],
    probe: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tensors);
    let grads = y.mul(probe).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = vars
        .iter()
        .enumerate()
        .map(|(i, v)| {
            grads
                .get(v)
                .unwrap_or_else(|| panic!("input {i} has no gradient"))
                .clone()
        })
        .collect();
    (y, grads)
}

/// Runs `ours` and `reference` on the same inputs, checks the outputs and the
/// gradients of every input (of the outputs weighted by one random tensor)
/// within `tol`, and that every gradient is nonzero.
fn check(
    what: &str,
    tol: f32,
    inputs: &[Tensor],
    ours: impl Fn(&[Tensor]) -> Tensor,
    reference: impl Fn(&[Tensor]) -> Tensor,
) {
    let probe = Tensor::randn(0f32, 1.0, ours(inputs).shape(), &Device::Cpu).unwrap();
    let (y, g) = run(inputs, &probe, &ours);
    let (r, gr) = run(inputs, &probe, &reference);
    let e = max_diff(&y, &r);
    assert!(e < tol, "{what}: output off by {e}");
    for (i, (g, gr)) in g.iter().zip(&gr).enumerate() {
        let e = max_diff(g, gr);
        assert!(e < tol, "{what}: gradient of input {i} off by {e}");
        assert!(
            compare::max_abs(g).unwrap() > 0.0,
            "{what}: gradient of input {i} is zero"
        );
    }
}

/// The names and shapes of the tensors a constructor made in a `VarMap`.
fn made(build: impl FnOnce(VarBuilder)) -> Vec<(String, Vec<usize>)> {
    let map = VarMap::new();
    build(VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu));
    let data = map.data().lock().unwrap();
    let mut out: Vec<_> = data
        .iter()
        .map(|(k, v)| (k.clone(), v.dims().to_vec()))
        .collect();
    out.sort();
    out
}

/// A constructor called on a `VarBuilder`.
type Build = Box<dyn Fn(VarBuilder)>;

#[test]
fn constructors_make_the_tensors_candle_nn_makes() {
    let cases: Vec<(&str, Build, Build)> = vec![
        (
            "linear",
            Box::new(|vb| drop(nn::linear(5, 3, vb.pp("l")).unwrap())),
            Box::new(|vb| drop(candle_nn::linear(5, 3, vb.pp("l")).unwrap())),
        ),
        (
            "linear_no_bias",
            Box::new(|vb| drop(nn::linear_no_bias(5, 3, vb).unwrap())),
            Box::new(|vb| drop(candle_nn::linear_no_bias(5, 3, vb).unwrap())),
        ),
        (
            "linear_b",
            Box::new(|vb| drop(nn::linear_b(5, 3, true, vb).unwrap())),
            Box::new(|vb| drop(candle_nn::linear_b(5, 3, true, vb).unwrap())),
        ),
        (
            "layer_norm",
            Box::new(|vb| drop(nn::layer_norm(7, 1e-5, vb).unwrap())),
            Box::new(|vb| drop(candle_nn::layer_norm(7, 1e-5, vb).unwrap())),
        ),
        (
            "layer_norm_no_bias",
            Box::new(|vb| drop(nn::layer_norm_no_bias(7, 1e-5, vb).unwrap())),
            Box::new(|vb| drop(candle_nn::layer_norm_no_bias(7, 1e-5, vb).unwrap())),
        ),
        (
            "rms_norm",
            Box::new(|vb| drop(nn::rms_norm(7, 1e-6, vb).unwrap())),
            Box::new(|vb| drop(candle_nn::rms_norm(7, 1e-6, vb).unwrap())),
        ),
        (
            "embedding",
            Box::new(|vb| drop(nn::embedding(11, 4, vb).unwrap())),
            Box::new(|vb| drop(candle_nn::embedding(11, 4, vb).unwrap())),
        ),
    ];
    for (what, ours, theirs) in cases {
        assert_eq!(made(ours), made(theirs), "{what}");
    }
    let lin = nn::linear(
        5,
        3,
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu),
    )
    .unwrap();
    assert_eq!(lin.weight().dims(), [3, 5]);
    assert_eq!(lin.bias().unwrap().dims(), [3]);
}

#[test]
fn linear_matches_candle_nn_with_and_without_bias_at_any_rank() {
    for shape in [vec![6, 5], vec![2, 3, 5], vec![2, 2, 3, 5]] {
        let inputs = [randn(&shape), randn(&[4, 5]), randn(&[4])];
        check(
            "linear",
            1e-5,
            &inputs,
            |t| {
                nn::Linear::new(t[1].clone(), Some(t[2].clone()))
                    .forward(&t[0])
                    .unwrap()
            },
            |t| {
                candle_nn::Linear::new(t[1].clone(), Some(t[2].clone()))
                    .forward(&t[0])
                    .unwrap()
            },
        );
        check(
            "linear without bias",
            1e-5,
            &inputs[..2],
            |t| nn::Linear::new(t[1].clone(), None).forward(&t[0]).unwrap(),
            |t| {
                candle_nn::Linear::new(t[1].clone(), None)
                    .forward(&t[0])
                    .unwrap()
            },
        );
    }
}

#[test]
fn norms_match_candle_nn_forward_and_the_composed_gradient() {
    let x = randn(&[2, 3, 24]).affine(2.0, 0.5).unwrap();
    let (w, b) = ((randn(&[24]) + 1.0).unwrap(), randn(&[24]));
    // candle_nn's forward (its fast path: no backward) gives the reference value.
    let theirs = candle_nn::LayerNorm::new(w.clone(), b.clone(), 1e-5)
        .forward(&x)
        .unwrap();
    let ours = nn::LayerNorm::new(w.clone(), b.clone(), 1e-5)
        .forward(&x)
        .unwrap();
    assert!(max_diff(&ours, &theirs) < 1e-5);
    let theirs = candle_nn::RmsNorm::new(w.clone(), 1e-5)
        .forward(&x)
        .unwrap();
    let ours = nn::RmsNorm::new(w.clone(), 1e-5).forward(&x).unwrap();
    assert!(max_diff(&ours, &theirs) < 1e-5);

    check(
        "layer norm",
        1e-4,
        &[x.clone(), w.clone(), b.clone()],
        |t| {
            nn::LayerNorm::new(t[1].clone(), t[2].clone(), 1e-5)
                .forward(&t[0])
                .unwrap()
        },
        |t| layer_norm_slow(&t[0], &t[1], &t[2], 1e-5).unwrap(),
    );
    check(
        "layer norm without bias",
        1e-4,
        &[x.clone(), w.clone()],
        |t| {
            nn::LayerNorm::new_no_bias(t[1].clone(), 1e-5)
                .forward(&t[0])
                .unwrap()
        },
        |t| layer_norm_slow(&t[0], &t[1], &t[1].zeros_like().unwrap(), 1e-5).unwrap(),
    );
    // candle_nn's differentiable RMS norm is `forward_diff`.
    check(
        "rms norm",
        1e-4,
        &[x.clone(), w.clone()],
        |t| nn::RmsNorm::new(t[1].clone(), 1e-5).forward(&t[0]).unwrap(),
        |t| {
            candle_nn::RmsNorm::new(t[1].clone(), 1e-5)
                .forward_diff(&t[0])
                .unwrap()
        },
    );
    check(
        "rms norm with a shift (LayerNormConfig without remove_mean)",
        1e-4,
        &[x.clone(), w.clone(), b.clone()],
        |t| {
            let vb = VarBuilder::from_tensors(
                [
                    ("weight".to_string(), t[1].clone()),
                    ("bias".to_string(), t[2].clone()),
                ]
                .into(),
                DType::F32,
                &Device::Cpu,
            );
            let config = candle_nn::LayerNormConfig {
                eps: 1e-5,
                remove_mean: false,
                affine: true,
            };
            nn::layer_norm(24, config, vb)
                .unwrap()
                .forward(&t[0])
                .unwrap()
        },
        |t| {
            rms_norm_slow(&t[0], &t[1], 1e-5)
                .unwrap()
                .broadcast_add(&t[2])
                .unwrap()
        },
    );
}

#[test]
fn candle_nn_fast_norms_give_their_parameters_no_gradient() {
    // Why `nn` exists: in candle 0.11, LayerNorm and RmsNorm take a fast path
    // without backward on contiguous inputs.
    let x = randn(&[3, 8]);
    let (w, b) = (
        Var::ones(8, DType::F32, &Device::Cpu).unwrap(),
        Var::zeros(8, DType::F32, &Device::Cpu).unwrap(),
    );
    let y = candle_nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5)
        .forward(&x)
        .unwrap();
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&w).is_none() && grads.get(&b).is_none());
    let y = nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5)
        .forward(&x)
        .unwrap();
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&w).is_some() && grads.get(&b).is_some());
}

#[test]
fn embedding_matches_candle_nn_for_ids_of_any_shape() {
    let table = randn(&[10, 6]);
    for ids in [
        Tensor::new(&[3u32, 0, 3, 9], &Device::Cpu).unwrap(),
        Tensor::new(&[[1u32, 2, 2], [9, 0, 1]], &Device::Cpu).unwrap(),
        Tensor::new(&[[4i64, 4], [5, 8]], &Device::Cpu).unwrap(),
    ] {
        let ours = nn::Embedding::new(table.clone(), 6).forward(&ids).unwrap();
        let theirs = candle_nn::Embedding::new(table.clone(), 6)
            .forward(&ids)
            .unwrap();
        let mut dims = ids.dims().to_vec();
        dims.push(6);
        assert_eq!(ours.dims(), dims);
        assert_eq!(max_diff(&ours, &theirs), 0.0);
    }
    let ids = Tensor::new(&[[1u32, 2, 2], [9, 0, 1]], &Device::Cpu).unwrap();
    check(
        "embedding",
        1e-5,
        std::slice::from_ref(&table),
        |t| nn::Embedding::new(t[0].clone(), 6).forward(&ids).unwrap(),
        |t| {
            candle_nn::Embedding::new(t[0].clone(), 6)
                .forward(&ids)
                .unwrap()
        },
    );
}

#[test]
fn activations_match_candle_nn() {
    use candle_nn::Activation as C;
    let x = (randn(&[3, 4, 10]) * 2.0).unwrap();
    for a in [
        C::Gelu,
        C::NewGelu,
        C::GeluPytorchTanh,
        C::Swiglu,
        C::Silu,
        C::Relu,
        C::Sigmoid,
        C::Elu(0.5),
        C::LeakyRelu(0.1),
    ] {
        let ours = nn::Activation::from(a);
        assert_eq!(C::from(ours), a);
        check(
            &format!("{a:?}"),
            1e-5,
            std::slice::from_ref(&x),
            |t| ours.forward(&t[0]).unwrap(),
            |t| a.forward(&t[0]).unwrap(),
        );
    }
    assert_eq!(nn::Activation::default(), nn::Activation::Gelu);
}

#[test]
fn rotary_embedding_is_candles_rope_slow_with_heads_moved_first() {
    let (b, s, heads, d) = (2, 5, 3, 8);
    let rope = nn::RotaryEmbedding::new(heads, d, s + 3, 10_000.0, &Device::Cpu).unwrap();
    assert_eq!(rope.heads(), heads);
    let angles: Vec<f32> = (0..s)
        .flat_map(|p| {
            (0..d / 2).map(move |i| p as f32 * 10_000f32.powf(-2.0 * i as f32 / d as f32))
        })
        .collect();
    let angles = Tensor::from_vec(angles, (s, d / 2), &Device::Cpu).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    check(
        "rope",
        1e-5,
        &[randn(&[b, s, heads * d])],
        |t| rope.forward(&t[0]).unwrap(),
        |t| {
            let x = t[0]
                .reshape((b, s, heads, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap();
            candle_nn::rotary_emb::rope_slow(&x, &cos, &sin).unwrap()
        },
    );
}

#[test]
fn layers_convert_from_candle_nn_and_keep_their_tensors() {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let lin = candle_nn::linear(4, 3, vb.pp("lin")).unwrap();
    let ours = nn::Linear::from(lin.clone());
    assert_eq!(ours.weight().id(), lin.weight().id());
    let norm = candle_nn::layer_norm(4, 1e-6, vb.pp("ln")).unwrap();
    let ours = nn::LayerNorm::from(norm.clone());
    assert_eq!((ours.eps(), ours.remove_mean()), (1e-6, true));
    assert_eq!(ours.bias().unwrap().id(), norm.bias().unwrap().id());
    let rms = nn::RmsNorm::from(candle_nn::rms_norm(4, 1e-6, vb.pp("rms")).unwrap());
    assert_eq!(rms.eps(), 1e-6);
    assert!(!rms.into_inner().remove_mean());
    let emb = nn::Embedding::from(candle_nn::embedding(9, 4, vb.pp("emb")).unwrap());
    assert_eq!(
        (emb.embeddings().dims(), emb.hidden_size()),
        (&[9, 4][..], 4)
    );
}

/// A small model from every layer: a few SGD steps lower the loss, and every
/// parameter gets a nonzero gradient at each step.
#[test]
fn a_model_built_from_the_layers_trains() {
    use candle_nn::Optimizer;
    let dev = Device::Cpu;
    let (vocab, hidden) = (13, 12);
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let embed = nn::embedding(vocab, hidden, vb.pp("embed")).unwrap();
    let ln = nn::layer_norm(hidden, 1e-5, vb.pp("ln")).unwrap();
    let up = nn::linear(hidden, 2 * hidden, vb.pp("up")).unwrap();
    let down = nn::linear_no_bias(hidden, hidden, vb.pp("down")).unwrap();
    let rms = nn::rms_norm(hidden, 1e-5, vb.pp("rms")).unwrap();
    let head = nn::linear(hidden, vocab, vb.pp("head")).unwrap();
    // candle's CPU random numbers take no seed: fixed matrices make the run
    // the same every time.
    for var in map.all_vars().iter().filter(|v| v.rank() == 2) {
        let n = var.elem_count() as u32;
        let values = (Tensor::arange(0u32, n, &dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            * 0.7)
            .unwrap();
        var.set(
            &(values.sin().unwrap() * 0.3)
                .unwrap()
                .reshape(var.shape())
                .unwrap(),
        )
        .unwrap();
    }
    let forward = |ids: &Tensor| {
        let x = embed.forward(ids)?;
        let h = nn::Activation::Swiglu.forward(&up.forward(&ln.forward(&x)?)?)?;
        let x = (x + nn::Activation::NewGelu.forward(&down.forward(&h)?)?)?;
        head.forward(&rms.forward(&x)?)?.flatten_to(1)
    };
    let ids = Tensor::new(&[[1u32, 5, 2, 12, 7], [0, 3, 3, 8, 11]], &dev).unwrap();
    let targets = Tensor::new(&[5u32, 2, 12, 7, 1, 3, 3, 8, 11, 0], &dev).unwrap();
    let mut sgd = candle_nn::SGD::new(map.all_vars(), 0.05).unwrap();
    let mut losses = Vec::new();
    for _ in 0..5 {
        let loss = nn::loss::cross_entropy(&forward(&ids).unwrap(), &targets, None).unwrap();
        let grads = loss.backward().unwrap();
        assert_eq!(map.all_vars().len(), 9);
        for var in map.all_vars() {
            let g = grads.get(&var).expect("a parameter without gradient");
            assert!(compare::max_abs(g).unwrap() > 0.0);
        }
        sgd.step(&grads).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
    }
    assert!(losses[4] < losses[0], "{losses:?}");
}
