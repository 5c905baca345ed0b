//! The `--json` output. The schema is documented in the README.

use crate::memory::Breakdown;
use crate::search::{Attempt, SearchResult};
use crate::spec::ModelSpec;
use oomfix_strategies::Plan;
use serde_json::{json, Value};

fn plan(p: &Plan) -> Value {
    serde_json::to_value(p).expect("a plan serialises")
}

fn estimate(b: &Breakdown) -> Value {
    let mut v = serde_json::Map::new();
    for (name, bytes) in b.components() {
        v.insert(format!("{name}_bytes"), json!(bytes));
    }
    v.insert("peak_bytes".into(), json!(b.peak));
    v.insert("peak_phase".into(), json!(b.peak_phase));
    v.insert("host_bytes".into(), json!(b.host));
    Value::Object(v)
}

fn attempt(a: &Attempt, lower_bound: bool) -> Value {
    let mut v = plan(&a.plan);
    let o = v.as_object_mut().expect("plan is an object");
    o.insert("strategy".into(), json!(a.strategy));
    o.insert("estimated_bytes".into(), json!(a.estimate.peak));
    o.insert(
        "measured_bytes".into(),
        json!(a.measured.map(|m| m.peak_bytes)),
    );
    o.insert(
        "measured_reserved_bytes".into(),
        json!(a.measured.map(|m| m.reserved_bytes)),
    );
    o.insert(
        "out_of_memory".into(),
        json!(a.measured.map(|m| m.out_of_memory)),
    );
    o.insert("fits".into(), json!(a.fits));
    o.insert("lower_bound".into(), json!(lower_bound));
    o.insert("estimated_step_seconds".into(), json!(a.time.total));
    o.insert("tokens_per_second".into(), json!(a.tokens_per_second()));
    o.insert("measured_step_seconds".into(), json!(a.measured_seconds()));
    v
}

/// The model as the JSON output describes it.
pub fn model_json(spec: &ModelSpec) -> Value {
    let c = &spec.config;
    json!({
        "path": spec.source,
        "family": c.family,
        "parameters": spec.parameters(),
        "layers": c.layers,
        "hidden": c.hidden,
        "heads": c.heads,
        "kv_heads": c.kv_heads,
        "intermediate": c.intermediate,
        "vocab": c.vocab,
        "max_positions": c.max_positions,
        "tied_embeddings": c.tied_embeddings,
        "dtype": spec.dtype,
        "file_bytes": spec.file_bytes,
        "assumptions": spec.assumptions,
    })
}

/// The whole search as one JSON object.
pub fn search_json(spec: &ModelSpec, result: &SearchResult) -> Value {
    let shown = result.chosen().unwrap_or_else(|| result.closest());
    json!({
        "fits": result.fits(),
        "budget_bytes": result.budget_bytes,
        "host_budget_bytes": result.host_budget_bytes,
        "headroom_bytes": result.headroom.bytes(shown.estimate.peak),
        "margin_bytes": result.margin_bytes(),
        "pinned": result.pins.names(),
        "explored": result.explored,
        "device": result.target.to_string(),
        "model": model_json(spec),
        "plan": result.chosen().map(|a| plan(&a.plan)),
        "estimated_step_seconds": shown.time.total,
        "estimate": estimate(&shown.estimate),
        "closest": (!result.fits()).then(|| attempt(shown, result.is_lower_bound(shown))),
        "advice": result.advice,
        "notes": result.notes,
        "longest": result.longest,
        "skipped": result.skipped,
        "activations_modelled": result.activations_modelled,
        "candle_first_gradient_as_is": oomfix_strategies::model::first_gradient_stored_as_is(),
        "estimate_is_lower_bound": result.is_lower_bound(shown),
        "attempts": result
            .attempts
            .iter()
            .map(|a| attempt(a, result.is_lower_bound(a)))
            .collect::<Vec<_>>(),
    })
}

/// `oomfix inspect --json`.
pub fn inspect_json(spec: &ModelSpec) -> Value {
    let mut v = model_json(spec);
    let obj = v.as_object_mut().expect("object");
    obj.insert("tensors".into(), json!(spec.tensors.len()));
    let c = &spec.config;
    obj.insert("architecture".into(), json!(c.settings.architecture));
    obj.insert("head_dim".into(), json!(c.head_dim()));
    obj.insert("qk_norm".into(), json!(c.settings.qk_norm));
    obj.insert(
        "missing".into(),
        json!(c
            .unimplemented()
            .map(|(field, value, why)| format!("{field} {value}: {why}"))),
    );
    if c.family != crate::Family::Generic {
        let s = &c.settings;
        obj.insert(
            "settings".into(),
            json!({
                "norm_eps": c.norm_eps(),
                "rope_theta": (c.family == crate::Family::Llama).then(|| c.rope_theta()),
                "rope_scaling": s.rope_scaling,
                "hidden_act": c.hidden_act(),
                "sliding_window": s.sliding_window,
                "attention_bias": s.attention_bias,
                "mlp_bias": s.mlp_bias,
                "eos_token_id": s.eos_token_id,
            }),
        );
    }
    v
}
