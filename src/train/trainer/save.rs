//! Saving: a Hugging Face model directory (the whole model, LoRA's
//! adapters as PEFT writes them, or the merged model) with the training
//! state beside it, gathered to rank 0 when sharded.

use super::Trainer;
use crate::output::write_dir_atomic;
use crate::state_file;
use crate::train::data::DataSource;
use crate::train::optim::Optim;
use crate::train::saved::{self, ScalerState, TrainerState};
use crate::{Error, Result};
use candle_core::{DType, Tensor, Var};
use oomfix_strategies::adamw::FusedAdamW;
use std::collections::HashMap;
use std::path::Path;

impl Trainer {
    /// Writes the directory `dir` ([`saved`](crate::train::saved)) atomically: built beside it
    /// and put in place whole ([`write_dir_atomic`]), replacing an existing
    /// one only once the new one is complete.
    ///
    /// The weights are written from the fp32 weights of record (the master
    /// weights under mixed precision or offloaded), converted to the source's
    /// dtype one tensor at a time; the moments are written from the
    /// optimizer's own storage, without copies.
    ///
    /// Sharded (world size > 1), every rank calls it at the same point
    /// (collective): the weights and moments are gathered to rank 0, which
    /// writes one directory, the same as an unsharded run's; every rank
    /// returns an error when rank 0's write fails.
    pub fn save(&self, dir: &Path, data: &DataSource) -> Result<()> {
        let source = &self.source;
        let model = self.hub_config("saving")?;
        let config = saved::hf_config(model, source.config.as_deref(), source.dtype)?;
        let (weights, moments) = self.consolidated()?;
        let mut optimizer: Vec<(String, Tensor)> = Vec::new();
        // The adapters are written in f32: no masters beside them.
        if source.dtype != DType::F32 && self.lora.is_none() {
            optimizer.extend(
                weights
                    .iter()
                    .map(|(n, t)| (format!("master.{n}"), t.clone())),
            );
        }
        for (name, m, v) in moments {
            optimizer.push((format!("{name}.m"), m));
            optimizer.push((format!("{name}.v"), v));
        }
        let optimizer_step = match &self.optim {
            Optim::Sharded(opt) => Some(opt.optimizer().step_count()),
            optim => optim.fused().map(FusedAdamW::step_count),
        };
        let state = TrainerState {
            format: saved::STATE_FORMAT.into(),
            format_version: saved::STATE_VERSION,
            step: self.step,
            optimizer_step,
            data: data.position().ok_or_else(|| {
                Error::Usage(
                    "a run of a Hugging Face family trains on tokens, not DataSource::ModelMade"
                        .into(),
                )
            })?,
            loss_scaler: self.scaler.as_ref().map(|s| ScalerState {
                scale: s.scale(),
                growth_tracker: s.growth_tracker(),
            }),
            plan: self.plan,
            model: model.clone(),
            base_model: self.lora.as_ref().map(|_| self.base_model_name()),
            merged: self.lora.is_some() && self.merge_lora,
        };
        if self.rank() != 0 {
            return self.saved_on_rank_0(true);
        }
        let io = |what: &Path, e: std::io::Error| Error::Io {
            context: format!("writing {}", what.display()),
            source: e,
        };
        let write_json = |path: &Path, value: &serde_json::Value| -> Result<()> {
            let text = serde_json::to_string_pretty(value).expect("JSON serialises") + "\n";
            std::fs::write(path, text).map_err(|e| io(path, e))
        };
        let written = write_dir_atomic(dir, |tmp| {
            let pt = HashMap::from([("format".to_string(), "pt".to_string())]);
            match &self.lora {
                None => state_file::write_safetensors_as(
                    &tmp.join(saved::MODEL_FILE),
                    weights,
                    pt,
                    Some(source.dtype),
                )?,
                Some(lora) if self.merge_lora => {
                    let record: HashMap<String, Tensor> = weights.into_iter().collect();
                    let merged = model
                        .tensors()
                        .into_iter()
                        .map(|(name, _)| {
                            let t = lora.merged_tensor(&name, &record, source.dtype)?;
                            Ok((name, t))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    state_file::write_safetensors_as(
                        &tmp.join(saved::MODEL_FILE),
                        merged,
                        pt,
                        Some(source.dtype),
                    )?;
                }
                Some(lora) => {
                    let renamed = weights
                        .into_iter()
                        .map(|(name, t)| (lora.peft_name(&name), t))
                        .collect();
                    state_file::write_safetensors_as(
                        &tmp.join(saved::ADAPTER_FILE),
                        renamed,
                        pt,
                        Some(DType::F32),
                    )?;
                    let config = oomfix_strategies::lora::peft_config(
                        &lora.lora,
                        &self.base_model_name(),
                        lora.family() == crate::Family::Gpt2,
                    );
                    write_json(&tmp.join(saved::ADAPTER_CONFIG_FILE), &config)?;
                }
            }
            // A merged model is a model to load, not a checkpoint: its
            // state only marks the directory as this run's output.
            if !state.merged {
                state_file::write(&tmp.join(saved::OPTIMIZER_FILE), optimizer, HashMap::new())?;
            }
            write_json(
                &tmp.join(saved::STATE_FILE),
                &serde_json::to_value(&state).expect("the state serialises"),
            )?;
            for (name, from) in &source.files {
                std::fs::copy(from, tmp.join(name)).map_err(|e| io(from, e))?;
            }
            if self.lora.is_none() || self.merge_lora {
                write_json(&tmp.join(saved::CONFIG_FILE), &config)?;
            }
            Ok(())
        });
        self.saved_on_rank_0(written.is_ok())?;
        written
    }

    /// Whether rank 0 wrote the checkpoint, told to every rank (collective
    /// when sharded): an error on the others when it did not.
    fn saved_on_rank_0(&self, ok: bool) -> Result<()> {
        if self.any_rank(!ok)? && ok {
            return Err(Error::Runtime(
                "rank 0 could not write the checkpoint".into(),
            ));
        }
        Ok(())
    }

    /// The fp32 weights of record: the masters where there are any, else the
    /// compute weights (then f32).
    fn record_vars(&self) -> Vec<Var> {
        match self.masters() {
            Some(m) => m.to_vec(),
            None => self.vars.clone(),
        }
    }

    /// The weights of record with their Hub names, and the optimizer's
    /// moments `(name, m, v)` (none with `candle_nn::AdamW`), as one
    /// unsharded run holds them. Without sharding they share the trainer's
    /// storage. Sharded (collective), each tensor is sent from the rank that
    /// holds it, one at a time; rank 0 keeps them all (the whole state, for
    /// the time of a save), the others none.
    #[allow(clippy::type_complexity)]
    fn consolidated(&self) -> Result<(Vec<(String, Tensor)>, Vec<(String, Tensor, Tensor)>)> {
        let names = self.names.iter().cloned();
        let record = self.record_vars();
        let Optim::Sharded(opt) = &self.optim else {
            let weights = names
                .zip(record)
                .map(|(n, w)| (n, w.as_tensor().clone()))
                .collect();
            let moments = self.optim.fused().map_or_else(Vec::new, |opt| {
                opt.moments()
                    .into_iter()
                    .map(|(n, m, v)| (n.to_string(), m, v))
                    .collect()
            });
            return Ok((weights, moments));
        };
        let comm = opt.comm();
        let rank = comm.rank();
        let owned: HashMap<&str, (Tensor, Tensor)> = opt
            .optimizer()
            .moments()
            .into_iter()
            .map(|(i, m, v)| (i, (m, v)))
            .collect();
        let (mut weights, mut moments) = (Vec::new(), Vec::new());
        for (i, (name, w)) in names.zip(&record).enumerate() {
            let owner = opt.owners()[i];
            let zeros = |dtype| Tensor::zeros(w.shape(), dtype, w.device());
            // The owner holds the fp32 weights of record (its master under
            // mixed precision; stage 3 freed the others' copies): it sends them.
            let w = match opt.weights_of_record(i) {
                Some(m) => comm.broadcast(&m.as_tensor().to_dtype(DType::F32)?, owner)?,
                None => comm.broadcast(&zeros(DType::F32)?, owner)?,
            };
            let (m, v) = match owned.get(i.to_string().as_str()) {
                Some((m, v)) => (m.clone(), v.clone()),
                None => (zeros(DType::F32)?, zeros(DType::F32)?),
            };
            let (m, v) = (comm.broadcast(&m, owner)?, comm.broadcast(&v, owner)?);
            if rank == 0 {
                weights.push((name.clone(), w));
                moments.push((name, m, v));
            }
        }
        Ok((weights, moments))
    }
}
