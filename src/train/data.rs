//! Training data: token windows from a token file, a text file, or random tokens.
//!
//! * `.bin`: little-endian token ids as nanoGPT's `prepare.py` writes them
//!   (u16 by default, u32 when the vocabulary needs it or when asked);
//! * `.jsonl` / `.ndjson` (JSON Lines): one row per line (blank lines are
//!   skipped); `.json`: a JSON array of rows; `.parquet`: a table of rows
//!   (a Hub dataset's export). Rows whose text field (`text`
//!   by default) holds a document are text; rows of chat or instruction
//!   data (`messages`, `prompt`/`completion`, Alpaca's
//!   `instruction`/`input`/`output`) are examples ([`super::examples`]);
//! * any other file: plain UTF-8 text, one document.
//!
//! Text is tokenized with the model's tokenizer ([`Tokenizer`]) line by line
//! (each line with its line break, as Hugging Face's text loader with
//! `keep_linebreaks` gives them), and every document is followed by the
//! end-of-text id when one is known. Without a tokenizer each byte is a token
//! (a byte-level fallback that needs a vocabulary of at least 256).
//! No file: uniformly random tokens from a seeded generator.
//!
//! Examples train as sequences of their own: laid into rows of the plan's
//! sequence length ([`super::examples::pack`]), several to a row kept apart
//! by document ids, or one to a row, padded; the loss on the tokens they
//! learn.
//!
//! Every id is checked against the model's vocabulary. Windows of
//! `seq_len + 1` tokens are read in order and wrap around (documents are
//! packed: a window may span an end-of-text id); the trainer turns each into
//! inputs and next-token targets.

use super::chat::ChatTemplate;
use super::examples::{self, Example, LossOn, PackOptions, Packed, Rows, Shape};
use super::saved::DataState;
use super::tokenizer::Tokenizer;
use crate::{Error, Result};
use candle_core::{Device, Tensor};
use oomfix_strategies::model::TokenBatch;
use std::path::{Path, PathBuf};

/// How a data file is read, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormat {
    /// `.bin`: token ids.
    Tokens,
    /// `.jsonl` or `.ndjson`: one JSON object per line.
    JsonLines,
    /// `.json`: a JSON array of objects.
    Json,
    /// `.parquet`: a table of records.
    Parquet,
    /// Anything else: UTF-8 text.
    Text,
}

impl DataFormat {
    /// The format of `path`, from its extension.
    pub fn of(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("bin") => DataFormat::Tokens,
            Some("jsonl" | "ndjson") => DataFormat::JsonLines,
            Some("json") => DataFormat::Json,
            Some("parquet") => DataFormat::Parquet,
            _ => DataFormat::Text,
        }
    }
}

/// How text data becomes token ids.
#[derive(Debug, Clone, Copy)]
pub struct TextOptions<'a> {
    /// The model's tokenizer; `None`: bytes as tokens.
    pub tokenizer: Option<&'a Tokenizer>,
    /// The field of a JSON Lines object that holds the text.
    pub text_field: &'a str,
    /// The id put after every document (the model's end-of-text token).
    pub eos: Option<u32>,
    /// The chat template message rows are rendered with.
    pub template: Option<&'a ChatTemplate>,
    /// Which tokens of an example the loss learns.
    pub loss_on: LossOn,
    /// Several examples to a row (kept apart); else one to a row.
    pub packing: bool,
    /// An example longer than a row is cut to it; else dropped.
    pub truncate: bool,
}

impl Default for TextOptions<'_> {
    fn default() -> Self {
        TextOptions {
            tokenizer: None,
            text_field: "text",
            eos: None,
            template: None,
            loss_on: LossOn::Completions,
            packing: true,
            truncate: false,
        }
    }
}

/// Lines tokenized together (the tokenizer's batch).
const LINES_PER_BATCH: usize = 1024;

/// Width of the ids in a `.bin` token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    /// 2 bytes per id (nanoGPT's default).
    U16,
    /// 4 bytes per id.
    U32,
}

