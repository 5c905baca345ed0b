//! The tensors a model starts from: read by their Hub names from
//! safetensors files, or drawn as transformers initialises new parameters.

use crate::{Error, Family, ModelConfig, Result};
use candle_core::safetensors::MmapedSafetensors;
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

/// The tensors a model starts from, made one at a time in the order of
/// [`ModelConfig::tensors`] as the model is built: read from memory-mapped
/// safetensors files, or drawn ([`Init`]). The host holds the tensor being
/// made beside the model built so far, never the whole model in f32 (32
/// GB for an 8B model).
pub(super) struct Tensors {
    wanted: std::vec::IntoIter<(String, Vec<usize>)>,
    /// The files, and by Hub name the file index, the file's own name and
    /// the shape of each wanted tensor found in them.
    files: Vec<(PathBuf, MmapedSafetensors)>,
    found: HashMap<String, (usize, String, Vec<usize>)>,
    init: Init,
}

impl Tensors {
    /// Random tensors for every tensor of `config`, as transformers
    /// initialises new parameters.
    pub(super) fn random(config: &ModelConfig, seed: u64) -> Tensors {
        Tensors {
            wanted: config.tensors().into_iter(),
            files: Vec::new(),
            found: HashMap::new(),
            init: Init::new(seed),
        }
    }

    /// The tensors of `config` in `paths`, checked before any is read: each
    /// is there with the shape the model needs, and every tensor of the
    /// files is one the model uses or may leave out. A checkpoint without
    /// the objective's head ([`is_objective_head`]) gets the head
    /// initialised from `seed`, with a warning naming its tensors, as
    /// transformers does; any other missing tensor is an input error.
    pub(super) fn read(config: &ModelConfig, paths: &[PathBuf], seed: u64) -> Result<Tensors> {
        let first = paths
            .first()
            .ok_or_else(|| Error::Usage("no weights file given".into()))?;
        let wanted = config.tensors();
        let mut files = Vec::with_capacity(paths.len());
        let mut found = HashMap::new();
        let mut unused = Vec::new();
        for (index, path) in paths.iter().enumerate() {
            // SAFETY: the mapping is read while the file is not changed, as
            // every reader of checkpoints in place assumes.
            let file = unsafe { MmapedSafetensors::new(path) }
                .map_err(|e| Error::input(path, format!("cannot read safetensors: {e}")))?;
            for (file_name, view) in file.tensors() {
                let name = hub_name(config.family, &file_name);
                if wanted.iter().any(|(w, _)| *w == name) {
                    found.insert(name, (index, file_name, view.shape().to_vec()));
                } else if !crate::architecture::may_leave(
                    config.family,
                    &name,
                    config.tied_embeddings,
                ) {
                    unused.push(file_name);
                }
            }
            files.push((path.clone(), file));
        }
        let mut missing_head = Vec::new();
        for (name, shape) in &wanted {
            match found.get(name) {
                None if is_objective_head(config.family, name) => missing_head.push(name.as_str()),
                None => {
                    let files = if paths.len() == 1 {
                        String::new()
                    } else {
                        format!(" (in {} files)", paths.len())
                    };
                    return Err(Error::input(
                        first,
                        format!("missing tensor `{name}`{files}"),
                    ));
                }
                Some((index, _, got)) if got != shape => {
                    return Err(Error::input(
                        &paths[*index],
                        format!("tensor `{name}` has shape {got:?}, the model needs {shape:?}"),
                    ));
                }
                Some(_) => {}
            }
        }
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
        if !missing_head.is_empty() {
            tracing::warn!(
                "{} has no {}: the training objective's head is newly initialised \
                 (N(0, 0.02) matrices, zero biases, unit norm scales), as transformers does",
                first.display(),
                missing_head.join(", ")
            );
        }
        Ok(Tensors {
            wanted: wanted.into_iter(),
            files,
            found,
            init: Init::new(seed),
        })
    }

    /// The next tensor by Hub name, on the CPU (a read one in the file's
    /// dtype, a drawn one in f32).
    fn make(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        match self.found.get(name) {
            Some((index, file_name, _)) => {
                let (path, file) = &self.files[*index];
                file.load(file_name, &Device::Cpu).map_err(|e| {
                    Error::input(path, format!("cannot read tensor `{file_name}`: {e}"))
                })
            }
            None => self.init.tensor(name, shape),
        }
    }
}

impl Iterator for Tensors {
    type Item = Result<(String, Tensor)>;

    fn next(&mut self) -> Option<Self::Item> {
        let (name, shape) = self.wanted.next()?;
        Some(self.make(&name, &shape).map(|t| (name, t)))
    }
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
