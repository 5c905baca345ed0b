//! The end of a run: the summary (with `--json`, the search's object with
//! the training's), and the exit of a run stopped by a signal.

use super::plan::Planned;
use super::steps::Trained;
use super::Setup;
use crate::cli::{logging, print_stdout, signals, Exit, Outcome};

/// Prints the summary on rank 0 (the rank that searched) and says how the
/// run ended: done, or stopped by a signal with or without its checkpoint.
pub(super) fn report(setup: &Setup, planned: &Planned, trained: &Trained) -> Outcome {
    let o = &setup.args.opts;
    let Trained {
        trainer,
        summary,
        stopped,
        signals,
        ..
    } = trained;
    if let Some(result) = &planned.searched {
        if planned.args.json {
            let mut v = oomfix::report::search_json(&planned.spec, result);
            v["training"] = oomfix::report::train_summary_json(summary);
            print_stdout(&format!("{v:#}\n"))?;
        } else {
            print_stdout(&oomfix::report::train_summary_text(summary))?;
        }
    }
    let stopped_by = match signals.received() {
        Some(sig) if trainer.steps() < o.steps => sig,
        // Stopped because another rank received a signal.
        None if *stopped => signal_hook::consts::SIGTERM,
        _ => return Ok(Exit::Done),
    };
    let saved = match &o.save {
        Some(path) => format!("checkpoint written to {}", path.display()),
        None => "no checkpoint written (no --save)".into(),
    };
    if setup.rank() == 0 {
        logging::notice(format_args!(
            "stopped by {} after step {}; {saved}",
            signals::name(stopped_by),
            trainer.steps()
        ));
    }
    Ok(Exit::Signal(stopped_by))
}
