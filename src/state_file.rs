//! The tensor files of a saved training directory ([`crate::train::saved`]:
//! what `--save` writes and `--resume` reads; a "checkpoint" to users, not
//! activation checkpointing): `.safetensors` files of named tensors whose
//! `__metadata__` carries a format tag and a SHA-256 of the contents.
//!
//! The file is a standard safetensors file (any safetensors reader opens it);
//! what the tensors mean is up to the writer ([`crate::train::saved`] lists
//! its names). Metadata entries written here:
//!
//! * `format`: `oomfix-checkpoint` ([`write()`]; `optimizer.safetensors`) or
//!   the caller's (`pt` for `model.safetensors`, [`write_safetensors`]);
//! * `format_version`: [`VERSION`] (`oomfix-checkpoint` only);
//! * `sha256`: 64 lowercase hex digits of the SHA-256 of, for each tensor in file
//!   order, its name, a zero byte, its header entry as JSON (dtype, shape, data
//!   offsets), a zero byte and its data bytes; then, for each other metadata
//!   entry sorted by key, the key, a zero byte, the value and a zero byte. It
//!   covers everything in the file but the header's padding, so a truncated,
//!   damaged or edited file fails [`StateFile::open`].
//!
//! [`write()`] goes through [`write_atomic`]: a failed or interrupted write leaves
//! an existing checkpoint untouched. The data is written once: the header first
//! holds a placeholder hash of the same length, replaced once the data is hashed.

use crate::output::write_atomic;
use crate::{Error, Result};
use candle_core::safetensors::Load;
use candle_core::{Device, Tensor};
use safetensors::tensor::{Metadata, TensorInfo, TensorView};
use safetensors::{Dtype, View};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The `format` metadata value of an oomfix checkpoint.
pub const FORMAT: &str = "oomfix-checkpoint";
/// The `format_version` this build writes and reads.
pub const VERSION: &str = "1";
/// The metadata key of the integrity hash.
const HASH_KEY: &str = "sha256";

/// Hashes one tensor's name and header entry (its data bytes follow).
fn hash_entry(h: &mut Sha256, name: &str, info: &TensorInfo) -> Result<()> {
    let entry =
        serde_json::to_vec(info).map_err(|e| Error::Runtime(format!("tensor `{name}`: {e}")))?;
    h.update(name.as_bytes());
    h.update([0]);
    h.update(&entry);
    h.update([0]);
    Ok(())
}

/// The header of a safetensors file: its length and what it says.
fn read_header(file: &mut File) -> std::result::Result<(usize, Metadata), String> {
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| e.to_string())?;
    let len = u64::from_le_bytes(len);
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    if len > 100_000_000 || 8 + len > size {
        return Err(format!("header length {len} in a file of {size} bytes"));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| e.to_string())?;
    let data_len = metadata
        .offset_keys()
        .iter()
        .filter_map(|n| metadata.info(n))
        .map(|i| i.data_offsets.1)
        .max()
        .unwrap_or(0);
    if 8 + len + data_len as u64 != size {
        return Err(format!(
            "{size} bytes where the header describes {}",
            8 + len + data_len as u64
        ));
    }
    Ok((len as usize, metadata))
}

/// The hash of the metadata entries (sorted by key), without the hash itself.
fn hash_metadata<'a>(h: &mut Sha256, entries: impl IntoIterator<Item = (&'a String, &'a String)>) {
    let sorted: BTreeMap<_, _> = entries
        .into_iter()
        .filter(|(k, _)| *k != HASH_KEY)
        .collect();
    for (k, v) in sorted {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(v.as_bytes());
        h.update([0]);
    }
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `tensors` (unique names) and `metadata` as a checkpoint at `path`,
/// atomically, adding the `format`, `format_version` and `sha256` entries.
/// Tensors on a device are copied to the host one at a time.
pub fn write(
    path: &Path,
    tensors: Vec<(String, Tensor)>,
    mut metadata: HashMap<String, String>,
) -> Result<()> {
    metadata.insert("format".into(), FORMAT.into());
    metadata.insert("format_version".into(), VERSION.into());
    write_safetensors(path, tensors, metadata)
}

/// Writes `tensors` (unique names) as a `.safetensors` file at `path`,
/// atomically, with `metadata` and a `sha256` entry computed as for a checkpoint.
pub fn write_safetensors(
    path: &Path,
    tensors: Vec<(String, Tensor)>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    write_safetensors_as(path, tensors, metadata, None)
}

