//! Bounded reading and validation of a safetensors header.
//!
//! A safetensors file is an 8-byte little-endian length `n`, `n` bytes of JSON
//! (the header), then the data region. Only the first `8 + n` bytes are read,
//! and `n` is bounded by the file's length and [`MAX_HEADER_BYTES`] before
//! anything is allocated, so a 100 GB file inspects as fast as a small one.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

use super::io_error;
use crate::{Error, Result};

/// Largest header accepted (100 MiB); a larger length field means the file is
/// not safetensors or is corrupt.
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// One tensor of a validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Name in the file.
    pub name: String,
    /// Dtype as safetensors spells it (`F32`, `BF16`, …).
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range `[begin, end)` within the data region.
    pub data_offsets: (u64, u64),
}

impl TensorEntry {
    /// Bytes of data the tensor occupies.
    pub fn bytes(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }
}

/// A validated header: every tensor is well formed and the tensors tile the
/// data region exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensors in data-region order.
    pub tensors: Vec<TensorEntry>,
    /// The free-form `__metadata__` map (empty when absent).
    pub metadata: BTreeMap<String, String>,
}

/// Reads and validates the header of the safetensors file at `path`, reading
/// only its first `8 + n` bytes. Every problem is an [`Error::Input`] naming
/// `path`.
pub fn read_header(path: &Path) -> Result<Header> {
    let mut file = File::open(path).map_err(|e| io_error(path, &e))?;
    let file_len = file.metadata().map_err(|e| io_error(path, &e))?.len();
    let n = read_header_len(path, &mut file, file_len)?;
    // `n <= MAX_HEADER_BYTES` was checked, so the cast and allocation are bounded.
    let mut bytes = vec![0u8; n as usize];
    file.read_exact(&mut bytes)
        .map_err(|e| io_error(path, &e))?;
    parse_header(&bytes, file_len - 8 - n).map_err(|msg| Error::input(path, msg))
}

/// Reads the 8-byte length field and checks it against the file's length and
/// [`MAX_HEADER_BYTES`].
fn read_header_len(path: &Path, file: &mut File, file_len: u64) -> Result<u64> {
    if file_len == 0 {
        return Err(Error::input(path, "file is empty, not a safetensors file"));
    }
    if file_len < 8 {
        return Err(Error::input(
            path,
            format!("file is only {file_len} bytes, shorter than the 8-byte header length of a safetensors file"),
        ));
    }
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| io_error(path, &e))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES {
        return Err(Error::input(
            path,
            format!(
                "header length field says {n} bytes, over the {} MiB limit: not a safetensors file, or corrupt",
                MAX_HEADER_BYTES >> 20
            ),
        ));
    }
    let rest = file_len - 8;
    if n > rest {
        return Err(Error::input(
            path,
            format!(
                "header length {n} is larger than the file: only {rest} bytes follow the length field (truncated?)"
            ),
        ));
    }
    Ok(n)
}

/// Validates header bytes for a data region of `data_len` bytes; the error is
/// one line describing the first problem found.
pub fn parse_header(bytes: &[u8], data_len: u64) -> std::result::Result<Header, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        format!(
            "header is not UTF-8 (invalid byte at header offset {})",
            e.valid_up_to()
        )
    })?;
    let entries = parse_entries(text)?;
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            metadata = parse_metadata(&value)?;
        } else {
            let entry = parse_tensor(name, &value, data_len)?;
            tensors.push(entry);
        }
    }
    tensors.sort_by_key(|t| t.data_offsets);
    check_tiling(&tensors, data_len)?;
    Ok(Header { tensors, metadata })
}

/// The header's top-level entries in file order; errors on a key that appears twice.
fn parse_entries(text: &str) -> std::result::Result<Vec<(String, Value)>, String> {
    match serde_json::from_str::<Entries>(text) {
        Ok(Entries {
            duplicate: Some(name),
            ..
        }) => Err(format!(
            "duplicate tensor name {name:?} in header (JSON would silently keep only one)"
        )),
        Ok(Entries { entries, .. }) => Ok(entries),
        // A data error means the top level is not an object; it may still be invalid JSON.
        Err(e) if e.is_data() => match serde_json::from_str::<Value>(text) {
            Ok(v) => Err(format!(
                "header is JSON but not an object (it is {})",
                kind(&v)
            )),
            Err(e) => Err(format!("header is not valid JSON: {e}")),
        },
        Err(e) => Err(format!("header is not valid JSON: {e}")),
    }
}

/// A JSON object's entries in order, with the first repeated key noted (serde_json's
/// own map keeps the last value of a repeated key silently).
struct Entries {
    entries: Vec<(String, Value)>,
    duplicate: Option<String>,
}

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        deserializer.deserialize_map(EntriesVisitor)
    }
}

struct EntriesVisitor;

