//! Fine-tuning a model file through the real binary: where the weights start
//! (`--init`), text data with the model's tokenizer, the checkpoint's own
//! configuration and the training loop's schedule, clipping and evaluation.

mod common;

use assert_cmd::Command;
use candle_core::{Device, Tensor};
use common::{events, token_bin, train_on_finetune_text, values};
use oomfix::train::StateFile;
use oomfix::ModelConfig;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A 2-layer GPT-2 of hidden 64 (one head), vocabulary 64, 32 positions.
fn tiny_config() -> ModelConfig {
    let mut c = ModelConfig::gpt2(2, 64, 1);
    c.vocab = 64;
    c.max_positions = 32;
    c.intermediate = 128;
    c
}

/// Writes `config`'s tensors to `path` (matrices of seeded normal values of
/// standard deviation 0.02, norm scales 1.5, biases 0.25); gives them back by name.
fn write_weights(path: &Path, config: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let dev = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = rand_distr::Normal::new(0f32, 0.02).unwrap();
    let tensors: HashMap<String, Tensor> = config
        .tensors()
        .into_iter()
        .map(|(name, shape)| {
            let t = if shape.len() >= 2 {
                let n = shape.iter().product();
                let v: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
                Tensor::from_vec(v, shape, &dev).unwrap()
            } else if name.ends_with(".weight") {
                Tensor::full(1.5f32, shape, &dev).unwrap()
            } else {
                Tensor::full(0.25f32, shape, &dev).unwrap()
            };
            (name, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, path).unwrap();
    tensors
}

/// A directory holding a model and data files.
struct Dir {
    dir: tempfile::TempDir,
}

impl Dir {
    fn new() -> Dir {
        Dir {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) {
        std::fs::write(self.path(name), bytes).unwrap();
    }

    /// `oomfix ARGS` in this directory, on the CPU, fp32, with small batches.
    fn oomfix(&self, args: &[&str]) -> Command {
        let mut cmd = common::oomfix_in(self.dir.path());
        cmd.args(args).args([
            "--device",
            "cpu",
            "--budget",
            "1GiB",
            "--precision",
            "fp32",
            "--global-batch",
            "2",
        ]);
        cmd
    }
}

/// The tensor `name` of a saved directory's weights as f32 values.
fn saved(ck: &Path, name: &str) -> Vec<f32> {
    let ck = StateFile::open(&ck.join("model.safetensors")).unwrap();
    ck.tensor(name)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn training_starts_from_the_files_weights_unless_asked_for_random() {
    let d = Dir::new();
    let config = tiny_config();
    let weights = write_weights(&d.path("model.safetensors"), &config, 1);
    d.write("data.bin", token_bin((0..400).map(|i| (i % 50) as u16)));
    // With a learning rate of 0 the checkpoint holds the starting weights.
    let run = |extra: &[&str]| {
        d.oomfix(&["train", "model.safetensors", "--data", "data.bin"])
            .args(["--seq-len", "16", "--steps", "1", "--lr", "0"])
            .args(["--save", "ck"])
            .args(extra)
            .assert()
            .code(0);
        saved(&d.path("ck"), "wte.weight")
    };
    let file = values(&weights["wte.weight"]);
    assert_eq!(run(&[]), file, "the default starts from the file");
    assert_eq!(run(&["--init", "pretrained"]), file);
    assert_eq!(run(&["--pretrained"]), file, "the former flag still works");
    let random = run(&["--init", "random"]);
    assert_eq!(random.len(), file.len());
    assert_ne!(
        random, file,
        "--init random does not read the file's weights"
    );
}

/// A word-level `tokenizer.json`: `<|endoftext|>` 0, `[UNK]` 1, then `words`
/// from id 2, split on whitespace and punctuation.
fn word_tokenizer(words: &[&str]) -> String {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<|endoftext|>".into(), 0.into());
    vocab.insert("[UNK]".into(), 1.into());
    for (i, w) in words.iter().enumerate() {
        vocab.insert(w.to_string(), (i + 2).into());
    }
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
    .to_string()
}

const WORDS: [&str; 6] = ["the", "cat", "sat", "dog", "ran", "far"];

/// The id `word_tokenizer(&WORDS)` gives `w`.
fn id(w: &str) -> u32 {
    WORDS.iter().position(|x| *x == w).unwrap() as u32 + 2
}

#[test]
fn text_is_tokenized_with_the_models_tokenizer_and_documents_end_with_eos() {
    use oomfix::train::data::{DataSource, TextOptions, TokenWidth};
    use oomfix::train::tokenizer::Tokenizer;
    let d = Dir::new();
    d.write("tokenizer.json", word_tokenizer(&WORDS));
    let tok = Tokenizer::from_file(&d.path("tokenizer.json")).unwrap();
    assert_eq!(tok.eos_id(), Some(0));
    d.write(
        "docs.jsonl",
        "{\"text\": \"the cat sat\"}\n\n{\"text\": \"the dog ran far\", \"id\": 7}\n",
    );
    let text = TextOptions {
        tokenizer: Some(&tok),
        eos: tok.eos_id(),
        ..TextOptions::default()
    };
    let mut data = DataSource::load(&d.path("docs.jsonl"), TokenWidth::U16, 64, &text).unwrap();
    let expected = [
        id("the"),
        id("cat"),
        id("sat"),
        0,
        id("the"),
        id("dog"),
        id("ran"),
        id("far"),
        0,
    ];
    // One window of all 9 tokens: the documents packed with EOS between them.
    assert_eq!(data.next_windows(1, 8, 64), expected);
    // Another field, and plain text: one document, line by line.
    d.write("docs2.jsonl", "{\"body\": \"dog sat\"}\n");
    let body = TextOptions {
        text_field: "body",
        ..text
    };
    let mut data = DataSource::load(&d.path("docs2.jsonl"), TokenWidth::U16, 64, &body).unwrap();
    assert_eq!(data.next_windows(1, 2, 64), [id("dog"), id("sat"), 0]);
    d.write("plain.txt", "the cat\nsat\n");
    let mut data = DataSource::load(&d.path("plain.txt"), TokenWidth::U16, 64, &text).unwrap();
    assert_eq!(
        data.next_windows(1, 3, 64),
        [id("the"), id("cat"), id("sat"), 0]
    );
}

/// A run directory with the tiny GPT-2 (random weights) and `config.json`.
fn model_dir(config_json: serde_json::Value) -> Dir {
    let d = Dir::new();
    write_weights(&d.path("model.safetensors"), &tiny_config(), 3);
    d.write("config.json", config_json.to_string());
    d
}

/// Runs `train model.safetensors --data DATA` (4 steps, sequences of 8) with
/// `extra`; gives back the exit code and stderr.
fn train_on(d: &Dir, data: &str, extra: &[&str]) -> (i32, String) {
    let out = d
        .oomfix(&["train", "model.safetensors", "--data", data])
        .args(["--seq-len", "8", "--steps", "2"])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Exit 2, one line naming `file` and saying `says`.
fn refused(d: &Dir, data: &str, extra: &[&str], file: &str, says: &str) {
    let (code, stderr) = train_on(d, data, extra);
    assert_eq!(code, 2, "{data}: {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains(file) && last.contains(says),
        "{data}: {stderr}"
    );
}

#[test]
fn text_data_trains_with_the_tokenizer_beside_the_model() {
    let d = model_dir(serde_json::json!({"n_head": 1, "eos_token_id": 0}));
    d.write("tokenizer.json", word_tokenizer(&WORDS));
    let docs: String = (0..20)
        .map(|i| format!("{{\"text\": \"the {} sat\"}}\n", WORDS[i % 6]))
        .collect();
    d.write("docs.jsonl", docs);
    let (code, stderr) = train_on(&d, "docs.jsonl", &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("is a token"), "{stderr}");
    // No tokenizer: bytes, with a warning (the vocabulary of 64 is too small).
    std::fs::remove_file(d.path("tokenizer.json")).unwrap();
    refused(
        &d,
        "docs.jsonl",
        &[],
        "docs.jsonl",
        "vocabulary of at least 256",
    );
    // --tokenizer names one elsewhere.
    std::fs::create_dir(d.path("tok")).unwrap();
    std::fs::write(d.path("tok/t.json"), word_tokenizer(&WORDS)).unwrap();
    let (code, stderr) = train_on(&d, "docs.jsonl", &["--tokenizer", "tok/t.json"]);
    assert_eq!(code, 0, "{stderr}");
    refused(
        &d,
        "docs.jsonl",
        &["--tokenizer", "config.json"],
        "config.json",
        "tokenizer",
    );
}

#[test]
fn bad_data_is_an_input_error_naming_the_file_and_line() {
    let d = model_dir(serde_json::json!({"n_head": 1}));
    d.write("tokenizer.json", word_tokenizer(&WORDS));
    d.write("empty.txt", "");
    refused(&d, "empty.txt", &[], "empty.txt", "is empty");
    d.write("empty.bin", "");
    refused(&d, "empty.bin", &[], "empty.bin", "is empty");
    d.write("latin1.txt", b"the cat\nsat \xe9t\xe9\n");
    refused(&d, "latin1.txt", &[], "latin1.txt", "line 2: not UTF-8");
    d.write(
        "nofield.jsonl",
        "{\"text\": \"the cat\"}\n{\"body\": \"sat\"}\n",
    );
    refused(
        &d,
        "nofield.jsonl",
        &[],
        "nofield.jsonl",
        "line 2: the object has no \"text\" field",
    );
    d.write(
        "notjson.jsonl",
        "{\"text\": \"the cat\"}\n\n{\"text\": \"sat\"\n",
    );
    refused(
        &d,
        "notjson.jsonl",
        &[],
        "notjson.jsonl",
        "line 3: not JSON",
    );
    d.write("number.jsonl", "{\"text\": 5}\n");
    refused(
        &d,
        "number.jsonl",
        &[],
        "number.jsonl",
        "line 1: \"text\" is a number",
    );
    refused(
        &d,
        "nofield.jsonl",
        &["--text-field", "body"],
        "nofield.jsonl",
        "line 1: the object has no \"body\" field",
    );
    d.write("big.bin", token_bin([1, 2, 64, 3]));
    refused(
        &d,
        "big.bin",
        &[],
        "big.bin",
        "token 2 is id 64, outside the model's vocabulary of 64",
    );
    // A tokenizer whose ids go beyond the model's vocabulary of 64.
    let many: Vec<String> = (0..70).map(|i| format!("w{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    d.write("tokenizer.json", word_tokenizer(&many));
    d.write("words.txt", "w1 w2\nw3 w68\n");
    refused(
        &d,
        "words.txt",
        &[],
        "words.txt",
        "line 2: the tokenizer gives id 70",
    );
}

/// A 2-layer Llama of hidden 64 (2 heads, 1 key/value head), vocabulary 64.
fn tiny_llama() -> ModelConfig {
    let mut c = ModelConfig::llama(2, 64, 2, 1, 96, 64, false);
    c.max_positions = 64;
    c
}

/// A Llama `config.json` with `extra` fields.
fn llama_json(extra: serde_json::Value) -> serde_json::Value {
    let base = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "tie_word_embeddings": false,
    });
    common::merged(base, extra)
}

#[test]
fn inspect_prints_the_checkpoints_settings() {
    let d = Dir::new();
    write_weights(&d.path("model.safetensors"), &tiny_llama(), 5);
    d.write(
        "config.json",
        llama_json(serde_json::json!({
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            "sliding_window": 4096,
            "eos_token_id": [7, 9],
        }))
        .to_string(),
    );
    let inspect = |json: bool| {
        let mut cmd = common::oomfix_in(d.dir.path());
        cmd.args(["inspect", "model.safetensors"])
            .args(json.then_some("--json"));
        common::stdout_of(&mut cmd, 0)
    };
    let v: serde_json::Value = serde_json::from_str(&inspect(true)).unwrap();
    assert_eq!(
        v["settings"],
        serde_json::json!({
            "norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": "llama3",
            "hidden_act": "silu",
            "sliding_window": 4096,
            "attention_bias": false,
            "mlp_bias": false,
            "eos_token_id": 7,
        })
    );
    let text = inspect(false);
    for line in [
        "norm eps       1e-5",
        "activation     silu",
        "rope theta     500000",
        "rope scaling   llama3",
        "biases         none",
        "sliding window 4096",
        "eos token id   7",
    ] {
        assert!(text.contains(line), "{line}: {text}");
    }
    // Without config.json: transformers' defaults.
    std::fs::remove_file(d.path("config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&inspect(true)).unwrap();
    assert_eq!(v["settings"]["norm_eps"], 1e-6);
    assert_eq!(v["settings"]["rope_theta"], 10000.0);
    assert_eq!(v["settings"]["rope_scaling"], serde_json::Value::Null);
}

#[test]
fn training_refuses_what_the_family_does_not_implement_naming_the_field() {
    let d = Dir::new();
    write_weights(&d.path("model.safetensors"), &tiny_llama(), 5);
    d.write("data.bin", token_bin((0..400).map(|i| (i % 50) as u16)));
    let with = |extra: serde_json::Value| d.write("config.json", llama_json(extra).to_string());
    for (extra, says) in [
        (
            serde_json::json!({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}),
            "\"rope_scaling\" is \"mrope\"",
        ),
        (
            serde_json::json!({"architectures": ["Gemma3ForConditionalGeneration"]}),
            "\"architectures\" is \"Gemma3ForConditionalGeneration\"",
        ),
        (
            serde_json::json!({"hidden_act": "gelu"}),
            "\"hidden_act\" is \"gelu\"",
        ),
        (
            serde_json::json!({"sliding_window": 4}),
            "\"sliding_window\" is 4",
        ),
        (
            serde_json::json!({"rms_norm_eps": -1}),
            "\"rms_norm_eps\" is -1, not a positive number",
        ),
    ] {
        with(extra.clone());
        refused(&d, "data.bin", &[], "config.json", says);
    }
    // What the family implements trains: a window as long as the sequence,
    // unscaled RoPE written out, scaled RoPE, Qwen2's unused window.
    for extra in [
        serde_json::json!({"sliding_window": 8, "rope_theta": 1e6, "rms_norm_eps": 1e-5}),
        serde_json::json!({"rope_scaling": {"rope_type": "default"}}),
        serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
        serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        serde_json::json!({"sliding_window": 4, "use_sliding_window": false}),
    ] {
        with(extra.clone());
        let (code, stderr) = train_on(&d, "data.bin", &[]);
        assert_eq!(code, 0, "{extra}: {stderr}");
    }
    // GPT-2's activation key.
    let g = model_dir(serde_json::json!({"n_head": 1, "activation_function": "relu"}));
    g.write("data.bin", token_bin((0..400).map(|i| (i % 50) as u16)));
    refused(
        &g,
        "data.bin",
        &[],
        "config.json",
        "\"activation_function\" is \"relu\"",
    );
}

/// `tests/fixtures/finetune`: a tiny pretrained Llama-style model with its
/// tokenizer, training and held-out text, and the reference values of
/// `scripts/make-parity-fixtures.py`.
fn finetune_fixture() -> (PathBuf, serde_json::Value) {
    let dir = common::finetune_dir();
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    (dir, serde_json::from_str(&text).unwrap())
}

#[test]
fn the_first_micro_batch_is_the_reference_tokens() {
    use oomfix::train::data::{DataSource, TextOptions, TokenWidth};
    use oomfix::train::tokenizer::Tokenizer;
    let (dir, reference) = finetune_fixture();
    let spec = oomfix::inspect(&dir).unwrap();
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let eos = spec.config.settings.eos_token_id;
    assert_eq!(eos, tok.eos_id());
    let text = TextOptions {
        tokenizer: Some(&tok),
        eos,
        ..TextOptions::default()
    };
    let mut data = DataSource::load(
        &dir.join("train.txt"),
        TokenWidth::U16,
        spec.config.vocab,
        &text,
    )
    .unwrap();
    let seq = reference["seq_len"].as_u64().unwrap() as usize;
    let windows: Vec<u32> = reference["first_windows"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w.as_array().unwrap().iter())
        .map(|id| id.as_u64().unwrap() as u32)
        .collect();
    let micro_batch = windows.len() / (seq + 1);
    assert_eq!(
        data.next_windows(micro_batch, seq, spec.config.vocab),
        windows
    );
}

#[test]
fn fine_tuning_the_pretrained_fixture_starts_from_the_transformers_loss() {
    let (dir, reference) = finetune_fixture();
    let work = tempfile::tempdir().unwrap();
    let seq = reference["seq_len"].to_string();
    let micro_batch = reference["micro_batch"].to_string();
    let out = train_on_finetune_text(work.path(), &dir)
        .args(["--seq-len", &seq, "--global-batch", &micro_batch])
        .args(["--micro-batch", &micro_batch, "--grad-accum", "1"])
        .args(["--steps", "3", "--lr", "1e-3", "--log-format", "json"])
        .output()
        .unwrap();
    let stderr = common::assert_exit(&out, 0);
    let losses = common::step_losses(&stderr);
    assert_eq!(losses.len(), 3, "{stderr}");
    let expected = reference["first_loss"].as_f64().unwrap();
    let rel = (losses[0] - expected).abs() / expected;
    assert!(
        rel < 1e-4,
        "first step's loss {} vs transformers' {expected} ({rel:e})",
        losses[0]
    );
    // Pretrained: far below a uniform guess over the vocabulary.
    let vocab = oomfix::inspect(&dir).unwrap().config.vocab as f64;
    assert!(expected < 0.5 * vocab.ln(), "{expected}");
}

/// Fine-tuning the pretrained fixture on its text lowers the loss on the
/// held-out text (evaluated before the first step, every 2 steps and after
/// the last), and the directory `--save` writes loads as a model.
#[test]
fn a_fine_tuned_model_evaluates_better_and_saves_a_directory_others_load() {
    let (dir, reference) = finetune_fixture();
    let work = tempfile::tempdir().unwrap();
    let seq = reference["seq_len"].to_string();
    let out = train_on_finetune_text(work.path(), &dir)
        .arg("--eval-data")
        .arg(dir.join("eval.txt"))
        .args(["--eval-every", "2", "--save", "tuned"])
        .args([
            "--seq-len",
            &seq,
            "--global-batch",
            "4",
            "--micro-batch",
            "4",
        ])
        .args(["--steps", "8", "--lr", "1e-3", "--log-format", "json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let evals: Vec<(u64, f64)> = events(&stderr, "eval")
        .iter()
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["eval_loss"].as_f64().unwrap(),
            )
        })
        .collect();
    let steps: Vec<u64> = evals.iter().map(|e| e.0).collect();
    assert_eq!(steps, [0, 2, 4, 6, 8], "{stderr}");
    assert!(evals[4].1 < evals[0].1, "held-out loss falls: {evals:?}");
    saved_logits(&work.path().join("tuned"), work.path());
}

/// The logits of the model saved in `saved`, computed here from its files,
/// written as `logits.safetensors` in `work` beside the input ids.
fn saved_logits(saved: &Path, work: &Path) -> PathBuf {
    let spec = oomfix::inspect(saved).unwrap();
    let model = common::fixture_model(&spec, None);
    let (file, logits) = common::write_logits(&model, spec.config.vocab, work);
    assert!(
        values(&logits).iter().all(|v| v.is_finite()),
        "the saved model's logits are finite"
    );
    file
}

/// The directory `--save` writes is a model other tools load:
/// `scripts/check-saved-model.py`, run with the Python `OOMFIX_PYTHON` names
/// (with `safetensors`), checks its names, shapes and dtype against
/// config.json and, where that Python has `transformers`, that
/// `from_pretrained` gives the logits computed here.
#[test]
#[ignore = "needs OOMFIX_PYTHON, a Python with safetensors: `.ci/run` makes one and runs the ignored tests"]
fn the_saved_directory_passes_the_python_check() {
    let python = common::oomfix_python("safetensors");
    let (dir, reference) = finetune_fixture();
    let work = tempfile::tempdir().unwrap();
    let seq = reference["seq_len"].to_string();
    let out = train_on_finetune_text(work.path(), &dir)
        .args(["--save", "tuned", "--seq-len", &seq, "--steps", "2"])
        .output()
        .unwrap();
    common::assert_exit(&out, 0);
    let saved = work.path().join("tuned");
    let file = saved_logits(&saved, work.path());
    common::run_python_check(
        &python,
        "check-saved-model.py",
        &[saved.as_os_str(), "--logits".as_ref(), file.as_os_str()],
    );
}

/// A BERT checkpoint without the masked-LM head (as sentence-transformers
/// publishes them) trains with the head newly initialised and a warning
/// naming its tensors; a tensor of the body missing is still an input error.
#[test]
fn a_checkpoint_without_the_objectives_head_gets_it_initialised_with_a_warning() {
    let fixture = common::fixture_dir().join("bert");
    let d = Dir::new();
    std::fs::copy(fixture.join("config.json"), d.path("config.json")).unwrap();
    let all =
        candle_core::safetensors::load(fixture.join("model.safetensors"), &Device::Cpu).unwrap();
    let body: HashMap<String, Tensor> = all
        .iter()
        .filter(|(name, _)| !name.starts_with("cls."))
        .map(|(n, t)| (n.clone(), t.clone()))
        .collect();
    assert!(body.len() < all.len(), "the fixture has a head to remove");
    let train = || {
        let args = [
            "train",
            "model.safetensors",
            "--steps",
            "1",
            "--seq-len",
            "8",
        ];
        let out = d.oomfix(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr)
    };
    candle_core::safetensors::save(&body, d.path("model.safetensors")).unwrap();
    let (code, stderr) = train();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("cls.predictions.transform.dense.weight")
            && stderr.contains("newly initialised"),
        "{stderr}"
    );

    let mut no_body = body.clone();
    no_body.remove("bert.encoder.layer.0.output.dense.weight");
    candle_core::safetensors::save(&no_body, d.path("model.safetensors")).unwrap();
    let (code, stderr) = train();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("missing tensor"), "{stderr}");
}

/// `train`'s one JSON object (`--json`) of a run of the fine-tuning fixture
/// with `args`, and its stderr.
fn train_json(dir: &Path, work: &Path, args: &[&str]) -> (serde_json::Value, String) {
    let out = common::exits(
        train_on_finetune_text(work, dir)
            .args(args)
            .args(["--json", "--log-format", "json"]),
        0,
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (common::json_stdout(&out), stderr)
}

/// Without `--lr`, a run from pretrained weights steps at the Hugging Face
/// Trainer's 5e-5 and one from a random initialisation at 3e-4; the rate and
/// where it came from are said on stderr and in the summary, and the steps
/// take it.
#[test]
fn the_default_learning_rate_depends_on_where_the_weights_start() {
    let (dir, reference) = finetune_fixture();
    let seq = reference["seq_len"].to_string();
    for (extra, lr, source) in [
        (&[][..], 5e-5, "the default from pretrained weights"),
        (
            &["--init", "random"],
            3e-4,
            "the default from a random initialisation",
        ),
        (&["--lr", "1e-3"], 1e-3, "--lr"),
    ] {
        let work = tempfile::tempdir().unwrap();
        let args = [&["--seq-len", &seq, "--steps", "1"][..], extra].concat();
        let (v, stderr) = train_json(&dir, work.path(), &args);
        assert_eq!(v["training"]["lr"], lr, "{extra:?}");
        let from = v["training"]["lr_source"].as_str().unwrap();
        assert!(from.starts_with(source), "{extra:?}: {from}");
        let steps = events(&stderr, "step");
        assert_eq!(steps[0]["lr"], lr, "{extra:?}: {stderr}");
        let said = stderr.contains(&format!("learning rate {lr:e} ({source}"));
        assert_eq!(said, extra.is_empty() || extra[0] == "--init", "{stderr}");
    }
    let work = tempfile::tempdir().unwrap();
    let out = train_on_finetune_text(work.path(), &dir)
        .args(["--seq-len", &seq, "--steps", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("lr      5e-5 (the default from pretrained weights; --lr sets it)"),
        "{stdout}"
    );
}

/// With `--eval-data`, the model is evaluated before the first step: on the
/// training text's first micro-batch that is the original model's loss as
/// transformers computes it.
#[test]
fn evaluation_before_the_first_step_is_the_original_models_loss() {
    let (dir, reference) = finetune_fixture();
    let work = tempfile::tempdir().unwrap();
    let seq = reference["seq_len"].to_string();
    let micro_batch = reference["micro_batch"].to_string();
    let eval = dir.join("train.txt");
    let (v, stderr) = train_json(
        &dir,
        work.path(),
        &[
            "--eval-data",
            eval.to_str().unwrap(),
            "--eval-batches",
            "1",
            "--seq-len",
            &seq,
            "--global-batch",
            &micro_batch,
            "--micro-batch",
            &micro_batch,
            "--steps",
            "2",
            "--lr",
            "1e-3",
        ],
    );
    let t = &v["training"];
    assert_eq!(t["first_eval"]["step"], 0, "{t:#}");
    assert_eq!(t["eval"]["step"], 2, "{t:#}");
    let before = t["first_eval"]["loss"].as_f64().unwrap();
    let expected = reference["first_loss"].as_f64().unwrap();
    assert!(
        (before - expected).abs() / expected < 1e-4,
        "evaluated before training {before}, transformers {expected}"
    );
    let steps: Vec<u64> = events(&stderr, "eval")
        .iter()
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [0, 2], "{stderr}");
}

/// The directory `--save` writes carries the model's licence files and model
/// card from the model directory, and a run from that directory carries them
/// on; other files stay behind.
#[test]
fn the_saved_directory_carries_the_models_licence_and_card() {
    let (fixture, reference) = finetune_fixture();
    let model = tempfile::tempdir().unwrap();
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "train.txt",
    ] {
        std::fs::copy(fixture.join(name), model.path().join(name)).unwrap();
    }
    let terms = [
        ("LICENSE", "the licence's terms\n"),
        ("NOTICE.txt", "a notice\n"),
        ("README.md", "# the model card\n"),
    ];
    for (name, text) in terms {
        std::fs::write(model.path().join(name), text).unwrap();
    }
    std::fs::write(model.path().join("notes.txt"), "not the model's\n").unwrap();
    let work = tempfile::tempdir().unwrap();
    let seq = reference["seq_len"].to_string();
    let train = |from: &Path, save: &str| {
        let out = train_on_finetune_text(work.path(), from)
            .args(["--seq-len", &seq, "--steps", "1", "--save", save])
            .output()
            .unwrap();
        common::assert_exit(&out, 0);
        work.path().join(save)
    };
    let first = train(model.path(), "tuned");
    let second = train(&first, "tuned-again");
    for saved in [&first, &second] {
        for (name, text) in terms {
            assert_eq!(
                std::fs::read_to_string(saved.join(name)).unwrap(),
                text,
                "{}",
                saved.join(name).display()
            );
        }
        assert!(!saved.join("notes.txt").exists());
    }
}
