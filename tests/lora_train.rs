//! LoRA and QLoRA training of the Hugging Face families: at step 0 the
//! model computes the base model's function; its forward and its adapters'
//! gradients equal PEFT's on the parity fixtures (f32 and bf16); the
//! command line trains, saves a PEFT adapter directory or the merged model,
//! resumes, and refuses what it cannot do.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    finetune_dir, fixture_model, fixture_spec, fixture_values, max_abs, max_diff, reference_batch,
    rel_error,
};
use oomfix::strategies::lora::{BasePrecision, Lora};
use oomfix::strategies::{Attention, Checkpointing, Execution};
use oomfix::train::lora::peft_module;
use oomfix::train::{build_model, build_model_with, HubModel, TokenBatch};
use oomfix::{Family, ModelSpec};
use std::collections::HashMap;
use std::path::Path;

/// A LoRA of `rank` and `alpha` on every linear projection of `spec`'s blocks.
fn lora(spec: &ModelSpec, rank: u32, alpha: u32, base: BasePrecision) -> Lora {
    let facts = oomfix::memory::model_facts(spec);
    Lora::new(rank, Some(alpha), None, base, &facts).unwrap()
}

/// The model's adapters set from `tensors` holding them under PEFT's names
/// (with `prefix` before each).
fn set_adapters(model: &HubModel, tensors: &HashMap<String, Tensor>, prefix: &str) {
    let family = model.config().family;
    for (name, var) in model.named_vars() {
        let key = format!("{prefix}base_model.model.{}", peft_module(family, name));
        let t = tensors
            .get(&key)
            .unwrap_or_else(|| panic!("no {key} among {:?}", tensors.keys()));
        var.set(&t.to_dtype(var.dtype()).unwrap()).unwrap();
    }
}

/// One parity fixture: the model, its batch, PEFT's f32 and bf16 values.
struct Fixture {
    name: &'static str,
    spec: ModelSpec,
    batch: TokenBatch,
    f32: HashMap<String, Tensor>,
    bf16: HashMap<String, Tensor>,
}

impl Fixture {
    fn load(name: &'static str) -> Fixture {
        let values = |kind: &str| fixture_values(&format!("{name}.{kind}.safetensors"));
        Fixture {
            name,
            spec: fixture_spec(name),
            batch: reference_batch(&values("ref")),
            f32: values("lora"),
            bf16: values("lora.bf16"),
        }
    }

    /// The model with the fixture's adapters (r 4, α 8) in `dtype`.
    fn model(&self, dtype: DType) -> HubModel {
        let lora = lora(&self.spec, 4, 8, BasePrecision::Bf16);
        let files = Some(self.spec.files.as_slice());
        let model = build_model_with(
            &self.spec.config,
            files,
            dtype,
            &Device::Cpu,
            0,
            Some(&lora),
        )
        .unwrap();
        set_adapters(&model, &self.f32, "lora.");
        model
    }
}

const FIXTURES: [&str; 7] = [
    "gpt2", "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
];

