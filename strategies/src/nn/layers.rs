//! Trainable layers built on [`super::ops`], with `candle_nn`'s names,
//! constructors, weight names and shapes.
//!
//! Each type holds the same tensors as its `candle_nn` namesake (built by the
//! same constructor from a `candle_nn::VarBuilder`, under the same names, with
//! the same initialisation) and converts from it with `From`; only the forward
//! differs: one fused op with its own backward where candle's fast path has
//! none or where the composed form keeps every intermediate alive.

use candle_core::{Module, Result, Tensor, D};
use candle_nn::{LayerNormConfig, VarBuilder};

use super::ops::{self, GeluForm, RopeTables, WeightLayout};
use crate::lora::{FrozenLinear, LoraLinear};

/// `y = x·Wᵀ + b` over the last dimension of `x`, the weight `[out, in]` as in
/// `candle_nn::Linear` and `torch.nn.Linear` (or `[in, out]`, `y = x·W + b`,
/// as GPT-2's `Conv1D` stores it: [`Linear::with_layout`]).
///
/// One node either way: [`ops::linear`] with a bias (added in place, only
/// the output kept), [`ops::project`] without; the weight's gradient is one
/// product, made in the weight's layout.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    layout: WeightLayout,
}

impl Linear {
    /// A layer of `weight` `[out, in]` and an optional `bias` `[out]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear::with_layout(weight, bias, WeightLayout::OutIn)
    }

    /// A layer of `weight` stored as `layout` says and an optional `bias`
    /// `[out]`.
    pub fn with_layout(weight: Tensor, bias: Option<Tensor>, layout: WeightLayout) -> Self {
        Linear {
            weight,
            bias,
            layout,
        }
    }

    /// The weight, `[out, in]` (`[in, out]` when its [`layout`](Self::layout)
    /// is [`WeightLayout::InOut`]).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// How the weight is stored.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }
}

impl Module for Linear {
    /// `x` `[.., in]` → `[.., out]`.
    ///
    /// Allocates the output: with a bias, [`ops::linear`] adds it in place.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(bias) => ops::linear(x, &self.weight, bias, self.layout),
            None => ops::project(x, &self.weight, self.layout),
        }
    }
}

impl From<candle_nn::Linear> for Linear {
    fn from(l: candle_nn::Linear) -> Self {
        Linear::new(l.weight().clone(), l.bias().cloned())
    }
}

/// An affine projection of the last dimension whose weight may be frozen:
/// trained ([`Linear`]), frozen ([`FrozenLinear`], in a 16-bit dtype or in
/// NF4), or frozen with a trained low-rank adapter ([`LoraLinear`]).
///
/// A frozen projection keeps only its input (its weight converted for the
/// product and freed, again in backward).
#[derive(Debug, Clone)]
pub enum Projection {
    /// Its weight and bias are trained.
    Trained(Linear),
    /// A frozen weight (`[out, in]`) and bias.
    Frozen(FrozenLinear),
    /// A frozen weight and bias with a trained LoRA adapter.
    Adapted(LoraLinear),
}

impl Module for Projection {
    /// `x` `[.., in]` → `[.., out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Projection::Trained(l) => l.forward(x),
            Projection::Frozen(f) => f.forward(x).map_err(candle_core::Error::wrap),
            Projection::Adapted(a) => a.forward(x).map_err(candle_core::Error::wrap),
        }
    }
}

impl From<Linear> for Projection {
    fn from(l: Linear) -> Self {
        Projection::Trained(l)
    }
}

/// A [`Linear`] layer with a bias, its tensors `weight` `[out_dim, in_dim]`
/// and `bias` `[out_dim]` made or fetched by `vb` as `candle_nn::linear` does.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear(in_dim, out_dim, vb).map(Linear::from)
}

/// A [`Linear`] layer without a bias (`weight` `[out_dim, in_dim]`), as
/// `candle_nn::linear_no_bias`.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_no_bias(in_dim, out_dim, vb).map(Linear::from)
}

