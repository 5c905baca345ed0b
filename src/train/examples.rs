//! Chat and instruction data: examples that each train as a sequence of
//! their own, with the loss on what the model should learn.
//!
//! A row of a JSON Lines file (or an element of a JSON array, or a record
//! of a Parquet file) is, as TRL's
//! SFTTrainer reads it:
//!
//! * `{"messages": [{"role", "content"}, …]}`: a conversation, rendered
//!   with the model's [`ChatTemplate`]; the loss falls on each assistant
//!   message: the tokens between the rendering of the messages before it
//!   with the generation prompt and the rendering that includes it (its
//!   content, end-of-turn token and whatever the template writes after it);
//! * `{"prompt": …, "completion": …}`: both message lists (rendered as one
//!   conversation; the loss on the tokens after the prompt's rendering with
//!   the generation prompt) or both strings (tokenized as plain text, the
//!   end-of-text id after the completion; the loss on the tokens after the
//!   prompt's);
//! * `{"instruction", "input", "output"}` (Alpaca): a prompt/completion
//!   conversation whose user message is the instruction, followed by a blank
//!   line and the input when the input is not empty, and whose assistant
//!   message is the output.
//!
//! Text rows (`{"text": …}`) are not examples: they are read as a token
//! stream ([`super::data`]). With [`LossOn::All`] every token after the
//! first is learned. Every row of a file has one shape.
//!
//! [`pack`] lays the examples into rows of a sequence length: several to a
//! row (packing, in file order, each row filled while the next example
//! fits) with document ids that keep them apart, or one to a row, padded.

use super::chat::ChatTemplate;
use super::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::path::Path;

/// Which tokens of an example the loss learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossOn {
    /// The assistant's messages or the completion (chat and prompt/completion
    /// data's default).
    #[default]
    Completions,
    /// Every token after the first.
    All,
}

/// What a data file's rows hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `{"text": …}` (or the `--text-field` named): a document of plain text.
    Text,
    /// `{"messages": […]}`.
    Messages,
    /// `{"prompt": …, "completion": …}`.
    PromptCompletion,
    /// `{"instruction", "input", "output"}`.
    Alpaca,
}

impl Shape {
    /// The shape of one row, or why it has none.
    fn of(row: &serde_json::Value, text_field: &str) -> Result<Self, String> {
        let Some(object) = row.as_object() else {
            return Err(format!("{}, not an object", json_kind(row)));
        };
        let has = |k: &str| object.contains_key(k);
        Ok(if has("messages") {
            Shape::Messages
        } else if has("prompt") && has("completion") {
            Shape::PromptCompletion
        } else if has("instruction") && has("output") {
            Shape::Alpaca
        } else if has(text_field) {
            Shape::Text
        } else {
            return Err(format!(
                "the object has no \"{text_field}\" field (nor \"messages\", \
                 \"prompt\" and \"completion\", or \"instruction\" and \"output\")"
            ));
        })
    }

    /// How messages name the shape.
    fn name(self) -> &'static str {
        match self {
            Shape::Text => "text",
            Shape::Messages => "messages",
            Shape::PromptCompletion => "prompt/completion",
            Shape::Alpaca => "instruction/input/output",
        }
    }
}

/// The rows of a JSON Lines file, a JSON array or a Parquet file, each with
/// the 1-based line (JSON Lines), element (array) or row (Parquet) it came
/// from. Blank lines are skipped.
pub struct Rows {
    /// `(line or element, row)`.
    pub rows: Vec<(usize, serde_json::Value)>,
    /// `"line"`, `"element"` or `"row"`, for messages.
    pub unit: &'static str,
}

