//! What a LoRA is, as PEFT's `LoraConfig` says it: the rank, the scale, the
//! projections it adapts and how the frozen base is stored.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

use crate::facts::{Linear, ModelFacts};
use crate::{Error, Result};

/// How the frozen base weights are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum BasePrecision {
    /// Unquantized, in the compute dtype: 16 bits under mixed precision
    /// (bf16, or f16 on a device without bf16), f32 under fp32 compute.
    #[serde(rename = "bf16")]
    Bf16,
    /// 4-bit NormalFloat, blocks of [`nf4::BLOCK`](super::nf4::BLOCK) values with an fp32 absmax
    /// each ([`nf4`](super::nf4)); embeddings, norms and the head 16-bit.
    #[serde(rename = "nf4")]
    Nf4,
    /// NF4 with the absmax values themselves quantized: 8 bits each, with an
    /// fp32 scale per [`nf4::DOUBLE_BLOCK`](super::nf4::DOUBLE_BLOCK) absmax values and one fp32 offset
    /// per weight.
    #[serde(rename = "nf4-dq")]
    Nf4Double,
}

impl BasePrecision {
    /// Name used on the command line and in output (`bf16`, `nf4`, `nf4-dq`).
    pub fn as_str(self) -> &'static str {
        match self {
            BasePrecision::Bf16 => "bf16",
            BasePrecision::Nf4 => "nf4",
            BasePrecision::Nf4Double => "nf4-dq",
        }
    }

    /// Whether the blocks' linear weights are 4-bit.
    pub fn is_quantized(self) -> bool {
        self != BasePrecision::Bf16
    }

    /// Bytes a weight of `elements` values takes in this form (16-bit:
    /// 2 per value).
    ///
    /// ```
    /// use oomfix_strategies::lora::BasePrecision;
    /// assert_eq!(BasePrecision::Bf16.weight_bytes(4096), 8192);
    /// assert_eq!(BasePrecision::Nf4.weight_bytes(4096), 2048 + 64 * 4);
    /// assert_eq!(BasePrecision::Nf4Double.weight_bytes(4096), 2048 + 64 + 4 + 4);
    /// ```
    pub fn weight_bytes(self, elements: u64) -> u64 {
        let codes = elements.div_ceil(2);
        let blocks = elements.div_ceil(super::nf4::BLOCK as u64);
        match self {
            BasePrecision::Bf16 => 2 * elements,
            BasePrecision::Nf4 => codes + 4 * blocks,
            BasePrecision::Nf4Double => {
                codes + blocks + 4 * blocks.div_ceil(super::nf4::DOUBLE_BLOCK as u64) + 4
            }
        }
    }
}

impl fmt::Display for BasePrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BasePrecision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "16" | "16-bit" => Ok(BasePrecision::Bf16),
            "nf4" => Ok(BasePrecision::Nf4),
            "nf4-dq" => Ok(BasePrecision::Nf4Double),
            _ => Err(format!(
                "unknown base precision `{s}` (expected bf16, nf4 or nf4-dq)"
            )),
        }
    }
}

/// The most distinct target names a [`Lora`] holds (and linear projections
/// per block [`ModelFacts`] describes).
pub const MAX_TARGETS: usize = 16;

/// The module names LoRA adapts, as PEFT's `target_modules` lists them
/// (`q_proj`, `c_attn`, `dense`): every linear projection of a block whose
/// name (the last part of its module path) is listed. Kept in the block's
/// order; serialized as a list of names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Targets {
    names: [Option<&'static str>; MAX_TARGETS],
}

impl Targets {
    /// The names, in order.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.names.iter().flatten().copied()
    }

    /// Whether a projection named `name` is adapted.
    pub fn contains(&self, name: &str) -> bool {
        self.names().any(|n| n == name)
    }

    /// The number of names.
    pub fn len(&self) -> usize {
        self.names().count()
    }

    /// Whether no name is listed.
    pub fn is_empty(&self) -> bool {
        self.names[0].is_none()
    }

    fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Targets> {
        let mut out = Targets::default();
        let mut n = 0;
        for name in names {
            let name = name.as_ref();
            if out.contains(name) {
                continue;
            }
            if n == MAX_TARGETS {
                return Err(Error::Config(format!(
                    "at most {MAX_TARGETS} LoRA target names"
                )));
            }
            out.names[n] = Some(crate::intern::intern(name.to_string()));
            n += 1;
        }
        Ok(out)
    }
}

impl Serialize for Targets {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_seq(self.names())
    }
}

impl<'de> Deserialize<'de> for Targets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(d)?;
        if names.is_empty() {
            return Err(serde::de::Error::custom("a LoRA needs at least one target"));
        }
        Targets::from_names(&names).map_err(serde::de::Error::custom)
    }
}

