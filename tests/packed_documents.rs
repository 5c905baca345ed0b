//! Packed rows (`TokenBatch::documents`): a row of several documents
//! computes what its documents compute one by one, in every causal family
//! (the reference fixtures of `tests/train_models.rs`: GPT-2, Llama, Qwen2,
//! Qwen3, the scaled RoPEs, Phi-3, Phi-4-mini's partial rotary, Gemma 2 and
//! 3), with composed and flash attention, with and without checkpointing,
//! LoRA adapters included; BERT refuses documents.

mod common;

use candle_core::{Device, Tensor};
use common::{adapted_fixture, causal_fixtures, fixture_model, fixture_spec, max_abs, max_diff};
use oomfix::strategies::{Attention, Checkpointing, Execution};
use oomfix::train::{HubModel, StepOutput, TokenBatch};
use oomfix::Error;

/// Deterministic ids below `vocab`.
fn ids(n: usize, seed: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 101 + 7) % vocab) as u32)
        .collect()
}

/// One document: its input ids and targets.
struct Document {
    inputs: Vec<u32>,
    targets: Vec<u32>,
}

impl Document {
    /// The document alone, as a batch of one row (no documents, every
    /// position in the loss).
    fn batch(&self) -> TokenBatch {
        let row = |v: &[u32]| Tensor::new(v, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        TokenBatch {
            input_ids: row(&self.inputs),
            targets: row(&self.targets),
            loss_mask: None,
            attention_mask: None,
            documents: None,
        }
    }
}

/// Documents of `lengths` over a vocabulary of `vocab`.
fn documents(lengths: &[usize], vocab: usize) -> Vec<Document> {
    lengths
        .iter()
        .enumerate()
        .map(|(d, &n)| Document {
            inputs: ids(n, 2 * d, vocab),
            targets: ids(n, 2 * d + 1, vocab),
        })
        .collect()
}

/// The documents packed into one row, then `padding` tokens as a last
/// document out of the loss; document ids 5, 6, ... (any distinct runs).
fn packed(docs: &[Document], padding: usize) -> TokenBatch {
    let mut inputs = Vec::new();
    let mut targets = Vec::new();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for (d, doc) in docs.iter().enumerate() {
        inputs.extend(&doc.inputs);
        targets.extend(&doc.targets);
        ids.extend(std::iter::repeat_n(5 + d as u32, doc.inputs.len()));
        mask.extend(std::iter::repeat_n(1f32, doc.inputs.len()));
    }
    inputs.extend(std::iter::repeat_n(0u32, padding));
    targets.extend(std::iter::repeat_n(0u32, padding));
    ids.extend(std::iter::repeat_n(5 + docs.len() as u32, padding));
    mask.extend(std::iter::repeat_n(0f32, padding));
    let row = |v: Vec<u32>| Tensor::new(v, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    TokenBatch {
        input_ids: row(inputs),
        targets: row(targets),
        loss_mask: Some(
            Tensor::new(mask, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap(),
        ),
        attention_mask: None,
        documents: Some(row(ids)),
    }
}

/// The document lengths of a family's test (with 3 tokens of padding after
/// them): three different lengths within GPT-2's 16 learned positions; all
/// past `longrope`'s original context of the fixtures (4), so that each
/// document alone takes the long factors as the packed row does; equal
/// lengths for `dynamic` (whose frequencies change with the length past
/// the context, and a packed row takes the longest document's).
fn lengths(name: &str) -> &'static [usize] {
    match name {
        "llama-dynamic" => &[6, 6, 6],
        "phi3-longrope" | "phi4-mini" => &[5, 9, 6],
        _ => &[4, 7, 2],
    }
}

/// The packed row's logits at its documents' positions, its loss and its
/// gradients against the documents' one by one: the logits within `tol` of
/// the largest, the sum of the per-token losses and each parameter's
/// gradient of that sum within `tol` relative (the packed loss is the mean
/// over the documents' tokens, each document's over its own).
fn assert_packed_equals_one_by_one(model: &HubModel, name: &str, exec: &Execution, tol: f32) {
    let vocab = model.config().vocab;
    let docs = documents(lengths(name), vocab);
    let batch = packed(&docs, 3);
    let tokens: usize = docs.iter().map(|d| d.inputs.len()).sum();
    let what = format!("{name} {} {}", exec.attention, exec.checkpoint);

    let logits = model.logits(&batch, exec).unwrap();
    let mut first = 0;
    for (d, doc) in docs.iter().enumerate() {
        let n = doc.inputs.len();
        let alone = model.logits(&doc.batch(), exec).unwrap();
        let inside = logits.narrow(1, first, n).unwrap();
        let rel = max_diff(&inside, &alone) / max_abs(&alone);
        assert!(
            rel < tol,
            "{what}: logits of document {d} differ by {rel:e}"
        );
        first += n;
    }

    let StepOutput { loss, grads } = model.forward_backward(&batch, exec).unwrap();
    let mut want_loss = 0f64;
    let mut want_grads: Vec<Tensor> = Vec::new();
    for doc in &docs {
        let n = doc.inputs.len() as f64;
        let out = model.forward_backward(&doc.batch(), exec).unwrap();
        want_loss += out.loss as f64 * n;
        let scaled: Vec<Tensor> = out.grads.iter().map(|g| (g * n).unwrap()).collect();
        want_grads = if want_grads.is_empty() {
            scaled
        } else {
            want_grads
                .iter()
                .zip(&scaled)
                .map(|(a, b)| (a + b).unwrap())
                .collect()
        };
    }
    let got_loss = loss as f64 * tokens as f64;
    let rel = ((got_loss - want_loss) / want_loss).abs();
    assert!(
        rel < tol as f64,
        "{what}: summed loss {got_loss} vs {want_loss}"
    );
    let largest = want_grads.iter().map(max_abs).fold(0f32, f32::max);
    for ((param, _), (got, want)) in model.named_vars().iter().zip(grads.iter().zip(&want_grads)) {
        let got = (got * tokens as f64).unwrap();
        // A key bias's gradient vanishes (the softmax cancels it): its
        // rounding is measured against the largest gradient.
        let scale = max_abs(want).max(1e-3 * largest);
        let rel = max_diff(&got, want) / scale;
        assert!(rel < tol, "{what}: gradient of {param} differs by {rel:e}");
    }
}

/// The attentions a model computes: Gemma's composed only.
fn attentions(model: &HubModel) -> &'static [Attention] {
    if model.config().flash_computes_it() {
        &[Attention::Composed, Attention::Flash]
    } else {
        &[Attention::Composed]
    }
}

#[test]
fn a_packed_row_computes_its_documents_one_by_one_in_every_causal_family() {
    for name in causal_fixtures() {
        let model = fixture_model(&fixture_spec(name), None);
        for &attention in attentions(&model) {
            for policy in [Checkpointing::None, Checkpointing::Every(1)] {
                let exec = Execution::default().attention(attention).checkpoint(policy);
                assert_packed_equals_one_by_one(&model, name, &exec, 1e-5);
            }
        }
    }
}

/// LoRA adapters (random, so that every adapter has a gradient) take the
/// same packed forward.
#[test]
fn adapted_models_compute_packed_documents_one_by_one() {
    for name in ["llama", "gpt2", "gemma3", "phi4-mini"] {
        let model = adapted_fixture(name);
        for &attention in attentions(&model) {
            let exec = Execution::default()
                .attention(attention)
                .checkpoint(Checkpointing::Every(1));
            // Adapters of N(0, 0.2²) make some adapter gradients small
            // sums of large terms: the packed row sums them in another
            // order (Gemma 3's, up to 1.2e-5 of their largest value).
            assert_packed_equals_one_by_one(&model, name, &exec, 2e-5);
        }
    }
}

/// Without the documents the packed row attends across them: the test
/// above would see it (its first document's logits agree, the others'
/// do not).
#[test]
fn without_documents_the_packed_row_differs() {
    let model = fixture_model(&fixture_spec("llama"), None);
    let docs = documents(&[5, 9, 6], model.config().vocab);
    let mut batch = packed(&docs, 3);
    batch.documents = None;
    let exec = Execution::default();
    let logits = model.logits(&batch, &exec).unwrap();
    let second = model.logits(&docs[1].batch(), &exec).unwrap();
    let inside = logits.narrow(1, 5, 9).unwrap();
    assert!(max_diff(&inside, &second) / max_abs(&second) > 1e-2);
}

/// BERT refuses documents: a usage error from its forward (which
/// `forward_backward` reports through the training step's error).
#[test]
fn bert_refuses_packed_documents() {
    let model = fixture_model(&fixture_spec("bert"), None);
    let docs = documents(&[4, 7, 2], model.config().vocab);
    let batch = packed(&docs, 3);
    let exec = Execution::default();
    match model.logits(&batch, &exec) {
        Err(Error::Usage(msg)) => assert!(msg.contains("packed documents"), "{msg}"),
        other => panic!(
            "expected a usage error, got {:?}",
            other.map(|t| t.dims().to_vec())
        ),
    }
    let err = model.forward_backward(&batch, &exec).err().unwrap();
    assert!(err.to_string().contains("packed documents"), "{err}");
}
