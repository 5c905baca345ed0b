//! Two models oomfix does not know, written with `oomfix_strategies::nn`'s
//! layers: a small ViT image classifier and a gated causal-convolution
//! language model. Shared by `examples/any_models.rs` (plans and trains
//! them) and `examples/any_model_bench.rs` (planning by measurement against
//! halving on out-of-memory and trying every configuration).

use candle_core::{DType, Device, Module, Tensor, Var, D};
use oomfix::strategies::attention::{flash_attention, AttentionOptions};
use oomfix::strategies::model::{self, Capabilities, Forward, MicroBatch, Model, Stages};
use oomfix::strategies::nn::loss::cross_entropy;
use oomfix::strategies::nn::ops::{attention_probs, gelu, GeluForm, ProbsOptions};
use oomfix::strategies::nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear};
use oomfix::strategies::Attention;
use rand::{rngs::StdRng, Rng, SeedableRng};

// ---------------------------------------------------------------------------
// A small ViT.

/// Image side, patch side, width, heads, blocks, classes.
const IMAGE: usize = 32;
const PATCH: usize = 4;
const PATCHES: usize = (IMAGE / PATCH) * (IMAGE / PATCH);
const VIT_WIDTH: usize = 96;
const VIT_HEADS: usize = 4;
const VIT_BLOCKS: usize = 4;
const CLASSES: usize = 10;

/// One pre-LN transformer encoder block.
pub struct VitBlock {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    up: Linear,
    down: Linear,
}

impl VitBlock {
    fn forward(&self, x: &Tensor, attention: Attention) -> candle_core::Result<Tensor> {
        let (b, s, d) = x.dims3()?;
        let (h, dh) = (VIT_HEADS, d / VIT_HEADS);
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let qkv = qkv.reshape((b, s, 3, h, dh))?.permute((2, 0, 3, 1, 4))?;
        let (q, k, v) = (
            qkv.get(0)?.contiguous()?,
            qkv.get(1)?.contiguous()?,
            qkv.get(2)?.contiguous()?,
        );
        let ctx = match attention {
            Attention::Flash => flash_attention(&q, &k, &v, &AttentionOptions::default())?,
            Attention::Composed => {
                let opts = ProbsOptions {
                    scale: 1.0 / (dh as f32).sqrt(),
                    causal: false,
                };
                attention_probs(&q, &k, None, None, opts)?.matmul(&v)?
            }
        };
        let ctx = ctx.transpose(1, 2)?.reshape((b, s, d))?;
        let x = (x + self.proj.forward(&ctx)?)?;
        let mlp = self.down.forward(&gelu(
            &self.up.forward(&self.ln2.forward(&x)?)?,
            GeluForm::Erf,
        )?)?;
        x + mlp
    }
}

/// A ViT classifier of random 32×32 RGB images (as 4×4 patches).
pub struct Vit {
    patch: Linear,
    position: Tensor,
    blocks: Vec<VitBlock>,
    norm: LayerNorm,
    head: Linear,
    vars: Vec<Var>,
    dtype: DType,
    device: Device,
}

/// Builds the ViT in `dtype` on `device` (weights drawn by candle_nn's initialisers).
pub fn vit(dtype: DType, device: &Device) -> candle_core::Result<Vit> {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, dtype, device);
    let d = VIT_WIDTH;
    let blocks = (0..VIT_BLOCKS)
        .map(|i| {
            let vb = vb.pp(format!("blocks.{i}"));
            Ok(VitBlock {
                ln1: layer_norm(d, 1e-6, vb.pp("ln1"))?,
                qkv: linear(d, 3 * d, vb.pp("qkv"))?,
                proj: linear(d, d, vb.pp("proj"))?,
                ln2: layer_norm(d, 1e-6, vb.pp("ln2"))?,
                up: linear(d, 4 * d, vb.pp("up"))?,
                down: linear(4 * d, d, vb.pp("down"))?,
            })
        })
        .collect::<candle_core::Result<_>>()?;
    let position = vb.get_with_hints(
        (PATCHES, d),
        "position",
        candle_nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        },
    )?;
    let vit = Vit {
        patch: linear(3 * PATCH * PATCH, d, vb.pp("patch"))?,
        position,
        blocks,
        norm: layer_norm(d, 1e-6, vb.pp("norm"))?,
        head: linear(d, CLASSES, vb.pp("head"))?,
        vars: model::vars_of(&varmap),
        dtype,
        device: device.clone(),
    };
    Ok(vit)
}