/// [`write_safetensors`], each tensor converted to `dtype` (when given) as it
/// is written: one converted tensor at a time.
pub fn write_safetensors_as(
    path: &Path,
    mut tensors: Vec<(String, Tensor)>,
    metadata: HashMap<String, String>,
    dtype: Option<candle_core::DType>,
) -> Result<()> {
    let dtype_of = |t: &Tensor| dtype.unwrap_or(t.dtype());
    // safetensors' own order: larger alignment first, then by name.
    tensors.sort_by(|(a, ta), (b, tb)| {
        Dtype::from(dtype_of(tb))
            .cmp(&Dtype::from(dtype_of(ta)))
            .then(a.cmp(b))
    });
    let mut offset = 0;
    let infos: Vec<(String, TensorInfo)> = tensors
        .iter()
        .map(|(name, t)| {
            let len = t.elem_count() * dtype_of(t).size_in_bytes();
            let info = TensorInfo {
                dtype: dtype_of(t).into(),
                shape: t.dims().to_vec(),
                data_offsets: (offset, offset + len),
            };
            offset += len;
            (name.clone(), info)
        })
        .collect();
    let header = |hash: String| -> Result<Vec<u8>> {
        let mut meta = metadata.clone();
        meta.insert(HASH_KEY.into(), hash);
        let bad =
            |e: String| Error::Runtime(format!("cannot write checkpoint {}: {e}", path.display()));
        let m = Metadata::new(Some(meta), infos.clone()).map_err(|e| bad(e.to_string()))?;
        let mut json = serde_json::to_vec(&m).map_err(|e| bad(e.to_string()))?;
        json.resize(json.len().next_multiple_of(8), b' ');
        Ok(json)
    };
    let io = |e: std::io::Error| Error::Io {
        context: format!("writing {}", path.display()),
        source: e,
    };
    write_atomic(path, |file: &mut File| {
        let placeholder = header("0".repeat(64))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&(placeholder.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&placeholder).map_err(io)?;
        let mut h = Sha256::new();
        for ((name, t), (_, info)) in tensors.iter().zip(&infos) {
            let t = t.to_dtype(dtype_of(t))?;
            let bytes = View::data(&t);
            hash_entry(&mut h, name, info)?;
            h.update(&bytes);
            w.write_all(&bytes).map_err(io)?;
        }
        hash_metadata(&mut h, &metadata);
        let file = w.into_inner().map_err(|e| io(e.into_error()))?;
        let header = header(hex(&h.finalize()))?;
        if header.len() != placeholder.len() {
            return Err(Error::Runtime(format!(
                "cannot write checkpoint {}: its header changed length",
                path.display()
            )));
        }
        file.seek(SeekFrom::Start(8)).map_err(io)?;
        file.write_all(&header).map_err(io)
    })
}

/// A `.safetensors` file written by oomfix (`optimizer.safetensors`, `model.safetensors`), opened
/// and verified; tensors are read from it on demand, one at a time.
///
/// The file is read with plain reads, never mapped: verifying streams it
/// through the hash in small pieces and [`tensor`](Self::tensor) reads one
/// tensor's bytes, so opening a checkpoint adds at most one tensor to the
/// process's memory (a mapped file's pages would count in its resident set).
pub struct StateFile {
    path: PathBuf,
    file: File,
    header_len: usize,
    metadata: Metadata,
}

