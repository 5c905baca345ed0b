//! Low-rank adaptation (LoRA, Hu et al. 2021) on frozen base weights, kept
//! in 16 bits or in 4-bit NormalFloat (QLoRA, Dettmers et al. 2023).
//!
//! Opt-in, because it changes what is trained: a plan carries a [`Lora`]
//! only when the user asked for one (`--lora RANK`). Each targeted linear
//! projection `y = x·Wᵀ` of the blocks becomes
//! `y = x·Wᵀ + (α/r)·(x·Aᵀ)·Bᵀ` with `A` `[r, in]` and `B` `[out, r]` trained
//! and `W` frozen, as PEFT's `LoraLayer` computes it. Only the adapters have
//! gradients, master weights and AdamW moments; every other fix acts on them
//! (accumulation, mixed precision, fused AdamW, ZeRO, offload), while the
//! frozen base weights stay on each device whole.
//!
//! The planner half, [`LoraFix`], moves the frozen weights from 16 bits to
//! NF4 ([`BasePrecision::Nf4`]: 4 bits and an fp32 absmax per block of 64)
//! and then to double-quantized NF4 (the absmax in 8 bits per block of 256),
//! unless the user pinned the base precision; it relaxes the other way.
//! Embeddings, norms and the head stay 16-bit: only the blocks' linear
//! projections are quantized, whether targeted or not (as bitsandbytes'
//! `Linear4bit` replaces every linear layer).
//!
//! Memory ([`Strategy::facts`], [`Strategy::memory`]): the trained parameters
//! are the adapters ([`adapter_parameters`]); the whole base model is
//! frozen, on the device in its stored form ([`frozen_bytes`]); a pass holds
//! one frozen weight at a time in the compute dtype ([`dequantized_bytes`]),
//! as a frozen matmul dequantizes one weight, multiplies and frees it, in
//! the forward and again for the input gradient.
//!
//! ```
//! use oomfix_strategies::lora::{BasePrecision, Lora, LoraFix};
//! use oomfix_strategies::{ModelFacts, Plan, SearchContext, Strategy};
//!
//! // A block of two projections, 64 -> 256 -> 64, in 4 blocks.
//! let facts = ModelFacts::new(4 * 2 * 64 * 256 + 1000, 64 * 256, 4)
//!     .with_linear("up", 64, 256)
//!     .with_linear("down", 256, 64);
//! let lora = Lora::new(8, None, None, BasePrecision::Bf16, &facts)?;
//! assert_eq!(lora.alpha, 16);
//! assert_eq!(lora.targets.names().collect::<Vec<_>>(), ["up", "down"]);
//! assert_eq!(oomfix_strategies::lora::adapter_parameters(&lora, &facts), 4 * 2 * 8 * (64 + 256));
//! assert!(Lora::new(65, None, None, BasePrecision::Bf16, &facts).is_err());
//!
//! let plan = Plan { lora: Some(lora), ..Plan::baseline(8, 128) };
//! let quantized = LoraFix.tighten(&plan, &SearchContext::new(8, 4)).unwrap();
//! assert_eq!(quantized.lora.unwrap().base, BasePrecision::Nf4);
//! # Ok::<(), oomfix_strategies::Error>(())
//! ```

mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod frozen;
pub mod nf4;

pub use config::{BasePrecision, Lora, Targets, MAX_TARGETS};
pub use frozen::{FrozenLinear, FrozenWeight, Nf4Weight};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, Var};
use std::sync::{Arc, Mutex};

#[cfg(test)]
use crate::Precision;
use crate::{Error, ModelFacts, Plan, Result, SearchContext, StateBytes, Strategy};

/// Trainable parameters of `lora`'s adapters on the model `facts`
/// describes: `r·(in + out)` per adapted projection, in every block.
pub fn adapter_parameters(lora: &Lora, facts: &ModelFacts) -> u64 {
    let per_block: u64 = lora
        .adapted(facts)
        .map(|l| u64::from(lora.rank) * (l.inputs + l.outputs))
        .sum();
    per_block * facts.layers as u64
}

