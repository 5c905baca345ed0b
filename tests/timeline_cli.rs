//! `--snapshot` and `--plot` from the command line: the snapshot as Python's
//! pickle reads it (with the keys memory_viz reads), the SVG and PNG files.

mod common;

use common::*;
use std::path::Path;

/// `oomfix` on `model` on the CPU, with `extra` options.
fn oomfix_on(model: &Path, extra: &[&std::ffi::OsStr]) -> std::process::Output {
    // Enough activations that the backward, not the optimizer step, holds
    // the peak (every component is then alive at it).
    oomfix()
        .args(on_cpu("256MiB", "8"))
        .args(extra)
        .arg(model)
        .output()
        .unwrap()
}

/// What memory_viz reads, checked with Python's own pickle.
const CHECK: &str = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], "rb"))
assert {"segments", "device_traces"} <= set(d), d.keys()
t = d["device_traces"][0]
assert len(t) > 10
for e in t:
    assert {"action", "addr", "size", "stream", "time_us", "frames"} <= set(e), e
    for f in e["frames"]:
        assert set(f) == {"name", "filename", "line"}, f
assert {e["action"] for e in t} == {"alloc", "free_completed", "snapshot"}
for s in d["segments"]:
    assert {"device", "address", "total_size", "stream", "segment_type", "blocks"} <= set(s), s
    for b in s["blocks"]:
        assert {"address", "size", "requested_size", "state", "frames"} <= set(b), b
components = {"weights", "gradients", "optimizer_state", "activations", "temporaries"}
assert {f["filename"] for e in t for f in e["frames"][:1]} == components
assert {e["category"] for e in t} == components | {"unknown"}
names = {f["name"] for e in t for f in e["frames"]}
assert any(n.startswith("h.0.attn.") for n in names), sorted(names)[:50]
assert {"forward", "backward", "optimizer_step"} <= names
# Replay: every free matches a live block; per-component bytes at the peak add up.
live, by = {}, dict.fromkeys(components, 0)
best = (0, None)
for e in t:
    if e["action"] == "alloc":
        live[e["addr"]] = (e["size"], e["category"]); by[e["category"]] += e["size"]
    elif e["action"] == "free_completed":
        size, c = live.pop(e["addr"]); by[c] -= size
    total = sum(size for size, _ in live.values())
    assert sum(by.values()) == total
    if total > best[0]:
        best = (total, dict(by))
assert all(best[1][c] > 0 for c in components), best
assert {s["address"] for s in d["segments"]} == set(live)
print(best[0])
"#;

#[test]
fn cli_snapshot_loads_with_python_pickle_and_plots_are_svg_and_png() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_gpt2_file(dir.path());
    let (snap, svg, png) = (
        dir.path().join("step.pickle"),
        dir.path().join("step.svg"),
        dir.path().join("step.png"),
    );
    let out = oomfix_on(
        &model,
        &[
            "--snapshot".as_ref(),
            snap.as_os_str(),
            "--plot".as_ref(),
            svg.as_os_str(),
        ],
    );
    common::assert_exit(&out, 0);
    let bytes = std::fs::read(&snap).unwrap();
    assert!(
        bytes[0] == 0x80 && bytes[1] <= 4,
        "pickle protocol {} (memory_viz reads up to 4)",
        bytes[1]
    );
    match std::process::Command::new("python3")
        .arg("-c")
        .arg(CHECK)
        .arg(&snap)
        .output()
    {
        Ok(py) => assert!(
            py.status.success(),
            "{}",
            String::from_utf8_lossy(&py.stderr)
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("python3 not found: pickle check skipped")
        }
        Err(e) => panic!("running python3: {e}"),
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    for s in [
        "weights",
        "optimizer state",
        "gradients",
        "activations",
        "temporaries",
        "budget 256.00 MiB",
        "forward",
        "backward",
    ] {
        assert!(text.contains(s), "the SVG has no `{s}`");
    }
    let out = oomfix_on(&model, &["--plot".as_ref(), png.as_os_str()]);
    common::assert_exit(&out, 0);
    let image = std::fs::read(&png).unwrap();
    assert_eq!(&image[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&image[12..16], b"IHDR");
    assert_eq!(u32::from_be_bytes(image[16..20].try_into().unwrap()), 1200);
}

#[test]
fn cli_plot_with_another_extension_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_gpt2_file(dir.path());
    let jpg = dir.path().join("step.jpg");
    let out = oomfix_on(&model, &["--plot".as_ref(), jpg.as_os_str()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("step.jpg") && stderr.contains(".svg or .png"),
        "{stderr}"
    );
    assert!(!jpg.exists());
}
