//! LoRA adapters as PEFT names and saves them: the adapters' variable
//! names ([`adapter_names`]), their names in a saved adapter
//! ([`peft_name`]), `adapter_config.json` ([`peft_config`]) and the
//! adapter directory ([`save_peft`]).

use candle_core::Tensor;

use super::Lora;
use crate::{Error, Result};

/// The adapter's weights in a PEFT adapter directory.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// The adapter's configuration in a PEFT adapter directory ([`peft_config`]).
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";

/// The adapted module `module`'s variable names, as PEFT's `lora.Linear`
/// names them: `<module>.lora_A.weight` (`A`), then `<module>.lora_B.weight`
/// (`B`).
pub fn adapter_names(module: &str) -> [String; 2] {
    [
        format!("{module}.lora_A.weight"),
        format!("{module}.lora_B.weight"),
    ]
}

/// The name PEFT saves the base model's tensor or adapter variable `name`
/// (`model.layers.0.self_attn.q_proj.lora_A.weight`) under:
/// `base_model.model.<name>`.
pub fn peft_name(name: &str) -> String {
    format!("base_model.model.{name}")
}

/// One adapted projection as PEFT saves it: its module path in the base
/// model (`model.layers.0.self_attn.q_proj`), `A` `[r, in]` and `B` `[out, r]`.
pub type SavedAdapter = (String, Tensor, Tensor);

/// The names PEFT saves an adapted module's `A` and `B` under (the
/// [`peft_name`]s of its [`adapter_names`]): `base_model.model.<module>.lora_A.weight`
/// and `.lora_B.weight` (the module's path in the base model,
/// `model.layers.0.self_attn.q_proj`).
pub fn peft_names(module: &str) -> [String; 2] {
    adapter_names(module).map(|name| peft_name(&name))
}

/// PEFT's `adapter_config.json` for `lora` on the base model `base_model`
/// (a Hub name or path); `fan_in_fan_out` for weights stored `[in, out]`
/// (GPT-2's `Conv1D`).
pub fn peft_config(lora: &Lora, base_model: &str, fan_in_fan_out: bool) -> serde_json::Value {
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": lora.targets.names().collect::<Vec<_>>(),
        "bias": "none",
        "base_model_name_or_path": base_model,
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": true,
        "modules_to_save": null,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
    })
}

/// Writes a PEFT LoRA adapter directory `dir` for `lora` on the base model
/// `base_model` (a Hub name or path): [`ADAPTER_CONFIG_FILE`]
/// ([`peft_config`]) and [`ADAPTER_FILE`] with PEFT's names
/// ([`peft_names`]), in the tensors' dtype. Each file is written beside its
/// final name and renamed.
pub fn save_peft(
    dir: &std::path::Path,
    base_model: &str,
    lora: &Lora,
    fan_in_fan_out: bool,
    adapters: &[SavedAdapter],
) -> Result<()> {
    let io = |what: &str, e: std::io::Error| Error::Config(format!("{what}: {e}"));
    let mut tensors = std::collections::HashMap::new();
    for (path, a, b) in adapters {
        if a.dims2()?.0 != lora.rank as usize || b.dims2()?.1 != lora.rank as usize {
            return Err(Error::Config(format!(
                "{path}: adapter of A {:?} and B {:?} for rank {}",
                a.dims(),
                b.dims(),
                lora.rank
            )));
        }
        let [na, nb] = peft_names(path);
        tensors.insert(na, a.clone());
        tensors.insert(nb, b.clone());
    }
    let config = peft_config(lora, base_model, fan_in_fan_out);
    std::fs::create_dir_all(dir).map_err(|e| io(&dir.display().to_string(), e))?;
    let beside = |name: &str| dir.join(format!(".{name}.tmp"));
    candle_core::safetensors::save(&tensors, beside(ADAPTER_FILE))?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Config(e.to_string()))?;
    std::fs::write(beside(ADAPTER_CONFIG_FILE), text + "\n")
        .map_err(|e| io(ADAPTER_CONFIG_FILE, e))?;
    for name in [ADAPTER_FILE, ADAPTER_CONFIG_FILE] {
        std::fs::rename(beside(name), dir.join(name)).map_err(|e| io(name, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::BasePrecision;
    use super::*;
    use crate::lora::testing::{llama3_8b, max_diff};
    use candle_core::Device;

    #[test]
    fn peft_adapter_files() {
        let facts = llama3_8b();
        let lora = Lora::new(
            4,
            Some(8),
            Some(&["q_proj", "v_proj"]),
            BasePrecision::Nf4,
            &facts,
        )
        .unwrap();
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (4, 16), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, (8, 4), &dev).unwrap();
        let dir = std::env::temp_dir().join(format!("oomfix-peft-{}", std::process::id()));
        let adapters = vec![(
            "model.layers.0.self_attn.q_proj".to_string(),
            a.clone(),
            b.clone(),
        )];
        save_peft(&dir, "meta-llama/Meta-Llama-3-8B", &lora, false, &adapters).unwrap();
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["peft_type"], "LORA");
        assert_eq!(config["task_type"], "CAUSAL_LM");
        assert_eq!(config["r"], 4);
        assert_eq!(config["lora_alpha"], 8);
        assert_eq!(
            config["target_modules"],
            serde_json::json!(["q_proj", "v_proj"])
        );
        assert_eq!(
            config["base_model_name_or_path"],
            "meta-llama/Meta-Llama-3-8B"
        );
        assert_eq!(config["bias"], "none");
        assert_eq!(config["fan_in_fan_out"], false);
        let saved =
            candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &dev).unwrap();
        let mut names: Vec<&String> = saved.keys().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
            ]
        );
        let sa = &saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
        assert_eq!(sa.dims(), [4, 16]);
        assert_eq!(max_diff(sa, &a), 0.0);
        assert!(!dir.join(".adapter_model.safetensors.tmp").exists());
        // A rank that is not the adapters': refused, nothing more written.
        let wrong = vec![("m".to_string(), b.clone(), a.clone())];
        assert!(save_peft(&dir.join("wrong"), "m", &lora, false, &wrong).is_err());
        assert!(!dir.join("wrong").join("adapter_config.json").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
