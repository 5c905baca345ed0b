//! LoRA and QLoRA on the Hugging Face families: the frozen base model, the
//! adapters the families' one projection builder (`Params::linear`) puts
//! on the targeted projections, and what a saved adapter or merged model is
//! made of.
//!
//! With a [`Lora`], every tensor of the model is frozen: the blocks' linear
//! weights are kept `[out, in]` (GPT-2's `Conv1D` weights transposed) as a
//! [`FrozenWeight`], in the compute dtype or in NF4 (quantized on the host
//! before they reach the device); the rest (embeddings, norms, biases, the
//! head) in the compute dtype. A targeted projection gets a fresh adapter
//! as PEFT's ([`oomfix_strategies::lora::fresh_adapter`]), drawn from the
//! run's seed in the order the blocks are built; the model's trained
//! variables are the adapters only, under PEFT's names ([`adapter_names`]:
//! `<module>.lora_A.weight` and `<module>.lora_B.weight`). The LoRA
//! mechanism itself (the adapted layer, its initialisation and merge, PEFT's
//! names and files) is `oomfix_strategies::lora`'s; this module says which of
//! a family's tensors it applies to and where they live.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use oomfix_strategies::lora::{
    self as strategy, adapter_names, Draw, FrozenLinear, FrozenWeight, Lora, LoraLinear,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::{Error, Family, ModelConfig, Result};
use oomfix_strategies::nn::Projection;

/// The module path PEFT names in a saved adapter for the module `module`
/// of `family`'s model (`transformer.h.0.attn.c_attn` for GPT-2's
/// `h.0.attn.c_attn`: `GPT2LMHeadModel` keeps its blocks under
/// `transformer`).
pub fn peft_module(family: Family, module: &str) -> String {
    match family {
        Family::Gpt2 => format!("transformer.{module}"),
        _ => module.to_string(),
    }
}

/// A frozen base model with LoRA adapters, as built: what merging and
/// saving read.
#[derive(Debug, Clone)]
pub struct LoraModel {
    /// The settings.
    pub lora: Lora,
    family: Family,
    /// The blocks' linear weights by Hub name, `[out, in]`.
    projections: HashMap<String, FrozenWeight>,
    /// Every other tensor by Hub name, in the compute dtype.
    others: HashMap<String, Tensor>,
    /// The adapted modules, in the order of the variables.
    adapted: Vec<String>,
}

impl LoraModel {
    /// The adapted modules' paths (`model.layers.0.self_attn.q_proj`), in
    /// the order of the model's variables (two each: `A`, `B`).
    pub fn adapted(&self) -> &[String] {
        &self.adapted
    }

    /// The family of the base model.
    pub fn family(&self) -> Family {
        self.family
    }

    /// The name PEFT saves the adapter variable `name`
    /// (`model.layers.0.self_attn.q_proj.lora_A.weight`) under in this model
    /// ([`peft_module`]).
    pub fn peft_name(&self, name: &str) -> String {
        strategy::peft_name(&peft_module(self.family, name))
    }

    /// Bytes the frozen base holds (on its device, and a token embedding
    /// only looked up on the host).
    pub fn frozen_bytes(&self) -> usize {
        let others: usize = self
            .others
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        others
            + self
                .projections
                .values()
                .map(FrozenWeight::bytes)
                .sum::<usize>()
    }

    /// The merged model's tensor `name` (of [`ModelConfig::tensors`]) in
    /// `dtype` on the host: an adapted projection's weight `W + (α/r)·B·A`
    /// from `adapters` (the adapters' weights of record by variable name),
    /// any other frozen weight as stored (an NF4 one dequantized), in the
    /// checkpoint's layout.
    pub fn merged_tensor(
        &self,
        name: &str,
        adapters: &HashMap<String, Tensor>,
        dtype: DType,
    ) -> Result<Tensor> {
        let Some(frozen) = self.projections.get(name) else {
            let t = self
                .others
                .get(name)
                .ok_or_else(|| Error::Usage(format!("the model has no tensor `{name}`")))?;
            return Ok(t.to_dtype(dtype)?.to_device(&Device::Cpu)?);
        };
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let mut w = if self.adapted.iter().any(|m| m == module) {
            let [a, b] = adapter_names(module).map(|n| adapters.get(&n));
            let (Some(a), Some(b)) = (a, b) else {
                return Err(Error::Usage(format!("no adapter weights for `{module}`")));
            };
            strategy::merged_weight(frozen, a, b, self.lora.scale())?
        } else {
            frozen.weight(DType::F32)?
        };
        if self.family == Family::Gpt2 {
            w = w.t()?.contiguous()?;
        }
        Ok(w.to_dtype(dtype)?.to_device(&Device::Cpu)?)
    }
}