impl Rows {
    /// Parses `text`, a JSON array when its first non-blank character is `[`,
    /// else JSON Lines.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        if text.trim_start().starts_with('[') {
            let values: Vec<serde_json::Value> = serde_json::from_str(text)
                .map_err(|e| Error::input(path, format!("not a JSON array of rows: {e}")))?;
            return Ok(Rows {
                rows: values
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| (i + 1, v))
                    .collect(),
                unit: "element",
            });
        }
        let mut rows = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let value = serde_json::from_str(line)
                .map_err(|e| Error::input(path, format!("line {}: not JSON: {e}", i + 1)))?;
            rows.push((i + 1, value));
        }
        Ok(Rows { rows, unit: "line" })
    }

    /// The rows of a Parquet file (a Hub dataset's export) read into
    /// `bytes`: each record as JSON (lists as arrays, structs as objects),
    /// numbered from 1.
    pub fn parquet(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let bad = |e: parquet::errors::ParquetError| {
            Error::input(path, format!("not a Parquet file we read: {e}"))
        };
        let reader = SerializedFileReader::new(bytes::Bytes::from(bytes)).map_err(bad)?;
        let mut rows = Vec::new();
        for (i, row) in reader.get_row_iter(None).map_err(bad)?.enumerate() {
            rows.push((i + 1, row.map_err(bad)?.to_json_value()));
        }
        Ok(Rows { rows, unit: "row" })
    }

    /// The one shape of every row; an error names the first row without a
    /// shape or with another shape than the first's.
    pub fn shape(&self, path: &Path, text_field: &str) -> Result<Shape> {
        let mut first: Option<(usize, Shape)> = None;
        for (at, row) in &self.rows {
            let shape = Shape::of(row, text_field)
                .map_err(|m| Error::input(path, format!("{} {at}: {m}", self.unit)))?;
            match first {
                None => first = Some((*at, shape)),
                Some((line, s)) if s != shape => {
                    return Err(Error::input(
                        path,
                        format!(
                            "{} {at}: a {} row in a file of {} rows ({} {line}); \
                             every row of a file has one shape",
                            self.unit,
                            shape.name(),
                            s.name(),
                            self.unit
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        first
            .map(|(_, s)| s)
            .ok_or_else(|| Error::input(path, "holds no rows"))
    }
}

/// One example: its token ids and which of them the loss learns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// The token ids.
    pub ids: Vec<u32>,
    /// `labels[t]`: token `t` is learned (predicted from the tokens before
    /// it); the first token never is.
    pub labels: Vec<bool>,
}

impl Example {
    /// Tokens the loss learns.
    pub fn learned(&self) -> usize {
        self.labels.iter().skip(1).filter(|&&l| l).count()
    }
}

/// How rows become [`Example`]s.
#[derive(Debug, Clone, Copy)]
pub struct ExampleOptions<'a> {
    /// The model's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The chat template (needed by message rows).
    pub template: Option<&'a ChatTemplate>,
    /// Which tokens are learned.
    pub loss_on: LossOn,
    /// The end-of-text id put after a plain-text completion.
    pub eos: Option<u32>,
    /// The model's vocabulary: every id is checked against it.
    pub vocab: usize,
}

/// The examples of `rows` (of one `shape` other than [`Shape::Text`]). An
/// error names the file and the row: a message that is not an object with a
/// string `role` and `content`, a template that fails on the row, an id
/// outside the vocabulary, chat rows without a template.
pub fn examples(
    path: &Path,
    rows: &Rows,
    shape: Shape,
    opts: &ExampleOptions,
) -> Result<Vec<Example>> {
    let needs_template = match shape {
        Shape::Messages | Shape::Alpaca => true,
        Shape::PromptCompletion => rows
            .rows
            .first()
            .is_some_and(|(_, r)| r["prompt"].is_array()),
        Shape::Text => false,
    };
    let template = match (needs_template, opts.template) {
        (true, None) => {
            return Err(Error::Usage(format!(
                "{}: {} rows are rendered with the model's chat template, and the model has none \
                 (no \"chat_template\" in tokenizer_config.json, no chat_template.jinja): \
                 give one with --chat-template FILE",
                path.display(),
                shape.name()
            )))
        }
        (_, t) => t,
    };
    rows.rows
        .iter()
        .map(|(at, row)| {
            let e = example(row, shape, template, opts)
                .map_err(|m| Error::input(path, format!("{} {at}: {m}", rows.unit)))?;
            if let Some(id) = e.ids.iter().find(|&&id| id as usize >= opts.vocab) {
                return Err(Error::input(
                    path,
                    format!(
                        "{} {at}: the tokenizer gives id {id}, outside the model's vocabulary of {} \
                         (is it the model's tokenizer?)",
                        rows.unit, opts.vocab
                    ),
                ));
            }
            Ok(e)
        })
        .collect()
}

/// One row's example, or why it has none.
fn example(
    row: &serde_json::Value,
    shape: Shape,
    template: Option<&ChatTemplate>,
    opts: &ExampleOptions,
) -> Result<Example, String> {
    let encode = |text: &str| -> Result<Vec<u32>, String> {
        let mut ids = opts
            .tokenizer
            .encode_batch(vec![text])
            .map_err(|e| e.to_string())?;
        Ok(ids.pop().unwrap_or_default())
    };
    let render = |messages: &[serde_json::Value], generation: bool| -> Result<String, String> {
        let t = template.expect("checked by the caller");
        t.render(messages, generation)
            .map_err(|e| format!("the chat template fails: {e}"))
    };
    // The ids of the conversation and the learned spans [start, end) of ids.
    let (ids, spans): (Vec<u32>, Vec<(usize, usize)>) = match shape {
        Shape::Messages => {
            let messages = message_list(&row["messages"], "messages")?;
            let ids = encode(&render(&messages, false)?)?;
            let mut spans = Vec::new();
            for (i, m) in messages.iter().enumerate() {
                if m["role"] == "assistant" {
                    let start = encode(&render(&messages[..i], true)?)?;
                    let end = encode(&render(&messages[..=i], false)?)?;
                    warn_unless_prefix(&start, &ids);
                    spans.push((start.len(), end.len()));
                }
            }
            (ids, spans)
        }
        Shape::PromptCompletion if row["prompt"].is_string() => {
            let (Some(prompt), Some(completion)) =
                (row["prompt"].as_str(), row["completion"].as_str())
            else {
                return Err("\"prompt\" is a string and \"completion\" is not: both are strings or both message lists".into());
            };
            let start = encode(prompt)?;
            let mut ids = encode(&format!("{prompt}{completion}"))?;
            ids.extend(opts.eos);
            warn_unless_prefix(&start, &ids);
            let end = ids.len();
            (ids, vec![(start.len(), end)])
        }
        Shape::PromptCompletion | Shape::Alpaca => {
            let (prompt, completion) = if shape == Shape::Alpaca {
                alpaca(row)?
            } else {
                (
                    message_list(&row["prompt"], "prompt")?,
                    message_list(&row["completion"], "completion")?,
                )
            };
            let start = encode(&render(&prompt, true)?)?;
            let all: Vec<serde_json::Value> = prompt.into_iter().chain(completion).collect();
            let ids = encode(&render(&all, false)?)?;
            warn_unless_prefix(&start, &ids);
            let end = ids.len();
            (ids, vec![(start.len(), end)])
        }
        Shape::Text => unreachable!("text rows are a token stream"),
    };
    let mut labels = vec![opts.loss_on == LossOn::All; ids.len()];
    if opts.loss_on == LossOn::Completions {
        for (start, end) in spans {
            for l in &mut labels[start.min(ids.len())..end.min(ids.len())] {
                *l = true;
            }
        }
    }
    if let Some(first) = labels.first_mut() {
        *first = false;
    }
    Ok(Example { ids, labels })
}

/// transformers warns, and keeps the token counts, when a prompt's ids are
/// not the start of the whole example's (a merge across the boundary).
fn warn_unless_prefix(prefix: &[u32], ids: &[u32]) {
    if !ids.starts_with(prefix) {
        tracing::warn!(
            prefix = prefix.len(),
            "the prompt's tokens are not the start of the example's: the loss starts after its token count"
        );
    }
}

/// `value` as a list of messages (objects with string `role` and `content`).
fn message_list(value: &serde_json::Value, what: &str) -> Result<Vec<serde_json::Value>, String> {
    let Some(list) = value.as_array() else {
        return Err(format!(
            "\"{what}\" is {}, not a list of messages",
            json_kind(value)
        ));
    };
    for (i, m) in list.iter().enumerate() {
        for key in ["role", "content"] {
            match m.get(key) {
                Some(serde_json::Value::String(_)) => {}
                Some(other) => {
                    return Err(format!(
                        "\"{what}\"[{i}].{key} is {}, not a string",
                        json_kind(other)
                    ))
                }
                None => return Err(format!("\"{what}\"[{i}] has no \"{key}\"")),
            }
        }
    }
    Ok(list.clone())
}

/// An Alpaca row's prompt and completion messages.
fn alpaca(
    row: &serde_json::Value,
) -> Result<(Vec<serde_json::Value>, Vec<serde_json::Value>), String> {
    let field = |k: &str| -> Result<&str, String> {
        match &row[k] {
            serde_json::Value::String(s) => Ok(s),
            serde_json::Value::Null if k == "input" => Ok(""),
            other => Err(format!("\"{k}\" is {}, not a string", json_kind(other))),
        }
    };
    let (instruction, input, output) = (field("instruction")?, field("input")?, field("output")?);
    let user = if input.is_empty() {
        instruction.to_string()
    } else {
        format!("{instruction}\n\n{input}")
    };
    Ok((
        vec![serde_json::json!({"role": "user", "content": user})],
        vec![serde_json::json!({"role": "assistant", "content": output})],
    ))
}

/// What a JSON value is, for messages.
pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// How [`pack`] lays examples into rows.
#[derive(Debug, Clone, Copy)]
pub struct PackOptions {
    /// Tokens per row (the plan's sequence length).
    pub seq_len: usize,
    /// Several examples to a row, kept apart by document ids; else one to a
    /// row.
    pub packing: bool,
    /// An example longer than a row keeps its first `seq_len + 1` tokens;
    /// else it is dropped.
    pub truncate: bool,
    /// The id padding positions hold (never attended by a real token, never
    /// learned).
    pub pad: u32,
}

/// Examples laid into rows of `seq_len` inputs and next-token targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    /// Tokens per row.
    pub seq_len: usize,
    /// Inputs, row after row.
    pub inputs: Vec<u32>,
    /// Targets (the next token of each input), row after row.
    pub targets: Vec<u32>,
    /// 1 where the target is learned, row after row.
    pub loss_mask: Vec<f32>,
    /// Document ids, row after row (when packing): each example a run of its
    /// own id, the padding another.
    pub documents: Option<Vec<u32>>,
    /// What packing did.
    pub report: PackReport,
}

/// What [`pack`] did with the examples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackReport {
    /// Examples laid into rows.
    pub examples: usize,
    /// Rows.
    pub rows: usize,
    /// Examples cut to the row length (with `truncate`).
    pub truncated: usize,
    /// Examples longer than a row, dropped (without `truncate`).
    pub dropped_long: usize,
    /// Examples with no learned token (within the row length), dropped.
    pub dropped_unlearned: usize,
    /// Learned tokens in all rows.
    pub learned: usize,
    /// Tokens in all rows that are not padding.
    pub tokens: usize,
}

/// Lays `examples` into rows of `opts.seq_len` (an example of `n` tokens
/// takes `n − 1` positions: inputs `ids[..n−1]`, targets `ids[1..]`).
pub fn pack(examples: &[Example], opts: PackOptions) -> Packed {
    let s = opts.seq_len.max(1);
    let mut report = PackReport::default();
    let mut rows: Vec<Vec<&[u32]>> = Vec::new();
    let mut labels: Vec<Vec<&[bool]>> = Vec::new();
    let mut used = 0;
    for e in examples {
        let mut n = e.ids.len();
        if n > s + 1 {
            if !opts.truncate {
                report.dropped_long += 1;
                continue;
            }
            report.truncated += 1;
            n = s + 1;
        }
        if n < 2 || !e.labels[1..n].contains(&true) {
            report.dropped_unlearned += 1;
            continue;
        }
        if rows.is_empty() || !opts.packing || used + (n - 1) > s {
            rows.push(Vec::new());
            labels.push(Vec::new());
            used = 0;
        }
        rows.last_mut().expect("pushed").push(&e.ids[..n]);
        labels.last_mut().expect("pushed").push(&e.labels[..n]);
        used += n - 1;
        report.examples += 1;
    }
    report.rows = rows.len();
    let cells = rows.len() * s;
    let mut packed = Packed {
        seq_len: s,
        inputs: Vec::with_capacity(cells),
        targets: Vec::with_capacity(cells),
        loss_mask: Vec::with_capacity(cells),
        documents: opts.packing.then(|| Vec::with_capacity(cells)),
        report,
    };
    for (row, labels) in rows.iter().zip(&labels) {
        let mut filled = 0;
        for (doc, (ids, learned)) in row.iter().zip(labels).enumerate() {
            packed.inputs.extend(&ids[..ids.len() - 1]);
            packed.targets.extend(&ids[1..]);
            packed
                .loss_mask
                .extend(learned[1..].iter().map(|&l| f32::from(u8::from(l))));
            if let Some(d) = &mut packed.documents {
                d.extend(std::iter::repeat_n(doc as u32, ids.len() - 1));
            }
            filled += ids.len() - 1;
        }
        packed.report.tokens += filled;
        let pad = s - filled;
        packed.inputs.extend(std::iter::repeat_n(opts.pad, pad));
        packed.targets.extend(std::iter::repeat_n(opts.pad, pad));
        packed.loss_mask.extend(std::iter::repeat_n(0.0, pad));
        if let Some(d) = &mut packed.documents {
            d.extend(std::iter::repeat_n(row.len() as u32, pad));
        }
    }
    packed.report.learned = packed.loss_mask.iter().filter(|&&m| m > 0.0).count();
    packed
}

impl Packed {
    /// Learned tokens of row `r`.
    pub fn learned_in_row(&self, r: usize) -> usize {
        self.loss_mask[r * self.seq_len..(r + 1) * self.seq_len]
            .iter()
            .filter(|&&m| m > 0.0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(ids: &[u32], learned_from: usize) -> Example {
        Example {
            ids: ids.to_vec(),
            labels: (0..ids.len()).map(|t| t >= learned_from).collect(),
        }
    }

    #[test]
    fn packing_fills_rows_in_order_and_keeps_examples_apart() {
        let examples = [ex(&[1, 2, 3], 1), ex(&[4, 5, 6, 7], 2), ex(&[8, 9], 1)];
        let opts = PackOptions {
            seq_len: 5,
            packing: true,
            truncate: false,
            pad: 0,
        };
        let p = pack(&examples, opts);
        assert_eq!(p.report.rows, 2);
        assert_eq!(p.inputs, [1, 2, 4, 5, 6, 8, 0, 0, 0, 0]);
        assert_eq!(p.targets, [2, 3, 5, 6, 7, 9, 0, 0, 0, 0]);
        assert_eq!(p.loss_mask, [1., 1., 0., 1., 1., 1., 0., 0., 0., 0.]);
        assert_eq!(
            p.documents.as_deref(),
            Some(&[0, 0, 1, 1, 1, 0, 1, 1, 1, 1][..])
        );
        assert_eq!((p.report.learned, p.report.tokens), (5, 6));
        assert_eq!(p.learned_in_row(0), 4);
    }

    #[test]
    fn long_examples_are_dropped_or_cut_and_unlearned_ones_dropped() {
        let examples = [
            ex(&[1, 2, 3, 4, 5, 6], 1),
            ex(&[7, 8, 9], 3),
            ex(&[1, 2], 1),
        ];
        let mut opts = PackOptions {
            seq_len: 3,
            packing: false,
            truncate: false,
            pad: 0,
        };
        let p = pack(&examples, opts);
        assert_eq!(
            (
                p.report.dropped_long,
                p.report.dropped_unlearned,
                p.report.rows
            ),
            (1, 1, 1)
        );
        assert_eq!(p.inputs, [1, 0, 0]);
        assert!(p.documents.is_none());
        opts.truncate = true;
        let p = pack(&examples, opts);
        assert_eq!((p.report.truncated, p.report.rows), (1, 2));
        assert_eq!(&p.inputs[..3], [1, 2, 3]);
        assert_eq!(&p.targets[..3], [2, 3, 4]);
    }
}