/// The adapted models' logits, loss and adapter gradients against PEFT's:
/// in f32 within 1e-5 of the largest logit, of the loss, and of each
/// gradient's largest element; in bf16 (the model and adapters rounded to
/// bf16, as PEFT's bf16 run) the loss within 0.5% of PEFT's f32 value, and
/// the logits and each gradient as close to PEFT's f32 values as twice
/// PEFT's own bf16 values are, plus 1% of the largest (the bounds of the
/// full-model parity tests, `tests/train_models.rs`; the fixtures' adapters
/// are large, N(0, 0.2²), so their bf16 roundings weigh more than there).
#[test]
fn forward_and_adapter_gradients_equal_peft_in_f32_and_bf16() {
    for f in FIXTURES.map(Fixture::load) {
        let family = f.spec.config.family;
        let peft = |name: &str| format!("grad.base_model.model.{}", peft_module(family, name));
        let want_logits = &f.f32["logits"];
        let want_loss = f.f32["loss"].to_vec1::<f32>().unwrap()[0];
        let bf16_loss = f.bf16["loss"].to_vec1::<f32>().unwrap()[0];
        for dtype in [DType::F32, DType::BF16] {
            let model = f.model(dtype);
            // What the model computes: Gemma's attention composed only, Gemma
            // 2's capped head not in chunks.
            let config = &f.spec.config;
            let attentions: &[Attention] = if config.flash_computes_it() {
                &[Attention::Composed, Attention::Flash]
            } else {
                &[Attention::Composed]
            };
            for &attention in attentions {
                // The loss whole, and in chunks of 5 rows of f32 logits (the
                // frozen head gets no gradient; the hidden states' does).
                let chunk = (5 * config.vocab.next_multiple_of(64) * 4) as u64;
                let mut chunkings = vec![None];
                if config.chunked_loss_computes_it() {
                    chunkings.push(Some(chunk));
                }
                for chunks in chunkings {
                    for policy in [Checkpointing::None, Checkpointing::Every(1)] {
                        let exec = Execution::default()
                            .attention(attention)
                            .checkpoint(policy)
                            .loss_chunks(chunks);
                        let policy = match chunks {
                            None => policy.to_string(),
                            Some(_) => format!("{policy}, chunked loss"),
                        };
                        let logits = model.logits(&f.batch, &exec).unwrap();
                        let logits_rel = max_diff(&logits, want_logits) / max_abs(want_logits);
                        let out = model.forward_backward(&f.batch, &exec).unwrap();
                        let loss_rel = (out.loss - want_loss).abs() / want_loss;
                        let mut worst = (0f32, String::new());
                        let mut worst_peft_bf16 = 0f32;
                        for ((name, _), got) in model.named_vars().iter().zip(&out.grads) {
                            let truth = &f.f32[&peft(name)];
                            let rel = rel_error(got, truth);
                            worst_peft_bf16 =
                                worst_peft_bf16.max(rel_error(&f.bf16[&peft(name)], truth));
                            if rel > worst.0 {
                                worst = (rel, name.clone());
                            }
                        }
                        eprintln!(
                        "{} {dtype:?} {attention} {policy}: logits {logits_rel:.2e}, loss {loss_rel:.2e}, \
                         adapter gradients up to {:.2e} ({}); PEFT bf16: loss {:.2e}, gradients up to {worst_peft_bf16:.2e}",
                        f.name,
                        worst.0,
                        worst.1,
                        (bf16_loss - want_loss).abs() / want_loss
                    );
                        let peft_bf16_logits =
                            max_diff(&f.bf16["logits"], want_logits) / max_abs(want_logits);
                        let (logits_tol, loss_tol, grad_tol) = match dtype {
                            DType::F32 => (1e-5, 1e-5, 1e-5),
                            _ => (
                                2.0 * peft_bf16_logits + 0.01,
                                5e-3,
                                2.0 * worst_peft_bf16 + 0.01,
                            ),
                        };
                        let what = format!("{} {dtype:?} {attention} {policy}", f.name);
                        assert!(logits_rel < logits_tol, "{what}: logits {logits_rel:e}");
                        assert!(loss_rel < loss_tol, "{what}: loss {loss_rel:e}");
                        assert!(
                            worst.0 < grad_tol,
                            "{what}: gradient of {} {:e}",
                            worst.1,
                            worst.0
                        );
                        assert_eq!(out.grads.len(), model.named_vars().len());
                    }
                }
            }
        }
    }
}

