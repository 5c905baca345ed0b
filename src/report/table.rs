//! The human-readable output.

use crate::search::{Attempt, SearchResult};
use crate::spec::ModelSpec;
use crate::units::{format_bytes, group_digits};
use std::fmt::Write;

fn model_line(spec: &ModelSpec) -> String {
    let c = &spec.config;
    // A mixture of experts is labelled, its architecture named.
    let arch = match (&c.settings.architecture, &c.settings.moe) {
        (a, Some(m)) => format!(
            " ({}mixture of experts, {} experts, {} per token)",
            a.as_ref().map_or(String::new(), |a| format!("{a}: ")),
            m.experts,
            m.top_k
        ),
        (_, None) => String::new(),
    };
    let mut s = format!(
        "{}{arch}, {} parameters ({})",
        c.family,
        group_digits(spec.parameters()),
        spec.dtype
    );
    if c.layers > 0 {
        let _ = write!(
            s,
            ", {} layers, hidden {}, {} heads",
            c.layers, c.hidden, c.heads
        );
        if c.kv_heads != c.heads {
            let _ = write!(s, " ({} kv)", c.kv_heads);
        }
        let _ = write!(s, ", vocab {}", group_digits(c.vocab as u64));
    }
    s
}

/// One attempt's row; `lower_bound`: its estimate leaves activations out.
fn row(i: usize, a: &Attempt, lower_bound: bool) -> String {
    let p = &a.plan;
    let shard = if p.shard.world_size > 1 {
        format!("ZeRO-{}/{}", p.shard.stage, p.shard.world_size)
    } else {
        "-".into()
    };
    let measured = match a.measured {
        Some(m) if m.out_of_memory => "OOM".to_string(),
        Some(m) => format_bytes(m.peak_bytes.max(m.reserved_bytes)),
        None => "-".into(),
    };
    let time = match a.measured_seconds() {
        Some(m) => format!("{} / {}", seconds(a.time.total), seconds(m)),
        None => seconds(a.time.total),
    };
    format!(
        "{i:>3}  {:<18} {:>5}x{:<4} {:<9} {:<9} {:<12} {:<11} {:<9} {:>11} {:>11}  {:<4} {}\n",
        a.strategy,
        p.micro_batch,
        p.grad_accum,
        match p.lora {
            // LoRA: the compute precision, then the frozen base's storage.
            Some(lora) => format!("{}/{}", p.precision, lora.base),
            None => p.precision.as_str().to_string(),
        },
        p.attention.as_str(),
        p.checkpoint.to_string(),
        p.optimizer.as_str(),
        shard,
        format_bytes(a.estimate.peak),
        measured,
        match (a.fits, lower_bound) {
            (true, true) => "yes*",
            (true, false) => "yes",
            (false, _) => "no",
        },
        time,
    )
}

/// Seconds with three significant digits and a unit.
fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} µs", s * 1e6)
    }
}

fn breakdown(out: &mut String, a: &Attempt) {
    let _ = writeln!(
        out,
        "estimated peak {} at the {}, made of:",
        format_bytes(a.estimate.peak),
        a.estimate.peak_phase
    );
    for (name, bytes) in a.estimate.peak_components() {
        let share = 100.0 * bytes as f64 / a.estimate.peak.max(1) as f64;
        let _ = writeln!(
            out,
            "  {:<24} {:>11}  {share:>5.1}%",
            name.replace('_', " "),
            format_bytes(bytes)
        );
    }
    if a.estimate.host > 0 {
        let _ = writeln!(
            out,
            "host memory {} besides (master weights and AdamW state offloaded, staging for gradients and weights)",
            format_bytes(a.estimate.host)
        );
    }
}

