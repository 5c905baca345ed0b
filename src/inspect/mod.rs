//! Model inspection: the family, shape and trainable tensors of a model, read
//! from safetensors headers only (never the data), with `config.json` when it
//! sits next to the weights.

mod config;
mod family;
pub mod header;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{Error, ModelSpec, Result, TensorInfo};
use header::{kind, read_header, Header, TensorEntry, MAX_HEADER_BYTES};

/// File name of an unsharded model's weights inside its directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// File name of a sharded model's index inside its directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Inspects a model without reading its weights.
///
/// `path` is a `.safetensors` file, a sharded index (`*.json` with a
/// `weight_map` of tensor name → shard file), or a directory holding
/// [`INDEX_FILE`], else [`MODEL_FILE`], else `*.safetensors` files (taken
/// in name order).
/// `config.json` next to the weights, when present, supplies what shapes
/// cannot say (heads, context length, tying).
///
/// Every problem with the input is an [`Error::Input`] naming the offending
/// file and saying what is wrong in one line.
pub fn inspect(path: &Path) -> Result<ModelSpec> {
    let meta = fs::metadata(path).map_err(|e| io_error(path, &e))?;
    let ((entries, files), dir) = if meta.is_dir() {
        (read_dir(path)?, path.to_path_buf())
    } else if path.extension().is_some_and(|e| e == "json") {
        (read_index(path)?, parent(path))
    } else {
        (
            (read_header(path)?.tensors, vec![path.to_path_buf()]),
            parent(path),
        )
    };
    let hf = config::read(&dir)?;
    let file_bytes = entries.iter().map(TensorEntry::bytes).sum();
    let all = entries
        .into_iter()
        .map(|e| TensorInfo {
            name: e.name,
            shape: e.shape,
            dtype: e.dtype.to_string(),
        })
        .collect();
    let inferred = family::infer(path, all, hf.as_ref())?;
    if inferred.tensors.is_empty() {
        return Err(Error::input(
            path,
            "holds no floating-point tensors, so nothing to train",
        ));
    }
    Ok(ModelSpec {
        source: path.display().to_string(),
        files,
        dtype: most_common_dtype(&inferred.tensors),
        config: inferred.config,
        tensors: inferred.tensors,
        file_bytes,
        assumptions: inferred.assumptions,
    })
}

/// The dtype holding the most elements.
fn most_common_dtype(tensors: &[TensorInfo]) -> String {
    let mut elements: BTreeMap<&str, u64> = BTreeMap::new();
    for t in tensors {
        *elements.entry(&t.dtype).or_default() += t.elements();
    }
    elements
        .into_iter()
        .max_by_key(|&(_, n)| n)
        .map(|(d, _)| d.to_string())
        .unwrap_or_default()
}

/// A directory's weights: its index when it has one, else `model.safetensors`
/// when it has one (as `transformers` reads it: other files beside it, such
/// as a saved checkpoint's `optimizer.safetensors`, are not weights), else
/// every `*.safetensors` file.
fn read_dir(dir: &Path) -> Result<(Vec<TensorEntry>, Vec<PathBuf>)> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        return read_index(&index);
    }
    let single = dir.join(MODEL_FILE);
    if single.is_file() {
        return merge(dir, vec![(read_header(&single)?, single)]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| io_error(dir, &e))? {
        let path = entry.map_err(|e| io_error(dir, &e))?.path();
        if path.extension().is_some_and(|e| e == "safetensors") && path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(Error::input(
            dir,
            format!("directory holds no .safetensors weights (and no {INDEX_FILE})"),
        ));
    }
    files.sort();
    let headers = files
        .into_iter()
        .map(|f| Ok((read_header(&f)?, f)))
        .collect::<Result<Vec<_>>>()?;
    merge(dir, headers)
}

/// A sharded model: reads the header of every shard the index names and checks
/// that each tensor is where the index says.
fn read_index(index: &Path) -> Result<(Vec<TensorEntry>, Vec<PathBuf>)> {
    let text = read_small_text(index)?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| Error::input(index, format!("index is not valid JSON: {e}")))?;
    let weight_map = match value.get("weight_map") {
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(Error::input(
                index,
                format!(
                    "\"weight_map\" is {}, not an object of tensor name to shard file",
                    kind(other)
                ),
            ))
        }
        None => {
            return Err(Error::input(
                index,
                "no \"weight_map\" object: not a sharded safetensors index",
            ))
        }
    };
    let mut by_shard: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, shard) in weight_map {
        let shard = shard.as_str().ok_or_else(|| {
            Error::input(
                index,
                format!(
                    "weight_map entry {name:?} is {}, not a shard file name",
                    kind(shard)
                ),
            )
        })?;
        by_shard.entry(shard).or_default().push(name);
    }
    if by_shard.is_empty() {
        return Err(Error::input(index, "\"weight_map\" is empty"));
    }
    let dir = parent(index);
    let mut headers = Vec::new();
    for (shard, names) in by_shard {
        let path = dir.join(shard);
        if let Ok(false) = path.try_exists() {
            let msg = format!(
                "weight_map names shard {shard:?}, but {} does not exist",
                path.display()
            );
            return Err(Error::input(index, msg));
        }
        let header = read_header(&path)?;
        let present: HashSet<&str> = header.tensors.iter().map(|t| t.name.as_str()).collect();
        if let Some(missing) = names.iter().find(|n| !present.contains(*n)) {
            let msg = format!(
                "weight_map puts {missing:?} in {shard:?}, but that shard has no such tensor"
            );
            return Err(Error::input(index, msg));
        }
        headers.push((header, path));
    }
    merge(index, headers)
}

/// All tensors of several files, and the files; a name in two files is an error about `source`.
fn merge(
    source: &Path,
    headers: Vec<(Header, PathBuf)>,
) -> Result<(Vec<TensorEntry>, Vec<PathBuf>)> {
    let mut seen: HashMap<String, PathBuf> = HashMap::new();
    let mut all = Vec::new();
    let mut files = Vec::new();
    for (header, file) in headers {
        files.push(file.clone());
        for t in header.tensors {
            if let Some(first) = seen.insert(t.name.clone(), file.clone()) {
                let msg = format!(
                    "tensor {:?} is in both {} and {}",
                    t.name,
                    first.display(),
                    file.display()
                );
                return Err(Error::input(source, msg));
            }
            all.push(t);
        }
    }
    Ok((all, files))
}

/// A JSON side file (index, config), refused when over [`MAX_HEADER_BYTES`].
fn read_small_text(path: &Path) -> Result<String> {
    let file = File::open(path).map_err(|e| io_error(path, &e))?;
    let mut bytes = Vec::new();
    file.take(MAX_HEADER_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, &e))?;
    if bytes.len() as u64 > MAX_HEADER_BYTES {
        return Err(Error::input(
            path,
            format!("larger than {MAX_HEADER_BYTES} bytes: not a JSON index or config"),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::input(
            path,
            format!(
                "not UTF-8 (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// The directory holding `path` (`""`, the current directory, for a bare file name).
fn parent(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// An I/O failure on an input path, as an input error naming it.
fn io_error(path: &Path, e: &io::Error) -> Error {
    let msg = match e.kind() {
        io::ErrorKind::NotFound => "no such file or directory".to_string(),
        io::ErrorKind::PermissionDenied => "permission denied: cannot read it".to_string(),
        _ => format!("cannot read: {e}"),
    };
    Error::input(path, msg)
}
