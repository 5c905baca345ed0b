//! `oomfix::inspect` never panics: arbitrary bytes and mutated valid files give
//! either a model or an input error.

mod common;

use std::path::Path;

use common::*;
use oomfix::{inspect, ModelConfig};
use proptest::prelude::*;
use tempfile::TempDir;

/// Inspects `path`, requiring that a failure is an input error (exit code 2), never a panic.
fn inspect_is_total(path: &Path) -> Result<(), TestCaseError> {
    if let Err(e) = inspect(path) {
        prop_assert!(e.is_input(), "not an input error: {e}");
        prop_assert!(!e.to_string().is_empty());
    }
    Ok(())
}

/// A small valid GPT-2 header and its data length.
fn valid_header() -> (String, u64) {
    let c = ModelConfig {
        vocab: 32,
        max_positions: 8,
        ..ModelConfig::gpt2(2, 8, 2)
    };
    header_json(&gpt2_hub_tensors(&c, ""))
}

#[test]
fn the_unmutated_file_is_valid() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("m.safetensors");
    let (header, data_len) = valid_header();
    write_header(&path, &header, data_len);
    inspect(&path).unwrap();
}

/// How a valid file is damaged.
#[derive(Debug, Clone)]
enum Mutation {
    /// XOR the header byte at (index mod length) with a non-zero mask.
    Flip(usize, u8),
    /// Overwrite the header byte at (index mod length) with a JSON-significant character.
    Poke(usize, u8),
    /// Cut the header to (index mod length) bytes.
    Truncate(usize),
    /// Replace the length field.
    LengthField(u64),
    /// Change the data region's length.
    DataLen(u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, m)| Mutation::Flip(i, m)),
        (
            any::<usize>(),
            prop::sample::select(b"{}[]\",:-.0123456789e ".to_vec())
        )
            .prop_map(|(i, c)| Mutation::Poke(i, c)),
        any::<usize>().prop_map(Mutation::Truncate),
        prop_oneof![any::<u64>(), 0..4096u64].prop_map(Mutation::LengthField),
        (0..8192u64).prop_map(Mutation::DataLen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("x.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        inspect_is_total(&path)?;
    }

    #[test]
    fn arbitrary_header_after_a_plausible_length(
        header in prop::collection::vec(any::<u8>(), 0..256),
        data_len in 0..64u64,
    ) {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("x.safetensors");
        write_raw(&path, header.len() as u64, &header, data_len);
        inspect_is_total(&path)?;
    }

    #[test]
    fn mutated_valid_file(mutations in prop::collection::vec(mutation(), 1..4)) {
        let (header, mut data_len) = valid_header();
        let mut bytes = header.into_bytes();
        let mut length_field = None;
        for m in mutations {
            let len = bytes.len().max(1);
            match m {
                Mutation::Flip(i, mask) => if let Some(b) = bytes.get_mut(i % len) { *b ^= mask },
                Mutation::Poke(i, c) => if let Some(b) = bytes.get_mut(i % len) { *b = c },
                Mutation::Truncate(i) => bytes.truncate(i % len),
                Mutation::LengthField(n) => length_field = Some(n),
                Mutation::DataLen(n) => data_len = n,
            }
        }
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("x.safetensors");
        write_raw(&path, length_field.unwrap_or(bytes.len() as u64), &bytes, data_len);
        inspect_is_total(&path)?;
    }
}

/// An embedding with zero rows holds no data whatever its width, so its width
/// can claim a hidden size so large that the assumed 4 × hidden MLP overflowed
/// (a panic with overflow checks on). Found while writing the `header` fuzz
/// target, which missed it in 30 minutes; `fuzz/corpus/header` now holds it.
#[test]
fn hidden_size_of_an_empty_embedding_too_large_for_4x_is_an_input_error() {
    let huge = vec![0, 1usize << 62];
    let layer = [
        ("wte.weight", "h.0.attn.c_attn.weight"),
        (
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        (
            "bert.embeddings.word_embeddings.weight",
            "bert.encoder.layer.0.attention.self.query.weight",
        ),
    ];
    for (embedding, block) in layer {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("m.safetensors");
        let (header, data_len) =
            header_json(&[(embedding, "F16", huge.clone()), (block, "F16", vec![1])]);
        write_header(&path, &header, data_len);
        let err = inspect(&path).unwrap_err();
        assert!(err.is_input(), "{err}");
        assert!(
            err.to_string()
                .contains("hidden size 4611686018427387904 is too large"),
            "{err}"
        );
    }
}