/// A plan's LoRA: rank-`rank` adapters scaled by `alpha / rank` on the
/// `targets`, over base weights stored as `base`.
///
/// Serialized as `{"rank":16,"alpha":32,"targets":["q_proj",…],"base":"nf4"}`
/// (the plan's `lora` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Lora {
    /// The adapters' rank `r`.
    pub rank: u32,
    /// PEFT's `lora_alpha`: the adapters' output is scaled by `alpha / rank`.
    pub alpha: u32,
    /// The adapted projections.
    pub targets: Targets,
    /// How the frozen base weights are stored.
    pub base: BasePrecision,
}

impl Lora {
    /// A LoRA of rank `rank` for the model `facts` describes: `alpha`
    /// defaults to twice the rank, `targets` to every linear projection of
    /// the blocks (PEFT's `all-linear`). Fails on a rank of 0 or above the
    /// narrowest target's width, an alpha of 0, a target the blocks do not
    /// have, or a model without linear projections.
    pub fn new(
        rank: u32,
        alpha: Option<u32>,
        targets: Option<&[&str]>,
        base: BasePrecision,
        facts: &ModelFacts,
    ) -> Result<Lora> {
        let known: Vec<&'static str> = facts.linears().fold(Vec::new(), |mut v, l| {
            if !v.contains(&l.name) {
                v.push(l.name);
            }
            v
        });
        if known.is_empty() {
            return Err(Error::Config(
                "the model has no linear projections in its blocks for LoRA to adapt".into(),
            ));
        }
        let targets = match targets {
            None => Targets::from_names(&known)?,
            Some(names) => {
                if names.is_empty() {
                    return Err(Error::Config("no LoRA target given".into()));
                }
                for &name in names {
                    if !known.contains(&name) {
                        return Err(Error::Config(format!(
                            "unknown LoRA target `{name}` (the blocks' linear projections: {})",
                            known.join(", ")
                        )));
                    }
                }
                Targets::from_names(names)?
            }
        };
        if rank == 0 {
            return Err(Error::Config(
                "a LoRA rank of 0 trains nothing (at least 1)".into(),
            ));
        }
        let narrowest = facts
            .linears()
            .filter(|l| targets.contains(l.name))
            .min_by_key(|l| l.inputs.min(l.outputs))
            .expect("at least one target");
        let width = narrowest.inputs.min(narrowest.outputs);
        if u64::from(rank) > width {
            return Err(Error::Config(format!(
                "a LoRA rank of {rank} exceeds the narrowest target, {} ({} x {}): at most {width}",
                narrowest.name, narrowest.outputs, narrowest.inputs
            )));
        }
        let alpha = alpha.unwrap_or(rank.saturating_mul(2));
        if alpha == 0 {
            return Err(Error::Config(
                "a LoRA alpha of 0 scales the adapters to nothing".into(),
            ));
        }
        Ok(Lora {
            rank,
            alpha,
            targets,
            base,
        })
    }

    /// The factor the adapters' output is scaled by: `alpha / rank`.
    pub fn scale(&self) -> f64 {
        f64::from(self.alpha) / f64::from(self.rank.max(1))
    }

    /// The linear projections of one block this LoRA adapts.
    pub fn adapted<'a>(&'a self, facts: &'a ModelFacts) -> impl Iterator<Item = Linear> + 'a {
        facts.linears().filter(|l| self.targets.contains(l.name))
    }
}

impl fmt::Display for Lora {
    /// `LoRA r16 α32 on 7 projections, nf4 base`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LoRA r{} α{} on {}, {} base",
            self.rank,
            self.alpha,
            self.targets.names().collect::<Vec<_>>().join("/"),
            self.base
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::testing::llama3_8b;

    #[test]
    fn bad_settings_are_refused() {
        let facts = llama3_8b();
        let new = |rank, alpha, targets: Option<&[&str]>| {
            Lora::new(rank, alpha, targets, BasePrecision::Bf16, &facts)
        };
        assert!(new(0, None, None)
            .unwrap_err()
            .to_string()
            .contains("rank of 0"));
        // k_proj is 1024 wide: the narrowest of all-linear.
        assert!(new(1024, None, None).is_ok());
        let e = new(1025, None, None).unwrap_err().to_string();
        assert!(e.contains("k_proj") && e.contains("at most 1024"), "{e}");
        assert!(new(2048, None, Some(&["q_proj"])).is_ok());
        let e = new(8, None, Some(&["qkv"])).unwrap_err().to_string();
        assert!(e.contains("`qkv`") && e.contains("q_proj, k_proj"), "{e}");
        assert!(new(8, Some(0), None).is_err());
        let empty = ModelFacts::new(10, 10, 1);
        assert!(Lora::new(8, None, None, BasePrecision::Nf4, &empty).is_err());
    }
}