/// [`linear`] when `bias`, else [`linear_no_bias`], as `candle_nn::linear_b`.
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_b(in_dim, out_dim, bias, vb).map(Linear::from)
}

/// Layer normalisation over the last dimension, `(x − mean)/√(var + eps)·w + b`,
/// or, built by [`LayerNorm::rms_norm`], RMS normalisation `x/√(mean(x²) + eps)·w`
/// (scaled by `w + offset` where [`RmsNorm::with_offset`] gives one).
///
/// One fused node ([`ops::layer_norm`], [`ops::layer_norm_no_bias`] or
/// [`ops::rms_norm_offset`]) that computes in f32 and keeps only its output;
/// `candle_nn::LayerNorm`'s fast path on contiguous inputs has no backward.
/// `w` and `b` are `[h]` in the input's dtype.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
    /// Added to the scale in f32 (RMS norm only; Gemma's `1 + w`).
    offset: f32,
}

impl LayerNorm {
    /// Layer norm with a scale and a shift.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm {
            bias: Some(bias),
            ..LayerNorm::new_no_bias(weight, eps)
        }
    }

    /// Layer norm with a scale only.
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: None,
            remove_mean: true,
            eps,
            offset: 0.0,
        }
    }

    /// RMS norm: no mean removed, a scale only.
    pub fn rms_norm(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            remove_mean: false,
            ..LayerNorm::new_no_bias(weight, eps)
        }
    }

    /// The scale, `[h]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift, `[h]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the mean is removed (layer norm) or not (RMS norm).
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }
}

impl Module for LayerNorm {
    /// `x` `[.., h]` → the same shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match (self.remove_mean, &self.bias) {
            (true, Some(b)) => ops::layer_norm(x, &self.weight, b, self.eps),
            (true, None) => ops::layer_norm_no_bias(x, &self.weight, self.eps),
            (false, None) => ops::rms_norm_offset(x, &self.weight, self.eps, self.offset),
            (false, Some(b)) => {
                ops::rms_norm_offset(x, &self.weight, self.eps, self.offset)?.broadcast_add(b)
            }
        }
    }
}

impl From<candle_nn::LayerNorm> for LayerNorm {
    fn from(l: candle_nn::LayerNorm) -> Self {
        LayerNorm {
            weight: l.weight().clone(),
            bias: l.bias().cloned(),
            remove_mean: l.remove_mean(),
            eps: l.eps(),
            offset: 0.0,
        }
    }
}

/// A [`LayerNorm`] of `size` features: `weight` (ones) and, when the config's
/// `affine` is set, `bias` (zeros), made or fetched by `vb` as
/// `candle_nn::layer_norm` does (which also accepts `gamma` and `beta`).
/// `config` is an epsilon (`1e-5`) or a `candle_nn::LayerNormConfig`.
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    candle_nn::layer_norm(size, config, vb).map(LayerNorm::from)
}

/// A [`LayerNorm`] with a scale only, as `candle_nn::layer_norm_no_bias`.
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    candle_nn::layer_norm_no_bias(size, eps, vb).map(LayerNorm::from)
}