/// Elements of `lora`'s largest adapter tensor (`A` `[r, in]` or `B` `[out, r]`).
pub fn largest_adapter(lora: &Lora, facts: &ModelFacts) -> u64 {
    lora.adapted(facts)
        .map(|l| u64::from(lora.rank) * l.inputs.max(l.outputs))
        .max()
        .unwrap_or(0)
}

/// Device bytes of the frozen base weights of a model of `facts` (after
/// [`Strategy::facts`]: `frozen` parameters, the blocks' projections among
/// them) stored as `base` under a compute dtype of `compute_bytes` per
/// value: the blocks' linear weights in `base`'s form (NF4), everything
/// else (embeddings, norms, biases, the head), and the projections of a
/// [`BasePrecision::Bf16`] base, in the compute dtype.
pub fn frozen_bytes(base: BasePrecision, compute_bytes: u64, facts: &ModelFacts) -> u64 {
    let layers = facts.layers as u64;
    let linear: u64 = facts.linears().map(|l| l.inputs * l.outputs).sum::<u64>() * layers;
    if !base.is_quantized() {
        return compute_bytes * facts.frozen;
    }
    let others = facts.frozen.saturating_sub(linear);
    let quantized: u64 = facts
        .linears()
        .map(|l| base.weight_bytes(l.inputs * l.outputs))
        .sum::<u64>()
        * layers;
    compute_bytes * others + quantized
}

/// Bytes of the one frozen weight a pass of `plan` holds in the compute
/// dtype at a time: with an NF4 base, the largest block projection
/// dequantized; else none (weights in the compute dtype are used as
/// stored).
pub fn dequantized_bytes(plan: &Plan, lora: &Lora, facts: &ModelFacts) -> u64 {
    let largest_linear = facts
        .linears()
        .map(|l| l.inputs * l.outputs)
        .max()
        .unwrap_or(0);
    if lora.base.is_quantized() {
        plan.precision.compute_bytes() * largest_linear
    } else {
        0
    }
}

/// Planner half of LoRA: for a plan that carries a [`Lora`] (the user's
/// choice; the fix never adds one), quantizes the frozen base weights
/// bf16 → nf4 → nf4-dq, and relaxes back.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoraFix;

impl Strategy for LoraFix {
    fn name(&self) -> &'static str {
        "lora"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let lora = plan.lora?;
        let base = match lora.base {
            BasePrecision::Bf16 => BasePrecision::Nf4,
            BasePrecision::Nf4 => BasePrecision::Nf4Double,
            BasePrecision::Nf4Double => return None,
        };
        Some(Plan {
            lora: Some(Lora { base, ..lora }),
            ..*plan
        })
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let lora = plan.lora?;
        let base = match lora.base {
            BasePrecision::Bf16 => return None,
            BasePrecision::Nf4 => BasePrecision::Bf16,
            BasePrecision::Nf4Double => BasePrecision::Nf4,
        };
        Some(Plan {
            lora: Some(Lora { base, ..lora }),
            ..*plan
        })
    }
    /// The adapters are what is trained; the whole base model is frozen.
    fn facts(&self, plan: &Plan, facts: &mut ModelFacts) {
        let Some(lora) = plan.lora else { return };
        facts.frozen += facts.parameters;
        facts.largest_frozen = facts.largest_frozen.max(facts.largest_tensor);
        facts.parameters = adapter_parameters(&lora, facts);
        facts.largest_tensor = largest_adapter(&lora, facts);
        facts.block_parameters = facts.parameters / (facts.layers.max(1) as u64);
    }
    /// The frozen weights on every device (after the other fixes set the
    /// adapters' terms: ZeRO shards and offload moves adapters' state, never
    /// the frozen weights) but a token embedding only looked up, which is
    /// host memory ([`ModelFacts::looked_up`]), and one weight at a time
    /// dequantized in a pass.
    fn memory(&self, plan: &Plan, model: &ModelFacts, state: &mut StateBytes) {
        let Some(lora) = plan.lora else { return };
        let frozen = frozen_bytes(lora.base, plan.precision.compute_bytes(), model);
        // A token embedding only looked up stays in host memory; the rows a
        // pass looks up are sent over.
        let on_host = (plan.precision.compute_bytes() * model.looked_up).min(frozen);
        state.weights += frozen - on_host;
        state.step_weights += frozen - on_host;
        state.host += on_host;
        state.pass_transient = state
            .pass_transient
            .max(dequantized_bytes(plan, &lora, model));
    }
}

