//! Logs machines can read, through the real binary: with `--log-format json`
//! every line on stderr is JSON (notices, training progress and errors
//! included), no colours when stderr is not a terminal, and docs/command-line.md's
//! `jq` example runs as printed.

mod common;

use assert_cmd::Command;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

fn oomfix(dir: &Path) -> Command {
    let mut cmd = common::oomfix_in(dir);
    cmd.env_remove("NO_COLOR").timeout(Duration::from_secs(120));
    cmd
}

/// Every line of `stderr`, parsed; panics on a line that is not a JSON object.
fn json_lines(stderr: &[u8]) -> Vec<Value> {
    let text = String::from_utf8_lossy(stderr);
    text.lines()
        .map(|l| match serde_json::from_str::<Value>(l) {
            Ok(v) if v.is_object() => v,
            _ => panic!("not a JSON object: `{l}` in\n{text}"),
        })
        .collect()
}

fn messages(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .map(|v| v["fields"]["message"].as_str().unwrap_or("").to_string())
        .collect()
}

/// Runs `args` with JSON logs; returns the exit code and the stderr lines.
fn run_json(dir: &Path, args: &[&str]) -> (i32, Vec<Value>) {
    let out = oomfix(dir)
        .args(args)
        .args(["--log-format", "json"])
        .output()
        .unwrap();
    (out.status.code().unwrap(), json_lines(&out.stderr))
}

/// The error event that ends a run: one, with the exit code.
fn error_event(lines: &[Value], code: i32) -> &Value {
    let errors: Vec<&Value> = lines.iter().filter(|v| v["level"] == "ERROR").collect();
    assert_eq!(errors.len(), 1, "{lines:#?}");
    assert_eq!(errors[0]["fields"]["exit_code"], code, "{:#}", errors[0]);
    errors[0]
}

#[test]
fn json_logs_make_every_stderr_line_json_notices_included() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    // The default model's notice, and the attempts.
    let (code, lines) = run_json(dir, &["--budget", "8GiB"]);
    assert_eq!(code, 0);
    let msgs = messages(&lines);
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("no model given; planning for the built-in gpt2")),
        "{msgs:?}"
    );
    assert!(lines.iter().any(|v| v["span"]["name"] == "attempt"));
    // Nothing fits.
    let (code, lines) = run_json(dir, &["--budget", "100MiB", "-v"]);
    assert_eq!(code, 1);
    assert!(!lines.is_empty());
}

#[test]
fn json_logs_report_every_kind_of_error_as_a_json_event() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for (args, code, says) in [
        // clap's own errors, found before the options are known.
        (&["--budget", "8GiB", "--bogus"][..], 2, "--bogus"),
        (
            &["--budget", "8GiB", "--global-batch", "-1"],
            2,
            "--global-batch",
        ),
        // the binary's checks
        (&["--global-batch", "4"], 2, "a budget is required"),
        (
            &["train", "--budget", "1GiB", "--init", "pretrained"],
            2,
            "--init pretrained",
        ),
        // an input error
        (
            &["--budget", "8GiB", "missing.safetensors"],
            2,
            "missing.safetensors",
        ),
    ] {
        let (got, lines) = run_json(dir, args);
        assert_eq!(got, code, "{args:?}: {lines:?}");
        let e = error_event(&lines, code);
        let msg = e["fields"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{args:?}: {msg}");
    }
    // A failure while running: the result cannot be written.
    #[cfg(target_os = "linux")]
    {
        let out = common::oomfix_process(dir)
            .args(["--budget", "8GiB", "--log-format", "json"])
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(3));
        let lines = json_lines(&out.stderr);
        let e = error_event(&lines, 3);
        assert!(e["fields"]["message"].as_str().unwrap().contains("stdout"));
    }
}