/// Where a training run's micro-batches come from: tokens (random or from a
/// file) for the Hugging Face families, or the model itself for a model
/// given as code ([`DataSource::ModelMade`]).
#[derive(Debug, Clone)]
pub enum DataSource {
    /// Random ids in `0..vocab` from a seeded xorshift generator.
    Synthetic {
        /// Generator state.
        state: u64,
    },
    /// Tokens loaded from a file, read in order with wrap-around.
    Tokens {
        /// The file they came from.
        path: PathBuf,
        /// All ids.
        ids: Vec<u32>,
        /// Next read position.
        pos: usize,
    },
    /// No tokens: a model given as code makes its own micro-batches
    /// ([`oomfix_strategies::model::MicroBatch::index`] and `seed`).
    ModelMade,
    /// Chat or instruction examples, laid into rows of the plan's sequence
    /// length, read in order with wrap-around.
    Examples(ExampleData),
}

/// The examples of a data file and the rows they are laid into.
#[derive(Debug, Clone)]
pub struct ExampleData {
    path: PathBuf,
    examples: Vec<Example>,
    packing: bool,
    truncate: bool,
    pad: u32,
    /// The rows at the sequence length last asked for.
    packed: Option<Packed>,
    /// Next row.
    pos: usize,
}

impl ExampleData {
    /// The file the examples came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The examples, in file order.
    pub fn examples(&self) -> &[Example] {
        &self.examples
    }

    /// The rows at `seq_len` (laid out on first use at that length).
    pub fn packed(&mut self, seq_len: usize) -> &Packed {
        if self.packed.as_ref().is_none_or(|p| p.seq_len != seq_len) {
            let packed = examples::pack(&self.examples, self.pack_options(seq_len));
            let r = packed.report;
            tracing::info!(
                examples = r.examples,
                rows = r.rows,
                seq_len,
                packing = self.packing,
                learned_tokens = r.learned,
                tokens = r.tokens,
                "examples of {} laid into rows",
                self.path.display()
            );
            let file = self.path.display();
            let limit = seq_len + 1;
            for (count, what) in [
                (
                    r.dropped_long,
                    format!(
                        "are longer than {limit} tokens and are left out (--truncate cuts them)"
                    ),
                ),
                (r.truncated, format!("are cut to {limit} tokens")),
                (
                    r.dropped_unlearned,
                    format!("have no token to learn within {limit} tokens and are left out"),
                ),
            ] {
                if count > 0 {
                    tracing::warn!(
                        "{count} of the {} examples of {file} {what}",
                        self.examples.len()
                    );
                }
            }
            self.packed = Some(packed);
            self.pos = 0;
        }
        self.packed.as_ref().expect("laid out above")
    }

    fn pack_options(&self, seq_len: usize) -> PackOptions {
        PackOptions {
            seq_len,
            packing: self.packing,
            truncate: self.truncate,
            pad: self.pad,
        }
    }

    /// Rows at `seq_len`, without laying them out for reading.
    fn rows(&self, seq_len: usize) -> usize {
        match &self.packed {
            Some(p) if p.seq_len == seq_len => p.report.rows,
            _ => {
                examples::pack(&self.examples, self.pack_options(seq_len))
                    .report
                    .rows
            }
        }
    }

    /// Tokens of the longest example.
    pub fn longest(&self) -> usize {
        self.examples.iter().map(|e| e.ids.len()).max().unwrap_or(0)
    }

    /// The learned tokens of each of the next `micro_batches` micro-batches
    /// of `batch` rows (wrapping around), from where the stream stands.
    pub fn learned_ahead(
        &mut self,
        micro_batches: usize,
        batch: usize,
        seq_len: usize,
    ) -> Vec<usize> {
        let pos = self.pos;
        let p = self.packed(seq_len);
        let rows = p.report.rows.max(1);
        (0..micro_batches)
            .map(|m| {
                (0..batch)
                    .map(|r| p.learned_in_row((pos + m * batch + r) % rows))
                    .sum()
            })
            .collect()
    }