/// At step 0 (B = 0) a LoRA model computes the base model's logits exactly,
/// on a 16-bit base; on an NF4 base, those of the base with its blocks'
/// projections quantized (close to the base's), and its first gradients
/// are those of A zero and B non-zero.
#[test]
fn a_fresh_lora_model_computes_the_base_models_function() {
    for f in FIXTURES.map(Fixture::load) {
        let config = &f.spec.config;
        let files = Some(f.spec.files.as_slice());
        let exec = Execution::default();
        let base = build_model(config, files, DType::F32, &Device::Cpu, 0).unwrap();
        let want = base.logits(&f.batch, &exec).unwrap();
        for precision in [
            BasePrecision::Bf16,
            BasePrecision::Nf4,
            BasePrecision::Nf4Double,
        ] {
            let lora = lora(&f.spec, 4, 8, precision);
            let model =
                build_model_with(config, files, DType::F32, &Device::Cpu, 3, Some(&lora)).unwrap();
            let got = model.logits(&f.batch, &exec).unwrap();
            // The base with its blocks' projections as stored: exactly the
            // NF4 values where quantized.
            let want = match precision {
                BasePrecision::Bf16 => want.clone(),
                _ => quantized_base(&f.spec, precision == BasePrecision::Nf4Double)
                    .logits(&f.batch, &exec)
                    .unwrap(),
            };
            let rel = max_diff(&got, &want) / max_abs(&want);
            assert!(
                rel < 1e-6,
                "{} {precision}: a fresh adapter changes the logits by {rel}",
                f.name
            );
            let out = model.forward_backward(&f.batch, &exec).unwrap();
            for ((name, var), g) in model.named_vars().iter().zip(&out.grads) {
                let norm = max_abs(g);
                if name.contains("lora_A") {
                    assert_eq!(norm, 0.0, "{}: {name} (B = 0)", f.name);
                    // PEFT's Kaiming-uniform bound: 1/√in.
                    let bound = 1.0 / (var.dim(1).unwrap() as f32).sqrt();
                    assert!(max_abs(var.as_tensor()) <= bound);
                } else {
                    assert!(norm > 0.0, "{}: {name} gets no gradient", f.name);
                    assert_eq!(max_abs(var.as_tensor()), 0.0);
                }
            }
        }
    }
}

