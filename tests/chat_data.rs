//! Chat and instruction data against transformers
//! (`tests/fixtures/chat`, from `scripts/make-chat-fixtures.py`): the
//! rendered text and token ids of `apply_chat_template` (rows of JSON Lines,
//! a JSON array and Parquet), the label masks of
//! the loss on completions, the evaluation loss of a tiny Llama on every
//! file with and without packing; packing and accumulation that change
//! nothing; bad chat data refused.

mod common;

use common::{
    assert_exit, chat_dir, events, json_of, json_stdout, oomfix, oomfix_in, step_losses, train_fp32,
};
use oomfix::train::chat::ChatTemplate;
use oomfix::train::data::{DataSource, TextOptions, TokenWidth};
use oomfix::train::examples::LossOn;
use oomfix::train::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(chat_dir().join("reference.json")).unwrap())
        .unwrap()
}

/// The data files and how their rows are read.
const FILES: [&str; 6] = [
    "messages.jsonl",
    "messages.json",
    "messages.parquet",
    "prompt_completion.jsonl",
    "prompt_completion_text.jsonl",
    "alpaca.jsonl",
];

fn load(file: &str, loss_on: LossOn) -> Vec<oomfix::train::examples::Example> {
    let model = chat_dir().join("model");
    let tok = Tokenizer::from_file(&model.join("tokenizer.json")).unwrap();
    let template = ChatTemplate::from_model_dir(&model).unwrap().unwrap();
    let opts = TextOptions {
        tokenizer: Some(&tok),
        eos: Some(2),
        template: Some(&template),
        loss_on,
        ..TextOptions::default()
    };
    match DataSource::load(&chat_dir().join(file), TokenWidth::U16, 384, &opts).unwrap() {
        DataSource::Examples(e) => e.examples().to_vec(),
        other => panic!("{file}: not examples: {other:?}"),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn the_template_renders_as_transformers_renders_it() {
    let r = reference();
    let template = ChatTemplate::from_model_dir(&chat_dir().join("model"))
        .unwrap()
        .unwrap();
    let text = std::fs::read_to_string(chat_dir().join("messages.jsonl")).unwrap();
    let rows: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (row, expected) in rows.iter().zip(r["rendered"].as_array().unwrap()) {
        let messages = row["messages"].as_array().unwrap();
        assert_eq!(
            template.render(messages, false).unwrap(),
            expected.as_str().unwrap()
        );
    }
    let first = &rows[0]["messages"].as_array().unwrap()[..1];
    assert_eq!(
        template.render(first, true).unwrap(),
        r["generation_prompt_rendered"].as_str().unwrap()
    );
}

#[test]
fn token_ids_and_label_masks_are_transformers() {
    let r = reference();
    for file in FILES {
        let completions = load(file, LossOn::Completions);
        let all = load(file, LossOn::All);
        // The Parquet file holds messages.jsonl's rows.
        let key = if file.ends_with(".parquet") {
            "messages.jsonl"
        } else {
            file
        };
        let expected = r[key].as_array().unwrap();
        assert_eq!(completions.len(), expected.len(), "{file}");
        for (i, ((c, a), e)) in completions.iter().zip(&all).zip(expected).enumerate() {
            assert_eq!(c.ids, ids(&e["input_ids"]), "{file} example {i}: ids");
            let mask: Vec<bool> = ids(&e["completion_mask"]).iter().map(|&m| m == 1).collect();
            // The first token is never a target.
            assert_eq!(c.labels[1..], mask[1..], "{file} example {i}: labels");
            assert_eq!(
                c.learned() as u64,
                e["tokens_completions"].as_u64().unwrap()
            );
            assert_eq!(a.ids, c.ids);
            assert_eq!(a.learned() as u64, e["tokens_all"].as_u64().unwrap());
        }
    }
}

/// `oomfix train` of the fixture's model on `data`, fp32 on the CPU, with
/// JSON logs on stderr.
fn train(work: &Path, data: &str, extra: &[&str]) -> std::process::Output {
    let dir = chat_dir();
    train_fp32(work, &dir.join("model"), &dir.join(data))
        .args(["--log-format", "json"])
        .args(extra)
        .output()
        .unwrap()
}

/// The evaluation loss before any step (`--eval-every 1`: before the
/// first step and after it) on `data`.
fn eval_loss(data: &str, extra: &[&str]) -> f64 {
    let work = tempfile::tempdir().unwrap();
    let path = chat_dir().join(data);
    let path = path.to_str().unwrap();
    let mut args = vec!["--eval-data", path, "--eval-every", "1", "--steps", "1"];
    args.extend_from_slice(extra);
    let out = train(work.path(), data, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{data} {extra:?}: {stderr}");
    let evals = events(&stderr, "eval");
    assert!(!evals.is_empty(), "{stderr}");
    evals[0]["eval_loss"].as_f64().unwrap()
}

#[test]
fn the_evaluation_loss_is_transformers_on_every_file_packed_or_not() {
    let r = reference();
    let cases: [(&str, &[&str], &str); 9] = [
        ("messages.jsonl", &[], "loss_completions"),
        ("messages.parquet", &[], "loss_completions"),
        ("messages.jsonl", &["--no-packing"], "loss_completions"),
        ("messages.jsonl", &["--loss-on", "all"], "loss_all"),
        ("messages.json", &[], "loss_completions"),
        (
            "prompt_completion.jsonl",
            &["--no-packing"],
            "loss_completions",
        ),
        (
            "prompt_completion.jsonl",
            &["--loss-on", "all", "--no-packing"],
            "loss_all",
        ),
        ("prompt_completion_text.jsonl", &[], "loss_completions"),
        ("alpaca.jsonl", &[], "loss_completions"),
    ];
    for (file, extra, key) in cases {
        let mut args = vec!["--seq-len", "256", "--global-batch", "2"];
        args.extend_from_slice(extra);
        let loss = eval_loss(file, &args);
        let reference_file = if file.ends_with(".parquet") {
            "messages.jsonl"
        } else {
            file
        };
        let expected = r[key][reference_file].as_f64().unwrap();
        let rel = (loss - expected).abs() / expected;
        assert!(
            rel < 1e-4,
            "{file} {extra:?}: {loss} vs transformers' {expected} ({rel:e})"
        );
    }
}

/// The losses of `steps` steps on messages.jsonl.
fn losses(extra: &[&str]) -> Vec<f64> {
    let work = tempfile::tempdir().unwrap();
    let mut args = vec!["--seq-len", "256", "--lr", "1e-2", "--steps", "3"];
    args.extend_from_slice(extra);
    let out = train(work.path(), "messages.jsonl", &args);
    step_losses(&assert_exit(&out, 0))
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{what}: {a:?} vs {b:?}");
    }
}

/// Five examples: packed into 256 tokens they take 2 rows (72+58+107 and
/// 55+127 tokens, less one each), unpacked 5. A step over all of them
/// computes the same loss and gradients either way, so every step's loss
/// is the same; and the same again with the rows accumulated one by one.
#[test]
fn packing_and_accumulation_change_no_step() {
    let packed = losses(&["--global-batch", "2", "--micro-batch", "2"]);
    let unpacked = losses(&["--no-packing", "--global-batch", "5", "--micro-batch", "5"]);
    assert_close(&packed, &unpacked, "packed vs one example per row");
    let accumulated = losses(&["--no-packing", "--global-batch", "5", "--micro-batch", "1"]);
    assert_close(&accumulated, &unpacked, "accumulated vs one micro-batch");
    assert!(
        packed[2] < packed[0],
        "training lowers the loss: {packed:?}"
    );
}

/// A model directory like the fixture's whose tokenizer_config.json has no
/// chat template.
fn model_without_template(work: &Path) -> PathBuf {
    let dir = work.join("model");
    std::fs::create_dir(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(chat_dir().join("model").join(f), dir.join(f)).unwrap();
    }
    dir
}

#[test]
fn bad_chat_data_is_refused_naming_the_file_and_line() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let write = |name: &str, text: &str| std::fs::write(w.join(name), text).unwrap();
    let user = r#"{"role": "user", "content": "hi"}"#;
    let assistant = r#"{"role": "assistant", "content": "hello"}"#;
    write(
        "shapeless.jsonl",
        &format!("{{\"messages\": [{user}, {assistant}]}}\n{{\"question\": \"x\"}}\n"),
    );
    write(
        "mixed.jsonl",
        &format!("{{\"messages\": [{user}, {assistant}]}}\n{{\"text\": \"x\"}}\n"),
    );
    write(
        "nocontent.jsonl",
        &format!("{{\"messages\": [{{\"role\": \"user\"}}, {assistant}]}}\n"),
    );
    write(
        "tool.jsonl",
        &format!("{{\"messages\": [{{\"role\": \"tool\", \"content\": \"x\"}}, {assistant}]}}\n"),
    );
    write("empty.jsonl", "\n\n");
    write("bad.parquet", "PAR1 not really");
    write(
        "ok.jsonl",
        &format!("{{\"messages\": [{user}, {assistant}]}}\n"),
    );
    write(
        "strict.jinja",
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
         {{ raise_exception('Only user and assistant roles are supported') }}{% endif %}\
         {{ m.role }}: {{ m.content }}\n{% endfor %}",
    );
    write("broken.jinja", "{% for m in messages %}{{ m.content }");
    let cases: [(&str, &[&str], &str); 8] = [
        (
            "shapeless.jsonl",
            &[],
            "line 2: the object has no \"text\" field",
        ),
        (
            "mixed.jsonl",
            &[],
            "line 2: a text row in a file of messages rows (line 1)",
        ),
        (
            "nocontent.jsonl",
            &[],
            "line 1: \"messages\"[0] has no \"content\"",
        ),
        (
            "tool.jsonl",
            &["--chat-template", "strict.jinja"],
            "line 1: the chat template fails",
        ),
        ("empty.jsonl", &[], "holds no rows"),
        ("bad.parquet", &[], "not a Parquet file"),
        (
            "ok.jsonl",
            &["--chat-template", "broken.jinja"],
            "broken.jinja: not a Jinja template",
        ),
        (
            "ok.jsonl",
            &["--chat-template", "missing.jinja"],
            "missing.jinja: cannot read",
        ),
    ];
    for (file, extra, says) in cases {
        let mut args = vec!["--save", "out"];
        args.extend_from_slice(extra);
        let out = train(w, &w.join(file).to_string_lossy(), &args);
        // The JSON log's message, its quotes unescaped.
        let stderr = String::from_utf8_lossy(&out.stderr).replace("\\\"", "\"");
        assert_eq!(out.status.code(), Some(2), "{file}: {stderr}");
        assert!(
            stderr.contains(says),
            "{file}: expected `{says}` in {stderr}"
        );
        assert!(
            stderr.contains(file) || says.contains(".jinja"),
            "{file}: {stderr}"
        );
        assert!(!w.join("out").exists(), "{file}: nothing is written");
    }
    // Chats for a model without a template name the option that gives one.
    let bare = model_without_template(w);
    let out = oomfix_in(w)
        .arg("train")
        .arg(&bare)
        .args(["--data", "ok.jsonl", "--device", "cpu", "--budget", "1GiB"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--chat-template"), "{stderr}");
}

#[test]
fn inspect_counts_the_examples_and_training_defaults_to_the_longest() {
    let r = reference();
    let model = chat_dir().join("model");
    let v = json_of(
        oomfix()
            .arg("inspect")
            .arg(&model)
            .arg("--data")
            .arg(chat_dir().join("messages.jsonl"))
            .arg("--json"),
        0,
    );
    let examples = r["messages.jsonl"].as_array().unwrap();
    let learned: u64 = examples
        .iter()
        .map(|e| e["tokens_completions"].as_u64().unwrap())
        .sum();
    let tokens: usize = examples
        .iter()
        .map(|e| e["input_ids"].as_array().unwrap().len())
        .sum();
    assert_eq!(v["data"]["examples"], 5);
    assert_eq!(v["data"]["learned_tokens"], learned);
    assert_eq!(v["data"]["tokens"], tokens);
    assert_eq!(v["data"]["longest"], 127);

    // No --seq-len: the longest example's 127 tokens make 126 positions.
    let work = tempfile::tempdir().unwrap();
    let out = train(work.path(), "messages.jsonl", &["--steps", "1", "--json"]);
    assert_exit(&out, 0);
    let v = json_stdout(&out);
    assert_eq!(v["plan"]["seq_len"], 126, "{v:#}");
}

/// A run of chat examples saved after 2 steps and resumed takes the steps
/// 3 and 4 of a run that never stopped (the data continues at its row).
#[test]
fn a_resumed_run_continues_the_examples_where_it_stopped() {
    let work = tempfile::tempdir().unwrap();
    let common = ["--seq-len", "128", "--global-batch", "1", "--lr", "1e-2"];
    let steps = |extra: &[&str]| -> Vec<f64> {
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        step_losses(&assert_exit(
            &train(work.path(), "messages.jsonl", &args),
            0,
        ))
    };
    let whole = steps(&["--steps", "4"]);
    steps(&["--steps", "2", "--save", "ck"]);
    let resumed = steps(&["--steps", "4", "--save", "ck", "--resume", "ck"]);
    assert_eq!(resumed.len(), 2, "{resumed:?}");
    assert_close(&resumed, &whole[2..], "resumed");
}