#[test]
fn json_logs_carry_train_progress_and_its_notices() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    common::tiny_gpt2_file(dir);
    let train = [
        "train",
        "tiny.safetensors",
        "--init",
        "random",
        "--budget",
        "1GiB",
        "--seq-len",
        "16",
        "--global-batch",
        "2",
        "--save",
        "ck",
    ];
    let device: &[&str] = if cfg!(feature = "cuda") {
        &["--device", "cpu"]
    } else {
        &[]
    };
    let (code, lines) = run_json(dir, &[&train[..], device, &["--steps", "2"]].concat());
    assert_eq!(code, 0, "{lines:#?}");
    let steps: Vec<(u64, u64)> = lines
        .iter()
        .filter(|v| v["fields"]["message"] == "step")
        .map(|v| {
            let f = &v["fields"];
            assert!(f["loss"].is_f64() && f["tokens"].is_u64(), "{f}");
            (
                f["step"].as_u64().unwrap(),
                f["total_steps"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(steps, [(1, 2), (2, 2)]);
    let msgs = messages(&lines);
    assert!(msgs.contains(&"saved".to_string()), "{msgs:?}");
    if !cfg!(feature = "cuda") {
        assert!(
            msgs.iter().any(|m| m.contains("training on the CPU")),
            "{msgs:?}"
        );
    }
    let (code, lines) = run_json(
        dir,
        &[&train[..], device, &["--steps", "3", "--resume", "ck"]].concat(),
    );
    assert_eq!(code, 0, "{lines:#?}");
    let resumed: Vec<&Value> = lines
        .iter()
        .filter(|v| v["fields"]["message"] == "resumed")
        .collect();
    assert_eq!(resumed.len(), 1, "{lines:#?}");
    assert_eq!(resumed[0]["fields"]["step"], 2);
}

#[test]
fn json_logs_carry_the_stop_by_a_signal() {
    let d = common::tiny_dir();
    let (mut child, mut err, mut text) = common::start_until(
        common::oomfix_process(d.path())
            .args(common::train_tiny("1GiB"))
            .args(["--steps", "1000000", "--log-format", "json"]),
        |line| line.contains(r#""message":"step""#),
    );
    common::signal(&child, libc::SIGTERM);
    std::io::Read::read_to_string(&mut err, &mut text).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(143), "{text}");
    let lines = json_lines(text.as_bytes());
    let msgs = messages(&lines);
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("stopped by SIGTERM after step")
                && m.ends_with("no checkpoint written (no --save)")),
        "{msgs:?}"
    );
}

#[test]
fn text_logs_have_no_colours_when_stderr_is_not_a_terminal() {
    let d = tempfile::tempdir().unwrap();
    let out = oomfix(d.path())
        .args(["--budget", "8GiB", "-vv"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("baseline"), "{stderr}");
    assert!(!stderr.contains('\x1b'), "ANSI escapes in {stderr:?}");
}

/// The shell command between `<!-- jq-example -->` markers in docs/command-line.md.
fn readme_jq_example() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/command-line.md"))
            .unwrap();
    let start = readme
        .find("<!-- jq-example -->")
        .expect("docs/command-line.md has a jq example");
    let end = readme
        .find("<!-- /jq-example -->")
        .expect("the jq example ends");
    let lines: Vec<&str> = readme[start..end]
        .lines()
        .skip(1)
        .filter(|l| !l.starts_with("```") && !l.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "one command line: {lines:?}");
    lines[0].to_string()
}

/// The example names this build's options and pipes into jq.
#[test]
fn the_readmes_jq_example_is_one_oomfix_command_into_jq() {
    let command = readme_jq_example();
    assert!(
        command.starts_with("oomfix ") && command.contains("| jq"),
        "{command}"
    );
}

#[test]
#[ignore = "needs jq: `.ci/run` installs it and runs the ignored tests"]
fn the_readmes_jq_example_runs_as_printed() {
    let command = readme_jq_example();
    let jq = std::process::Command::new("jq").arg("--version").output();
    assert!(
        jq.is_ok_and(|o| o.status.success()),
        "jq is not installed: the jq example cannot run"
    );
    // `oomfix` as the command line names it: this build, first on PATH.
    let bin = assert_cmd::cargo::cargo_bin("oomfix");
    let bin_dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&bin, bin_dir.path().join("oomfix")).unwrap();
    let path = std::env::join_paths(std::iter::once(bin_dir.path().to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .unwrap();
    let out = std::process::Command::new("bash")
        .args(["-o", "pipefail", "-c", &command])
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{command}: {stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    let rows: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(rows.len() >= 2, "{stdout}");
    assert_eq!(rows[0]["strategy"], "baseline");
    for row in &rows {
        let mut keys: Vec<&str> = row
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        keys.sort();
        assert_eq!(keys, ["estimated_bytes", "fits", "strategy"], "{row}");
        assert!(row["estimated_bytes"].is_u64() && row["fits"].is_boolean());
    }
    assert_eq!(rows.last().unwrap()["fits"], true, "{stdout}");
}