/// The attempts table, the chosen plan (or the closest attempt) and its breakdown.
pub fn search_table(spec: &ModelSpec, result: &SearchResult) -> String {
    let mut out = String::new();
    let first = &result.attempts[0].plan;
    let _ = writeln!(out, "model   {}", spec.source);
    let _ = writeln!(out, "        {}", model_line(spec));
    for a in &spec.assumptions {
        let _ = writeln!(out, "        assumed: {a}");
    }
    let _ = writeln!(
        out,
        "budget  {} per device on {}; global batch {}, sequence length {}\n",
        format_bytes(result.budget_bytes),
        result.target,
        first.global_batch(),
        first.seq_len
    );
    if let Some(l) = &result.longest {
        let _ = match l.seq_len {
            Some(n) => writeln!(
                out,
                "longest that fits: {} tokens (of {}; {} searched)\n",
                group_digits(n as u64),
                group_digits(l.upper as u64),
                match l.trail.len() {
                    1 => "1 length".to_string(),
                    n => format!("{n} lengths"),
                }
            ),
            None => writeln!(out, "longest that fits: none, not even 1 token\n"),
        };
    }
    for note in &result.notes {
        let _ = writeln!(out, "NOTE    {note}\n");
    }
    if !result.activations_modelled {
        let _ = writeln!(
            out,
            "NOTE    activations are not modelled for this architecture: every estimate below\n        \
             is a lower bound (weights, gradients, optimizer state only), and `yes*` means\n        \
             fits on that lower bound alone (measure the model to know)\n"
        );
    }
    let _ = writeln!(
        out,
        "  #  {:<18} {:>10} {:<9} {:<9} {:<12} {:<11} {:<9} {:>11} {:>11}  fits step (est. / measured)",
        "strategy",
        "batch x acc",
        "precision",
        "attention",
        "checkpoint",
        "optimizer",
        "shard",
        "estimated",
        "measured"
    );
    for (i, a) in result.attempts.iter().enumerate() {
        out.push_str(&row(i, a, result.is_lower_bound(a)));
    }
    out.push('\n');
    match result.chosen() {
        Some(a) => {
            let _ = writeln!(out, "plan    {}", a.plan);
            let pct = 100.0 * a.peak() as f64 / result.budget_bytes.max(1) as f64;
            let label = if result.is_lower_bound(a) {
                "fits on a lower bound only (activations not modelled)"
            } else {
                "fits"
            };
            let _ = writeln!(
                out,
                "        {label}: {} of {} ({pct:.0}%), {} left; headroom kept {}",
                format_bytes(a.peak()),
                format_bytes(result.budget_bytes),
                format_bytes(result.margin_bytes().unwrap_or(0)),
                format_bytes(result.headroom.bytes(a.estimate.peak)),
            );
            let _ = writeln!(
                out,
                "        fastest of {} plans explored: {} per step estimated ({:.0} tokens/s){}",
                result.explored.max(1),
                seconds(a.time.total),
                a.tokens_per_second(),
                match result.pins.names().as_slice() {
                    [] => String::new(),
                    names => format!("; pinned: {}", names.join(", ")),
                }
            );
            breakdown(&mut out, a);
        }
        None => {
            let a = result.closest();
            let headroom = result.headroom.bytes(a.estimate.peak);
            let needed = a.peak() + headroom;
            let miss = needed.saturating_sub(result.budget_bytes);
            let _ = writeln!(out, "nothing fits. closest: {}", a.plan);
            if a.ran_out_of_memory() {
                let _ = writeln!(
                    out,
                    "        ran out of memory when measured ({} estimated, {} in use when it failed)",
                    format_bytes(a.estimate.peak),
                    format_bytes(a.measured.map_or(0, |m| m.peak_bytes))
                );
            } else if miss > 0 {
                let _ = writeln!(
                    out,
                    "        {} over the budget ({} needed: {} and a headroom of {})",
                    format_bytes(miss),
                    format_bytes(needed),
                    format_bytes(a.peak()),
                    format_bytes(headroom)
                );
            } else {
                let _ = writeln!(
                    out,
                    "        within the budget on the device ({} needed: {} and a headroom of {})",
                    format_bytes(needed),
                    format_bytes(a.peak()),
                    format_bytes(headroom)
                );
            }
            if let Some(host_budget) = result.host_budget_bytes.filter(|&h| a.estimate.host > h) {
                let _ = writeln!(
                    out,
                    "        {} over the host memory it may use ({} on the host, {} allowed: --host-budget)",
                    format_bytes(a.estimate.host - host_budget),
                    format_bytes(a.estimate.host),
                    format_bytes(host_budget)
                );
            }
            if let Some((name, _)) = a.estimate.peak_components().first() {
                let _ = writeln!(out, "        dominated by {}", name.replace('_', " "));
            }
            breakdown(&mut out, a);
            for advice in &result.advice {
                let _ = writeln!(out, "hint: {advice}");
            }
        }
    }
    out
}

