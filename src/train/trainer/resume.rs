//! Resuming: the state a saved directory holds put back into a trainer of
//! the same model (under any plan), and what changes when the plan differs.

use super::Trainer;
use crate::state_file::StateFile;
use crate::train::data::DataSource;
use crate::train::optim::Optim;
use crate::train::saved::{self, TrainerState, TrainingState};
use crate::{Error, ModelConfig, Result};
use candle_core::{Tensor, Var};
use oomfix_strategies::Plan;
use std::path::Path;

/// A model shape in a few words, for messages.
fn describe(c: &ModelConfig) -> String {
    format!(
        "{:?}, {} layers, hidden {}, {} heads, vocab {}",
        c.family, c.layers, c.hidden, c.heads, c.vocab
    )
}

/// Whether two names of a base model are the same model: equal, or paths
/// of the same directory.
fn same_base(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (Path::new(a).canonicalize(), Path::new(b).canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// What changes when a run of the plan `saved` resumes with the plan `now`,
/// one line per change for the log: the fields that differ
/// ([`Plan::differences`]) and, when it changes, the global batch. Empty when
/// the plans are the same.
pub fn plan_changes(saved: &Plan, now: &Plan) -> Vec<String> {
    let diff = saved.differences(now);
    if diff.is_empty() {
        return Vec::new();
    }
    let fields: Vec<String> = diff
        .iter()
        .map(|(field, was, now)| format!("{field} {was} -> {now}"))
        .collect();
    let mut out = vec![format!(
        "resuming a run of the plan `{saved}` with another plan: {}",
        fields.join(", ")
    )];
    let (was, is) = (saved.global_batch(), now.global_batch());
    if was != is {
        out.push(format!(
            "the global batch changes from {was} to {is} sequences per optimizer step: \
             each step now averages the gradient of {is} sequences, and the data advances \
             {is} × {} tokens per step",
            now.seq_len
        ));
    }
    if saved.seq_len != now.seq_len {
        out.push(format!(
            "the sequence length changes from {} to {} tokens",
            saved.seq_len, now.seq_len
        ));
    }
    out
}

impl Trainer {
    /// Restores the state [`save`](Self::save) wrote to the directory `dir`,
    /// and moves `data` to where that run stood; returns the plan that run
    /// used (this trainer's may differ: the weights, moments, step, data
    /// position and loss scale carry over to any plan of the same model).
    ///
    /// The checkpoint must verify (see [`TrainingState::open`]) and be of the
    /// same model shape (else an input error naming the first difference) and
    /// kind of data; every failure is an input error naming the file. The
    /// checks run before anything changes; a failure while loading tensors
    /// after them leaves the trainer and `data` partly restored (drop them).
    /// Tensors are read and set one at a time: resuming holds at most one
    /// tensor besides the trainer's own state.
    ///
    /// Sharded, every rank calls it (collective at stage 3) and takes its own
    /// share of the moments: a checkpoint of any world size resumes at any other.
    pub fn resume(&mut self, dir: &Path, data: &mut DataSource) -> Result<Plan> {
        let model = self.hub_config("resuming")?;
        let ck = TrainingState::open(dir)?;
        let state_path = dir.join(saved::STATE_FILE);
        if let Some(diff) = saved::first_difference(&ck.state.model, model) {
            return Err(Error::input(
                &state_path,
                format!(
                    "checkpoint is of another model ({}): {diff}; this run trains {}",
                    describe(&ck.state.model),
                    describe(model)
                ),
            ));
        }
        self.check_lora_checkpoint(&ck.state, &state_path)?;
        if let DataSource::Examples(examples) = data {
            // Rows exist at a sequence length: the checkpoint's plan's.
            examples.packed(ck.state.plan.seq_len);
        }
        data.seek(ck.state.data)
            .map_err(|msg| Error::input(&state_path, format!("cannot continue the data: {msg}")))?;
        self.load_tensors(&ck)?;
        if let (Some(s), Some(saved)) = (&mut self.scaler, ck.state.loss_scaler) {
            s.restore(saved.scale, saved.growth_tracker)
                .map_err(|e| Error::input(&state_path, e.to_string()))?;
        }
        self.step = ck.state.step;
        Ok(ck.state.plan)
    }

    /// Whether a checkpoint of `saved` continues this run's LoRA (or full
    /// fine-tuning): the same kind of run; for LoRA, the same rank, alpha
    /// and targets on the same base model (the base's storage may differ).
    /// An input error naming `path` otherwise.
    fn check_lora_checkpoint(&self, saved: &TrainerState, path: &Path) -> Result<()> {
        let refuse = |msg: String| Err(Error::input(path, msg));
        match (saved.plan.lora, self.plan.lora) {
            (None, None) => Ok(()),
            (Some(_), None) => refuse(
                "the checkpoint holds LoRA adapters: resume it with --lora and the same settings"
                    .into(),
            ),
            (None, Some(_)) => refuse(
                "the checkpoint is of a full fine-tuning run, not LoRA adapters: resume it without --lora"
                    .into(),
            ),
            (Some(was), Some(now)) => {
                if (was.rank, was.alpha, was.targets) != (now.rank, now.alpha, now.targets) {
                    return refuse(format!(
                        "the checkpoint's adapters are `{was}`; this run trains `{now}` (rank, alpha and targets must match)"
                    ));
                }
                let now_base = self.base_model_name();
                match &saved.base_model {
                    Some(was_base) if !same_base(was_base, &now_base) => refuse(format!(
                        "the checkpoint's adapters are for the base model {was_base}; this run's base model is {now_base}"
                    )),
                    _ => Ok(()),
                }
            }
        }
    }

    /// Loads the weights and the optimizer's moments from `ck`, one tensor at a time.
    fn load_tensors(&mut self, ck: &TrainingState) -> Result<()> {
        let read = |file: &StateFile, name: &str, var: &Var| -> Result<Tensor> {
            let t = file.tensor(name)?;
            if t.dims() != var.dims() {
                return Err(Error::input(
                    file.path(),
                    format!(
                        "tensor `{name}` has shape {:?}, the model needs {:?}",
                        t.dims(),
                        var.dims()
                    ),
                ));
            }
            Ok(t)
        };
        let set = |var: &Var, t: &Tensor| -> Result<()> {
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
            Ok(())
        };
        if let Optim::Sharded(opt) = &mut self.optim {
            // Stage 3: every parameter is set, then the non-owned freed again.
            opt.gather_params()?;
        }
        let names = &self.names;
        let masters = self.masters();
        for (i, (name, compute)) in names.iter().zip(&self.vars).enumerate() {
            let master = format!("master.{name}");
            let t = if ck.optimizer.contains(&master) {
                read(&ck.optimizer, &master, compute)?
            } else {
                match &self.lora {
                    Some(lora) => read(&ck.model, &lora.peft_name(name), compute)?,
                    None => read(&ck.model, name, compute)?,
                }
            };
            if let Some(m) = masters {
                set(&m[i], &t)?;
            }
            match &self.optim {
                Optim::Sharded(opt) => opt.set_weights(i, &t)?,
                _ => set(compute, &t)?,
            }
        }
        let saved_moments = ck.state.optimizer_step.filter(|_| {
            names
                .first()
                .is_some_and(|n| ck.optimizer.contains(&format!("{n}.m")))
        });
        if let Optim::Sharded(opt) = &mut self.optim {
            let rank = opt.comm().rank();
            let owned: Vec<usize> = (0..names.len())
                .filter(|&i| opt.owners()[i] == rank)
                .collect();
            if let Some(step) = saved_moments {
                for i in owned {
                    let (name, var) = (&names[i], &self.vars[i]);
                    let m = read(&ck.optimizer, &format!("{name}.m"), var)?;
                    let v = read(&ck.optimizer, &format!("{name}.v"), var)?;
                    opt.optimizer_mut()
                        .set_moments(&i.to_string(), &m, &v)
                        .map_err(|e| Error::input(ck.optimizer.path(), e.to_string()))?;
                }
                opt.optimizer_mut().set_step_count(step);
            } else {
                tracing::warn!(
                    "the checkpoint holds no optimizer moments (its run used candle_nn::AdamW): they restart from zero"
                );
            }
            opt.release_params()?;
            return Ok(());
        }
        match (self.optim.fused_mut(), saved_moments) {
            (Some(opt), Some(step)) => {
                for (name, var) in names.iter().zip(&self.vars) {
                    let m = read(&ck.optimizer, &format!("{name}.m"), var)?;
                    let v = read(&ck.optimizer, &format!("{name}.v"), var)?;
                    opt.set_moments(name, &m, &v)
                        .map_err(|e| Error::input(ck.optimizer.path(), e.to_string()))?;
                }
                opt.set_step_count(step);
            }
            (Some(_), None) => tracing::warn!(
                "the checkpoint holds no optimizer moments (its run used candle_nn::AdamW): they restart from zero"
            ),
            (None, Some(_)) => tracing::warn!(
                "the plan uses candle_nn::AdamW, which cannot take the checkpoint's optimizer moments: they restart from zero"
            ),
            (None, None) => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::plan_changes;
    use oomfix_strategies::{Attention, Plan};

    #[test]
    fn a_plan_change_is_listed_field_by_field() {
        let plan = Plan::baseline(8, 64);
        assert!(plan_changes(&plan, &plan).is_empty());
        let other = Plan {
            micro_batch: 4,
            grad_accum: 2,
            attention: Attention::Flash,
            ..plan
        };
        let lines = plan_changes(&plan, &other);
        assert_eq!(lines.len(), 1, "{lines:?}");
        for part in [
            "micro_batch 8 -> 4",
            "grad_accum 1 -> 2",
            r#"attention "composed" -> "flash""#,
        ] {
            assert!(lines[0].contains(part), "{lines:?}");
        }
        let smaller = Plan {
            micro_batch: 2,
            ..plan
        };
        let lines = plan_changes(&plan, &smaller);
        assert!(
            lines[1].contains("global batch changes from 8 to 2"),
            "{lines:?}"
        );
    }
}
