//! Weight decay reaches matrices only: with zero gradients AdamW's update is
//! the decay alone, so matrices shrink by `1 - lr·wd` and biases and norm
//! scales stay as they were.

use candle_core::{Device, Tensor, Var};
use oomfix_strategies::adamw::{is_decay_exempt, FusedAdamW, ParamsAdamW};

#[test]
fn decay_leaves_biases_and_norm_scales_untouched_when_gradients_are_zero() {
    let dev = Device::Cpu;
    let (lr, wd) = (0.1, 0.5);
    let vars = vec![
        (
            "wte.weight".to_string(),
            Var::new(&[[1f32, -2.0], [3.0, 4.0]], &dev).unwrap(),
        ),
        (
            "ln_f.weight".to_string(),
            Var::new(&[1.5f32, 0.5], &dev).unwrap(),
        ),
        (
            "h.0.attn.c_attn.bias".to_string(),
            Var::new(&[0.25f32, -0.75], &dev).unwrap(),
        ),
    ];
    let before: Vec<Vec<f32>> = vars
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
        .collect();
    let params = ParamsAdamW {
        lr,
        weight_decay: wd,
        ..Default::default()
    };
    let mut opt = FusedAdamW::new_named(vars.clone(), params).unwrap();
    opt.exempt_from_weight_decay(is_decay_exempt);
    let zeros: Vec<Tensor> = vars.iter().map(|(_, v)| v.zeros_like().unwrap()).collect();
    opt.step(&zeros).unwrap();
    let after: Vec<Vec<f32>> = vars
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
        .collect();
    let shrink = (1.0 - lr * wd) as f32;
    let decayed: Vec<f32> = before[0].iter().map(|x| x * shrink).collect();
    assert_eq!(after[0], decayed, "the matrix decays");
    assert_eq!(after[1], before[1], "the norm scale does not");
    assert_eq!(after[2], before[2], "the bias does not");

    // Without the exemption every tensor decays.
    let mut all = FusedAdamW::new_named(vars.clone(), params_of(lr, wd)).unwrap();
    all.step(&zeros).unwrap();
    let bias: Vec<f32> = vars[2].1.as_tensor().to_vec1().unwrap();
    assert_eq!(
        bias,
        before[2].iter().map(|x| x * shrink).collect::<Vec<_>>()
    );
}

fn params_of(lr: f64, weight_decay: f64) -> ParamsAdamW {
    ParamsAdamW {
        lr,
        weight_decay,
        ..Default::default()
    }
}
