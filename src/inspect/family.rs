//! Architecture inference: family, dimensions and trainable tensors from
//! tensor names and shapes, with `config.json` filling in what shapes cannot say.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use super::config::HfConfig;
use super::header::is_float;
use crate::architecture::{self, Support};
use crate::{Error, Family, ModelConfig, ModelSettings, Result, TensorInfo};

/// What inference found.
#[derive(Debug)]
pub(crate) struct Inferred {
    /// The model's shape.
    pub config: ModelConfig,
    /// Trainable tensors: buffers and non-float tensors left out, tied weights once.
    pub tensors: Vec<TensorInfo>,
    /// What was assumed because neither shapes nor `config.json` said it.
    pub assumptions: Vec<String>,
}

/// Infers the model from all tensors in the file(s) at `source` and an optional
/// `config.json`; an error about the weights names `source`.
pub(crate) fn infer(
    source: &Path,
    all: Vec<TensorInfo>,
    hf: Option<&HfConfig>,
) -> Result<Inferred> {
    let t = Tensors::new(&all);
    let draft = if let Some(p) = t.gpt2_prefix() {
        gpt2(source, &t, p, hf)?
    } else if t.is_llama() {
        llama(source, &t, hf)?
    } else if let Some(p) = t.bert_prefix() {
        bert(source, &t, p, hf)?
    } else {
        generic(&t, hf)
    };
    let mut draft = draft;
    if let Some(c) = hf {
        draft.config.settings = c.settings.clone();
    }
    if let Some(m) = &mut draft.config.settings.moe {
        draft.config.intermediate = m.expert_intermediate;
        // transformers 5 saves the experts stacked.
        m.fused_experts = t
            .layer_shape("model.layers.", "mlp.experts.gate_up_proj")
            .is_some();
    }
    if draft.config.family == Family::Llama {
        // Biases present in the weights count even when `config.json` is silent.
        let s = &mut draft.config.settings;
        s.attention_bias |= !t
            .layer_ids("model.layers.", "self_attn.o_proj.bias")
            .is_empty();
        s.mlp_bias |= !t
            .layer_ids("model.layers.", "mlp.gate_proj.bias")
            .is_empty();
    }
    let family = draft.config.family;
    check_architecture(source, &draft.config, hf)?;
    if let Some(hf) = hf {
        let notes = super::config::rules::check(hf, &draft.config)?;
        draft.assumptions.extend(notes);
    }
    check_tensors(source, &draft, &all)?;
    let tensors = all
        .into_iter()
        .filter(|x| {
            is_float(&x.dtype)
                && !is_buffer(family, &x.name)
                && !draft.tied_copies.contains(&x.name)
        })
        .collect();
    Ok(Inferred {
        config: draft.config,
        tensors,
        assumptions: draft.assumptions,
    })
}

/// A family's result before the trainable tensors are picked.
struct Draft {
    config: ModelConfig,
    /// Names of tensors that repeat a tied parameter (counted once).
    tied_copies: Vec<String>,
    assumptions: Vec<String>,
}

/// Tensors that are saved state, not parameters.
fn is_buffer(family: Family, name: &str) -> bool {
    architecture::is_buffer(family, &architecture::hub_name(family, name))
}

/// The family and architecture as messages name them: `llama (Qwen3ForCausalLM)`.
fn taken_for(config: &ModelConfig) -> String {
    match &config.settings.architecture {
        Some(arch) => format!("{} ({arch})", config.family),
        None => format!("{} (config.json names no architecture)", config.family),
    }
}

