//! The tensors a model starts from: read by their Hub names from
//! safetensors files, or drawn as transformers initialises new parameters.

use crate::{Error, Family, ModelConfig, Result};
use candle_core::{Device, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};
use std::collections::HashMap;
use std::path::PathBuf;

/// Standard deviation of the random initialisation of matrices.
const INIT_STD: f32 = 0.02;

/// The Hub name of a tensor named `name` in a file of `family`.
fn hub_name(family: Family, name: &str) -> String {
    crate::architecture::hub_name(family, name)
}

/// The tensors of `config` read from `paths` (on the CPU, in the file's dtype).
/// A checkpoint without the objective's head ([`is_objective_head`]) gets
/// the head initialised from `seed`, with a warning naming its tensors, as
/// transformers does; any other missing tensor is an input error.
pub(super) fn load_tensors(
    config: &ModelConfig,
    paths: &[PathBuf],
    seed: u64,
) -> Result<Vec<(String, Tensor)>> {
    let first = paths
        .first()
        .ok_or_else(|| Error::Usage("no weights file given".into()))?;
    let wanted = config.tensors();
    let mut found: HashMap<String, (Tensor, &PathBuf)> = HashMap::new();
    let mut unused = Vec::new();
    for path in paths {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| Error::input(path, format!("cannot read safetensors: {e}")))?;
        for (file_name, tensor) in tensors {
            let name = hub_name(config.family, &file_name);
            if wanted.iter().any(|(w, _)| *w == name) {
                found.insert(name, (tensor, path));
            } else if !crate::architecture::may_leave(config.family, &name, config.tied_embeddings)
            {
                unused.push(file_name);
            }
        }
    }

    let missing_head: Vec<&str> = wanted
        .iter()
        .map(|(name, _)| name.as_str())
        .filter(|name| !found.contains_key(*name) && is_objective_head(config.family, name))
        .collect();
    let init = Init::new(seed);
    if !missing_head.is_empty() {
        tracing::warn!(
            "{} has no {}: the training objective's head is newly initialised \
             (N(0, 0.02) matrices, zero biases, unit norm scales), as transformers does",
            first.display(),
            missing_head.join(", ")
        );
    }
    let tensors = wanted
        .into_iter()
        .map(|(name, shape)| {
            let Some((tensor, path)) = found.remove(&name) else {
                if is_objective_head(config.family, &name) {
                    return Ok((name.clone(), init.tensor(&name, &shape)?));
                }
                let files = if paths.len() == 1 {
                    String::new()
                } else {
                    format!(" (in {} files)", paths.len())
                };
                return Err(Error::input(
                    first,
                    format!("missing tensor `{name}`{files}"),
                ));
            };
            if tensor.dims() != shape.as_slice() {
                return Err(Error::input(
                    path,
                    format!(
                        "tensor `{name}` has shape {:?}, the model needs {shape:?}",
                        tensor.dims()
                    ),
                ));
            }
            Ok((name, tensor))
        })
        .collect::<Result<Vec<_>>>()?;
    if !unused.is_empty() {
        unused.sort_unstable();
        return Err(Error::input(
            first,
            format!(
                "tensors the {} model would not use: {}; a checkpoint is trained whole or not at all",
                config.family,
                unused.join(", ")
            ),
        ));
    }
    Ok(tensors)
}

/// Random f32 tensors on the CPU for every tensor of `config`.
pub(super) fn random_tensors(config: &ModelConfig, seed: u64) -> Result<Vec<(String, Tensor)>> {
    let init = Init::new(seed);
    config
        .tensors()
        .into_iter()
        .map(|(name, shape)| Ok((name.clone(), init.tensor(&name, &shape)?)))
        .collect()
}

/// The initialisation of new parameters, as transformers' `_init_weights`
/// does it: matrices from N(0, 0.02²), norm scales ones, biases zeros.
///
/// A matrix is drawn in chunks of [`Init::CHUNK`] values, each from its own
/// generator seeded by the seed, the tensor's name and the chunk's index, so
/// the chunks are drawn in parallel and a tensor's values do not depend on
/// the order tensors are made in or on the number of threads (an 8B model's
/// eight billion values take seconds on a many-core host, not minutes).
struct Init {
    seed: u64,
}

impl Init {
    /// Values per independently seeded chunk of a matrix.
    const CHUNK: usize = 1 << 20;

    fn new(seed: u64) -> Self {
        Init { seed }
    }

    /// A new f32 tensor `name` of `shape` on the CPU.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        use rayon::prelude::*;
        let n = shape.iter().product();
        let values: Vec<f32> = if shape.len() >= 2 {
            let normal = Normal::new(0f32, INIT_STD).expect("a positive standard deviation");
            let base = name_seed(self.seed, name);
            let mut values = vec![0f32; n];
            values
                .par_chunks_mut(Self::CHUNK)
                .enumerate()
                .for_each(|(i, chunk)| {
                    let mut rng = StdRng::seed_from_u64(base ^ (i as u64).wrapping_mul(PHI));
                    chunk.iter_mut().for_each(|v| *v = normal.sample(&mut rng));
                });
            values
        } else if name.ends_with(".weight") {
            vec![1.0; n] // a norm's scale
        } else {
            vec![0.0; n] // a bias
        };
        Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
    }
}

/// 2⁶⁴ / φ, an odd constant that spreads consecutive indices over the seed space.
const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

/// A seed for tensor `name` from the run's `seed`: FNV-1a of the name, mixed
/// with the seed (stable across platforms and releases, unlike std's hasher).
fn name_seed(seed: u64, name: &str) -> u64 {
    let fnv = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    fnv ^ seed.wrapping_mul(PHI)
}

/// Whether `name` belongs to the head of the training objective rather than
/// to the model body: BERT's masked-LM head (`cls.*`, absent from
/// sentence-transformers checkpoints) or a causal LM's untied `lm_head`
/// (absent from a base model's checkpoint).
fn is_objective_head(family: Family, name: &str) -> bool {
    match family {
        Family::Bert => name.starts_with("cls."),
        _ => name == "lm_head.weight",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix of several chunks has the same values whatever the number of
    /// threads drawing them, and its chunks are not copies of one another.
    #[test]
    fn random_matrices_do_not_depend_on_the_thread_count() {
        let draw = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                Init::new(7)
                    .tensor("model.layers.0.mlp.up_proj.weight", &[3, Init::CHUNK])
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap()
            })
        };
        let one = draw(1);
        assert_eq!(one, draw(4));
        assert_ne!(one[0], one[1]);
        let std = (one[0].iter().map(|v| v * v).sum::<f32>() / Init::CHUNK as f32).sqrt();
        assert!((std / INIT_STD - 1.0).abs() < 0.01, "std {std}");
    }
}
