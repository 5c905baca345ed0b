//! RoPE frequencies of a Llama-style model as Hugging Face `transformers`
//! computes them (`modeling_rope_utils.py`): unscaled, and the `llama3`,
//! `linear`, `dynamic` (NTK) and `yarn` scalings of `rope_scaling`.

use std::f64::consts::PI;

use candle_core::Device;
use oomfix_strategies::nn::ops::RopeTables;

use super::layers::Packing;
use crate::{Error, ModelConfig, Result};

/// The tables of `freqs` (cos and sin multiplied by `factor`) for
/// `positions` positions on `device`: by position, or with a packing by
/// token, each token turned by its position in its document
/// ([`RopeTables::at_positions`]).
pub(crate) fn tables(
    freqs: &[f64],
    factor: f64,
    positions: usize,
    packing: Option<&Packing>,
    device: &Device,
) -> candle_core::Result<RopeTables> {
    let tables = RopeTables::from_inv_freq(positions, freqs, factor, device)?;
    match packing {
        Some(p) => tables.at_positions(&p.positions),
        None => Ok(tables),
    }
}

/// The inverse frequencies (`rotary_dim / 2` of them: the whole head, or
/// the part `partial_rotary_factor` says) for sequences of `s` tokens, and
/// the factor cos and sin are multiplied by (`yarn`'s and `longrope`'s
/// attention factor, else 1). A scaling without the numbers it needs is a
/// usage error naming them.
pub(crate) fn frequencies(config: &ModelConfig, s: usize) -> Result<(Vec<f64>, f64)> {
    let d = config.rotary_dim();
    let base = config.rope_theta();
    let plain = |base: f64| -> Vec<f64> {
        (0..d / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / d as f64))
            .collect()
    };
    let r = &config.settings.rope;
    let Some(kind) = config.settings.rope_scaling.as_deref() else {
        return Ok((plain(base), 1.0));
    };
    let need = |v: Option<f64>, name: &str| {
        v.filter(|x| *x > 0.0).ok_or_else(|| {
            Error::Usage(format!("rope_scaling {kind:?} needs a positive \"{name}\""))
        })
    };
    if kind == "yarn" {
        return Ok(yarn(config));
    }
    if kind == "longrope" {
        return longrope(config, s);
    }
    let factor = need(r.factor, "factor")?;
    match kind {
        "linear" => Ok((plain(base).into_iter().map(|f| f / factor).collect(), 1.0)),
        "dynamic" => {
            // Recomputed only for sequences past the model's context.
            let max = config.max_positions.max(1);
            if s <= max {
                return Ok((plain(base), 1.0));
            }
            let grown = factor * s as f64 / max as f64 - (factor - 1.0);
            let base = base * grown.powf(d as f64 / (d as f64 - 2.0));
            Ok((plain(base), 1.0))
        }
        "llama3" => {
            let low = need(r.low_freq_factor, "low_freq_factor")?;
            let high = need(r.high_freq_factor, "high_freq_factor")?;
            let old = r.original_max_positions.ok_or_else(|| {
                Error::Usage(format!(
                    "rope_scaling {kind:?} needs \"original_max_position_embeddings\""
                ))
            })? as f64;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            let freqs = plain(base)
                .into_iter()
                .map(|f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect();
            Ok((freqs, 1.0))
        }
        other => Err(Error::Usage(format!(
            "rope_scaling {other:?} is not implemented"
        ))),
    }
}

/// The unscaled inverse frequencies of the sliding-window blocks when they
/// have a RoPE base of their own (Gemma 3's `rope_local_base_freq`); `None`
/// when they share the global blocks' frequencies.
pub(crate) fn local_frequencies(config: &ModelConfig) -> Option<Vec<f64>> {
    let base = config.settings.gemma.as_ref()?.local_rope_theta?;
    let d = config.head_dim();
    Some(
        (0..d / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / d as f64))
            .collect(),
    )
}

/// `longrope` (Phi-3 128k, Phi-3.5, Phi-4-mini): each frequency divided by
/// its `long_factor` past the original context
/// (`original_max_position_embeddings`), else by its `short_factor`; the
/// attention factor `attention_factor`, else `√(1 + ln f / ln original)`
/// with `f` the `factor`, else the ratio of the contexts (1 when `f ≤ 1`).
fn longrope(config: &ModelConfig, s: usize) -> Result<(Vec<f64>, f64)> {
    let r = &config.settings.rope;
    let d = config.rotary_dim();
    let original = r.original_max_positions.filter(|&o| o > 0).ok_or_else(|| {
        Error::Usage("rope_scaling \"longrope\" needs \"original_max_position_embeddings\"".into())
    })?;
    let (name, factors) = if s > original {
        ("long_factor", &r.long_factor)
    } else {
        ("short_factor", &r.short_factor)
    };
    let factors = factors
        .as_ref()
        .filter(|f| f.len() == d / 2)
        .ok_or_else(|| {
            Error::Usage(format!(
                "rope_scaling \"longrope\" needs a \"{name}\" of {} numbers (one per rotated pair)",
                d / 2
            ))
        })?;
    let base = config.rope_theta();
    let freqs = factors
        .iter()
        .enumerate()
        .map(|(i, f)| 1.0 / (f * base.powf(2.0 * i as f64 / d as f64)))
        .collect();
    let factor = r
        .factor
        .filter(|&f| f > 0.0)
        .unwrap_or(config.max_positions as f64 / original as f64);
    let attention = match r.attention_factor {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    };
    Ok((freqs, attention))
}