/// RMS normalisation `x/√(mean(x²) + eps)·w` over the last dimension, or
/// scaled by `w + offset` ([`RmsNorm::with_offset`]): one
/// [`ops::rms_norm_offset`] node (`candle_nn::RmsNorm::forward` has no
/// backward).
#[derive(Debug, Clone)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// RMS norm with the scale `weight` `[h]`.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm(LayerNorm::rms_norm(weight, eps))
    }

    /// RMS norm scaled by `weight + offset` (`[h]`), the sum taken in f32
    /// (Gemma's norms store `w` with `offset` 1).
    pub fn with_offset(weight: Tensor, eps: f64, offset: f32) -> Self {
        RmsNorm(LayerNorm {
            offset,
            ..LayerNorm::rms_norm(weight, eps)
        })
    }

    /// The [`LayerNorm`] that computes it.
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The scale, `[h]`.
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }

    /// The same as [`Module::forward`] (the name of `candle_nn`'s
    /// differentiable form, kept so that code calling it switches unchanged).
    pub fn forward_diff(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

impl Module for RmsNorm {
    /// `x` `[.., h]` → the same shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

impl From<candle_nn::RmsNorm> for RmsNorm {
    fn from(l: candle_nn::RmsNorm) -> Self {
        RmsNorm(LayerNorm::from(l.into_inner()))
    }
}

/// An [`RmsNorm`] of `size` features, its `weight` (ones) made or fetched by
/// `vb` as `candle_nn::rms_norm` does.
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    candle_nn::rms_norm(size, eps, vb).map(RmsNorm::from)
}

/// A token embedding table `[vocab, hidden]`: ids of any shape → their rows,
/// `[.., hidden]`.
///
/// One [`ops::embedding`] node, whose backward scatters the output's
/// gradient straight into one table-sized gradient (candle's `index_select`
/// backward adds into a table of zeros).
#[derive(Debug, Clone)]
pub struct Embedding {
    embeddings: Tensor,
    hidden_size: usize,
}

impl Embedding {
    /// A lookup into `embeddings` `[vocab, hidden_size]`.
    pub fn new(embeddings: Tensor, hidden_size: usize) -> Self {
        Embedding {
            embeddings,
            hidden_size,
        }
    }

    /// The table, `[vocab, hidden]`.
    pub fn embeddings(&self) -> &Tensor {
        &self.embeddings
    }

    /// The width of a row.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }
}

impl Module for Embedding {
    /// `ids` (u32 or i64, any shape) → `[.., hidden]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut dims = ids.dims().to_vec();
        dims.push(self.hidden_size);
        ops::embedding(&self.embeddings, &ids.flatten_all()?)?.reshape(dims)
    }
}

impl From<candle_nn::Embedding> for Embedding {
    fn from(e: candle_nn::Embedding) -> Self {
        Embedding::new(e.embeddings().clone(), e.hidden_size())
    }
}

/// An [`Embedding`] of `in_size` rows of `out_size`, its `weight` (normal,
/// σ = 1) made or fetched by `vb` as `candle_nn::embedding` does.
pub fn embedding(in_size: usize, out_size: usize, vb: VarBuilder) -> Result<Embedding> {
    candle_nn::embedding(in_size, out_size, vb).map(Embedding::from)
}

/// An activation function, with the variants of `candle_nn::Activation`.
///
/// GELU (both forms) and SwiGLU are fused ops ([`ops::gelu`],
/// [`ops::swiglu`]) that keep only their output; the others are
/// `candle_nn::Activation`'s (differentiable, composed from candle ops).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Activation {
    /// Exact GELU, `0.5·x·(1 + erf(x/√2))` (`gelu` in Hugging Face configs).
    #[default]
    Gelu,
    /// Tanh-approximate GELU (`gelu_new`).
    NewGelu,
    /// `max(x, 0)`.
    Relu,
    /// `max(x, 0)²`.
    Relu2,
    /// `min(max(x, 0), 6)`.
    Relu6,
    /// `x·sigmoid(x)`.
    Silu,
    /// `1/(1 + e^(−x))`.
    Sigmoid,
    /// `clamp((x + 3)/6, 0, 1)`.
    HardSigmoid,
    /// `silu(a)·b` with `a`, `b` the two halves of the last dimension.
    Swiglu,
    /// `x·sigmoid(x)`.
    Swish,
    /// `x·tanh(softplus(x))`.
    Mish,
    /// `x·hard_sigmoid(x)`.
    HardSwish,
    /// ELU with the given `alpha`.
    Elu(f64),
    /// Leaky ReLU with the given negative slope.
    LeakyRelu(f64),
    /// Tanh-approximate GELU (`gelu_pytorch_tanh`).
    GeluPytorchTanh,
}