    /// The next `batch` rows at `seq_len` as a batch on `device`: with
    /// `wrap`, from the start again past the last row; without, only the
    /// rows left in the pass (`None` when none is).
    pub fn next_batch(
        &mut self,
        batch: usize,
        seq_len: usize,
        wrap: bool,
        device: &Device,
    ) -> Result<Option<TokenBatch>> {
        let pos = self.pos;
        let p = self.packed(seq_len);
        let rows = p.report.rows;
        if rows == 0 {
            return Err(Error::input(
                &self.path,
                format!("no example fits {seq_len} tokens and has a token to learn"),
            ));
        }
        let take: Vec<usize> = if wrap {
            (0..batch).map(|r| (pos + r) % rows).collect()
        } else {
            (pos..(pos + batch).min(rows)).collect()
        };
        if take.is_empty() {
            return Ok(None);
        }
        let s = p.seq_len;
        let gather = |v: &[u32]| -> Vec<u32> {
            take.iter()
                .flat_map(|&r| v[r * s..(r + 1) * s].to_vec())
                .collect()
        };
        let shape = (take.len(), s);
        let mask: Vec<f32> = take
            .iter()
            .flat_map(|&r| p.loss_mask[r * s..(r + 1) * s].to_vec())
            .collect();
        let tokens = TokenBatch {
            input_ids: Tensor::from_vec(gather(&p.inputs), shape, device)?,
            targets: Tensor::from_vec(gather(&p.targets), shape, device)?,
            loss_mask: Some(Tensor::from_vec(mask, shape, device)?),
            attention_mask: None,
            documents: p
                .documents
                .as_deref()
                .map(|d| Tensor::from_vec(gather(d), shape, device))
                .transpose()?,
        };
        self.pos = if wrap {
            (pos + batch) % rows
        } else {
            pos + take.len()
        };
        Ok(Some(tokens))
    }
}

/// What a data file holds (`inspect --data`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DataSummary {
    /// Tokens in all (every example's, or the stream's).
    pub tokens: usize,
    /// Examples (none for a token stream).
    pub examples: Option<usize>,
    /// Tokens the loss learns (of examples; a stream learns every token).
    pub learned_tokens: Option<usize>,
    /// Tokens of the shortest example.
    pub shortest: Option<usize>,
    /// Tokens of the longest example.
    pub longest: Option<usize>,
}

impl DataSource {
    /// What the data holds; `None` for random tokens and a model's own data.
    pub fn summary(&self) -> Option<DataSummary> {
        match self {
            DataSource::Tokens { ids, .. } => Some(DataSummary {
                tokens: ids.len(),
                examples: None,
                learned_tokens: None,
                shortest: None,
                longest: None,
            }),
            DataSource::Examples(e) => Some(DataSummary {
                tokens: e.examples.iter().map(|x| x.ids.len()).sum(),
                examples: Some(e.examples.len()),
                learned_tokens: Some(e.examples.iter().map(Example::learned).sum()),
                shortest: e.examples.iter().map(|x| x.ids.len()).min(),
                longest: e.examples.iter().map(|x| x.ids.len()).max(),
            }),
            DataSource::Synthetic { .. } | DataSource::ModelMade => None,
        }
    }

    /// Random tokens, reproducible from `seed`.
    pub fn synthetic(seed: u64) -> Self {
        DataSource::Synthetic {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        }
    }

    /// Loads a token file (`.bin`) or a text file (bytes as tokens, no
    /// end-of-text id), checking every id against `vocab`.
    pub fn from_file(path: &Path, width: TokenWidth, vocab: usize) -> Result<Self> {
        Self::load(path, width, vocab, &TextOptions::default())
    }

