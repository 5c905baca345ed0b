//! A model's own tokenizer: a Hugging Face `tokenizer.json`, read with the
//! `tokenizers` crate (pure Rust, no network).

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The end-of-text tokens looked up, in order, when the model's
/// `config.json` gives no `eos_token_id`: GPT-2's, SentencePiece models'
/// (Llama 2, Mistral), Llama 3's and BERT's separator.
pub const EOS_TOKENS: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "[SEP]"];

/// A tokenizer read from a `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Reads `path`; a missing or malformed file is an input error naming it.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| Error::input(path, format!("cannot read tokenizer: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::input(
                path,
                format!("not a tokenizer.json the tokenizers library reads: {e}"),
            )
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The id of the first of [`EOS_TOKENS`] the vocabulary holds.
    pub fn eos_id(&self) -> Option<u32> {
        EOS_TOKENS.iter().find_map(|t| self.inner.token_to_id(t))
    }

    /// The id of `token`, if the vocabulary holds it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ids of each text, without special tokens (no BOS/CLS/SEP added).
    /// A failure is a runtime error naming the tokenizer.
    pub fn encode_batch(&self, texts: Vec<&str>) -> Result<Vec<Vec<u32>>> {
        let encodings = self
            .inner
            .encode_batch(texts, false)
            .map_err(|e| Error::Runtime(format!("tokenizing with {}: {e}", self.path.display())))?;
        Ok(encodings
            .into_iter()
            .map(|e| e.get_ids().to_vec())
            .collect())
    }
}