impl<'de> Visitor<'de> for EntriesVisitor {
    type Value = Entries;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Entries, A::Error> {
        let mut seen = HashSet::new();
        let mut entries = Vec::new();
        let mut duplicate = None;
        while let Some(key) = map.next_key::<String>()? {
            if seen.contains(&key) {
                duplicate.get_or_insert(key);
                map.next_value::<IgnoredAny>()?;
            } else {
                seen.insert(key.clone());
                entries.push((key, map.next_value()?));
            }
        }
        Ok(Entries { entries, duplicate })
    }
}

/// Checks that `__metadata__` maps strings to strings.
fn parse_metadata(value: &Value) -> std::result::Result<BTreeMap<String, String>, String> {
    let obj = value.as_object().ok_or_else(|| {
        format!(
            "\"__metadata__\" must be an object of strings, but it is {}",
            kind(value)
        )
    })?;
    obj.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            other => Err(format!(
                "\"__metadata__\" must map strings to strings, but {k:?} is {}",
                kind(other)
            )),
        })
        .collect()
}

/// Validates one tensor entry on its own (dtype, shape, offsets, size, bounds).
fn parse_tensor(
    name: String,
    value: &Value,
    data_len: u64,
) -> std::result::Result<TensorEntry, String> {
    let at = |msg: String| format!("tensor {name:?}: {msg}");
    let obj = value
        .as_object()
        .ok_or_else(|| at(format!("entry is {}, not an object", kind(value))))?;
    let field = |key: &str| obj.get(key).ok_or_else(|| at(format!("missing \"{key}\"")));
    let dtype_value = field("dtype")?;
    let dtype_name = dtype_value
        .as_str()
        .ok_or_else(|| at(format!("\"dtype\" is {}, not a string", kind(dtype_value))))?;
    let (dtype, size) = dtype_info(dtype_name).map_err(at)?;
    let shape = parse_shape(field("shape")?).map_err(at)?;
    let (begin, end) = parse_offsets(field("data_offsets")?).map_err(at)?;
    let bytes = shape
        .iter()
        .try_fold(size, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| {
            at(format!(
                "shape {shape:?} of {dtype} overflows a 64-bit byte count"
            ))
        })?;
    if end - begin != bytes {
        return Err(at(format!(
            "shape {shape:?} of {dtype} needs {bytes} bytes but data_offsets [{begin}, {end}] span {}",
            end - begin
        )));
    }
    if end > data_len {
        return Err(at(format!(
            "data_offsets [{begin}, {end}] reach past the end of the data region ({data_len} bytes; file truncated?)"
        )));
    }
    Ok(TensorEntry {
        name,
        dtype,
        shape,
        data_offsets: (begin, end),
    })
}

/// The canonical name and element size in bytes of a safetensors dtype.
pub fn dtype_info(name: &str) -> std::result::Result<(&'static str, u64), String> {
    const DTYPES: [(&str, u64); 18] = [
        ("BOOL", 1),
        ("U8", 1),
        ("I8", 1),
        ("F8_E5M2", 1),
        ("F8_E4M3", 1),
        ("F8_E8M0", 1),
        ("F8_E4M3FNUZ", 1),
        ("F8_E5M2FNUZ", 1),
        ("I16", 2),
        ("U16", 2),
        ("F16", 2),
        ("BF16", 2),
        ("I32", 4),
        ("U32", 4),
        ("F32", 4),
        ("F64", 8),
        ("I64", 8),
        ("U64", 8),
    ];
    if let Some(&(canonical, size)) = DTYPES.iter().find(|(d, _)| *d == name) {
        return Ok((canonical, size));
    }
    if matches!(name, "F4" | "F6_E2M3" | "F6_E3M2") {
        return Err(format!(
            "dtype {name} packs several values per byte and is not supported"
        ));
    }
    Err(format!("unknown dtype {:?}", brief_str(name)))
}

/// Whether a dtype holds floating-point values (trainable parameters).
pub fn is_float(dtype: &str) -> bool {
    dtype.starts_with('F') || dtype == "BF16"
}

fn parse_shape(value: &Value) -> std::result::Result<Vec<usize>, String> {
    let dims = value
        .as_array()
        .ok_or_else(|| format!("\"shape\" is {}, not a list of dimensions", kind(value)))?;
    dims.iter()
        .map(|d| match d {
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => {
                    usize::try_from(u).map_err(|_| format!("dimension {u} is too large"))
                }
                (None, Some(i)) => Err(format!("shape has a negative dimension {i}")),
                _ => Err(format!("shape has a non-integer dimension {n}")),
            },
            other => Err(format!(
                "shape has a dimension that is {}, not an integer",
                kind(other)
            )),
        })
        .collect()
}

fn parse_offsets(value: &Value) -> std::result::Result<(u64, u64), String> {
    let pair = match value.as_array().map(Vec::as_slice) {
        Some([b, e]) => b.as_u64().zip(e.as_u64()),
        _ => None,
    };
    let (begin, end) = pair.ok_or_else(|| {
        format!(
            "\"data_offsets\" must be two non-negative integers [begin, end], found {}",
            brief(value)
        )
    })?;
    if begin > end {
        return Err(format!(
            "data_offsets [{begin}, {end}] begin after they end"
        ));
    }
    Ok((begin, end))
}