    /// Loads `path` in its [`DataFormat`]: token ids (`width` each), or text
    /// tokenized as `text` says. Every problem is an input error naming the
    /// file (and the line of a text format): an empty file, text that is not
    /// UTF-8, a JSON line that is not an object with the text field as a
    /// string, an id outside `vocab`, fewer than 2 tokens.
    pub fn load(path: &Path, width: TokenWidth, vocab: usize, opts: &TextOptions) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| Error::input(path, format!("cannot read data: {e}")))?;
        if bytes.is_empty() {
            return Err(Error::input(path, "is empty: no data to train on"));
        }
        let format = DataFormat::of(path);
        if format == DataFormat::Tokens {
            return Self::tokens(path, token_ids(path, &bytes, width, vocab)?);
        }
        let (text, rows) = match format {
            DataFormat::Parquet => ("", Rows::parquet(path, bytes)?),
            DataFormat::Text => {
                let text = utf8(path, &bytes)?;
                return Self::tokens(path, text_ids(path, text, None, vocab, opts)?);
            }
            _ => {
                let text = utf8(path, &bytes)?;
                (text, Rows::parse(path, text)?)
            }
        };
        let shape = rows.shape(path, opts.text_field)?;
        if shape == Shape::Text {
            let documents = text_rows(path, &rows, opts.text_field)?;
            return Self::tokens(path, text_ids(path, text, Some(&documents), vocab, opts)?);
        }
        let tokenizer = opts.tokenizer.ok_or_else(|| {
            Error::Usage(format!(
                "{}: chat and instruction data is tokenized with the model's tokenizer: \
                 give --tokenizer or put tokenizer.json beside the model",
                path.display()
            ))
        })?;
        let eopts = examples::ExampleOptions {
            tokenizer,
            template: opts.template,
            loss_on: opts.loss_on,
            eos: opts.eos,
            vocab,
        };
        let examples = examples::examples(path, &rows, shape, &eopts)?;
        tracing::info!(
            examples = examples.len(),
            shape = ?shape,
            longest = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0),
            "examples of {}",
            path.display()
        );
        Ok(DataSource::Examples(ExampleData {
            path: path.to_path_buf(),
            examples,
            packing: opts.packing,
            truncate: opts.truncate,
            pad: opts.eos.unwrap_or(0),
            packed: None,
            pos: 0,
        }))
    }

    /// A token stream of `ids` read from `path` (at least 2).
    fn tokens(path: &Path, ids: Vec<u32>) -> Result<Self> {
        if ids.len() < 2 {
            return Err(Error::input(path, "holds fewer than 2 tokens"));
        }
        Ok(DataSource::Tokens {
            path: path.to_path_buf(),
            ids,
            pos: 0,
        })
    }

    /// Where the stream stands, as a checkpoint saves it (`None` for a
    /// model's own micro-batches, which come from no stream).
    pub fn position(&self) -> Option<DataState> {
        match self {
            DataSource::Synthetic { state } => Some(DataState::Synthetic { state: *state }),
            DataSource::Tokens { ids, pos, .. } => Some(DataState::Tokens {
                position: *pos as u64,
                tokens: ids.len() as u64,
            }),
            DataSource::ModelMade => None,
            DataSource::Examples(e) => Some(DataState::Examples {
                row: e.pos as u64,
                rows: e.packed.as_ref().map_or(0, |p| p.report.rows) as u64,
            }),
        }
    }

    /// Continues the stream from `position` (from [`position`](Self::position)
    /// on a source of the same kind: synthetic, or tokens of the same length).
    /// On error, says why in a sentence and changes nothing.
    pub fn seek(&mut self, position: DataState) -> Result<(), String> {
        match (self, position) {
            (DataSource::Synthetic { state }, DataState::Synthetic { state: s }) if s != 0 => *state = s,
            (DataSource::Examples(e), DataState::Examples { row, rows })
                if e.packed.as_ref().is_some_and(|p| p.report.rows as u64 == rows) && row < rows =>
            {
                e.pos = row as usize
            }
            (DataSource::Examples(e), DataState::Examples { rows, .. }) => {
                return Err(format!(
                    "the data was {rows} rows of examples; {} gives {} at this sequence length",
                    e.path.display(),
                    e.packed.as_ref().map_or(0, |p| p.report.rows)
                ))
            }
            (DataSource::Tokens { ids, pos, .. }, DataState::Tokens { position, tokens })
                if tokens == ids.len() as u64 && position < tokens =>
            {
                *pos = position as usize
            }
            (DataSource::Tokens { ids, path, .. }, DataState::Tokens { tokens, .. }) if tokens != ids.len() as u64 => {
                return Err(format!(
                    "the data was a stream of {tokens} tokens; {} holds {}",
                    path.display(),
                    ids.len()
                ))
            }
            (DataSource::Tokens { path, .. }, DataState::Synthetic { .. }) => {
                return Err(format!("the data was random tokens; this run reads {}", path.display()))
            }
            (DataSource::Synthetic { .. }, DataState::Tokens { tokens, .. }) => {
                return Err(format!("the data was a file of {tokens} tokens; this run uses random tokens (give --data)"))
            }
            (_, p) => return Err(format!("invalid data position {p:?}")),
        }
        Ok(())
    }

    /// The windows of `seq_len + 1` tokens one pass over the token stream
    /// reads from its start, predicting every token after the first once
    /// (consecutive windows share a token; the last wraps around to the
    /// start); `None` for synthetic data, which never ends.
    pub fn windows_per_pass(&self, seq_len: usize) -> Option<usize> {
        match self {
            DataSource::Synthetic { .. } | DataSource::ModelMade => None,
            DataSource::Tokens { ids, .. } => Some((ids.len() - 1).div_ceil(seq_len.max(1)).max(1)),
            DataSource::Examples(e) => Some(e.rows(seq_len)),
        }
    }

    /// Back to the start of the token stream (synthetic data: unchanged).
    pub fn rewind(&mut self) {
        match self {
            DataSource::Tokens { pos, .. } => *pos = 0,
            DataSource::Examples(e) => e.pos = 0,
            DataSource::Synthetic { .. } | DataSource::ModelMade => {}
        }
    }

    /// Moves past the next `windows` windows of `seq_len + 1` tokens, as
    /// [`next_windows`](Self::next_windows) would (for another rank's slice).
    pub fn skip_windows(&mut self, windows: usize, seq_len: usize) {
        match self {
            DataSource::Synthetic { state } => {
                for _ in 0..windows * (seq_len + 1) {
                    *state ^= *state << 13;
                    *state ^= *state >> 7;
                    *state ^= *state << 17;
                }
            }
            DataSource::Tokens { ids, pos, .. } => {
                *pos = ((*pos as u128 + windows as u128 * seq_len as u128) % ids.len() as u128)
                    as usize;
            }
            DataSource::Examples(e) => {
                let rows = e.packed(seq_len).report.rows.max(1);
                e.pos = (e.pos + windows) % rows;
            }
            DataSource::ModelMade => {}
        }
    }

    /// The next `batch` windows of `seq_len + 1` tokens, row after row (none
    /// from [`DataSource::ModelMade`] and [`DataSource::Examples`], whose
    /// batches come from [`ExampleData::next_batch`]).
    pub fn next_windows(&mut self, batch: usize, seq_len: usize, vocab: usize) -> Vec<u32> {
        let n = batch * (seq_len + 1);
        match self {
            DataSource::Synthetic { state } => (0..n)
                .map(|_| {
                    *state ^= *state << 13;
                    *state ^= *state >> 7;
                    *state ^= *state << 17;
                    (*state % vocab as u64) as u32
                })
                .collect(),
            DataSource::Tokens { ids, pos, .. } => {
                let mut out = Vec::with_capacity(n);
                for _ in 0..batch {
                    for k in 0..=seq_len {
                        out.push(ids[(*pos + k) % ids.len()]);
                    }
                    *pos = (*pos + seq_len) % ids.len();
                }
                out
            }
            DataSource::ModelMade | DataSource::Examples(_) => Vec::new(),
        }
    }
}

