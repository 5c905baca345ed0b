//! Each fused op against the same expression composed from candle ops: the
//! value and the gradient of every input, in f32 and in the 16-bit dtypes.

use super::*;
use candle_core::{Device, Var};

/// Largest |a − b| relative to the largest |b| ([`crate::compare::rel_diff`]).
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    crate::compare::rel_diff(a, b).unwrap() as f32
}

fn randn(shape: &[usize], std: f32, offset: f32) -> Tensor {
    (Tensor::randn(0f32, std, shape, &Device::Cpu).unwrap() + offset as f64).unwrap()
}

/// Runs `ours` and `reference` on the same inputs (cast to `dtype`), weights their
/// outputs by one random tensor, and compares the outputs and every input's
/// gradient. The reference runs in f32 on the f32 originals.
fn check(
    inputs: &[Tensor],
    ours: impl Fn(&[Tensor]) -> Tensor,
    reference: impl Fn(&[Tensor]) -> Tensor,
) {
    for (dtype, tol) in CASES {
        check_in(dtype, tol, inputs, &ours, &reference);
    }
}

/// [`check`] in `dtype`, within `tol`.
fn check_in(
    dtype: DType,
    tol: f32,
    inputs: &[Tensor],
    ours: impl Fn(&[Tensor]) -> Tensor,
    reference: impl Fn(&[Tensor]) -> Tensor,
) {
    let vars_ours: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap())
        .collect();
    // The reference sees the inputs after rounding to `dtype`, widened back to f32.
    let vars_ref: Vec<Var> = vars_ours
        .iter()
        .map(|v| Var::from_tensor(&v.to_dtype(DType::F32).unwrap()).unwrap())
        .collect();
    let y = ours(
        &vars_ours
            .iter()
            .map(|v| v.as_tensor().clone())
            .collect::<Vec<_>>(),
    );
    let r = reference(
        &vars_ref
            .iter()
            .map(|v| v.as_tensor().clone())
            .collect::<Vec<_>>(),
    );
    assert_eq!(y.dtype(), dtype);
    let e = rel_diff(&y, &r);
    assert!(e < tol, "{dtype:?} output: {e}");
    let weights = Tensor::randn(0f32, 1.0, r.shape(), &Device::Cpu).unwrap();
    let loss = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .mul(&weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
    };
    let (g, gr) = (loss(&y), loss(&r));
    for (i, (v, vr)) in vars_ours.iter().zip(&vars_ref).enumerate() {
        let e = rel_diff(g.get(v).unwrap(), gr.get(vr).unwrap());
        assert!(e < tol, "{dtype:?} gradient of input {i}: {e}");
    }
}

/// Tolerances: f32 to rounding; 16-bit to a few of their ulps (relative).
const CASES: [(DType, f32); 3] = [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)];

#[test]
fn layer_norm_matches_the_composed_expression() {
    let inputs = [
        randn(&[3, 5, 96], 2.0, 0.5),
        randn(&[96], 1.0, 1.0),
        randn(&[96], 1.0, 0.0),
    ];
    check(
        &inputs,
        |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
        |t| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5).unwrap(),
    );
}

#[test]
fn layer_norm_without_bias_matches_the_composed_expression() {
    let inputs = [randn(&[3, 5, 80], 2.0, 0.5), randn(&[80], 1.0, 1.0)];
    check(
        &inputs,
        |t| layer_norm_no_bias(&t[0], &t[1], 1e-5).unwrap(),
        |t| {
            let zeros = t[1].zeros_like().unwrap();
            candle_nn::ops::layer_norm_slow(&t[0], &t[1], &zeros, 1e-5).unwrap()
        },
    );
}

#[test]
fn rms_norm_matches_the_composed_expression() {
    let inputs = [randn(&[4, 7, 64], 1.5, 0.3), randn(&[64], 1.0, 1.0)];
    check(
        &inputs,
        |t| rms_norm(&t[0], &t[1], 1e-6).unwrap(),
        |t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-6).unwrap(),
    );
}

#[test]
fn linear_matches_matmul_plus_bias_in_both_weight_layouts() {
    let x = randn(&[2, 5, 24], 1.0, 0.0);
    let b = randn(&[40], 1.0, 0.0);
    for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
        let w = match layout {
            WeightLayout::InOut => randn(&[24, 40], 0.2, 0.0),
            WeightLayout::OutIn => randn(&[40, 24], 0.2, 0.0),
        };
        check(
            &[x.clone(), w.clone(), b.clone()],
            |t| linear(&t[0], &t[1], &t[2], layout).unwrap(),
            |t| {
                let w = match layout {
                    WeightLayout::InOut => t[1].clone(),
                    WeightLayout::OutIn => t[1].t().unwrap(),
                };
                t[0].broadcast_matmul(&w)
                    .unwrap()
                    .broadcast_add(&t[2])
                    .unwrap()
            },
        );
    }
}

