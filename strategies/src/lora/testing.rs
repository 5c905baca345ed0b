//! What the LoRA modules' tests share: a model's facts and a comparison of
//! tensors.

use candle_core::Tensor;

use crate::facts::ModelFacts;

/// Llama-3-8B's shape: 32 blocks, hidden 4096, 8 of 32 heads for k and v,
/// MLP 14336, vocabulary 128256, untied head.
pub(crate) fn llama3_8b() -> ModelFacts {
    let (h, kv, i, v, layers) = (4096u64, 1024u64, 14336u64, 128256u64, 32u64);
    let block = h * h * 2 + 2 * kv * h + 3 * h * i + 2 * h;
    let total = layers * block + 2 * v * h + h;
    ModelFacts::new(total, v * h, layers as usize)
        .with_block_parameters(block)
        .with_linear("q_proj", h, h)
        .with_linear("k_proj", h, kv)
        .with_linear("v_proj", h, kv)
        .with_linear("o_proj", h, h)
        .with_linear("gate_proj", h, i)
        .with_linear("up_proj", h, i)
        .with_linear("down_proj", i, h)
}

/// The largest |a − b| of two f32 tensors of one shape.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    values(a)
        .iter()
        .zip(values(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The values of an f32 tensor, in row-major order.
pub(crate) fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}
