//! The `oomfix` command: parse the arguments, run the command, map its outcome
//! to an exit code:
//!
//! * 0: done (a plan fits; `inspect` succeeded; `train` ran all its steps);
//! * 1: nothing fits the budget;
//! * 2: a usage or input error (bad option, unreadable model or data file, a
//!   corrupt checkpoint or one of another model or plan), reported before
//!   any planning output;
//! * 3: a failure while running: training stopped on a NaN or infinite loss, a
//!   write failed, a device error;
//! * 130, 143: `train` stopped by SIGINT or SIGTERM at a step boundary (after
//!   writing its checkpoint with `--save`), as shells report a death by those
//!   signals; a second signal exits at once with the same code.
//!
//! Everything but the library lives in [`cli`].

mod cli;

use cli::args::{self, Command, ParseStop};
use cli::logging;
use std::process::ExitCode;

#[global_allocator]
static ALLOC: oomfix::track::CountingAlloc = oomfix::track::CountingAlloc;

fn main() -> ExitCode {
    cli::started();
    let invocation = match args::parse() {
        Ok(invocation) => invocation,
        Err(ParseStop::Info(help)) => {
            let _ = help.print();
            return ExitCode::SUCCESS;
        }
        Err(ParseStop::Usage { failure, json }) => {
            logging::init_for_usage_error(json);
            return ExitCode::from(logging::report(&failure));
        }
    };
    // Every log record of a rank of a job carries its rank.
    let rank = cli::job::rank_from_env();
    logging::set_rank(rank);
    if let Err(failure) = logging::init(&invocation.log) {
        return ExitCode::from(logging::report(&failure));
    }
    let _span = rank.map(|rank| tracing::info_span!("rank", rank).entered());
    let outcome = match &invocation.command {
        Command::Plan(args) => cli::plan::run(args),
        Command::Inspect(args) => cli::inspect::run(args),
        Command::Train(args) => cli::train::run(args),
        Command::MeasureStep(args) => cli::measure::run(args),
    };
    match outcome {
        Ok(exit) => exit.into(),
        // A rank of a job reports its own failure to the others (`cli::train`).
        Err(failure) => ExitCode::from(logging::report(&failure)),
    }
}
