//! The parameters by Hub name, as the families look them up when they
//! build their layers: trained variables, or a frozen base with LoRA
//! adapters.

use super::lora;
use crate::{Error, Result};
use candle_core::{Tensor, Var};
use oomfix_strategies::nn::ops::WeightLayout;
use oomfix_strategies::nn::{LayerNorm, Linear, Projection, RmsNorm};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// The parameters by Hub name, as the families look them up: the trained
/// variables, or (LoRA) a frozen base whose targeted projections get
/// adapters.
pub(crate) struct Params {
    vars: Vec<(String, Var)>,
    index: HashMap<String, usize>,
    lora: Option<lora::Adapting>,
    /// Where [`into_vars`](Self::into_vars) leaves the LoRA model built.
    pub(super) built: Rc<RefCell<Option<lora::LoraModel>>>,
}

impl Params {
    pub(super) fn new(vars: Vec<(String, Var)>) -> Self {
        let index = vars
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.clone(), i))
            .collect();
        Params {
            vars,
            index,
            lora: None,
            built: Rc::default(),
        }
    }

    /// The parameters of a frozen base with adapters.
    pub(super) fn frozen(adapting: lora::Adapting) -> Self {
        Params {
            lora: Some(adapting),
            ..Params::new(Vec::new())
        }
    }

    /// The parameter `name` (a clone sharing the `Var`'s storage, or the
    /// frozen tensor).
    pub(crate) fn get(&self, name: &str) -> Result<Tensor> {
        let missing = || Error::Usage(format!("the model has no tensor `{name}`"));
        if let Some(adapting) = &self.lora {
            return adapting.get(name).ok_or_else(missing);
        }
        let i = self.index.get(name).ok_or_else(missing)?;
        Ok(self.vars[*i].1.as_tensor().clone())
    }

    /// The projection `{prefix}.weight` (+ `{prefix}.bias` if `bias`): the
    /// one place every family builds a linear projection of its blocks.
    /// Trained; or, with LoRA, frozen, with an adapter if its name (the
    /// last part of `prefix`) is a target.
    pub(crate) fn linear(
        &self,
        prefix: &str,
        bias: bool,
        layout: WeightLayout,
    ) -> Result<Projection> {
        let b = if bias {
            Some(self.get(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        if let Some(adapting) = &self.lora {
            return adapting.linear(prefix, b);
        }
        let weight = self.get(&format!("{prefix}.weight"))?;
        Ok(Linear::with_layout(weight, b, layout).into())
    }

    /// The layer norm `{prefix}.weight`, `{prefix}.bias`.
    pub(crate) fn layer_norm(&self, prefix: &str, eps: f64) -> Result<LayerNorm> {
        Ok(LayerNorm::new(
            self.get(&format!("{prefix}.weight"))?,
            self.get(&format!("{prefix}.bias"))?,
            eps,
        ))
    }

    /// The RMS norm `{prefix}.weight`, its scale `weight + offset`.
    pub(crate) fn rms_norm(&self, prefix: &str, eps: f64, offset: f32) -> Result<RmsNorm> {
        Ok(RmsNorm::with_offset(
            self.get(&format!("{prefix}.weight"))?,
            eps,
            offset,
        ))
    }

    /// The trained variables with their names (LoRA: the adapters).
    pub(crate) fn into_vars(self) -> Vec<(String, Var)> {
        match self.lora {
            None => self.vars,
            Some(adapting) => {
                let (vars, model) = adapting.finish();
                *self.built.borrow_mut() = Some(model);
                vars
            }
        }
    }
}