/// `oomfix inspect` output.
pub fn inspect_text(spec: &ModelSpec) -> String {
    let c = &spec.config;
    let mut out = String::new();
    let _ = writeln!(out, "model          {}", spec.source);
    let _ = writeln!(out, "family         {}", c.family);
    if let Some(arch) = &c.settings.architecture {
        let _ = writeln!(out, "architecture   {arch}");
    }
    if let Some((field, value, why)) = c.unimplemented() {
        let _ = writeln!(out, "missing        {field} {value}: {why}");
    }
    let _ = writeln!(out, "parameters     {}", group_digits(spec.parameters()));
    let _ = writeln!(out, "tensors        {}", spec.tensors.len());
    let _ = writeln!(out, "dtype          {}", spec.dtype);
    let _ = writeln!(out, "data           {}", format_bytes(spec.file_bytes));
    if c.layers > 0 {
        let _ = writeln!(out, "layers         {}", c.layers);
        let _ = writeln!(out, "hidden         {}", c.hidden);
        let _ = writeln!(
            out,
            "heads          {} (kv {}, size {})",
            c.heads,
            c.kv_heads,
            c.head_dim()
        );
        let _ = writeln!(out, "intermediate   {}", c.intermediate);
        let _ = writeln!(out, "vocab          {}", c.vocab);
        let _ = writeln!(out, "max positions  {}", c.max_positions);
        let _ = writeln!(
            out,
            "tied embedding {}",
            if c.tied_embeddings { "yes" } else { "no" }
        );
    }
    if c.family != crate::Family::Generic {
        let s = &c.settings;
        let _ = writeln!(out, "norm eps       {:e}", c.norm_eps());
        let _ = writeln!(out, "activation     {}", c.hidden_act());
        if c.family == crate::Family::Llama {
            let _ = writeln!(out, "rope theta     {}", c.rope_theta());
            let _ = writeln!(
                out,
                "rope scaling   {}",
                s.rope_scaling.as_deref().unwrap_or("none")
            );
            let biases = match (s.attention_bias, c.qkv_bias, s.mlp_bias) {
                (true, _, true) => "attention, mlp",
                (true, _, false) => "attention",
                (false, true, true) => "q/k/v, mlp",
                (false, true, false) => "q/k/v",
                (false, false, true) => "mlp",
                (false, false, false) => "none",
            };
            let _ = writeln!(out, "biases         {biases}");
            if s.qk_norm {
                let _ = writeln!(out, "q/k norm       per head (RMSNorm)");
            }
            if let Some(m) = &s.moe {
                let _ = writeln!(
                    out,
                    "experts        {} per block, {} per token, MLP {} each (mixture of experts: \
                     planned, not trained)",
                    m.experts, m.top_k, m.expert_intermediate
                );
            }
            if let Some(g) = &s.gemma {
                let cap = |c: Option<f64>| c.map_or("none".to_string(), |c| c.to_string());
                let sliding = g.sliding_layers.iter().filter(|&&x| x).count();
                let _ = writeln!(
                    out,
                    "gemma          {}: norms scaled by 1 + w, 4 per block, embedding x sqrt(hidden), \
                     scores x {}^-1/2",
                    g.version, g.query_pre_attn_scalar
                );
                let _ = writeln!(
                    out,
                    "soft-caps      attention {}, logits {}",
                    cap(g.attn_softcap),
                    cap(g.final_softcap)
                );
                let local = g
                    .local_rope_theta
                    .map_or(String::new(), |t| format!(", RoPE base {t}"));
                let _ = writeln!(
                    out,
                    "sliding blocks {sliding} of {}{local}",
                    g.sliding_layers.len()
                );
            }
            if !c.flash_computes_it() {
                let _ = writeln!(
                    out,
                    "attention      composed (flash attention computes neither soft-caps nor sliding windows)"
                );
            }
        }
        if let Some(w) = s.sliding_window {
            let _ = writeln!(out, "sliding window {w}");
        }
        if let Some(e) = s.eos_token_id {
            let _ = writeln!(out, "eos token id   {e}");
        }
    }
    for a in &spec.assumptions {
        let _ = writeln!(out, "assumed        {a}");
    }
    out
}
