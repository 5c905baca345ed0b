//! The README's recipes run as printed: each shell block between
//! `<!-- recipe -->` markers, in order, with this build's `oomfix` first on
//! PATH, in a directory that holds the repository's `tests/fixtures` as a
//! fresh clone does. (Its Rust recipe is a doctest of the library.)

use serde_json::Value;
use std::path::{Path, PathBuf};

/// The shell blocks between `<!-- recipe -->` and `<!-- /recipe -->`.
fn recipes() -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let mut out = Vec::new();
    let mut rest = readme.as_str();
    while let Some(start) = rest.find("<!-- recipe -->") {
        let end = rest[start..]
            .find("<!-- /recipe -->")
            .expect("every recipe ends")
            + start;
        let block: Vec<&str> = rest[start..end]
            .lines()
            .skip(1)
            .filter(|l| !l.starts_with("```"))
            .collect();
        out.push(block.join("\n"));
        rest = &rest[end..];
    }
    out
}

/// A directory laid out as the repository's root for the recipes
/// (`tests/fixtures`), and a PATH with this build's `oomfix` first.
fn checkout() -> (tempfile::TempDir, std::ffi::OsString) {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("tests")).unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    std::os::unix::fs::symlink(fixtures, root.path().join("tests/fixtures")).unwrap();
    let bin = root.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(assert_cmd::cargo::cargo_bin("oomfix"), bin.join("oomfix")).unwrap();
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    (root, path)
}

fn run(recipe: &str, root: &Path, path: &std::ffi::OsString) -> String {
    let out = std::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", recipe])
        .current_dir(root)
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{recipe}\nexit {:?}\n{stdout}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_readmes_recipes_run_as_printed() {
    let recipes = recipes();
    assert_eq!(recipes.len(), 4, "{recipes:?}");
    for recipe in &recipes {
        for line in recipe.lines().filter(|l| !l.starts_with(' ')) {
            assert!(line.starts_with("oomfix "), "{line}");
        }
    }
    let (root, path) = checkout();
    let root_dir: PathBuf = root.path().to_path_buf();

    // Plan a model for a GPU.
    let stdout = run(&recipes[0], &root_dir, &path);
    assert!(stdout.contains("family         llama"), "{stdout}");
    assert!(stdout.contains("\nplan    "), "{stdout}");
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(root_dir.join("plan.json")).unwrap())
            .unwrap();
    assert_eq!(plan["fits"], true);
    assert_eq!(plan["device"], "cuda:0");

    // Fine-tune, save, resume: the second run finishes the 20 steps.
    let stdout = run(&recipes[1], &root_dir, &path);
    assert!(stdout.contains("trained 10 steps"), "{stdout}");
    assert!(stdout.contains("lr      5e-5"), "{stdout}");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(root_dir.join("tuned/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["step"], 20);
    assert!(stdout.contains("family         llama"), "{stdout}");

    // LoRA on an NF4 base, saved as PEFT's adapters and resumed.
    let stdout = run(&recipes[2], &root_dir, &path);
    assert!(stdout.contains("trained 10 steps"), "{stdout}");
    let adapters = root_dir.join("adapters");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(adapters.join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["step"], 20);
    assert_eq!(state["plan"]["lora"]["base"], "nf4");
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(adapters.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 8);
    assert!(adapters.join("adapter_model.safetensors").is_file());

    // LoRA on chats: the adapters keep the tokenizer and its chat template.
    let stdout = run(&recipes[3], &root_dir, &path);
    assert!(stdout.contains("trained 10 steps"), "{stdout}");
    let adapters = root_dir.join("chat-adapters");
    assert!(adapters.join("adapter_config.json").is_file());
    let template = std::fs::read_to_string(adapters.join("chat_template.jinja")).unwrap();
    assert!(template.contains("<|im_start|>"), "{template}");
    assert!(adapters.join("tokenizer_config.json").is_file());
}