#[test]
fn project_matches_matmul_in_both_weight_layouts() {
    let x = randn(&[2, 5, 24], 1.0, 0.0);
    for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
        let w = match layout {
            WeightLayout::InOut => randn(&[24, 40], 0.2, 0.0),
            WeightLayout::OutIn => randn(&[40, 24], 0.2, 0.0),
        };
        check(
            &[x.clone(), w],
            |t| project(&t[0], &t[1], layout).unwrap(),
            |t| match layout {
                WeightLayout::InOut => t[0].broadcast_matmul(&t[1]).unwrap(),
                WeightLayout::OutIn => t[0].broadcast_matmul(&t[1].t().unwrap()).unwrap(),
            },
        );
    }
}

#[test]
fn gelu_matches_candles_tanh_and_erf_forms() {
    let x = randn(&[3, 50, 33], 2.0, 0.0);
    check(
        std::slice::from_ref(&x),
        |t| gelu(&t[0], GeluForm::Tanh).unwrap(),
        |t| t[0].gelu().unwrap(),
    );
    check(
        std::slice::from_ref(&x),
        |t| gelu(&t[0], GeluForm::Erf).unwrap(),
        |t| t[0].gelu_erf().unwrap(),
    );
}

#[test]
fn swiglu_matches_silu_times_up() {
    let inputs = [randn(&[2, 9, 40], 2.0, 0.0), randn(&[2, 9, 40], 1.0, 0.0)];
    check(
        &inputs,
        |t| swiglu(&t[0], &t[1]).unwrap(),
        |t| t[0].silu().unwrap().mul(&t[1]).unwrap(),
    );
}

#[test]
fn rope_matches_candles_rotate_half_with_heads_moved_first() {
    let (b, s, n, d) = (2, 7, 3, 8);
    let tables = RopeTables::new(s + 2, d, 10_000.0, 0.5, &Device::Cpu).unwrap();
    // Reference: candle's rope_slow on [b, n, s, d] with half-width tables.
    let angles: Vec<f32> = (0..s)
        .flat_map(|p| {
            (0..d / 2).map(move |i| p as f32 * 10_000f32.powf(-2.0 * i as f32 / d as f32))
        })
        .collect();
    let angles = Tensor::from_vec(angles, (s, d / 2), &Device::Cpu).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    check(
        &[randn(&[b, s, n * d], 1.0, 0.0)],
        |t| rope(&t[0], n, &tables).unwrap(),
        |t| {
            let heads_first = t[0].reshape((b, s, n, d)).unwrap().transpose(1, 2).unwrap();
            let y =
                candle_nn::rotary_emb::rope_slow(&heads_first.contiguous().unwrap(), &cos, &sin);
            (y.unwrap() * 0.5).unwrap()
        },
    );
    assert!(rope(&randn(&[b, s, n * d + 1], 1.0, 0.0), n, &tables).is_err());
    assert!(rope(&randn(&[b, s + 3, n * d], 1.0, 0.0), n, &tables).is_err());
}

/// Per-token tables ([`RopeTables::at_positions`]) of packed documents give
/// what RoPE gives each document alone (its positions from 0), in value
/// and gradient; per-token tables of another batch size are refused.
#[test]
fn rope_with_per_token_tables_restarts_each_documents_positions() {
    let (b, s, n, d) = (2, 7, 3, 8);
    let tables = RopeTables::new(s, d, 10_000.0, 0.5, &Device::Cpu).unwrap();
    let docs: [&[usize]; 2] = [&[3, 1, 3], &[7]];
    let positions: Vec<Vec<u32>> = docs
        .iter()
        .map(|lengths| lengths.iter().flat_map(|&l| 0..l as u32).collect())
        .collect();
    let positions = Tensor::new(positions, &Device::Cpu).unwrap();
    let per_token = tables.at_positions(&positions).unwrap();
    check(
        &[randn(&[b, s, n * d], 1.0, 0.0)],
        |t| rope(&t[0], n, &per_token).unwrap(),
        |t| {
            // Each document by itself, joined along the sequence.
            let rows: Vec<Tensor> = docs
                .iter()
                .enumerate()
                .map(|(bb, lengths)| {
                    let mut first = 0;
                    let parts: Vec<Tensor> = lengths
                        .iter()
                        .map(|&l| {
                            let x = t[0].narrow(0, bb, 1).unwrap().narrow(1, first, l).unwrap();
                            first += l;
                            rope(&x, n, &tables).unwrap()
                        })
                        .collect();
                    Tensor::cat(&parts, 2).unwrap()
                })
                .collect();
            Tensor::cat(&rows, 0).unwrap()
        },
    );
    assert!(rope(&randn(&[1, s, n * d], 1.0, 0.0), n, &per_token).is_err());
    assert!(per_token.at_positions(&positions).is_err());
    let beyond = Tensor::new(&[[0u32, 7]], &Device::Cpu).unwrap();
    assert!(tables.at_positions(&beyond).is_err());
}