/// The base model of `spec` with every block projection replaced by its NF4
/// values (quantized `[out, in]` as the frozen weights are), in f32.
fn quantized_base(spec: &ModelSpec, double: bool) -> HubModel {
    use oomfix::strategies::lora::nf4;
    let gpt2 = spec.config.family == Family::Gpt2;
    let tensors = candle_core::safetensors::load(&spec.files[0], &Device::Cpu).unwrap();
    let mut out = HashMap::new();
    for (name, t) in tensors {
        let block = oomfix::ModelConfig::block_of(&name).is_some();
        if !block || t.rank() != 2 {
            out.insert(name, t);
            continue;
        }
        let w = if gpt2 {
            t.t().unwrap().contiguous().unwrap()
        } else {
            t
        };
        let values: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let q = nf4::quantize(&values);
        let absmax = if double {
            nf4::DoubleAbsmax::quantize(q.absmax()).dequantize()
        } else {
            q.absmax().to_vec()
        };
        let back = nf4::Nf4::from_parts(q.codes().to_vec(), absmax, values.len())
            .unwrap()
            .dequantize();
        let back = Tensor::from_vec(back, w.dims2().unwrap(), &Device::Cpu).unwrap();
        out.insert(
            name,
            if gpt2 {
                back.t().unwrap().contiguous().unwrap()
            } else {
                back
            },
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&out, &file).unwrap();
    build_model(&spec.config, Some(&[file]), DType::F32, &Device::Cpu, 0).unwrap()
}

/// `oomfix train` in `work` on the fine-tuning fixture, on the CPU in fp32.
fn train(work: &Path, args: &[&str]) -> (i32, String) {
    train_model(work, &finetune_dir(), args)
}

/// [`train`] of the model in `model` on the fine-tuning fixture's data.
fn train_model(work: &Path, model: &Path, args: &[&str]) -> (i32, String) {
    let out = common::train_on_finetune_text(work, model)
        .args([
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--global-batch",
            "2",
        ])
        .args(["--lr", "1e-2"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn adapter_file(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
}

/// The saved directory is PEFT's: its config and its tensors' names,
/// shapes and dtype (what CI checks without torch).
#[test]
fn train_lora_saves_a_peft_adapter_directory() {
    let work = tempfile::tempdir().unwrap();
    let (code, stderr) = train(
        work.path(),
        &["--lora", "4", "--steps", "3", "--save", "ad"],
    );
    assert_eq!(code, 0, "{stderr}");
    let ad = work.path().join("ad");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ad.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["task_type"], "CAUSAL_LM");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8);
    let mut targets: Vec<&str> = config["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    targets.sort();
    assert_eq!(
        targets,
        [
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj"
        ]
    );
    let base = config["base_model_name_or_path"].as_str().unwrap();
    assert_eq!(
        Path::new(base).canonicalize().unwrap(),
        finetune_dir().canonicalize().unwrap()
    );
    let tensors = adapter_file(&ad);
    // 2 blocks × 7 projections × (A, B); hidden 32, kv 2 × 8, MLP 64.
    assert_eq!(tensors.len(), 28);
    let shape = |n: &str| tensors[n].dims().to_vec();
    let p = "base_model.model.model.layers.1";
    assert_eq!(
        shape(&format!("{p}.self_attn.k_proj.lora_A.weight")),
        [4, 32]
    );
    assert_eq!(
        shape(&format!("{p}.self_attn.k_proj.lora_B.weight")),
        [16, 4]
    );
    assert_eq!(shape(&format!("{p}.mlp.down_proj.lora_A.weight")), [4, 64]);
    assert_eq!(shape(&format!("{p}.mlp.down_proj.lora_B.weight")), [32, 4]);
    assert!(tensors.values().all(|t| t.dtype() == DType::F32));
    // Trained: B is no longer zero.
    assert!(max_abs(&tensors[&format!("{p}.mlp.down_proj.lora_B.weight")]) > 0.0);
    assert!(!ad.join("model.safetensors").exists());
    assert!(ad.join("tokenizer.json").exists());
}

/// A run stopped and resumed takes the same steps as one that was not; a
/// merged model is the base plus the adapters and loads as a model.
#[test]
fn lora_resumes_as_full_fine_tuning_does_and_merges() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    // A 16-bit base, pinned: the merged weights are compared exactly.
    let train = |w: &Path, args: &[&str]| {
        let mut all = vec!["--base-precision", "bf16"];
        all.extend_from_slice(args);
        train(w, &all)
    };
    let (code, stderr) = train(w, &["--lora", "4", "--steps", "4", "--save", "straight"]);
    assert_eq!(code, 0, "{stderr}");
    let (code, stderr) = train(w, &["--lora", "4", "--steps", "2", "--save", "half"]);
    assert_eq!(code, 0, "{stderr}");
    let (code, stderr) = train(
        w,
        &[
            "--lora", "4", "--steps", "4", "--resume", "half", "--save", "resumed",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let (a, b) = (
        adapter_file(&w.join("straight")),
        adapter_file(&w.join("resumed")),
    );
    for (name, t) in &a {
        assert_eq!(max_diff(t, &b[name]), 0.0, "{name}");
    }
    // The merged model of the same run: W + (α/r)·B·A where adapted.
    let (code, stderr) = train(
        w,
        &["--lora", "4", "--steps", "4", "--save", "merged", "--merge"],
    );
    assert_eq!(code, 0, "{stderr}");
    let merged = w.join("merged");
    assert!(merged.join("config.json").exists());
    assert!(!merged.join("adapter_model.safetensors").exists());
    let spec = oomfix::inspect(&merged).unwrap();
    let base_spec = oomfix::inspect(&finetune_dir()).unwrap();
    assert_eq!(spec.config.hidden, base_spec.config.hidden);
    let m = candle_core::safetensors::load(merged.join("model.safetensors"), &Device::Cpu).unwrap();
    let base = candle_core::safetensors::load(base_spec.files[0].clone(), &Device::Cpu).unwrap();
    let module = "model.layers.0.self_attn.q_proj";
    let ad = |w: &str| a[&format!("base_model.model.{module}.lora_{w}.weight")].clone();
    let want = (&base[&format!("{module}.weight")]
        + ad("B").matmul(&ad("A")).unwrap().affine(2.0, 0.0).unwrap())
    .unwrap();
    let diff = max_diff(&m[&format!("{module}.weight")], &want);
    assert!(diff < 1e-6, "merged weight off by {diff}");
    assert_eq!(
        max_diff(&m["model.norm.weight"], &base["model.norm.weight"]),
        0.0
    );
    // The merged directory trains as a model; it is not a checkpoint of adapters.
    let (code, stderr) = train(w, &["--lora", "4", "--steps", "5", "--resume", "merged"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("merged LoRA model"), "{stderr}");
}

/// What LoRA training cannot do is refused in one line, exit 2, nothing written.
#[test]
fn bad_lora_runs_are_refused_in_one_line() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let (code, stderr) = train(w, &["--lora", "4", "--steps", "1", "--save", "ad"]);
    assert_eq!(code, 0, "{stderr}");
    let refused = |args: &[&str], says: &str| {
        let (code, stderr) = train(w, args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!w.join("out").exists(), "{args:?}");
    };
    refused(&["--lora", "0", "--save", "out"], "rank of 0");
    refused(&["--lora", "17", "--save", "out"], "at most 16");
    refused(
        &["--lora", "4", "--lora-targets", "c_attn", "--save", "out"],
        "unknown LoRA target `c_attn`",
    );
    refused(
        &["--base-precision", "nf4", "--save", "out"],
        "needs --lora RANK",
    );
    refused(&["--lora", "4", "--merge"], "needs --save DIR");
    refused(
        &[
            "--lora", "8", "--steps", "2", "--resume", "ad", "--save", "out",
        ],
        "rank, alpha and targets must match",
    );
    refused(
        &["--steps", "2", "--resume", "ad", "--save", "out"],
        "resume it with --lora",
    );
    // Adapters of another base model: the same shape, another directory.
    let other = w.join("other-base");
    std::fs::create_dir(&other).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(finetune_dir().join(f), other.join(f)).unwrap();
    }
    let (code, stderr) = train_model(
        w,
        &other,
        &[
            "--lora", "4", "--steps", "2", "--resume", "ad", "--save", "out",
        ],
    );
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("adapters are for the base model"),
        "{stderr}"
    );
    assert!(!w.join("out").exists());
}

/// `scripts/check-peft-adapter.py`, run with the Python `OOMFIX_PYTHON`
/// names (with torch, transformers and peft): `PeftModel.from_pretrained`
/// loads the saved adapter directory on its base model and gives the
/// logits oomfix computes with those adapters.
#[test]
#[ignore = "needs OOMFIX_PYTHON, a Python with torch, transformers and peft (CI's has none: the test above checks the files)"]
fn peft_loads_the_saved_adapters_and_gives_oomfix_logits() {
    let python = common::oomfix_python("torch, transformers and peft");
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let (code, stderr) = train(w, &["--lora", "4", "--steps", "3", "--save", "ad"]);
    assert_eq!(code, 0, "{stderr}");
    let dir = finetune_dir();
    let spec = oomfix::inspect(&dir).unwrap();
    let lora = lora(&spec, 4, 8, BasePrecision::Bf16);
    let model = fixture_model(&spec, Some(&lora));
    set_adapters(&model, &adapter_file(&w.join("ad")), "");
    let (file, _) = common::write_logits(&model, spec.config.vocab, w);
    let adapters = w.join("ad");
    common::run_python_check(
        &python,
        "check-peft-adapter.py",
        &[
            dir.as_os_str(),
            adapters.as_os_str(),
            "--logits".as_ref(),
            file.as_os_str(),
        ],
    );
}

#[test]
fn gpt2_family_is_named_in_peft_paths() {
    assert_eq!(
        peft_module(Family::Gpt2, "h.0.attn.c_attn.lora_A.weight"),
        "transformer.h.0.attn.c_attn.lora_A.weight"
    );
    assert_eq!(
        peft_module(Family::Llama, "model.layers.0.mlp.up_proj"),
        "model.layers.0.mlp.up_proj"
    );
}