/// The ids of a `.bin` file, checked against `vocab`.
fn token_ids(path: &Path, bytes: &[u8], width: TokenWidth, vocab: usize) -> Result<Vec<u32>> {
    let w = match width {
        TokenWidth::U16 => 2,
        TokenWidth::U32 => 4,
    };
    if !bytes.len().is_multiple_of(w) {
        return Err(Error::input(
            path,
            format!(
                "length {} is not a multiple of {w}-byte token ids",
                bytes.len()
            ),
        ));
    }
    let ids: Vec<u32> = bytes
        .chunks_exact(w)
        .map(|c| match width {
            TokenWidth::U16 => u16::from_le_bytes([c[0], c[1]]) as u32,
            TokenWidth::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        })
        .collect();
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(Error::input(
            path,
            format!("token {i} is id {id}, outside the model's vocabulary of {vocab}"),
        ));
    }
    Ok(ids)
}

/// One piece of text to tokenize and the line it starts on (1-based).
struct Piece<'a> {
    line: usize,
    text: &'a str,
    /// The end of a document: the end-of-text id follows it.
    ends_document: bool,
}

/// `bytes` as UTF-8, or an input error naming the line and column of the
/// first invalid byte.
fn utf8<'a>(path: &Path, bytes: &'a [u8]) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        let bad = e.valid_up_to();
        let line = bytes[..bad].iter().filter(|&&b| b == b'\n').count() + 1;
        let column = bad
            - bytes[..bad]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1)
            + 1;
        Error::input(
            path,
            format!(
                "line {line}: not UTF-8 (invalid byte 0x{:02x} at column {column})",
                bytes[bad]
            ),
        )
    })
}