/// Per-token RoPE tables on CUDA (the kernel reads row `bb·s + p`) against
/// the CPU op, in value and in the gradient of the input.
#[cfg(feature = "cuda")]
#[test]
fn rope_with_per_token_tables_on_cuda_matches_the_cpu() {
    let gpu = Device::new_cuda(0).unwrap();
    let (b, s, n, d) = (2, 7, 3, 8);
    let positions = Tensor::new(
        &[[0u32, 1, 2, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6]],
        &Device::Cpu,
    )
    .unwrap();
    let (x, w) = (
        randn(&[b, s, n * d], 1.0, 0.0),
        randn(&[b, n, s, d], 1.0, 0.0),
    );
    for (dtype, tol) in CASES {
        let run = |dev: &Device| {
            let tables = RopeTables::new(s, d, 10_000.0, 0.5, dev).unwrap();
            let tables = tables
                .at_positions(&positions.to_device(dev).unwrap())
                .unwrap();
            let x = Var::from_tensor(&x.to_dtype(dtype).unwrap().to_device(dev).unwrap()).unwrap();
            let y = rope(x.as_tensor(), n, &tables).unwrap();
            let loss = y
                .to_dtype(DType::F32)
                .unwrap()
                .mul(&w.to_device(dev).unwrap());
            let grads = loss.unwrap().sum_all().unwrap().backward().unwrap();
            let back = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
            (back(&y), back(grads.get(&x).unwrap()))
        };
        let ((y, dx), (y_cpu, dx_cpu)) = (run(&gpu), run(&Device::Cpu));
        assert!(rel_diff(&y, &y_cpu) < tol, "{dtype:?} output");
        assert!(rel_diff(&dx, &dx_cpu) < tol, "{dtype:?} gradient");
    }
}

#[test]
fn mismatched_parameters_are_errors() {
    let x = randn(&[2, 8], 1.0, 0.0);
    assert!(layer_norm(&x, &randn(&[7], 1.0, 0.0), &randn(&[8], 1.0, 0.0), 1e-5).is_err());
    assert!(rms_norm(
        &x,
        &randn(&[8], 1.0, 0.0).to_dtype(DType::BF16).unwrap(),
        1e-5
    )
    .is_err());
    // [in, out] weights of the wrong input width, and a bias of the wrong width.
    let linear_in_out = |w: &[usize], b: &[usize]| {
        let (w, b) = (randn(w, 1.0, 0.0), randn(b, 1.0, 0.0));
        linear(&x, &w, &b, WeightLayout::InOut)
    };
    assert!(linear_in_out(&[7, 3], &[3]).is_err());
    assert!(linear_in_out(&[8, 3], &[4]).is_err());
    assert!(swiglu(&x, &randn(&[2, 4], 1.0, 0.0)).is_err());
}

