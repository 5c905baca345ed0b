//! `oomfix inspect`: what a weights file's header says.

use super::args::InspectArgs;
use super::{print_stdout, Exit, Outcome};
use oomfix::report;

/// Runs `oomfix inspect`.
pub fn run(args: &InspectArgs) -> Outcome {
    let spec = oomfix::inspect(&args.model)?;
    let text = if args.json {
        format!("{:#}\n", report::inspect_json(&spec))
    } else {
        report::inspect_text(&spec)
    };
    print_stdout(&text)?;
    Ok(Exit::Done)
}
