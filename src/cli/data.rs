//! Training and evaluation data from the command line's options: the
//! model's tokenizer and chat template found beside it (or given), the file
//! read in its format and checked against the model's vocabulary.

use super::args::DataOptions;
use super::Failure;
use oomfix::train::chat::{ChatTemplate, SpecialTokens};
use oomfix::train::data::{DataFormat, DataSource, ExampleData, TextOptions, TokenWidth};
use oomfix::train::tokenizer::Tokenizer;
use oomfix::ModelConfig;
use std::path::{Path, PathBuf};

/// The tokenizer for text data: `--tokenizer`, else `tokenizer.json` in
/// `model_dir` when there is one.
fn tokenizer(o: &DataOptions, model_dir: Option<&Path>) -> Result<Option<Tokenizer>, Failure> {
    let path = match (&o.tokenizer, model_dir) {
        (Some(p), _) => p.clone(),
        (None, Some(dir)) if dir.join("tokenizer.json").is_file() => dir.join("tokenizer.json"),
        _ => return Ok(None),
    };
    Ok(Some(Tokenizer::from_file(&path)?))
}

/// The training data `o` asks for, tokenized and checked against the
/// model's vocabulary; without `--data`, random tokens from `seed`.
pub fn data_source(
    o: &DataOptions,
    seed: u64,
    config: &ModelConfig,
    model_dir: Option<&Path>,
) -> Result<DataSource, Failure> {
    let Some(path) = &o.data else {
        if o.tokenizer.is_some() || o.text_field != "text" || o.chat_template.is_some() {
            return Err(Failure::Usage(
                "--tokenizer, --text-field and --chat-template apply to data: give --data".into(),
            ));
        }
        return Ok(DataSource::synthetic(seed));
    };
    load_data(o, path, config, model_dir)
}

/// The data file `path` (`--data` or `--eval-data`) in its format,
/// tokenized as `o` says and checked against the model's vocabulary.
pub fn load_data(
    o: &DataOptions,
    path: &Path,
    config: &ModelConfig,
    model_dir: Option<&Path>,
) -> Result<DataSource, Failure> {
    let text_field_given = o.text_field != "text";
    let format = DataFormat::of(path);
    let rows = matches!(
        format,
        DataFormat::JsonLines | DataFormat::Json | DataFormat::Parquet
    );
    if text_field_given && !rows {
        return Err(Failure::Usage(format!(
            "--text-field applies to rows (.jsonl, .json, .parquet); {} is not",
            path.display()
        )));
    }
    let width = if o.u32_tokens {
        TokenWidth::U32
    } else {
        TokenWidth::U16
    };
    let tokenizer = tokenizer(o, model_dir)?;
    let eos = config
        .settings
        .eos_token_id
        .or_else(|| tokenizer.as_ref().and_then(Tokenizer::eos_id));
    if format != DataFormat::Tokens {
        match &tokenizer {
            Some(t) => tracing::info!(
                tokenizer = %t.path().display(),
                eos = eos.map(i64::from).unwrap_or(-1),
                "tokenizing {}",
                path.display()
            ),
            None => tracing::warn!(
                "no tokenizer.json beside the model and no --tokenizer: each byte of {} is a token",
                path.display()
            ),
        }
    }
    // Only rows may be chats.
    let template = match format {
        _ if rows => chat_template(o, model_dir)?,
        _ if o.chat_template.is_some() => {
            return Err(Failure::Usage(format!(
                "--chat-template applies to chat data (.jsonl, .json, .parquet); {} is not",
                path.display()
            )))
        }
        _ => None,
    };
    let text = TextOptions {
        tokenizer: tokenizer.as_ref(),
        text_field: &o.text_field,
        eos,
        template: template.as_ref(),
        loss_on: o.loss_on,
        packing: !o.no_packing,
        truncate: o.truncate,
    };
    Ok(DataSource::load(path, width, config.vocab, &text)?)
}

/// The sequence length examples train at by default: the longest
/// example's (its tokens less the last, which is only a target), within the
/// model's context.
pub fn examples_seq_len(examples: &ExampleData, config: &ModelConfig) -> usize {
    examples
        .longest()
        .saturating_sub(1)
        .clamp(1, config.max_positions.max(1))
}

/// The chat template: `--chat-template` (with the special tokens of the
/// model's tokenizer_config.json), else the model's own, if any.
fn chat_template(
    o: &DataOptions,
    model_dir: Option<&Path>,
) -> Result<Option<ChatTemplate>, Failure> {
    Ok(match (&o.chat_template, model_dir) {
        (Some(file), dir) => {
            let tokens = match dir {
                Some(dir) => SpecialTokens::from_model_dir(dir)?,
                None => SpecialTokens::default(),
            };
            Some(ChatTemplate::from_file(file, tokens)?)
        }
        (None, Some(dir)) => ChatTemplate::from_model_dir(dir)?,
        (None, None) => None,
    })
}

/// The directory holding the model's side files (`config.json`,
/// `tokenizer.json`): the model itself when it is a directory, else its parent.
pub fn model_dir(model: &Path) -> PathBuf {
    if model.is_dir() {
        model.to_path_buf()
    } else {
        model.parent().map(Path::to_path_buf).unwrap_or_default()
    }
}
