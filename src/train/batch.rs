//! Token batches: random ones, ones made of windows of token ids (BERT's
//! masked), and their shape checked against a model.

use super::TokenBatch;
use crate::{Error, Family, ModelConfig, Result};
use candle_core::{Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The `[MASK]` token id BERT's uncased vocabulary uses.
const BERT_MASK_ID: u32 = 103;

/// A random batch for `family` with token ids below `vocab`, reproducible from `seed`.
///
/// Causal families get `seq + 1` random tokens per sequence: inputs are the first
/// `seq`, targets the last `seq`. BERT gets `seq` random tokens; about 15% of the
/// positions (at least one per sequence) are replaced by the `[MASK]` id (103, or
/// `vocab − 1` for vocabularies of 103 tokens or fewer), targeted with the original
/// token and selected by `loss_mask`.
pub fn synthetic_batch(
    family: Family,
    vocab: usize,
    batch: usize,
    seq: usize,
    seed: u64,
    device: &Device,
) -> Result<TokenBatch> {
    if vocab < 2 || batch == 0 || seq == 0 || vocab > u32::MAX as usize {
        return Err(Error::Usage(format!(
            "a synthetic batch needs vocab >= 2, batch >= 1 and seq >= 1 (got {vocab}, {batch}, {seq})"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let windows: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    batch_from_windows(family, vocab, &windows, batch, seq, seed, device)
}

/// A batch from `batch` windows of `seq + 1` token ids each (row after row).
///
/// Causal families take the first `seq` ids of a window as inputs and the last
/// `seq` as targets. BERT takes the first `seq` ids, replaces about 15% of them
/// (at least one per sequence, chosen reproducibly from `seed`) by the `[MASK]` id
/// (103, or `vocab − 1` for vocabularies of 103 tokens or fewer) and targets
/// the originals at those positions.
pub fn batch_from_windows(
    family: Family,
    vocab: usize,
    windows: &[u32],
    batch: usize,
    seq: usize,
    seed: u64,
    device: &Device,
) -> Result<TokenBatch> {
    if windows.len() != batch * (seq + 1) {
        return Err(Error::Usage(format!(
            "{} token ids do not make {batch} windows of {} tokens",
            windows.len(),
            seq + 1
        )));
    }
    let ids = |v: Vec<u32>| Tensor::from_vec(v, (batch, seq), device);
    let rows = || windows.chunks(seq + 1);
    let inputs: Vec<u32> = rows().flat_map(|r| r[..seq].to_vec()).collect();
    if family != Family::Bert {
        let targets = rows().flat_map(|r| r[1..].to_vec()).collect();
        return Ok(TokenBatch {
            input_ids: ids(inputs)?,
            targets: ids(targets)?,
            loss_mask: None,
            attention_mask: None,
            documents: None,
        });
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6d61_736b);
    let mut masked: Vec<bool> = (0..batch * seq).map(|_| rng.random_bool(0.15)).collect();
    for row in masked.chunks_mut(seq) {
        if !row.contains(&true) {
            row[rng.random_range(0..seq)] = true;
        }
    }
    let mask_id = if vocab > BERT_MASK_ID as usize {
        BERT_MASK_ID
    } else {
        vocab as u32 - 1
    };
    let masked_inputs = inputs
        .iter()
        .zip(&masked)
        .map(|(&t, &m)| if m { mask_id } else { t })
        .collect();
    let loss_mask = masked.iter().map(|&m| f32::from(u8::from(m))).collect();
    Ok(TokenBatch {
        input_ids: ids(masked_inputs)?,
        targets: ids(inputs)?,
        loss_mask: Some(Tensor::from_vec(loss_mask, (batch, seq), device)?),
        attention_mask: None,
        documents: None,
    })
}

/// `(b, s)` of `batch`, checked against the model's position limit (the
/// families with learned positions, GPT-2 and BERT, have no more).
pub(crate) fn batch_dims(batch: &TokenBatch, config: &ModelConfig) -> Result<(usize, usize)> {
    let (b, s) = batch.dims().map_err(|e| match e {
        oomfix_strategies::Error::Config(msg) => Error::Usage(msg),
        e => e.into(),
    })?;
    let learned_positions = matches!(config.family, Family::Gpt2 | Family::Bert);
    if learned_positions && s > config.max_positions {
        return Err(Error::Usage(format!(
            "sequence length {s} exceeds the model's {} learned positions",
            config.max_positions
        )));
    }
    Ok((b, s))
}