/// The documents of text rows: each row's text field, with its line;
/// empty texts are skipped.
fn text_rows(path: &Path, rows: &Rows, field: &str) -> Result<Vec<(usize, String)>> {
    let mut documents = Vec::new();
    for (at, row) in &rows.rows {
        match row.get(field) {
            Some(serde_json::Value::String(s)) if s.is_empty() => {}
            Some(serde_json::Value::String(s)) => documents.push((*at, s.clone())),
            Some(other) => {
                return Err(Error::input(
                    path,
                    format!(
                        "{} {at}: \"{field}\" is {}, not a string",
                        rows.unit,
                        examples::json_kind(other)
                    ),
                ))
            }
            None => unreachable!("a text row has the field"),
        }
    }
    if documents.is_empty() {
        return Err(Error::input(
            path,
            "holds no documents (every text is empty)",
        ));
    }
    Ok(documents)
}

/// The ids of plain text (`documents` `None`: one document, line by line)
/// or of the documents of text rows, each followed by the end-of-text id.
fn text_ids(
    path: &Path,
    text: &str,
    documents: Option<&[(usize, String)]>,
    vocab: usize,
    opts: &TextOptions,
) -> Result<Vec<u32>> {
    let at = |line: usize, msg: String| Error::input(path, format!("line {line}: {msg}"));
    if opts.tokenizer.is_none() && vocab < 256 {
        return Err(Error::input(
            path,
            format!("byte-level text needs a vocabulary of at least 256, the model has {vocab}"),
        ));
    }
    if let Some(eos) = opts.eos.filter(|&e| e as usize >= vocab) {
        return Err(Error::input(
            path,
            format!("the end-of-text id {eos} is outside the model's vocabulary of {vocab}"),
        ));
    }
    let pieces: Vec<Piece> = match documents {
        Some(documents) => documents
            .iter()
            .map(|(line, doc)| Piece {
                line: *line,
                text: doc,
                ends_document: true,
            })
            .collect(),
        None => {
            let lines: Vec<&str> = text.split_inclusive('\n').collect();
            let last = lines.len().saturating_sub(1);
            lines
                .into_iter()
                .enumerate()
                .map(|(i, t)| Piece {
                    line: i + 1,
                    text: t,
                    ends_document: i == last,
                })
                .collect()
        }
    };
    let mut ids = Vec::with_capacity(text.len() / 3);
    for batch in pieces.chunks(LINES_PER_BATCH) {
        let encoded: Vec<Vec<u32>> = match opts.tokenizer {
            Some(t) => t.encode_batch(batch.iter().map(|p| p.text).collect())?,
            None => batch
                .iter()
                .map(|p| p.text.bytes().map(u32::from).collect())
                .collect(),
        };
        for (piece, piece_ids) in batch.iter().zip(encoded) {
            if let Some(id) = piece_ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(at(
                    piece.line,
                    format!(
                        "the tokenizer gives id {id}, outside the model's vocabulary of {vocab} \
                         (is it the model's tokenizer?)"
                    ),
                ));
            }
            ids.extend(piece_ids);
            if piece.ends_document {
                ids.extend(opts.eos);
            }
        }
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of the ids 0 to 9 as 16-bit tokens in `dir`.
    fn ten_tokens(dir: &tempfile::TempDir) -> PathBuf {
        let p = dir.path().join("t.bin");
        let ids: Vec<u8> = (0u16..10).flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(&p, ids).unwrap();
        p
    }

    #[test]
    fn token_file_windows_overlap_by_one_and_wrap() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = DataSource::from_file(&ten_tokens(&dir), TokenWidth::U16, 16).unwrap();
        assert_eq!(d.next_windows(2, 3, 16), [0, 1, 2, 3, 3, 4, 5, 6]);
        assert_eq!(d.next_windows(1, 4, 16), [6, 7, 8, 9, 0]);
    }

    #[test]
    fn skipping_windows_is_reading_and_dropping_them() {
        let dir = tempfile::tempdir().unwrap();
        let file = DataSource::from_file(&ten_tokens(&dir), TokenWidth::U16, 16).unwrap();
        for source in [DataSource::synthetic(7), file] {
            let (mut read, mut skip) = (source.clone(), source);
            read.next_windows(3, 4, 16);
            skip.skip_windows(3, 4);
            assert_eq!(read.next_windows(2, 4, 16), skip.next_windows(2, 4, 16));
        }
    }

    #[test]
    fn bad_data_is_an_input_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        std::fs::write(&p, [1u8, 0, 99, 0, 7]).unwrap();
        let e = DataSource::from_file(&p, TokenWidth::U16, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 2"), "{e}");
        std::fs::write(&p, [1u8, 0, 99, 0]).unwrap();
        let e = DataSource::from_file(&p, TokenWidth::U16, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("id 99"), "{e}");
        let t = dir.path().join("t.txt");
        std::fs::write(&t, "hello").unwrap();
        assert!(DataSource::from_file(&t, TokenWidth::U16, 64).is_err());
        assert_eq!(
            DataSource::from_file(&t, TokenWidth::U16, 256)
                .unwrap()
                .next_windows(1, 2, 256),
            [104, 101, 108]
        );
    }

    #[test]
    fn seeking_to_a_position_continues_the_stream() {
        let mut a = DataSource::synthetic(3);
        a.next_windows(2, 4, 50);
        let mut b = DataSource::synthetic(9);
        b.seek(a.position().unwrap()).unwrap();
        assert_eq!(a.next_windows(1, 4, 50), b.next_windows(1, 4, 50));

        let dir = tempfile::tempdir().unwrap();
        let p = ten_tokens(&dir);
        let mut t = DataSource::from_file(&p, TokenWidth::U16, 16).unwrap();
        t.next_windows(1, 3, 16);
        let mut u = DataSource::from_file(&p, TokenWidth::U16, 16).unwrap();
        u.seek(t.position().unwrap()).unwrap();
        assert_eq!(u.next_windows(1, 2, 16), [3, 4, 5]);

        assert!(u
            .seek(DataState::Tokens {
                position: 1,
                tokens: 11
            })
            .unwrap_err()
            .contains("11 tokens"));
        assert!(u
            .seek(DataState::Tokens {
                position: 10,
                tokens: 10
            })
            .is_err());
        assert!(u
            .seek(a.position().unwrap())
            .unwrap_err()
            .contains("random tokens"));
        assert!(a
            .seek(t.position().unwrap())
            .unwrap_err()
            .contains("--data"));
        assert!(a.seek(DataState::Synthetic { state: 0 }).is_err());
    }

    #[test]
    fn synthetic_is_reproducible_and_in_range() {
        let a = DataSource::synthetic(7).next_windows(2, 5, 11);
        assert_eq!(a, DataSource::synthetic(7).next_windows(2, 5, 11));
        assert!(a.iter().all(|&t| t < 11));
    }
}