impl Module for Activation {
    /// Elementwise, or for [`Activation::Swiglu`] `[.., 2·n]` → `[.., n]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match *self {
            Activation::Gelu => ops::gelu(x, GeluForm::Erf),
            Activation::NewGelu | Activation::GeluPytorchTanh => ops::gelu(x, GeluForm::Tanh),
            Activation::Swiglu => {
                let halves = x.chunk(2, D::Minus1)?;
                ops::swiglu(&halves[0], &halves[1])
            }
            other => candle_nn::Activation::from(other).forward(x),
        }
    }
}

impl From<candle_nn::Activation> for Activation {
    fn from(a: candle_nn::Activation) -> Self {
        use candle_nn::Activation as C;
        match a {
            C::Gelu => Activation::Gelu,
            C::NewGelu => Activation::NewGelu,
            C::Relu => Activation::Relu,
            C::Relu2 => Activation::Relu2,
            C::Relu6 => Activation::Relu6,
            C::Silu => Activation::Silu,
            C::Sigmoid => Activation::Sigmoid,
            C::HardSigmoid => Activation::HardSigmoid,
            C::Swiglu => Activation::Swiglu,
            C::Swish => Activation::Swish,
            C::Mish => Activation::Mish,
            C::HardSwish => Activation::HardSwish,
            C::Elu(alpha) => Activation::Elu(alpha),
            C::LeakyRelu(slope) => Activation::LeakyRelu(slope),
            C::GeluPytorchTanh => Activation::GeluPytorchTanh,
        }
    }
}

impl From<Activation> for candle_nn::Activation {
    fn from(a: Activation) -> Self {
        use candle_nn::Activation as C;
        match a {
            Activation::Gelu => C::Gelu,
            Activation::NewGelu => C::NewGelu,
            Activation::Relu => C::Relu,
            Activation::Relu2 => C::Relu2,
            Activation::Relu6 => C::Relu6,
            Activation::Silu => C::Silu,
            Activation::Sigmoid => C::Sigmoid,
            Activation::HardSigmoid => C::HardSigmoid,
            Activation::Swiglu => C::Swiglu,
            Activation::Swish => C::Swish,
            Activation::Mish => C::Mish,
            Activation::HardSwish => C::HardSwish,
            Activation::Elu(alpha) => C::Elu(alpha),
            Activation::LeakyRelu(slope) => C::LeakyRelu(slope),
            Activation::GeluPytorchTanh => C::GeluPytorchTanh,
        }
    }
}

/// Rotary position embedding (Llama's `rotate_half` form) that also moves the
/// heads first: `[b, s, heads·d]` (or `[b, s, heads, d]`) → `[b, heads, s, d]`,
/// contiguous, ready for attention.
///
/// One [`ops::rope`] node that keeps nothing (`candle_nn::rotary_emb::rope`
/// has no backward in candle 0.11; `rope_slow` keeps its intermediates).
/// Sequences up to the `max_positions` the tables were made for; position
/// `p` of a sequence uses row `p`.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    tables: RopeTables,
    heads: usize,
}

impl RotaryEmbedding {
    /// For `heads` heads of `head_dim` (even) and positions `0..max_positions`,
    /// with the frequencies `theta^(−2i/head_dim)` (Llama: `theta` = 10 000).
    pub fn new(
        heads: usize,
        head_dim: usize,
        max_positions: usize,
        theta: f64,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let tables = RopeTables::new(max_positions, head_dim, theta, 1.0, device)?;
        Ok(RotaryEmbedding { tables, heads })
    }

    /// For `heads` heads with prepared tables (e.g. with an attention scale
    /// folded in, [`RopeTables::new`]).
    pub fn from_tables(tables: RopeTables, heads: usize) -> Self {
        RotaryEmbedding { tables, heads }
    }

    /// The number of heads the input is split into.
    pub fn heads(&self) -> usize {
        self.heads
    }
}

impl Module for RotaryEmbedding {
    /// `[b, s, heads·d]` or `[b, s, heads, d]` → `[b, heads, s, d]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::rope(x, self.heads, &self.tables)
    }
}