/// The adapters' variables with their names, and the adapted modules.
type Made = (Vec<(String, Var)>, Vec<String>);

/// What [`super::Params`] holds for a LoRA model: the frozen base and the
/// adapters made so far.
pub(crate) struct Adapting {
    lora: Lora,
    family: Family,
    projections: HashMap<String, FrozenWeight>,
    others: HashMap<String, Tensor>,
    /// The adapters' vars with their names, and the adapted modules.
    made: RefCell<Made>,
    rng: RefCell<StdRng>,
    dtype: DType,
    /// Where the model computes.
    device: Device,
}

impl Adapting {
    /// The frozen base of `config` from its `tensors` (on the host, any
    /// float dtype; each dropped once moved or quantized) for `lora`, on
    /// `device` in `dtype`; adapters drawn from `seed`.
    pub(crate) fn new(
        config: &ModelConfig,
        tensors: impl IntoIterator<Item = Result<(String, Tensor)>>,
        lora: Lora,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> Result<Self> {
        if !matches!(config.family, Family::Gpt2 | Family::Llama) {
            return Err(Error::Usage(format!(
                "LoRA trains the causal language models (GPT-2 and Llama-style families); {} is not one",
                config.family
            )));
        }
        let mut projections = HashMap::new();
        let mut others = HashMap::new();
        for made in tensors {
            let (name, t) = made?;
            let projection = ModelConfig::block_of(&name).is_some() && t.rank() == 2;
            if !projection {
                // A token embedding only looked up stays on the host.
                let place = if looked_up_only(config, &name) {
                    &Device::Cpu
                } else {
                    device
                };
                others.insert(name, t.to_dtype(dtype)?.to_device(place)?);
                continue;
            }
            // [out, in]: GPT-2's Conv1D weights are [in, out].
            let t = match config.family {
                Family::Gpt2 => t.t()?.contiguous()?,
                _ => t,
            };
            let frozen = FrozenWeight::on_device(&t, lora.base, dtype, device)?;
            projections.insert(name, frozen);
        }
        Ok(Adapting {
            lora,
            family: config.family,
            projections,
            others,
            made: RefCell::new((Vec::new(), Vec::new())),
            rng: RefCell::new(StdRng::seed_from_u64(seed ^ 0x6c6f_7261)),
            dtype,
            device: device.clone(),
        })
    }

    /// The frozen tensor `name` that is not a block projection.
    pub(crate) fn get(&self, name: &str) -> Option<Tensor> {
        self.others.get(name).cloned()
    }

    /// The projection `{prefix}.weight` (+ `{prefix}.bias` if `bias`):
    /// adapted if its name is a target, else frozen.
    pub(crate) fn linear(&self, prefix: &str, bias: Option<Tensor>) -> Result<Projection> {
        let weight = format!("{prefix}.weight");
        let frozen = self
            .projections
            .get(&weight)
            .cloned()
            .ok_or_else(|| Error::Usage(format!("the model has no tensor `{weight}`")))?;
        let name = prefix.rsplit('.').next().unwrap_or(prefix);
        if !self.lora.targets.contains(name) {
            return Ok(Projection::Frozen(FrozenLinear::new(frozen, bias)));
        }
        let (a, b) = strategy::fresh_adapter(
            frozen.dims()?,
            self.lora.rank as usize,
            self.dtype,
            &self.device,
            Draw::Seeded(&mut self.rng.borrow_mut()),
        )?;
        let layer =
            LoraLinear::with_adapter(frozen, bias, a.clone(), b.clone(), self.lora.scale())?;
        let mut made = self.made.borrow_mut();
        let [na, nb] = adapter_names(prefix);
        made.0.push((na, a));
        made.0.push((nb, b));
        made.1.push(prefix.to_string());
        Ok(Projection::Adapted(layer))
    }

    /// The adapters' variables with their names, and the model as built.
    pub(crate) fn finish(self) -> (Vec<(String, Var)>, LoraModel) {
        let (vars, adapted) = self.made.into_inner();
        let model = LoraModel {
            lora: self.lora,
            family: self.family,
            projections: self.projections,
            others: self.others,
            adapted,
        };
        (vars, model)
    }
}

/// Whether the frozen tensor `name` of `config` is a token embedding the
/// model only looks rows up in ([`ModelConfig::looked_up_embedding`]): kept
/// in host memory, the rows a pass needs sent over.
fn looked_up_only(config: &ModelConfig, name: &str) -> bool {
    config.looked_up_embedding() > 0 && name == "model.embed_tokens.weight"
}