impl StateFile {
    /// Opens `path`, checks that it is a complete file with an integrity hash
    /// (an oomfix checkpoint of a version this build reads, or a model file
    /// written by oomfix), and verifies the hash. Every
    /// failure is an input error naming the file.
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |msg: String| Error::input(path, msg);
        let mut file = File::open(path).map_err(|e| bad(format!("cannot open checkpoint: {e}")))?;
        let (header_len, metadata) = read_header(&mut file).map_err(|e| {
            bad(format!(
                "not a complete checkpoint (truncated or damaged?): {e}"
            ))
        })?;
        let ck = StateFile {
            path: path.to_path_buf(),
            file,
            header_len,
            metadata,
        };
        match (
            ck.meta("format"),
            ck.meta("format_version"),
            ck.meta(HASH_KEY),
        ) {
            (Some(FORMAT), Some(VERSION), _) => {}
            (Some(FORMAT), v, _) => {
                return Err(bad(format!(
                    "checkpoint format version {}; this oomfix reads {VERSION}",
                    v.unwrap_or("?")
                )))
            }
            (Some("pt"), _, Some(_)) => {}
            _ => {
                return Err(bad(
                    "not an oomfix checkpoint (a .safetensors file without its metadata)".into(),
                ))
            }
        }
        ck.verify()?;
        Ok(ck)
    }

    fn verify(&self) -> Result<()> {
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        for name in self.metadata.offset_keys() {
            let info = self
                .metadata
                .info(&name)
                .expect("offset_keys lists known tensors");
            hash_entry(&mut h, &name, info)?;
            let (start, end) = self.span(info);
            let mut at = start;
            while at < end {
                let n = buf.len().min((end - at) as usize);
                self.read_at(&mut buf[..n], at)?;
                h.update(&buf[..n]);
                at += n as u64;
            }
        }
        if let Some(meta) = self.metadata.metadata() {
            hash_metadata(&mut h, meta);
        }
        if self.meta(HASH_KEY) != Some(hex(&h.finalize()).as_str()) {
            return Err(Error::input(
                &self.path,
                "checkpoint is corrupt: its contents do not match its SHA-256",
            ));
        }
        Ok(())
    }

    /// The byte range of a tensor's data in the file.
    fn span(&self, info: &TensorInfo) -> (u64, u64) {
        let start = (8 + self.header_len) as u64;
        (
            start + info.data_offsets.0 as u64,
            start + info.data_offsets.1 as u64,
        )
    }

    fn read_at(&self, buf: &mut [u8], at: u64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(buf, at).map_err(|e| {
            Error::input(
                &self.path,
                format!("not a complete checkpoint (truncated or damaged?): {e}"),
            )
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata entry.
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.metadata
            .metadata()
            .as_ref()?
            .get(key)
            .map(String::as_str)
    }

    /// The tensors' names, in file order.
    pub fn names(&self) -> Vec<String> {
        self.metadata.offset_keys()
    }

    /// Whether the checkpoint holds a tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.metadata.info(name).is_some()
    }

    /// The tensor `name`, read into host memory; an input error when missing.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self.metadata.info(name).ok_or_else(|| {
            Error::input(&self.path, format!("checkpoint has no tensor `{name}`"))
        })?;
        let (start, end) = self.span(info);
        let mut bytes = vec![0u8; (end - start) as usize];
        self.read_at(&mut bytes, start)?;
        let view = TensorView::new(info.dtype, info.shape.clone(), &bytes)
            .map_err(|e| Error::input(&self.path, format!("tensor `{name}`: {e}")))?;
        view.load(&Device::Cpu)
            .map_err(|e| Error::input(&self.path, format!("tensor `{name}`: {e}")))
    }

    /// The scalar tensor `name` as an i64 (the integers of a checkpoint).
    pub fn scalar_i64(&self, name: &str) -> Result<i64> {
        self.scalar(name, |t| {
            t.to_dtype(candle_core::DType::I64)?.to_scalar::<i64>()
        })
    }

    /// The scalar tensor `name` as an f64.
    pub fn scalar_f64(&self, name: &str) -> Result<f64> {
        self.scalar(name, |t| {
            t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()
        })
    }

    fn scalar<T>(&self, name: &str, get: impl Fn(&Tensor) -> candle_core::Result<T>) -> Result<T> {
        get(&self.tensor(name)?)
            .map_err(|e| Error::input(&self.path, format!("tensor `{name}` is not a scalar: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(dir: &Path) -> PathBuf {
        let p = dir.join("ck.safetensors");
        let tensors = vec![
            (
                "w".to_string(),
                Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap(),
            ),
            ("step".to_string(), Tensor::new(7i64, &Device::Cpu).unwrap()),
            (
                "h".to_string(),
                Tensor::new(&[1f32, 2.], &Device::Cpu)
                    .unwrap()
                    .to_dtype(candle_core::DType::BF16)
                    .unwrap(),
            ),
        ];
        write(
            &p,
            tensors,
            HashMap::from([("plan".to_string(), "a plan".to_string())]),
        )
        .unwrap();
        p
    }

    #[test]
    fn round_trips_tensors_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let ck = StateFile::open(&sample(dir.path())).unwrap();
        assert_eq!(ck.meta("plan"), Some("a plan"));
        assert_eq!(ck.meta("format"), Some(FORMAT));
        assert_eq!(
            ck.tensor("w").unwrap().to_vec2::<f32>().unwrap(),
            [[1., 2.], [3., 4.]]
        );
        assert_eq!(ck.scalar_i64("step").unwrap(), 7);
        assert_eq!(ck.tensor("h").unwrap().dtype(), candle_core::DType::BF16);
        assert!(ck
            .tensor("nope")
            .unwrap_err()
            .to_string()
            .contains("no tensor `nope`"));
        // A plain safetensors reader opens it too.
        let plain = candle_core::safetensors::load(ck.path(), &Device::Cpu).unwrap();
        assert_eq!(plain.len(), 3);
    }

    #[test]
    fn any_flipped_bit_or_truncation_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = sample(dir.path());
        let good = std::fs::read(&p).unwrap();
        let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&good[8..8 + header_len]).unwrap();
        // Every data byte, and the metadata's plan text.
        let plan_at = 8 + header.find("a plan").unwrap();
        let positions = (8 + header_len..good.len()).chain([plan_at]);
        for i in positions {
            let mut bad = good.clone();
            bad[i] ^= 0x04;
            std::fs::write(&p, &bad).unwrap();
            let e = StateFile::open(&p)
                .err()
                .unwrap_or_else(|| panic!("flip at byte {i} accepted"))
                .to_string();
            assert!(e.contains("ck.safetensors"), "{e}");
        }
        for len in [0, 7, 8 + header_len, good.len() - 1] {
            std::fs::write(&p, &good[..len]).unwrap();
            let e = StateFile::open(&p).err().unwrap().to_string();
            assert!(e.contains("not a complete checkpoint"), "{len}: {e}");
        }
    }

    #[test]
    fn a_plain_safetensors_file_is_not_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        let t = HashMap::from([("w", Tensor::new(&[1f32], &Device::Cpu).unwrap())]);
        candle_core::safetensors::save(&t, &p).unwrap();
        let e = StateFile::open(&p).err().unwrap().to_string();
        assert!(e.contains("not an oomfix checkpoint"), "{e}");
    }
}