/// An architecture `config.json` names that oomfix implements must be the
/// family the tensors are: an input error naming both otherwise. One it
/// does not implement is left to [`ModelConfig::unimplemented`].
fn check_architecture(source: &Path, config: &ModelConfig, hf: Option<&HfConfig>) -> Result<()> {
    let (Some(hf), Some(arch)) = (hf, config.settings.architecture.as_deref()) else {
        return Ok(());
    };
    match architecture::support(arch) {
        Support::Implemented { family, .. } if family != config.family => {
            let found = match config.family {
                Family::Generic => "no family oomfix knows".to_string(),
                f => format!("a {f} model"),
            };
            Err(Error::input(
                source,
                format!(
                    "{} names {arch}, a {family} model, but the tensors are {found}",
                    hf.path.display()
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// Every tensor of the checkpoint is a parameter of the model oomfix takes
/// it for, with the shape the model needs, or one the model may leave
/// ([`architecture::may_leave`]): anything else is an input error naming the
/// tensors and the family, before anything is planned. Skipped for
/// [`Family::Generic`] and for architectures oomfix does not implement
/// (refused by name instead).
fn check_tensors(source: &Path, draft: &Draft, all: &[TensorInfo]) -> Result<()> {
    let c = &draft.config;
    let refused = c
        .settings
        .architecture
        .as_deref()
        .and_then(architecture::refusal)
        .is_some();
    if c.family == Family::Generic || refused {
        return Ok(());
    }
    let wanted: HashMap<String, Vec<usize>> = c.tensors().into_iter().collect();
    let mut unused = Vec::new();
    for t in all {
        let hub = architecture::hub_name(c.family, &t.name);
        match wanted.get(&hub) {
            Some(shape) if *shape != t.shape => {
                return Err(Error::input(
                    source,
                    format!(
                        "tensor {} has shape {:?}, but a {} model of this configuration needs {shape:?}",
                        t.name,
                        t.shape,
                        taken_for(c)
                    ),
                ));
            }
            Some(_) => {}
            None if draft.tied_copies.contains(&t.name)
                || architecture::may_leave(c.family, &hub, c.tied_embeddings) => {}
            None => unused.push(t.name.as_str()),
        }
    }
    if unused.is_empty() {
        return Ok(());
    }
    unused.sort_unstable();
    const SHOWN: usize = 6;
    let more = if unused.len() > SHOWN {
        format!(" and {} more", unused.len() - SHOWN)
    } else {
        String::new()
    };
    Err(Error::input(
        source,
        format!(
            "{} tensor{} the model would not use: {}{more}; oomfix took it for a {} model, which has no such parameters",
            unused.len(),
            if unused.len() == 1 { "" } else { "s" },
            unused[..unused.len().min(SHOWN)].join(", "),
            taken_for(c)
        ),
    ))
}

/// Name lookups over the file's tensors.
struct Tensors<'a> {
    by_name: HashMap<&'a str, &'a [usize]>,
}

impl<'a> Tensors<'a> {
    fn new(all: &'a [TensorInfo]) -> Self {
        Tensors {
            by_name: all
                .iter()
                .map(|t| (t.name.as_str(), t.shape.as_slice()))
                .collect(),
        }
    }

    fn shape(&self, name: &str) -> Option<&'a [usize]> {
        self.by_name.get(name).copied()
    }

    /// Rows and columns of a 2-D tensor.
    fn matrix(&self, name: &str) -> Option<(usize, usize)> {
        match self.shape(name)? {
            &[r, c] => Some((r, c)),
            _ => None,
        }
    }

    /// Distinct `N` over names `{prefix}N.{suffix}`.
    fn layer_ids(&self, prefix: &str, suffix: &str) -> BTreeSet<usize> {
        self.by_name
            .keys()
            .filter_map(|n| layer_of(n, prefix, suffix))
            .collect()
    }

    /// Distinct `N` over names `{prefix}N.…`.
    fn layers(&self, prefix: &str) -> usize {
        self.layer_ids(prefix, "").len()
    }

    /// Shape of the lowest-numbered layer's `{prefix}N.{suffix}` tensor.
    fn layer_shape(&self, prefix: &str, suffix: &str) -> Option<&'a [usize]> {
        let first = self.layer_ids(prefix, suffix).into_iter().next()?;
        self.shape(&format!("{prefix}{first}.{suffix}"))
    }

    /// `""` or `"transformer."` when the names are GPT-2's.
    fn gpt2_prefix(&self) -> Option<&'static str> {
        ["transformer.", ""].into_iter().find(|p| {
            self.matrix(&format!("{p}wte.weight")).is_some()
                && !self
                    .layer_ids(&format!("{p}h."), "attn.c_attn.weight")
                    .is_empty()
        })
    }

    fn is_llama(&self) -> bool {
        self.matrix("model.embed_tokens.weight").is_some()
            && ["self_attn.q_proj.weight", "self_attn.qkv_proj.weight"]
                .iter()
                .any(|p| !self.layer_ids("model.layers.", p).is_empty())
    }

    /// `"bert."` or `""` when the names are BERT's.
    fn bert_prefix(&self) -> Option<&'static str> {
        ["bert.", ""].into_iter().find(|p| {
            self.matrix(&format!("{p}embeddings.word_embeddings.weight"))
                .is_some()
                && !self
                    .layer_ids(&format!("{p}encoder.layer."), "attention.self.query.weight")
                    .is_empty()
        })
    }
}

/// `N` when `name` is `{prefix}N.{suffix}` (any rest when `suffix` is empty).
fn layer_of(name: &str, prefix: &str, suffix: &str) -> Option<usize> {
    let (n, rest) = name.strip_prefix(prefix)?.split_once('.')?;
    let digits = !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    if !digits || !(suffix.is_empty() || rest == suffix) {
        return None;
    }
    n.parse().ok()
}

fn gpt2(source: &Path, t: &Tensors, p: &str, hf: Option<&HfConfig>) -> Result<Draft> {
    let names = LearnedPositions {
        family: Family::Gpt2,
        embed: format!("{p}wte.weight"),
        positions: format!("{p}wpe.weight"),
        blocks: format!("{p}h."),
        // Conv1D weights are [in, out].
        mlp_in: ("mlp.c_fc.weight", 1),
        head: "lm_head.weight",
        qkv_bias: false,
    };
    learned_positions(source, t, hf, names)
}

/// Where a model with learned positions and as many key/value heads as
/// query heads (GPT-2, BERT) keeps what its shape is read from.
struct LearnedPositions {
    family: Family,
    /// The token embedding (vocabulary × hidden).
    embed: String,
    /// The position embedding (positions × hidden).
    positions: String,
    /// The prefix of the numbered blocks.
    blocks: String,
    /// The MLP's first projection under each block, and the dimension of
    /// its shape that is the intermediate size.
    mlp_in: (&'static str, usize),
    /// The output head, tied to the embedding where absent.
    head: &'static str,
    qkv_bias: bool,
}

/// The draft of a [`LearnedPositions`] model: the intermediate size is
/// assumed 4 × hidden and the heads 64 wide where neither the tensors nor
/// `config.json` say.
fn learned_positions(
    source: &Path,
    t: &Tensors,
    hf: Option<&HfConfig>,
    names: LearnedPositions,
) -> Result<Draft> {
    let mut assumptions = Vec::new();
    let (vocab, hidden) = t.matrix(&names.embed).unwrap_or_default();
    let (mlp_in, dim) = names.mlp_in;
    let intermediate = t
        .layer_shape(&names.blocks, mlp_in)
        .and_then(|s| s.get(dim).copied());
    let heads = heads_or_assume(hf, hidden, &mut assumptions)?;
    let (tied, tied_copies) = tie(t, &names.embed, names.head, hf, true);
    let config = ModelConfig {
        family: names.family,
        layers: t.layers(&names.blocks),
        hidden,
        heads,
        kv_heads: heads,
        intermediate: assume_4x_unless(intermediate, source, hidden, &mut assumptions)?,
        vocab,
        max_positions: t.matrix(&names.positions).map_or(0, |(rows, _)| rows),
        tied_embeddings: tied,
        qkv_bias: names.qkv_bias,
        settings: ModelSettings::default(),
    };
    Ok(Draft {
        config,
        tied_copies,
        assumptions,
    })
}

fn llama(source: &Path, t: &Tensors, hf: Option<&HfConfig>) -> Result<Draft> {
    let mut assumptions = Vec::new();
    let embed = "model.embed_tokens.weight";
    let (vocab, hidden) = t.matrix(embed).unwrap_or_default();
    let blocks = "model.layers.";
    // Phi-3's fused qkv_proj: rows H·d for q, then KV·d each for k and v.
    let qkv_rows = t
        .layer_shape(blocks, "self_attn.qkv_proj.weight")
        .and_then(|s| s.first().copied());
    let q_rows = match hf.and_then(|c| Some((c.heads?, c.head_dim))) {
        Some((heads, Some(d))) => heads * d,
        _ => hidden,
    };
    let kv_rows = t
        .layer_shape(blocks, "self_attn.k_proj.weight")
        .and_then(|s| s.first().copied())
        .or_else(|| qkv_rows.map(|r| r.saturating_sub(q_rows) / 2))
        .unwrap_or(hidden);
    let (heads, kv_heads) = llama_heads(hf, hidden, kv_rows, &mut assumptions)?;
    let max_positions = hf.and_then(|c| c.max_positions).unwrap_or_else(|| {
        assumptions.push(format!(
            "context limit 4096 assumed: {}",
            not_said(hf, "max_position_embeddings")
        ));
        4096
    });
    let intermediate = t
        .layer_shape(blocks, "mlp.gate_proj.weight")
        .and_then(|s| s.first().copied())
        .or_else(|| {
            t.layer_shape(blocks, "mlp.gate_up_proj.weight")
                .and_then(|s| s.first().map(|r| r / 2))
        })
        // A mixture of experts: one expert's MLP.
        .or_else(|| {
            [
                "mlp.experts.0.gate_proj.weight",
                "block_sparse_moe.experts.0.w1.weight",
            ]
            .into_iter()
            .find_map(|name| t.layer_shape(blocks, name).and_then(|s| s.first().copied()))
        })
        .or_else(|| {
            t.layer_shape(blocks, "mlp.experts.down_proj")
                .and_then(|s| s.get(2).copied())
        });
    let (tied, tied_copies) = tie(t, embed, "lm_head.weight", hf, false);
    let config = ModelConfig {
        family: Family::Llama,
        layers: t.layers(blocks),
        hidden,
        heads,
        kv_heads,
        intermediate: assume_4x_unless(intermediate, source, hidden, &mut assumptions)?,
        vocab,
        max_positions,
        tied_embeddings: tied,
        qkv_bias: !t.layer_ids(blocks, "self_attn.q_proj.bias").is_empty(),
        settings: ModelSettings::default(),
    };
    Ok(Draft {
        config,
        tied_copies,
        assumptions,
    })
}

/// Query and key/value heads of a Llama-style model: from `config.json`, else
/// from the k_proj rows with an assumed head size.
fn llama_heads(
    hf: Option<&HfConfig>,
    hidden: usize,
    kv_rows: usize,
    assumptions: &mut Vec<String>,
) -> Result<(usize, usize)> {
    let Some((cfg, heads)) = hf.and_then(|c| Some((c, c.heads?))) else {
        let mut head_dim = if hidden >= 2048 && hidden.is_multiple_of(128) {
            128
        } else {
            64
        };
        // A size that splits both projections (tiny models' heads are smaller).
        while head_dim > 1 && !(hidden.is_multiple_of(head_dim) && kv_rows.is_multiple_of(head_dim))
        {
            head_dim /= 2;
        }
        let (heads, kv_heads) = ((hidden / head_dim).max(1), (kv_rows / head_dim).max(1));
        assumptions.push(format!(
            "head size {head_dim} assumed ({heads} heads, {kv_heads} key/value heads): {}",
            not_said(hf, "num_attention_heads")
        ));
        return Ok((heads, kv_heads));
    };
    let head_dim = match cfg.head_dim {
        Some(d) if d > 0 => d,
        _ if hidden.is_multiple_of(heads) => hidden / heads,
        _ => {
            return Err(cfg.error(format!(
                "num_attention_heads {heads} does not divide the weights' hidden size {hidden}"
            )))
        }
    };
    let kv_heads = cfg.kv_heads.unwrap_or(kv_rows / head_dim);
    if kv_heads * head_dim != kv_rows {
        return Err(cfg.error(format!(
            "{kv_heads} key/value heads of size {head_dim} do not match k_proj's {kv_rows} rows in the weights"
        )));
    }
    Ok((heads, kv_heads))
}

fn bert(source: &Path, t: &Tensors, p: &str, hf: Option<&HfConfig>) -> Result<Draft> {
    let names = LearnedPositions {
        family: Family::Bert,
        embed: format!("{p}embeddings.word_embeddings.weight"),
        positions: format!("{p}embeddings.position_embeddings.weight"),
        blocks: format!("{p}encoder.layer."),
        mlp_in: ("intermediate.dense.weight", 0),
        head: "cls.predictions.decoder.weight",
        qkv_bias: true,
    };
    let mut draft = learned_positions(source, t, hf, names)?;
    // The MLM decoder's bias is the same parameter as `cls.predictions.bias`.
    if t.shape("cls.predictions.bias").is_some()
        && t.shape("cls.predictions.decoder.bias").is_some()
    {
        draft
            .tied_copies
            .push("cls.predictions.decoder.bias".into());
    }
    Ok(draft)
}

/// An unknown architecture: `config.json`'s numbers where it has them, the
/// layer count from numbered names, zero elsewhere.
fn generic(t: &Tensors, hf: Option<&HfConfig>) -> Draft {
    let c = hf.cloned().unwrap_or_default();
    let heads = c.heads.unwrap_or(0);
    let config = ModelConfig {
        family: Family::Generic,
        layers: c
            .layers
            .unwrap_or_else(|| numbered_layers(t.by_name.keys().copied())),
        hidden: c.hidden.unwrap_or(0),
        heads,
        kv_heads: c.kv_heads.unwrap_or(heads),
        intermediate: c.intermediate.unwrap_or(0),
        vocab: c.vocab.unwrap_or(0),
        max_positions: c.max_positions.unwrap_or(0),
        tied_embeddings: c.tie_word_embeddings.unwrap_or(false),
        qkv_bias: false,
        settings: ModelSettings::default(),
    };
    let assumptions = vec![
        "unknown architecture (not GPT-2, Llama-style or BERT): only the tensors are known, estimates are generic"
            .to_string(),
    ];
    Draft {
        config,
        tied_copies: Vec::new(),
        assumptions,
    }
}

/// The most distinct numbers found at one numbered position of the names
/// (`blocks.N.…`, `encoder.layers.N.…`), or 0.
fn numbered_layers<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    let mut ids: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
    for name in names {
        let mut start = 0;
        for segment in name.split('.') {
            if let Ok(n) = segment.parse::<usize>() {
                ids.entry(&name[..start]).or_default().insert(n);
                break;
            }
            start += segment.len() + 1;
        }
    }
    ids.values().map(BTreeSet::len).max().unwrap_or(0)
}

/// Attention heads from `config.json`, else `hidden / 64` recorded as assumed.
fn heads_or_assume(
    hf: Option<&HfConfig>,
    hidden: usize,
    assumptions: &mut Vec<String>,
) -> Result<usize> {
    match hf.and_then(|c| Some((c, c.heads?))) {
        Some((_, heads)) if hidden.is_multiple_of(heads) => Ok(heads),
        Some((cfg, heads)) => Err(cfg.error(format!(
            "num_attention_heads {heads} does not divide the weights' hidden size {hidden}"
        ))),
        None => {
            let heads = (hidden / 64).max(1);
            assumptions.push(format!(
                "{heads} attention heads assumed (size 64): {}",
                not_said(hf, "num_attention_heads")
            ));
            Ok(heads)
        }
    }
}

/// The MLP size the weights give, else 4 × hidden recorded as assumed; a hidden
/// size too large for that (only a zero-element embedding can claim one) is an
/// error about the weights at `source`.
fn assume_4x_unless(
    found: Option<usize>,
    source: &Path,
    hidden: usize,
    assumptions: &mut Vec<String>,
) -> Result<usize> {
    if let Some(size) = found {
        return Ok(size);
    }
    let size = hidden.checked_mul(4).ok_or_else(|| {
        Error::input(
            source,
            format!("hidden size {hidden} is too large: assuming an MLP of 4 × hidden overflows"),
        )
    })?;
    assumptions.push(format!(
        "MLP size {size} (4 × hidden) assumed: no MLP weight found"
    ));
    Ok(size)
}

/// Whether the output head shares the embedding, and the head's name when the
/// file stores it as a copy to count once. A head of another shape is its own
/// parameter; one of the same shape is tied when `config.json` says so, else
/// when the family ties by default.
fn tie(
    t: &Tensors,
    embed: &str,
    head: &str,
    hf: Option<&HfConfig>,
    family_ties: bool,
) -> (bool, Vec<String>) {
    match t.shape(head) {
        None => (true, Vec::new()),
        Some(s)
            if Some(s) == t.shape(embed)
                && hf
                    .and_then(|c| c.tie_word_embeddings)
                    .unwrap_or(family_ties) =>
        {
            (true, vec![head.to_string()])
        }
        Some(_) => (false, Vec::new()),
    }
}

/// Why a `config.json` field is unknown, for assumption lines.
fn not_said(hf: Option<&HfConfig>, field: &str) -> String {
    match hf {
        Some(c) => format!("{} has no {field}", c.path.display()),
        None => "no config.json next to the weights".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, shape: &[usize]) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: "F32".into(),
        }
    }

    fn from_config(c: &ModelConfig) -> Vec<TensorInfo> {
        c.tensors().iter().map(|(n, s)| info(n, s)).collect()
    }

    #[test]
    fn layer_names() {
        assert_eq!(
            layer_of("model.layers.12.mlp.up_proj.weight", "model.layers.", ""),
            Some(12)
        );
        assert_eq!(
            layer_of("h.3.attn.c_attn.weight", "h.", "attn.c_attn.weight"),
            Some(3)
        );
        assert_eq!(
            layer_of("h.3.attn.c_proj.weight", "h.", "attn.c_attn.weight"),
            None
        );
        assert_eq!(layer_of("h.x.attn", "h.", ""), None);
        assert_eq!(layer_of("h..attn", "h.", ""), None);
        assert_eq!(
            numbered_layers(["a.blocks.0.w", "a.blocks.1.w", "a.blocks.1.b", "b.0"].into_iter()),
            2
        );
    }

    #[test]
    fn recovers_the_shapes_it_was_built_from() {
        for c in [ModelConfig::gpt2_small(), ModelConfig::bert_base()] {
            let got = infer(Path::new("m.safetensors"), from_config(&c), None).unwrap();
            assert_eq!(got.config, c);
            assert_eq!(got.tensors.len(), c.tensors().len());
        }
        // TinyLlama's GQA is visible with head size 64 (hidden 2048 would assume 128).
        let c = ModelConfig::tinyllama_1_1b();
        let hf = HfConfig {
            heads: Some(32),
            max_positions: Some(4096),
            ..Default::default()
        };
        assert_eq!(
            infer(Path::new("m.safetensors"), from_config(&c), Some(&hf))
                .unwrap()
                .config,
            c
        );
    }

    #[test]
    fn config_that_contradicts_the_shapes_is_an_error() {
        let c = ModelConfig::tinyllama_1_1b();
        let hf = HfConfig {
            heads: Some(32),
            kv_heads: Some(8),
            ..Default::default()
        };
        let err = infer(Path::new("m.safetensors"), from_config(&c), Some(&hf))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("8 key/value heads of size 64 do not match k_proj's 256 rows"),
            "{err}"
        );
        let hf = HfConfig {
            heads: Some(7),
            ..Default::default()
        };
        assert!(infer(
            Path::new("m.safetensors"),
            from_config(&ModelConfig::gpt2_small()),
            Some(&hf)
        )
        .is_err());
    }

    #[test]
    fn untied_head_of_another_shape_counts() {
        // A Llama's: a parameter of the model.
        let mut llama = ModelConfig::llama(2, 64, 1, 1, 128, 100, true);
        let mut t = from_config(&llama);
        t.push(info("lm_head.weight", &[100, 64]));
        let got = infer(Path::new("m.safetensors"), t.clone(), None).unwrap();
        assert!(!got.config.tied_embeddings);
        assert!(got.tensors.iter().any(|t| t.name == "lm_head.weight"));
        // Of another shape than the embedding: refused, naming the head.
        llama.vocab = 90;
        let mut t = from_config(&llama);
        t.push(info("lm_head.weight", &[100, 64]));
        let err = infer(Path::new("m.safetensors"), t, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("lm_head.weight has shape [100, 64]"), "{err}");
        // GPT-2's model always ties its head: a head of its own is refused.
        let mut t = from_config(&ModelConfig::gpt2(2, 64, 1));
        t.push(info("lm_head.weight", &[100, 64]));
        let err = infer(Path::new("m.safetensors"), t, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("1 tensor the model would not use: lm_head.weight")
                && err.contains("gpt2"),
            "{err}"
        );
    }

    #[test]
    fn tensors_of_another_family_are_refused_naming_them() {
        let mut c = ModelConfig::llama(2, 64, 2, 2, 128, 100, true);
        c.settings.qk_norm = true;
        let got = infer(Path::new("m.safetensors"), from_config(&c), None);
        let err = got.unwrap_err().to_string();
        assert!(
            err.contains("4 tensors the model would not use")
                && err.contains("model.layers.0.self_attn.k_norm.weight")
                && err.contains("llama (config.json names no architecture)"),
            "{err}"
        );
        // Named by config.json, they are the model's.
        let hf = HfConfig {
            heads: Some(2),
            settings: ModelSettings {
                architecture: Some("Qwen3ForCausalLM".into()),
                qk_norm: true,
                ..Default::default()
            },
            ..Default::default()
        };
        let got = infer(Path::new("m.safetensors"), from_config(&c), Some(&hf)).unwrap();
        assert_eq!(got.tensors.len(), c.tensors().len());
    }
}