#[test]
fn embedding_matches_index_select_with_repeated_ids_and_a_tied_use() {
    let ids = Tensor::new(&[3u32, 0, 3, 5, 3, 1, 0], &Device::Cpu).unwrap();
    check(
        &[randn(&[6, 4], 1.0, 0.0)],
        |t| embedding(&t[0], &ids).unwrap(),
        |t| t[0].index_select(&ids, 0).unwrap(),
    );
    // Tied: the table's gradient also has a product's share.
    check(
        &[randn(&[6, 4], 1.0, 0.0)],
        |t| {
            embedding(&t[0], &ids)
                .unwrap()
                .matmul(&t[0].t().unwrap())
                .unwrap()
        },
        |t| {
            t[0].index_select(&ids, 0)
                .unwrap()
                .matmul(&t[0].t().unwrap())
                .unwrap()
        },
    );
    let table = randn(&[6, 4], 1.0, 0.0);
    let i64_ids = Tensor::new(&[5i64, 2], &Device::Cpu).unwrap();
    let rows = embedding(&table, &i64_ids).unwrap();
    assert_eq!(
        rel_diff(&rows, &table.index_select(&i64_ids, 0).unwrap()),
        0.0
    );
    assert!(embedding(&table, &Tensor::new(&[6u32], &Device::Cpu).unwrap()).is_err());
    assert!(embedding(&table, &Tensor::new(&[[1u32]], &Device::Cpu).unwrap()).is_err());
}

#[test]
fn a_padding_id_gets_no_gradient_from_the_lookup_only() {
    // Id 3 is the padding id: its rows come out, its positions give the
    // table nothing; a tied use still gives row 3 its share.
    let ids = Tensor::new(&[3u32, 0, 3, 5, 3, 1, 0], &Device::Cpu).unwrap();
    let keep = Tensor::new(&[0f32, 1., 0., 1., 0., 1., 1.], &Device::Cpu)
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    // The reference: the rows at padding positions taken from a detached table.
    let reference = |t: &Tensor| {
        let rows = t.index_select(&ids, 0).unwrap();
        let frozen = t.detach().index_select(&ids, 0).unwrap();
        let keep = keep.to_dtype(t.dtype()).unwrap();
        (rows.broadcast_mul(&keep).unwrap()
            + frozen.broadcast_mul(&(1.0 - &keep).unwrap()).unwrap())
        .unwrap()
    };
    check(
        &[randn(&[6, 4], 1.0, 0.0)],
        |t| embedding_padded(&t[0], &ids, Some(3)).unwrap(),
        |t| reference(&t[0]),
    );
    check(
        &[randn(&[6, 4], 1.0, 0.0)],
        |t| {
            embedding_padded(&t[0], &ids, Some(3))
                .unwrap()
                .matmul(&t[0].t().unwrap())
                .unwrap()
        },
        |t| reference(&t[0]).matmul(&t[0].t().unwrap()).unwrap(),
    );
    // No padding id, or one past the table: the plain lookup's gradient.
    let table = candle_core::Var::from_tensor(&randn(&[6, 4], 1.0, 0.0)).unwrap();
    let grad = |padding| {
        let y = embedding_padded(table.as_tensor(), &ids, padding).unwrap();
        let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        g.get(table.as_tensor()).unwrap().clone()
    };
    assert_eq!(rel_diff(&grad(None), &grad(Some(6))), 0.0);
    let padded = grad(Some(3));
    let row3: Vec<f32> = padded.get(3).unwrap().to_vec1().unwrap();
    assert!(row3.iter().all(|&v| v == 0.0), "{row3:?}");
    assert!(rel_diff(&padded.get(0).unwrap(), &grad(None).get(0).unwrap()) == 0.0);
}

/// softmax(q·kᵀ·scale + mask) from candle ops, with each key head repeated
/// for its query heads; `allowed(batch, i, j)` says whether query `i` sees key `j`.
fn composed_probs(
    q: &Tensor,
    k: &Tensor,
    scale: f64,
    allowed: impl Fn(usize, usize, usize) -> bool,
) -> Tensor {
    let (b, h, s_q, d) = q.dims4().unwrap();
    let (_, kv, s_k, _) = k.dims4().unwrap();
    let k = k
        .unsqueeze(2)
        .unwrap()
        .broadcast_as((b, kv, h / kv, s_k, d))
        .unwrap()
        .reshape((b, h, s_k, d))
        .unwrap();
    let mask: Vec<f32> = (0..b)
        .flat_map(|bb| (0..s_q).flat_map(move |i| (0..s_k).map(move |j| (bb, i, j))))
        .map(|(bb, i, j)| if allowed(bb, i, j) { 0.0 } else { -1e9 })
        .collect();
    let mask = Tensor::from_vec(mask, (b, 1, s_q, s_k), &Device::Cpu).unwrap();
    let scores = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
    candle_nn::ops::softmax(&scores.broadcast_add(&mask).unwrap(), D::Minus1).unwrap()
}