// ---------------------------------------------------------------------------
// Mechanism: adapted projections on frozen weights, and PEFT's adapter files.

/// A linear projection with a LoRA adapter: `y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ`
/// with `W` (and the bias `b`) frozen, `A` `[r, in]` and `B` `[out, r]`
/// trained and `s = alpha / r`, as PEFT's `lora.Linear` computes it
/// (without dropout).
///
/// A fresh adapter is PEFT's: `A` Kaiming-uniform with `a = √5` (uniform in
/// ±1/√in), `B` zeros, so the projection computes the frozen one's function.
///
/// The projection is one op for candle's autograd: it keeps its input (and
/// `A`, `B`), as a plain projection keeps its input and weight, and nothing
/// else. Its forward converts `W` to the input's dtype (dequantizes an NF4
/// weight), multiplies and frees it; its backward does so again for the
/// input's gradient, and recomputes `x·Aᵀ` (`[n, r]`) for the adapter's.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use oomfix_strategies::lora::{BasePrecision, LoraLinear};
/// let dev = Device::Cpu;
/// let w = Tensor::randn(0f32, 0.1, (6, 4), &dev)?;
/// let x = Tensor::randn(0f32, 1.0, (3, 4), &dev)?;
/// let layer = LoraLinear::new(&w, None, 2, 4.0, BasePrecision::Bf16)?;
/// // At step 0 the adapter adds nothing.
/// let base = x.matmul(&w.t()?)?;
/// assert_eq!(layer.forward(&x)?.to_vec2::<f32>()?, base.to_vec2::<f32>()?);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LoraLinear {
    frozen: Arc<FrozenWeight>,
    bias: Option<Tensor>,
    a: Var,
    b: Var,
    scale: f64,
}

impl LoraLinear {
    /// An adapted projection of `weight` (`[out, in]`) and `bias`, frozen
    /// as `base`, with a fresh rank-`rank` adapter scaled by `alpha / rank`,
    /// its variables in `weight`'s dtype and on its device.
    pub fn new(
        weight: &Tensor,
        bias: Option<&Tensor>,
        rank: usize,
        alpha: f64,
        base: BasePrecision,
    ) -> Result<LoraLinear> {
        let (out, d_in) = weight.dims2()?;
        if rank == 0 || rank > out.min(d_in) {
            return Err(Error::Config(format!(
                "a LoRA rank of {rank} on a {out} x {d_in} projection (1 to {})",
                out.min(d_in)
            )));
        }
        let (dtype, device) = (weight.dtype(), weight.device());
        // PEFT: kaiming_uniform_(A, a=√5): gain √(2 / (1 + 5)), bound
        // gain·√(3 / fan_in) = 1/√in.
        let bound = 1.0 / (d_in as f64).sqrt();
        let a = Tensor::rand(-bound as f32, bound as f32, (rank, d_in), device)?.to_dtype(dtype)?;
        let b = Tensor::zeros((out, rank), dtype, device)?;
        LoraLinear::with_adapter(
            FrozenWeight::new(weight, base)?,
            bias.map(Tensor::detach),
            Var::from_tensor(&a)?,
            Var::from_tensor(&b)?,
            alpha / rank as f64,
        )
    }

    /// An adapted projection of a frozen weight with the adapter `a`
    /// (`[r, in]`), `b` (`[out, r]`) and scale `scale`.
    pub fn with_adapter(
        frozen: FrozenWeight,
        bias: Option<Tensor>,
        a: Var,
        b: Var,
        scale: f64,
    ) -> Result<LoraLinear> {
        let (out, d_in) = frozen.dims()?;
        let (r, a_in) = a.dims2()?;
        if a_in != d_in || b.dims2()? != (out, r) {
            return Err(Error::Config(format!(
                "a LoRA adapter of A {:?} and B {:?} on a {out} x {d_in} weight",
                a.dims(),
                b.dims()
            )));
        }
        Ok(LoraLinear {
            frozen: Arc::new(frozen),
            bias,
            a,
            b,
            scale,
        })
    }