/// `yarn`: frequencies blended between the original (fast rotations) and
/// the interpolated ones (slow rotations) over a linear ramp, and the
/// attention factor. The pre-training context is
/// `original_max_position_embeddings`, else `max_position_embeddings`; the
/// factor `factor`, else the ratio of the two contexts.
fn yarn(config: &ModelConfig) -> (Vec<f64>, f64) {
    let r = &config.settings.rope;
    let d = config.rotary_dim() as f64;
    let base = config.rope_theta();
    let original = r
        .original_max_positions
        .filter(|&o| o > 0)
        .unwrap_or(config.max_positions.max(1)) as f64;
    let factor = r
        .factor
        .filter(|&f| f > 0.0)
        .unwrap_or(config.max_positions as f64 / original);
    let mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention = match (r.attention_factor, r.mscale, r.mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m > 0.0 && all > 0.0 => {
            mscale(factor, m) / mscale(factor, all)
        }
        _ => mscale(factor, 1.0),
    };
    let beta_fast = r.beta_fast.filter(|b| *b > 0.0).unwrap_or(32.0);
    let beta_slow = r.beta_slow.filter(|b| *b > 0.0).unwrap_or(1.0);
    let correction =
        |rotations: f64| (d * (original / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln());
    let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
    if r.truncate.unwrap_or(true) {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001;
    }
    let freqs = (0..config.rotary_dim() / 2)
        .map(|i| {
            let extrapolated = 1.0 / base.powf(2.0 * i as f64 / d);
            let interpolated = extrapolated / factor;
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            interpolated * (1.0 - keep) + extrapolated * keep
        })
        .collect();
    (freqs, attention)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelSettings;

    fn config(kind: &str, rope: crate::RopeFactors) -> ModelConfig {
        let mut c = ModelConfig::llama(1, 64, 4, 4, 64, 64, true);
        c.settings = ModelSettings {
            rope_scaling: Some(kind.into()),
            rope,
            ..Default::default()
        };
        c
    }

    #[test]
    fn llama3_keeps_fast_divides_slow_and_blends_between() {
        let c = config(
            "llama3",
            crate::RopeFactors {
                factor: Some(8.0),
                low_freq_factor: Some(1.0),
                high_freq_factor: Some(4.0),
                original_max_positions: Some(64),
                ..Default::default()
            },
        );
        let (f, a) = frequencies(&c, 8).unwrap();
        let (plain, _) = frequencies(&ModelConfig::llama(1, 64, 4, 4, 64, 64, true), 8).unwrap();
        assert_eq!(a, 1.0);
        // head 16, base 1e4: wavelengths 2π·10^(i/2): 6.3, 19.9, 62.8, 199, …
        assert_eq!(f[0], plain[0]); // 6.3 < 64/4
        assert!(f[1] < plain[1] && f[1] > plain[1] / 8.0); // 16 ≤ 19.9 ≤ 64: blended
        assert!((f[4] - plain[4] / 8.0).abs() < 1e-15); // 628 > 64
    }

    /// The frequencies and attention factor of the configurations of the
    /// parity fixtures whose reference holds them (8 positions) against
    /// those transformers' rotary embedding held after its forward pass
    /// (computed in f32).
    #[test]
    fn frequencies_match_transformers() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/train");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let file = path
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or_default();
            let Some(name) = file.strip_suffix(".ref.safetensors") else {
                continue;
            };
            let reference =
                candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
            let Some(inv_freq) = reference.get("rope.inv_freq") else {
                continue;
            };
            let spec = crate::inspect(&dir.join(name)).unwrap();
            let want: Vec<f64> = inv_freq.to_vec1().unwrap();
            let factor: Vec<f64> = reference["rope.attention_scaling"].to_vec1().unwrap();
            let (got, got_factor) = frequencies(&spec.config, 8).unwrap();
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs(),
                    "{name}: frequency {i}: {g} vs {w}"
                );
            }
            assert!(
                (got_factor - factor[0]).abs() < 1e-6,
                "{name}: {got_factor} vs {factor:?}"
            );
            checked += 1;
        }
        // Qwen3, Llama 3, linear, dynamic and YaRN scaling, Phi-3 (plain
        // and LongRoPE), Phi-4-mini.
        assert_eq!(checked, 8, "fixtures with RoPE frequencies");
    }

    #[test]
    fn a_scaling_without_its_numbers_is_an_error() {
        let c = config("llama3", Default::default());
        let err = frequencies(&c, 8).unwrap_err().to_string();
        assert!(err.contains("factor"), "{err}");
    }
}