#[test]
fn attention_probs_match_the_composed_softmax() {
    // Grouped heads (4 query heads on 2 key heads), odd lengths, fewer queries
    // than keys (the causal mask aligned to the last key), and key padding.
    let (b, h, kv, s_q, s_k, d) = (2, 4, 2, 5, 9, 8);
    let keep = Tensor::new(
        &[
            [1f32, 1., 0., 1., 1., 1., 1., 0., 1.],
            [1., 1., 1., 1., 1., 1., 1., 1., 0.],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let flags = keep.to_vec2::<f32>().unwrap();
    let inputs = [
        randn(&[b, h, s_q, d], 1.0, 0.0),
        randn(&[b, kv, s_k, d], 1.0, 0.0),
    ];
    let causal = |_: usize, i: usize, j: usize| j <= i + s_k - s_q;
    let padded = |bb: usize, _: usize, j: usize| flags[bb][j] != 0.0;
    for is_causal in [false, true] {
        let opts = ProbsOptions {
            scale: 0.35,
            causal: is_causal,
        };
        let pad = !is_causal;
        check(
            &inputs,
            |t| attention_probs(&t[0], &t[1], pad.then_some(&keep), None, opts).unwrap(),
            |t| {
                let allowed = |bb, i, j| {
                    if pad {
                        padded(bb, i, j)
                    } else {
                        causal(bb, i, j)
                    }
                };
                composed_probs(&t[0], &t[1], 0.35, allowed)
            },
        );
    }
}

/// Each query's first visible key (packed documents) on top of the causal
/// mask and key padding, against the composed softmax.
#[test]
fn attention_probs_with_key_starts_match_the_composed_softmax() {
    let (b, h, kv, s, d) = (2, 4, 2, 9, 8);
    let start = Tensor::new(
        &[[0u32, 0, 0, 3, 3, 5, 5, 5, 5], [0, 1, 1, 1, 1, 1, 6, 6, 6]],
        &Device::Cpu,
    )
    .unwrap();
    let first = start.to_vec2::<u32>().unwrap();
    let keep = Tensor::new(
        &[[1u8, 1, 1, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]],
        &Device::Cpu,
    )
    .unwrap();
    let flags = keep.to_vec2::<u8>().unwrap();
    let inputs = [
        randn(&[b, h, s, d], 1.0, 0.0),
        randn(&[b, kv, s, d], 1.0, 0.0),
    ];
    let opts = ProbsOptions {
        scale: 0.35,
        causal: true,
    };
    check(
        &inputs,
        |t| attention_probs(&t[0], &t[1], Some(&keep), Some(&start), opts).unwrap(),
        |t| {
            let allowed = |bb: usize, i: usize, j: usize| {
                j <= i && j >= first[bb][i] as usize && flags[bb][j] != 0
            };
            composed_probs(&t[0], &t[1], 0.35, allowed)
        },
    );
    let wrong = Tensor::zeros((b, s - 1), DType::U32, &Device::Cpu).unwrap();
    assert!(attention_probs(&inputs[0], &inputs[1], None, Some(&wrong), opts).is_err());
}

#[test]
fn attention_probs_backward_in_uneven_groups_of_key_heads() {
    // 5 key heads (3 query heads each): the backward makes dS for groups of
    // 2, 2 and 1 key heads; 1 key head: a single group.
    for (h, kv) in [(15, 5), (3, 1)] {
        let (s_q, s_k, d) = (6, 7, 4);
        let inputs = [
            randn(&[1, h, s_q, d], 1.0, 0.0),
            randn(&[1, kv, s_k, d], 1.0, 0.0),
        ];
        let opts = ProbsOptions {
            scale: 0.5,
            causal: true,
        };
        check_in(
            DType::F32,
            1e-5,
            &inputs,
            |t| attention_probs(&t[0], &t[1], None, None, opts).unwrap(),
            |t| composed_probs(&t[0], &t[1], 0.5, |_, i, j| j <= i + s_k - s_q),
        );
    }
}

#[test]
fn attention_probs_of_a_query_that_sees_no_key_are_zero() {
    let q = Var::randn(0f32, 1.0, (1, 1, 3, 4), &Device::Cpu).unwrap();
    let k = Var::randn(0f32, 1.0, (1, 1, 3, 4), &Device::Cpu).unwrap();
    let keep = Tensor::zeros((1, 3), DType::U8, &Device::Cpu).unwrap();
    let opts = ProbsOptions {
        scale: 1.0,
        causal: false,
    };
    let p = attention_probs(q.as_tensor(), k.as_tensor(), Some(&keep), None, opts).unwrap();
    assert_eq!(p.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [0.0; 9]);
    let grads = p.sum_all().unwrap().backward().unwrap();
    for var in [&q, &k] {
        let g = grads.get(var).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(g.to_scalar::<f32>().unwrap(), 0.0);
    }
}

#[test]
fn attention_probs_reject_mismatched_inputs() {
    let q = randn(&[1, 3, 4, 8], 1.0, 0.0);
    let opts = ProbsOptions {
        scale: 1.0,
        causal: true,
    };
    // 3 query heads on 2 key heads; a head size that differs; padding of the wrong shape.
    assert!(attention_probs(&q, &randn(&[1, 2, 4, 8], 1.0, 0.0), None, None, opts).is_err());
    assert!(attention_probs(&q, &randn(&[1, 1, 4, 4], 1.0, 0.0), None, None, opts).is_err());
    let keep = Tensor::ones((1, 3), DType::U8, &Device::Cpu).unwrap();
    assert!(attention_probs(&q, &randn(&[1, 1, 4, 8], 1.0, 0.0), Some(&keep), None, opts).is_err());
}

/// softmax(q·kᵀ·scale) over the keys each query sees, in f64 loops: `[b, H,
/// s_q, s_k]` row-major; a row that sees no key is zeros.
fn probs_reference(
    q: &[f32],
    k: &[f32],
    [b, h, kv, s_q, s_k, d]: [usize; 6],
    keep: Option<&[u8]>,
    opts: ProbsOptions,
) -> Vec<f64> {
    let mut out = vec![0f64; b * h * s_q * s_k];
    for (bb, hh, i) in
        (0..b).flat_map(|bb| (0..h).flat_map(move |hh| (0..s_q).map(move |i| (bb, hh, i))))
    {
        let kh = hh / (h / kv);
        let seen = |j: usize| {
            (!opts.causal || j + s_q <= i + s_k) && keep.is_none_or(|f| f[bb * s_k + j] != 0)
        };
        let score = |j: usize| {
            let qi = &q[((bb * h + hh) * s_q + i) * d..][..d];
            let kj = &k[((bb * kv + kh) * s_k + j) * d..][..d];
            qi.iter()
                .zip(kj)
                .map(|(&a, &c)| a as f64 * c as f64)
                .sum::<f64>()
                * opts.scale as f64
        };
        let js: Vec<usize> = (0..s_k).filter(|&j| seen(j)).collect();
        let m = js
            .iter()
            .map(|&j| score(j))
            .fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = js.iter().map(|&j| (score(j) - m).exp()).sum();
        let row = &mut out[((bb * h + hh) * s_q + i) * s_k..][..s_k];
        for &j in &js {
            row[j] = (score(j) - m).exp() / sum;
        }
    }
    out
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// f32 probabilities within 1e-5 of the f64 reference for any shape,
    /// group size, causal or not, and random key padding (rows that see no
    /// key, e.g. more queries than keys under the causal mask, included).
    #[test]
    fn attention_probs_match_an_f64_reference(
        (b, kv, g, s_q, s_k, d) in (1usize..3, 1usize..3, 1usize..4, 1usize..9, 1usize..9, 1usize..6),
        causal in proptest::bool::ANY,
        padded in proptest::bool::ANY,
        seed in 0u64..1000,
    ) {
        let h = kv * g;
        let mut next = seed;
        let mut rand = move || {
            next = next.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((next >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
        };
        let q: Vec<f32> = (0..b * h * s_q * d).map(|_| rand()).collect();
        let k: Vec<f32> = (0..b * kv * s_k * d).map(|_| rand()).collect();
        let flags: Vec<u8> = (0..b * s_k).map(|_| u8::from(rand() > -1.0)).collect();
        let keep = padded.then_some(flags.as_slice());
        let opts = ProbsOptions { scale: 0.7, causal };
        let dev = Device::Cpu;
        let qt = Tensor::from_vec(q.clone(), (b, h, s_q, d), &dev).unwrap();
        let kt = Tensor::from_vec(k.clone(), (b, kv, s_k, d), &dev).unwrap();
        let keep_t = keep.map(|f| Tensor::from_vec(f.to_vec(), (b, s_k), &dev).unwrap());
        let p = attention_probs(&qt, &kt, keep_t.as_ref(), None, opts).unwrap();
        let got = p.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = probs_reference(&q, &k, [b, h, kv, s_q, s_k, d], keep, opts);
        for (x, y) in got.iter().zip(&want) {
            proptest::prop_assert!((*x as f64 - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}
