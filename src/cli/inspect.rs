//! `oomfix inspect`: what a weights file's header says and, with `--data`,
//! what the data holds as training would read it.

use super::args::InspectArgs;
use super::{data, print_stdout, Exit, Failure, Outcome};
use oomfix::report;
use oomfix::train::data::DataSummary;

/// Runs `oomfix inspect`.
pub fn run(args: &InspectArgs) -> Outcome {
    let spec = oomfix::inspect(&args.model)?;
    let summary = match &args.input.data {
        Some(path) => {
            let dir = data::model_dir(&args.model);
            let source = data::load_data(&args.input, path, &spec.config, Some(&dir))?;
            source.summary().map(|s| (path, s))
        }
        None if args.input.tokenizer.is_some() || args.input.chat_template.is_some() => {
            return Err(Failure::Usage(
                "--tokenizer and --chat-template read data: give --data".into(),
            ))
        }
        None => None,
    };
    let text = if args.json {
        let mut v = report::inspect_json(&spec);
        if let Some((path, s)) = summary {
            let mut d = serde_json::to_value(s).expect("a summary serialises");
            d["path"] = path.display().to_string().into();
            v["data"] = d;
        }
        format!("{v:#}\n")
    } else {
        let mut text = report::inspect_text(&spec);
        if let Some((path, s)) = summary {
            text.push_str(&data_line(&path.display().to_string(), &s));
        }
        text
    };
    print_stdout(&text)?;
    Ok(Exit::Done)
}

/// The `data` line of the text report.
fn data_line(path: &str, s: &DataSummary) -> String {
    match (s.examples, s.learned_tokens, s.shortest, s.longest) {
        (Some(n), Some(learned), Some(shortest), Some(longest)) => format!(
            "data           {path}: {n} examples, {} tokens ({shortest} to {longest} per example), {} learned\n",
            s.tokens, learned
        ),
        _ => format!("data           {path}: {} tokens\n", s.tokens),
    }
}