    /// `A`, `[r, in]`.
    pub fn a(&self) -> &Var {
        &self.a
    }

    /// `B`, `[out, r]`.
    pub fn b(&self) -> &Var {
        &self.b
    }

    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The frozen weight.
    pub fn frozen(&self) -> &FrozenWeight {
        &self.frozen
    }

    /// `W + s·B·A` in `dtype`: the weight of the merged projection.
    pub fn merged(&self, dtype: DType) -> Result<Tensor> {
        let w = self.frozen.weight(DType::F32)?;
        let ba = self
            .b
            .as_tensor()
            .to_dtype(DType::F32)?
            .matmul(&self.a.as_tensor().to_dtype(DType::F32)?)?;
        Ok((w + ba.affine(self.scale, 0.0)?)?.to_dtype(dtype)?)
    }

    /// `x` `[..., in]` to `[..., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (out, d_in) = self.frozen.dims()?;
        let x2 = x.reshape(((), d_in))?;
        // The output, computed off the graph: the frozen product (its weight
        // freed at once), the bias, the adapter's.
        let y = {
            let xd = x2.detach();
            let y = frozen::frozen_product(&xd, &self.frozen, self.bias.as_ref())?;
            let t = xd.matmul(&self.a.as_tensor().detach().t()?)?;
            let u = t.matmul(&self.b.as_tensor().detach().t()?)?;
            (y + u.affine(self.scale, 0.0)?)?
        };
        let op = Adapted {
            output: Mutex::new(Some(y)),
            frozen: Arc::clone(&self.frozen),
            scale: self.scale,
        };
        let y = x2.apply_op3(self.a.as_tensor(), self.b.as_tensor(), op)?;
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        Ok(y.reshape(dims)?)
    }
}

/// The adapted projection as one op of `x` `[n, in]`, `A`, `B`: its forward
/// hands over the output computed beforehand; its backward gives the
/// gradients of all three.
struct Adapted {
    output: Mutex<Option<Tensor>>,
    frozen: Arc<FrozenWeight>,
    scale: f64,
}

impl CustomOp3 for Adapted {
    fn name(&self) -> &'static str {
        "oomfix-lora-linear"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        frozen::cpu_output(frozen::take(&self.output)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        frozen::cuda_output(frozen::take(&self.output)?)
    }

    /// `dx = g·W + s·(g·B)·A`, `dA = s·(g·B)ᵀ·x`, `dB = s·gᵀ·(x·Aᵀ)`, from
    /// detached tensors, `W` converted again and freed.
    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, a, b, g) = (x.detach(), a.detach(), b.detach(), g.detach());
        let w = self
            .frozen
            .weight(g.dtype())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let dx = g.matmul(&w)?;
        drop(w);
        let t = x.matmul(&a.t()?)?;
        let db = g.t()?.matmul(&t)?.affine(self.scale, 0.0)?;
        drop(t);
        let gt = g.matmul(&b)?.affine(self.scale, 0.0)?;
        let da = gt.t()?.matmul(&x)?;
        let dx = (dx + gt.matmul(&a)?)?;
        Ok((Some(dx), Some(da), Some(db)))
    }
}

/// One adapted projection as PEFT saves it: its module path in the base
/// model (`model.layers.0.self_attn.q_proj`), `A` `[r, in]` and `B` `[out, r]`.
pub type SavedAdapter = (String, Tensor, Tensor);

/// The names PEFT saves an adapted module's `A` and `B` under:
/// `base_model.model.<module>.lora_A.weight` and `.lora_B.weight` (the
/// module's path in the base model, `model.layers.0.self_attn.q_proj`).
pub fn peft_names(module: &str) -> [String; 2] {
    [
        format!("base_model.model.{module}.lora_A.weight"),
        format!("base_model.model.{module}.lora_B.weight"),
    ]
}