/// Checks that tensors sorted by offset cover `[0, data_len)` without gaps or overlaps.
fn check_tiling(tensors: &[TensorEntry], data_len: u64) -> std::result::Result<(), String> {
    let mut covered = 0u64;
    let mut previous: Option<&TensorEntry> = None;
    for t in tensors {
        let (begin, end) = t.data_offsets;
        if begin < covered {
            // `covered > 0` implies a previous tensor.
            let p = previous
                .map(|p| (p.name.as_str(), p.data_offsets))
                .unwrap_or_default();
            return Err(format!(
                "tensors {:?} [{}, {}] and {:?} [{begin}, {end}] overlap in the data region",
                p.0, p.1 .0, p.1 .1, t.name
            ));
        }
        if begin > covered {
            return Err(format!(
                "gap of {} unused bytes in the data region before tensor {:?} (data_offsets [{begin}, {end}]); \
                 tensors must be contiguous",
                begin - covered,
                t.name
            ));
        }
        covered = end;
        previous = Some(t);
    }
    if covered != data_len {
        return Err(format!(
            "gap of {} unused bytes at the end of the data region: tensors cover {covered} of its {data_len} bytes",
            data_len - covered
        ));
    }
    Ok(())
}

/// "an object", "a string", … for messages.
pub(super) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A JSON value shortened for a one-line message.
fn brief(value: &Value) -> String {
    brief_str(&value.to_string())
}

fn brief_str(s: &str) -> String {
    const MAX: usize = 60;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, data_len: u64) -> std::result::Result<Header, String> {
        parse_header(json.as_bytes(), data_len)
    }

    #[test]
    fn valid_header_sorted_by_offset() {
        let h = parse(
            r#"{"__metadata__":{"format":"pt"},
                "b":{"dtype":"F16","shape":[2,3],"data_offsets":[16,28]},
                "a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},
                "z":{"dtype":"I64","shape":[0],"data_offsets":[28,28]}}  "#,
            28,
        )
        .unwrap();
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "z"]);
        assert_eq!(h.tensors[1].shape, [2, 3]);
        assert_eq!(h.tensors[1].bytes(), 12);
        assert_eq!(h.metadata["format"], "pt");
    }

    #[test]
    fn scalar_tensor_has_one_element() {
        let h = parse(
            r#"{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}"#,
            8,
        )
        .unwrap();
        assert_eq!(h.tensors[0].bytes(), 8);
    }

    #[test]
    fn each_problem_has_its_own_message() {
        let cases: [(&str, u64, &str); 14] = [
            ("", 0, "not valid JSON"),
            ("[1]", 0, "not an object (it is an array)"),
            (r#"{"a":3}"#, 0, "entry is a number, not an object"),
            (
                r#"{"a":{"shape":[],"data_offsets":[0,4]}}"#,
                4,
                "missing \"dtype\"",
            ),
            (
                r#"{"a":{"dtype":"Q4","shape":[],"data_offsets":[0,4]}}"#,
                4,
                "unknown dtype \"Q4\"",
            ),
            (
                r#"{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#,
                1,
                "not supported",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                4,
                "negative dimension -1",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#,
                4,
                "non-integer dimension 1.5",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#,
                4,
                "overflows",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
                4,
                "two non-negative integers",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}}"#,
                8,
                "begin after they end",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                4,
                "needs 8 bytes but",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                4,
                "past the end of the data region",
            ),
            (r#"{"__metadata__":{"n":1}}"#, 0, "\"n\" is a number"),
        ];
        for (json, data_len, want) in cases {
            let err = parse(json, data_len).unwrap_err();
            assert!(err.contains(want), "{json}: got {err:?}, want {want:?}");
        }
    }

    #[test]
    fn tiling_reports_overlap_gap_and_trailing_bytes() {
        let overlap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                          "b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
        assert!(parse(overlap, 6).unwrap_err().contains("overlap"));
        let gap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                      "b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}}"#;
        assert!(parse(gap, 10)
            .unwrap_err()
            .contains("gap of 2 unused bytes"));
        let short = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(parse(short, 9)
            .unwrap_err()
            .contains("gap of 5 unused bytes at the end"));
    }

    #[test]
    fn duplicate_names_are_refused() {
        let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                      "a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        assert!(parse(dup, 2)
            .unwrap_err()
            .contains("duplicate tensor name \"a\""));
    }

    #[test]
    fn invalid_utf8_is_named() {
        let err = parse_header(b"{\"a\xff\":1}", 0).unwrap_err();
        assert!(
            err.contains("not UTF-8 (invalid byte at header offset 3)"),
            "{err}"
        );
    }
}