impl Model for Vit {
    fn vars(&self) -> Vec<Var> {
        self.vars.clone()
    }
    fn forward(&self, batch: &MicroBatch) -> candle_core::Result<Forward<'_>> {
        let b = batch.size;
        let mut rng = StdRng::seed_from_u64(batch.index);
        let pixels: Vec<f32> = (0..b * PATCHES * 3 * PATCH * PATCH)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let labels: Vec<u32> = (0..b)
            .map(|_| rng.random_range(0..CLASSES as u32))
            .collect();
        let pixels = Tensor::from_vec(pixels, (b, PATCHES, 3 * PATCH * PATCH), &self.device)?
            .to_dtype(self.dtype)?;
        let labels = Tensor::new(labels, &self.device)?;
        // The position table is one of the VarMap's variables.
        let stem = self.patch.forward(&pixels)?.broadcast_add(&self.position)?;
        let attention = batch.execution.attention;
        let blocks = self
            .blocks
            .iter()
            .map(|blk| Box::new(move |x: &Tensor| blk.forward(x, attention)) as _)
            .collect();
        let head = Box::new(move |x: &Tensor| {
            let pooled = self.norm.forward(x)?.mean(1)?;
            cross_entropy(&self.head.forward(&pooled)?, &labels, None)
        });
        Ok(Forward::Stages(Stages { stem, blocks, head }))
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_blocks(VIT_BLOCKS)
            .with_attention()
            .with_half()
    }
}

// ---------------------------------------------------------------------------
// A gated causal-convolution language model.

const VOCAB: usize = 256;
const CONV_WIDTH: usize = 128;
const CONV_KERNEL: usize = 4;
const CONV_BLOCKS: usize = 4;

/// norm → (x, gate) projection → causal depthwise convolution of x →
/// x·SiLU(gate) → output projection, with a residual.
pub struct ConvBlock {
    norm: LayerNorm,
    inner: Linear,
    kernel: Tensor,
    out: Linear,
}

impl ConvBlock {
    fn forward(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let (_, s, d) = h.dims3()?;
        let xg = self.inner.forward(&self.norm.forward(h)?)?;
        let x = xg.narrow(D::Minus1, 0, d)?;
        let gate = xg.narrow(D::Minus1, d, d)?;
        // y[t] = Σ_k kernel[k] · x[t − k], zero before the start.
        let mut y = x.broadcast_mul(&self.kernel.get(0)?)?;
        for k in 1..CONV_KERNEL.min(s) {
            let shifted = x.pad_with_zeros(1, k, 0)?.narrow(1, 0, s)?;
            y = (y + shifted.broadcast_mul(&self.kernel.get(k)?)?)?;
        }
        let mixed = (y * candle_nn::ops::sigmoid(&gate)?.mul(&gate)?)?;
        h + self.out.forward(&mixed)?
    }
}

/// A language model of random tokens (each sequence counts up from a random
/// start, modulo the vocabulary, so that there is something to learn).
pub struct ConvLm {
    embed: Embedding,
    blocks: Vec<ConvBlock>,
    norm: LayerNorm,
    head: Linear,
    vars: Vec<Var>,
    device: Device,
}

/// Builds the gated convolution LM in `dtype` on `device`.
pub fn conv_lm(dtype: DType, device: &Device) -> candle_core::Result<ConvLm> {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, dtype, device);
    let d = CONV_WIDTH;
    let blocks = (0..CONV_BLOCKS)
        .map(|i| {
            let vb = vb.pp(format!("blocks.{i}"));
            Ok(ConvBlock {
                norm: layer_norm(d, 1e-5, vb.pp("norm"))?,
                inner: linear(d, 2 * d, vb.pp("inner"))?,
                kernel: vb.get_with_hints(
                    (CONV_KERNEL, d),
                    "kernel",
                    candle_nn::Init::Randn {
                        mean: 0.0,
                        stdev: 0.3,
                    },
                )?,
                out: linear(d, d, vb.pp("out"))?,
            })
        })
        .collect::<candle_core::Result<_>>()?;
    Ok(ConvLm {
        embed: embedding(VOCAB, d, vb.pp("embed"))?,
        blocks,
        norm: layer_norm(d, 1e-5, vb.pp("norm"))?,
        head: linear(d, VOCAB, vb.pp("head"))?,
        vars: model::vars_of(&varmap),
        device: device.clone(),
    })
}

impl Model for ConvLm {
    fn vars(&self) -> Vec<Var> {
        self.vars.clone()
    }
    fn forward(&self, batch: &MicroBatch) -> candle_core::Result<Forward<'_>> {
        let (b, s) = (batch.size, batch.seq_len);
        let mut rng = StdRng::seed_from_u64(batch.index);
        let windows: Vec<Vec<u32>> = (0..b)
            .map(|_| {
                let start = rng.random_range(0..VOCAB as u32);
                (0..=s as u32).map(|t| (start + t) % VOCAB as u32).collect()
            })
            .collect();
        let inputs: Vec<u32> = windows.iter().flat_map(|w| w[..s].to_vec()).collect();
        let targets: Vec<u32> = windows.iter().flat_map(|w| w[1..].to_vec()).collect();
        let inputs = Tensor::from_vec(inputs, (b, s), &self.device)?;
        let targets = Tensor::new(targets, &self.device)?;
        let stem = self.embed.forward(&inputs)?;
        let blocks = self
            .blocks
            .iter()
            .map(|blk| Box::new(move |x: &Tensor| blk.forward(x)) as _)
            .collect();
        let head = Box::new(move |x: &Tensor| {
            let logits = self.head.forward(&self.norm.forward(x)?)?;
            cross_entropy(&logits.reshape((b * s, VOCAB))?, &targets, None)
        });
        Ok(Forward::Stages(Stages { stem, blocks, head }))
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE.with_blocks(CONV_BLOCKS).with_half()
    }
}
