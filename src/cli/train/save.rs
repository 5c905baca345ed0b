//! The run's checkpoints (`--save`): written every `--save-every` steps and
//! at the end, once per step.

use super::Setup;
use crate::cli::Failure;
use oomfix::train::data::DataSource;
use oomfix::train::Trainer;
use std::path::PathBuf;

/// Where the run's checkpoints go, and the step of the one on disk.
pub(super) struct Checkpoints {
    path: Option<PathBuf>,
    /// The state on disk, as a step count: nothing to write again at that step.
    saved_at: Option<u64>,
    rank: usize,
}

impl Checkpoints {
    /// The checkpoints of a run at step `step`: `--resume`'s directory is
    /// on disk already when `--save` names it too.
    pub fn new(setup: &Setup, step: u64) -> Self {
        let o = &setup.args.opts;
        Checkpoints {
            path: o.save.clone(),
            saved_at: (o.save.is_some() && o.save == o.resume).then_some(step),
            rank: setup.rank(),
        }
    }

    /// Writes the checkpoint of `trainer`'s step (collective when sharded),
    /// unless it is on disk already or there is no `--save`.
    pub fn save(&mut self, trainer: &Trainer, data: &DataSource) -> Result<(), Failure> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        if self.saved_at != Some(trainer.steps()) {
            trainer.save(path, data)?;
            if self.rank == 0 {
                tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "saved");
            }
            self.saved_at = Some(trainer.steps());
        }
        Ok(())
    }
}