/// PEFT's `adapter_config.json` for `lora` on the base model `base_model`
/// (a Hub name or path); `fan_in_fan_out` for weights stored `[in, out]`
/// (GPT-2's `Conv1D`).
pub fn peft_config(lora: &Lora, base_model: &str, fan_in_fan_out: bool) -> serde_json::Value {
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": lora.targets.names().collect::<Vec<_>>(),
        "bias": "none",
        "base_model_name_or_path": base_model,
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": true,
        "modules_to_save": null,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
    })
}

/// Writes a PEFT LoRA adapter directory `dir` for `lora` on the base model
/// `base_model` (a Hub name or path): `adapter_config.json`
/// ([`peft_config`]) and `adapter_model.safetensors` with PEFT's names
/// ([`peft_names`]), in the tensors' dtype. Each file is written beside its
/// final name and renamed.
pub fn save_peft(
    dir: &std::path::Path,
    base_model: &str,
    lora: &Lora,
    fan_in_fan_out: bool,
    adapters: &[SavedAdapter],
) -> Result<()> {
    let io = |what: &str, e: std::io::Error| Error::Config(format!("{what}: {e}"));
    let mut tensors = std::collections::HashMap::new();
    for (path, a, b) in adapters {
        if a.dims2()?.0 != lora.rank as usize || b.dims2()?.1 != lora.rank as usize {
            return Err(Error::Config(format!(
                "{path}: adapter of A {:?} and B {:?} for rank {}",
                a.dims(),
                b.dims(),
                lora.rank
            )));
        }
        let [na, nb] = peft_names(path);
        tensors.insert(na, a.clone());
        tensors.insert(nb, b.clone());
    }
    let config = peft_config(lora, base_model, fan_in_fan_out);
    std::fs::create_dir_all(dir).map_err(|e| io(&dir.display().to_string(), e))?;
    let weights = dir.join("adapter_model.safetensors");
    let weights_tmp = dir.join(".adapter_model.safetensors.tmp");
    candle_core::safetensors::save(&tensors, &weights_tmp)?;
    let config_path = dir.join("adapter_config.json");
    let config_tmp = dir.join(".adapter_config.json.tmp");
    let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Config(e.to_string()))?;
    std::fs::write(&config_tmp, text + "\n").map_err(|e| io("adapter_config.json", e))?;
    std::fs::rename(&weights_tmp, &weights).map_err(|e| io("adapter_model.safetensors", e))?;
    std::fs::rename(&config_tmp, &config_path).map_err(|e| io("adapter_config.json", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::state_of;
    use candle_core::Device;

    /// Llama-3-8B's shape: 32 blocks, hidden 4096, 8 of 32 heads for k and v,
    /// MLP 14336, vocabulary 128256, untied head.
    fn llama3_8b() -> ModelFacts {
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

    #[test]
    fn llama3_8b_counts() {
        let facts = llama3_8b();
        assert_eq!(facts.parameters, 8_030_261_248);
        let lora = Lora::new(16, None, None, BasePrecision::Nf4, &facts).unwrap();
        // PEFT's print_trainable_parameters for r=16 all-linear on Llama-3-8B.
        assert_eq!(adapter_parameters(&lora, &facts), 41_943_040);
        let only_qv = Lora::new(
            16,
            None,
            Some(&["q_proj", "v_proj"]),
            BasePrecision::Bf16,
            &facts,
        )
        .unwrap();
        assert_eq!(
            adapter_parameters(&only_qv, &facts),
            32 * 16 * (4096 + 4096 + 4096 + 1024)
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        let facts = llama3_8b();
        let new = |rank, alpha, targets: Option<&[&str]>| {
            Lora::new(rank, alpha, targets, BasePrecision::Bf16, &facts)
        };
        assert!(new(0, None, None)
            .unwrap_err()
            .to_string()
            .contains("rank of 0"));
        // k_proj is 1024 wide: the narrowest of all-linear.
        assert!(new(1024, None, None).is_ok());
        let e = new(1025, None, None).unwrap_err().to_string();
        assert!(e.contains("k_proj") && e.contains("at most 1024"), "{e}");
        assert!(new(2048, None, Some(&["q_proj"])).is_ok());
        let e = new(8, None, Some(&["qkv"])).unwrap_err().to_string();
        assert!(e.contains("`qkv`") && e.contains("q_proj, k_proj"), "{e}");
        assert!(new(8, Some(0), None).is_err());
        let empty = ModelFacts::new(10, 10, 1);
        assert!(Lora::new(8, None, None, BasePrecision::Nf4, &empty).is_err());
    }

    #[test]
    fn the_plan_carries_it_in_its_json() {
        let facts = llama3_8b();
        let lora = Lora::new(
            16,
            Some(8),
            Some(&["v_proj", "q_proj"]),
            BasePrecision::Nf4,
            &facts,
        )
        .unwrap();
        let plan = Plan {
            lora: Some(lora),
            ..Plan::baseline(8, 128)
        };
        let json = serde_json::to_string(&plan).unwrap();
        assert!(
            json.ends_with(
                r#""lora":{"rank":16,"alpha":8,"targets":["v_proj","q_proj"],"base":"nf4"}}"#
            ),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
        // A plan without LoRA keeps its encoding.
        assert!(!serde_json::to_string(&Plan::baseline(8, 128))
            .unwrap()
            .contains("lora"));
    }

    #[test]
    fn frozen_weights_have_no_gradients_nor_state() {
        let facts = llama3_8b();
        let fixes = crate::builtins();
        let lora = Lora::new(16, None, None, BasePrecision::Bf16, &facts).unwrap();
        let plan = Plan {
            precision: Precision::Bf16,
            optimizer: crate::OptimizerImpl::FusedAdamW,
            lora: Some(lora),
            ..Plan::baseline(8, 128)
        };
        let (trained, s) = state_of(&plan, &facts, &fixes);
        let a = 41_943_040u64;
        assert_eq!(trained.parameters, a);
        assert_eq!(trained.frozen, facts.parameters);
        assert_eq!(s.gradients, 2 * a);
        assert_eq!(s.master_weights, 4 * a);
        assert_eq!(s.optimizer_state, 8 * a);
        assert_eq!(s.weights, 2 * a + 2 * facts.parameters);
        assert_eq!(s.pass_transient, 0);
        // NF4: the blocks' projections in 4 bits and an fp32 absmax per 64;
        // embeddings, head and norms in 16 bits; one projection dequantized.
        let nf4 = Plan {
            lora: Some(Lora {
                base: BasePrecision::Nf4,
                ..lora
            }),
            ..plan
        };
        let (_, q) = state_of(&nf4, &facts, &fixes);
        let linears = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336u64);
        let others = facts.parameters - linears;
        assert_eq!(
            q.weights,
            2 * a + 2 * others + linears / 2 + linears / 64 * 4
        );
        assert_eq!(q.pass_transient, 2 * 4096 * 14336);
        // 5.69 GiB: about 4.5 bits per projection weight beside 16-bit
        // embeddings and head (1.05 billion values).
        let gib = q.weights as f64 / (1u64 << 30) as f64;
        assert!((5.6..5.8).contains(&gib), "{gib} GiB");
    }

    #[test]
    fn the_base_is_quantized_step_by_step_and_relaxed_back() {
        let facts = llama3_8b();
        let ctx = SearchContext::new(8, 32);
        let lora = Lora::new(16, None, None, BasePrecision::Bf16, &facts).unwrap();
        let mut plan = Plan {
            lora: Some(lora),
            ..Plan::baseline(8, 128)
        };
        let mut seen = vec![];
        while let Some(next) = LoraFix.tighten(&plan, &ctx) {
            plan = next;
            seen.push(plan.lora.unwrap().base);
        }
        assert_eq!(seen, [BasePrecision::Nf4, BasePrecision::Nf4Double]);
        let relaxed = LoraFix.relax(&plan, &ctx).unwrap();
        assert_eq!(relaxed.lora.unwrap().base, BasePrecision::Nf4);
        // Never on a plan without LoRA.
        let full = Plan::baseline(8, 128);
        assert!(LoraFix.tighten(&full, &ctx).is_none());
        assert!(LoraFix.relax(&full, &ctx).is_none());
        let (_, unchanged) = state_of(&full, &facts, &crate::builtins());
        assert_eq!(unchanged.weights, 4 * facts.parameters);
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn a_fresh_adapter_computes_the_frozen_function() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.2, (24, 16), &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.2, 24, &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (2, 5, 16), &dev).unwrap();
        let layer = LoraLinear::new(&w, Some(&bias), 8, 16.0, BasePrecision::Bf16).unwrap();
        let y = layer.forward(&x).unwrap();
        assert_eq!(y.dims(), [2, 5, 24]);
        let base = x
            .broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&bias)
            .unwrap();
        assert_eq!(max_diff(&y, &base), 0.0);
        // PEFT's initialisation: A uniform in ±1/√in, B zeros.
        let a = layer
            .a()
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let bound = 1.0 / 4.0;
        assert!(a.iter().all(|v| v.abs() <= bound));
        assert!(a.iter().any(|v| v.abs() > bound / 2.0));
        assert!(layer
            .b()
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| *v == 0.0));
        assert_eq!(layer.scale(), 2.0);
        // On an NF4 base: the dequantized weight's function.
        let q = LoraLinear::new(&w, None, 8, 16.0, BasePrecision::Nf4).unwrap();
        let deq = q.frozen().weight(DType::F32).unwrap();
        let wv = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let expected = Tensor::from_vec(nf4::quantize(&wv).dequantize(), (24, 16), &dev).unwrap();
        assert_eq!(max_diff(&deq, &expected), 0.0);
        let yq = q.forward(&x).unwrap();
        assert_eq!(
            max_diff(&yq, &x.broadcast_matmul(&deq.t().unwrap()).unwrap()),
            0.0
        );
        assert!(LoraLinear::new(&w, None, 17, 1.0, BasePrecision::Bf16).is_err());
        assert!(LoraLinear::new(&w, None, 0, 1.0, BasePrecision::Bf16).is_err());
    }

    /// The adapted op's gradients (of its input, `A` and `B`) against
    /// candle's autograd through the composed formula, on a 16-bit and an
    /// NF4 base, fp32.
    #[test]
    fn gradients_equal_the_composed_reference() {
        let dev = Device::Cpu;
        for base in [BasePrecision::Bf16, BasePrecision::Nf4] {
            let w = Tensor::randn(0f32, 0.2, (12, 10), &dev).unwrap();
            let frozen = FrozenWeight::new(&w, base).unwrap();
            let wq = frozen.weight(DType::F32).unwrap();
            let a0 = Tensor::randn(0f32, 0.3, (4, 10), &dev).unwrap();
            let b0 = Tensor::randn(0f32, 0.3, (12, 4), &dev).unwrap();
            let x0 = Tensor::randn(0f32, 1.0, (3, 7, 10), &dev).unwrap();
            let r = Tensor::randn(0f32, 1.0, (3, 7, 12), &dev).unwrap();
            let scale = 0.75;
            let grads = |fused: bool| {
                let (x, a, b) = (
                    Var::from_tensor(&x0).unwrap(),
                    Var::from_tensor(&a0).unwrap(),
                    Var::from_tensor(&b0).unwrap(),
                );
                let y = if fused {
                    let layer = LoraLinear::with_adapter(
                        FrozenWeight::new(&w, base).unwrap(),
                        None,
                        a.clone(),
                        b.clone(),
                        scale,
                    )
                    .unwrap();
                    layer.forward(x.as_tensor()).unwrap()
                } else {
                    let base_y = x.as_tensor().broadcast_matmul(&wq.t().unwrap()).unwrap();
                    let t = x
                        .as_tensor()
                        .broadcast_matmul(&a.as_tensor().t().unwrap())
                        .unwrap();
                    let u = t.broadcast_matmul(&b.as_tensor().t().unwrap()).unwrap();
                    (base_y + u.affine(scale, 0.0).unwrap()).unwrap()
                };
                let loss = (y.clone() * &r).unwrap().sum_all().unwrap();
                let store = loss.backward().unwrap();
                let g = |v: &Var| store.get(v.as_tensor()).unwrap().clone();
                (y, g(&x), g(&a), g(&b))
            };
            let fused = grads(true);
            let composed = grads(false);
            assert!(max_diff(&fused.0, &composed.0) < 1e-5, "{base}: output");
            assert!(max_diff(&fused.1, &composed.1) < 1e-5, "{base}: dx");
            assert!(max_diff(&fused.2, &composed.2) < 1e-4, "{base}: dA");
            assert!(max_diff(&fused.3, &composed.3) < 1e-4, "{base}: dB");
            // A central difference on one element of A agrees too.
            let loss_at = |delta: f32| {
                let mut a = a0.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                a[5] += delta;
                let a = Tensor::from_vec(a, (4, 10), &dev).unwrap();
                let layer = LoraLinear::with_adapter(
                    FrozenWeight::new(&w, base).unwrap(),
                    None,
                    Var::from_tensor(&a).unwrap(),
                    Var::from_tensor(&b0).unwrap(),
                    scale,
                )
                .unwrap();
                let y = layer.forward(&x0).unwrap();
                (y * &r)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            };
            let h = 1e-2;
            let numeric = (loss_at(h) - loss_at(-h)) / (2.0 * h as f64);
            let analytic = fused.2.flatten_all().unwrap().to_vec1::<f32>().unwrap()[5] as f64;
            assert!(
                (numeric - analytic).abs() < 1e-2 * analytic.abs().max(1.0),
                "{numeric} {analytic}"
            );
        }
    }

    #[test]
    fn merged_weight_is_w_plus_scaled_ba() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.2, (6, 5), &dev).unwrap();
        let a = Var::randn(0f32, 0.3, (2, 5), &dev).unwrap();
        let b = Var::randn(0f32, 0.3, (6, 2), &dev).unwrap();
        let layer =
            LoraLinear::with_adapter(FrozenWeight::Dense(w.clone()), None, a, b, 2.0).unwrap();
        let x = Tensor::randn(0f32, 1.0, (4, 5), &dev).unwrap();
        let merged = layer.merged(DType::F32).unwrap();
        let y = layer.forward(&x).unwrap();
        assert!(max_diff(&y, &x.matmul(&merged.t().unwrap()).unwrap()) < 1e-5);
    }

    #[test]
    fn peft_adapter_files() {
        let facts = llama3_8b();
        let lora = Lora::new(
            4,
            Some(8),
            Some(&["q_proj", "v_proj"]),
            BasePrecision::Nf4,
            &facts,
        )
        .unwrap();
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (4, 16), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, (8, 4), &dev).unwrap();
        let dir = std::env::temp_dir().join(format!("oomfix-peft-{}", std::process::id()));
        let adapters = vec![(
            "model.layers.0.self_attn.q_proj".to_string(),
            a.clone(),
            b.clone(),
        )];
        save_peft(&dir, "meta-llama/Meta-Llama-3-8B", &lora, false, &adapters).unwrap();
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["peft_type"], "LORA");
        assert_eq!(config["task_type"], "CAUSAL_LM");
        assert_eq!(config["r"], 4);
        assert_eq!(config["lora_alpha"], 8);
        assert_eq!(
            config["target_modules"],
            serde_json::json!(["q_proj", "v_proj"])
        );
        assert_eq!(
            config["base_model_name_or_path"],
            "meta-llama/Meta-Llama-3-8B"
        );
        assert_eq!(config["bias"], "none");
        assert_eq!(config["fan_in_fan_out"], false);
        let saved =
            candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &dev).unwrap();
        let mut names: Vec<&String> = saved.keys().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
            ]
        );
        let sa = &saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
        assert_eq!(sa.dims(), [4, 16]);
        assert_eq!(max_diff(sa, &a), 0.0);
        assert!(!dir.join(".adapter_model.safetensors.tmp").exists());
        // A rank that is not the adapters': refused, nothing more written.
        let wrong = vec![("m".to_string(), b.clone(), a.clone())];
        assert!(save_peft(&dir.join("wrong"), "m", &lora, false, &wrong).is_err());
        assert!(!dir.join("wrong").join("adapter_config.json").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
