//! Bounded reading and validation of a safetensors header.
//!
//! A safetensors file is an 8-byte little-endian length `n`, `n` bytes of JSON
//! (the header), then the data region. Only the first `8 + n` bytes are read,
//! and `n` is bounded by the file's length and [`MAX_HEADER_BYTES`] (the
//! reference implementation's limit) before anything is allocated, so a 100 GB
//! file inspects as fast as a small one.
//!
//! The JSON is validated as it is parsed, straight from the header's bytes,
//! with no tree of JSON values: each entry is checked where it lies and only
//! its result is kept, and `__metadata__` is kept as its own JSON text, moved
//! to the front of the header's buffer. Reading a header therefore holds its
//! `n` bytes plus the tensors' names, shapes and offsets.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::Path;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Number, Value};

use super::io_error;
use crate::{Error, Result};

/// Largest header accepted, in bytes: the limit of the reference `safetensors`
/// library. A larger length field means the file is not safetensors or is
/// corrupt.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Most dimensions a tensor's shape may have. Each dimension takes 8 bytes
/// once parsed but can take 2 bytes of JSON, so without a limit one shape
/// could hold four times the header's size.
pub const MAX_RANK: usize = 64;

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
    pub metadata: Metadata,
}

/// A header's `__metadata__` object, validated to map strings to strings and
/// kept as its JSON text, which is read again when asked for (a map of
/// strings would take many times the text's size for many short entries).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    /// The object's JSON text; empty when the header has no `__metadata__`.
    json: String,
}

impl Metadata {
    /// Whether the header has no `__metadata__` entries.
    pub fn is_empty(&self) -> bool {
        self.to_map().is_empty()
    }

    /// The value of `key`, the last one when the key is repeated.
    pub fn get(&self, key: &str) -> Option<String> {
        self.to_map().remove(key)
    }

    /// Every entry (the last value of a repeated key).
    pub fn to_map(&self) -> BTreeMap<String, String> {
        if self.json.is_empty() {
            return BTreeMap::new();
        }
        // Validated when the header was read.
        serde_json::from_str(&self.json).unwrap_or_default()
    }

    /// The object's JSON text as it appears in the header (`""` when absent).
    pub fn json(&self) -> &str {
        &self.json
    }
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
    let parsed = parse(&bytes, file_len - 8 - n).map_err(|msg| Error::input(path, msg))?;
    Ok(parsed.into_header(bytes))
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
                "header length field says {n} bytes, over the safetensors limit of {MAX_HEADER_BYTES} bytes: \
                 not a safetensors file, or corrupt"
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
    let parsed = parse(bytes, data_len)?;
    let json = parsed
        .metadata
        .map(|r| String::from_utf8_lossy(&bytes[r]).into_owned())
        .unwrap_or_default();
    Ok(Header {
        tensors: parsed.tensors,
        metadata: Metadata { json },
    })
}

/// A validated header whose metadata is still a range of the header's bytes.
struct Parsed {
    tensors: Vec<TensorEntry>,
    /// Where the `__metadata__` object lies in the header, when it has one.
    metadata: Option<Range<usize>>,
}

impl Parsed {
    /// The header, its metadata text moved to the front of `bytes` and the
    /// rest of `bytes` released, so that no second copy is made.
    fn into_header(self, mut bytes: Vec<u8>) -> Header {
        let json = match self.metadata {
            Some(r) => {
                let len = r.len();
                bytes.copy_within(r, 0);
                bytes.truncate(len);
                bytes.shrink_to_fit();
                // A whole JSON object cut from valid UTF-8 is valid UTF-8.
                String::from_utf8(bytes)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
            }
            None => String::new(),
        };
        Header {
            tensors: self.tensors,
            metadata: Metadata { json },
        }
    }
}

/// Parses and validates header bytes: JSON syntax, then duplicate names, then
/// each entry in file order, then the tiling of the data region.
fn parse(bytes: &[u8], data_len: u64) -> std::result::Result<Parsed, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        format!(
            "header is not UTF-8 (invalid byte at header offset {})",
            e.valid_up_to()
        )
    })?;
    let start = text.trim_start_matches(JSON_WHITESPACE);
    if !start.starts_with('{') {
        return Err(match serde_json::from_str::<IgnoredAny>(text) {
            Ok(_) => format!(
                "header is JSON but not an object (it is {})",
                raw_kind(start)
            ),
            Err(e) => format!("header is not valid JSON: {e}"),
        });
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let entries = de
        .deserialize_map(EntriesVisitor { text, data_len })
        .and_then(|entries| de.end().map(|()| entries))
        .map_err(|e| format!("header is not valid JSON: {e}"))?;
    let Entries {
        mut tensors,
        metadata,
        metadata_repeated_after,
        first_invalid,
    } = entries;
    if let Some(name) = first_duplicate(&tensors, metadata_repeated_after) {
        return Err(format!(
            "duplicate tensor name {name:?} in header (JSON would silently keep only one)"
        ));
    }
    if let Some(msg) = first_invalid {
        return Err(msg);
    }
    tensors.sort_by_key(|t| t.data_offsets);
    check_tiling(&tensors, data_len)?;
    Ok(Parsed { tensors, metadata })
}

const JSON_WHITESPACE: [char; 4] = [' ', '\t', '\n', '\r'];

/// The header's top-level entries, each validated as it is parsed.
struct Entries {
    /// Tensors in file order; an invalid entry is kept by name only, for the
    /// duplicate check.
    tensors: Vec<TensorEntry>,
    /// The range of the (first) `__metadata__` object in the header.
    metadata: Option<Range<usize>>,
    /// When `__metadata__` appears twice: how many tensors preceded the second.
    metadata_repeated_after: Option<usize>,
    /// The message of the first invalid entry in file order.
    first_invalid: Option<String>,
}

/// Visits the header object: the text is kept to locate `__metadata__` in it.
struct EntriesVisitor<'a> {
    text: &'a str,
    data_len: u64,
}

impl<'de> Visitor<'de> for EntriesVisitor<'de> {
    type Value = Entries;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Entries, A::Error> {
        let mut entries = Entries {
            tensors: Vec::new(),
            metadata: None,
            metadata_repeated_after: None,
            first_invalid: None,
        };
        while let Some(Key(name)) = map.next_key::<Key>()? {
            if name == "__metadata__" {
                if entries.metadata.is_some() {
                    map.next_value::<IgnoredAny>()?;
                    entries
                        .metadata_repeated_after
                        .get_or_insert(entries.tensors.len());
                    continue;
                }
                let raw: &'de RawValue = map.next_value()?;
                match check_metadata(raw.get()) {
                    Ok(()) => {
                        let begin = raw.get().as_ptr() as usize - self.text.as_ptr() as usize;
                        entries.metadata = Some(begin..begin + raw.get().len());
                    }
                    Err(msg) => {
                        entries.first_invalid.get_or_insert(msg);
                        entries.metadata = Some(0..0);
                    }
                }
                continue;
            }
            let raw: &'de RawValue = map.next_value()?;
            let mut entry = parse_tensor(raw.get(), self.data_len).unwrap_or_else(|msg| {
                entries
                    .first_invalid
                    .get_or_insert_with(|| format!("tensor {name:?}: {msg}"));
                TensorEntry {
                    name: String::new(),
                    dtype: "",
                    shape: Vec::new(),
                    data_offsets: (0, 0),
                }
            });
            entry.name = name.into_owned();
            entries.tensors.push(entry);
        }
        Ok(entries)
    }
}

/// An object key, borrowed from the header unless it holds escapes.
struct Key<'de>(std::borrow::Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> std::result::Result<Key<'de>, E> {
                Ok(Key(s.into()))
            }
            fn visit_str<E>(self, s: &str) -> std::result::Result<Key<'de>, E> {
                Ok(Key(s.to_owned().into()))
            }
            fn visit_string<E>(self, s: String) -> std::result::Result<Key<'de>, E> {
                Ok(Key(s.into()))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

/// The first tensor name, in file order, that an earlier entry already used
/// (`__metadata__` counts when it appears twice).
fn first_duplicate(
    tensors: &[TensorEntry],
    metadata_repeated_after: Option<usize>,
) -> Option<&str> {
    // Indices sorted by name, then by position: within a run of equal names
    // the second index is where the name repeats.
    let mut order: Vec<u32> = (0..tensors.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| {
        tensors[a as usize]
            .name
            .cmp(&tensors[b as usize].name)
            .then(a.cmp(&b))
    });
    let repeat = order
        .windows(2)
        .filter(|w| tensors[w[0] as usize].name == tensors[w[1] as usize].name)
        .map(|w| w[1] as usize)
        .min();
    match (repeat, metadata_repeated_after) {
        (Some(i), Some(m)) if m <= i => Some("__metadata__"),
        (Some(i), _) => Some(&tensors[i].name),
        (None, Some(_)) => Some("__metadata__"),
        (None, None) => None,
    }
}

/// Checks that the `__metadata__` value (JSON text) maps strings to strings.
fn check_metadata(json: &str) -> std::result::Result<(), String> {
    if !json.starts_with('{') {
        return Err(format!(
            "\"__metadata__\" must be an object of strings, but it is {}",
            raw_kind(json)
        ));
    }
    struct StringsVisitor;
    impl<'de> Visitor<'de> for StringsVisitor {
        type Value = std::result::Result<(), String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut bad = None;
            while let Some(Key(key)) = map.next_key::<Key>()? {
                let value: &RawValue = map.next_value()?;
                if bad.is_none() && !value.get().starts_with('"') {
                    bad = Some(format!(
                        "\"__metadata__\" must map strings to strings, but {key:?} is {}",
                        raw_kind(value.get())
                    ));
                }
            }
            Ok(bad.map_or(Ok(()), Err))
        }
    }
    serde_json::Deserializer::from_str(json)
        .deserialize_map(StringsVisitor)
        .unwrap_or_else(|e| Err(format!("\"__metadata__\" is not valid JSON: {e}")))
}

/// Validates one tensor entry (JSON text) on its own: dtype, shape, offsets,
/// size, bounds. The entry's name is left empty.
fn parse_tensor(json: &str, data_len: u64) -> std::result::Result<TensorEntry, String> {
    if !json.starts_with('{') {
        return Err(format!("entry is {}, not an object", raw_kind(json)));
    }
    let fields = serde_json::Deserializer::from_str(json)
        .deserialize_map(FieldsVisitor)
        .map_err(|e| format!("entry is not valid JSON: {e}"))?;
    let dtype_json = fields.dtype.ok_or("missing \"dtype\"")?.get();
    if !dtype_json.starts_with('"') {
        return Err(format!(
            "\"dtype\" is {}, not a string",
            raw_kind(dtype_json)
        ));
    }
    let dtype_name: String = serde_json::from_str(dtype_json)
        .map_err(|e| format!("\"dtype\" is not a valid string: {e}"))?;
    let (dtype, size) = dtype_info(&dtype_name)?;
    let shape = parse_shape(fields.shape.ok_or("missing \"shape\"")?.get())?;
    let (begin, end) = parse_offsets(fields.data_offsets.ok_or("missing \"data_offsets\"")?.get())?;
    let bytes = shape
        .iter()
        .try_fold(size, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| format!("shape {shape:?} of {dtype} overflows a 64-bit byte count"))?;
    if end - begin != bytes {
        return Err(format!(
            "shape {shape:?} of {dtype} needs {bytes} bytes but data_offsets [{begin}, {end}] span {}",
            end - begin
        ));
    }
    if end > data_len {
        return Err(format!(
            "data_offsets [{begin}, {end}] reach past the end of the data region ({data_len} bytes; file truncated?)"
        ));
    }
    Ok(TensorEntry {
        name: String::new(),
        dtype,
        shape,
        data_offsets: (begin, end),
    })
}

/// The fields of a tensor entry, as JSON text; a repeated field keeps its last
/// value, unknown fields are ignored.
#[derive(Default)]
struct Fields<'a> {
    dtype: Option<&'a RawValue>,
    shape: Option<&'a RawValue>,
    data_offsets: Option<&'a RawValue>,
}

struct FieldsVisitor;

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Fields<'de>, A::Error> {
        let mut fields = Fields::default();
        while let Some(Key(key)) = map.next_key::<Key>()? {
            let slot = match key.as_ref() {
                "dtype" => &mut fields.dtype,
                "shape" => &mut fields.shape,
                "data_offsets" => &mut fields.data_offsets,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = Some(map.next_value::<&RawValue>()?);
        }
        Ok(fields)
    }
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

/// The dimensions of a `shape` (JSON text), at most [`MAX_RANK`] of them.
fn parse_shape(json: &str) -> std::result::Result<Vec<usize>, String> {
    if !json.starts_with('[') {
        return Err(format!(
            "\"shape\" is {}, not a list of dimensions",
            raw_kind(json)
        ));
    }
    struct DimsVisitor;
    impl<'de> Visitor<'de> for DimsVisitor {
        type Value = std::result::Result<Vec<usize>, String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON array")
        }
        fn visit_seq<A: SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut dims = Vec::new();
            while let Some(dim) = seq.next_element::<&RawValue>()? {
                let dim = if dims.len() == MAX_RANK {
                    Err(format!("shape has more than {MAX_RANK} dimensions"))
                } else {
                    parse_dim(dim.get())
                };
                match dim {
                    Ok(d) => dims.push(d),
                    Err(msg) => {
                        while seq.next_element::<IgnoredAny>()?.is_some() {}
                        return Ok(Err(msg));
                    }
                }
            }
            Ok(Ok(dims))
        }
    }
    serde_json::Deserializer::from_str(json)
        .deserialize_seq(DimsVisitor)
        .unwrap_or_else(|e| Err(format!("\"shape\" is not valid JSON: {e}")))
}

/// One dimension (JSON text): a non-negative integer that fits a `usize`.
fn parse_dim(json: &str) -> std::result::Result<usize, String> {
    let n = match json.parse::<Number>() {
        Ok(n) => n,
        Err(_) => {
            return Err(format!(
                "shape has a dimension that is {}, not an integer",
                raw_kind(json)
            ))
        }
    };
    match (n.as_u64(), n.as_i64()) {
        (Some(u), _) => usize::try_from(u).map_err(|_| format!("dimension {u} is too large")),
        (None, Some(i)) => Err(format!("shape has a negative dimension {i}")),
        _ => Err(format!("shape has a non-integer dimension {n}")),
    }
}

/// `data_offsets` (JSON text): two non-negative integers, in order.
fn parse_offsets(json: &str) -> std::result::Result<(u64, u64), String> {
    let (begin, end) = serde_json::from_str::<(u64, u64)>(json).map_err(|_| {
        format!(
            "\"data_offsets\" must be two non-negative integers [begin, end], found {}",
            brief_json(json)
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

/// "an object", "a string", … for the JSON text of a value (which begins
/// without whitespace, as serde_json's raw values do).
fn raw_kind(json: &str) -> &'static str {
    match json.as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

/// The JSON text of a value without whitespace between tokens, shortened for
/// a one-line message.
fn brief_json(json: &str) -> String {
    let mut compact = String::new();
    let (mut in_string, mut escaped) = (false, false);
    for c in json.chars() {
        if in_string {
            in_string = escaped || c != '"';
            escaped = !escaped && c == '\\';
        } else if JSON_WHITESPACE.contains(&c) {
            continue;
        } else {
            in_string = c == '"';
        }
        compact.push(c);
        if compact.len() > 4 * 60 {
            break;
        }
    }
    brief_str(&compact)
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

    /// A header of one tensor `a` with these fields (JSON text).
    fn one(dtype: &str, shape: &str, offsets: &str) -> String {
        format!(r#"{{"a":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#)
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
        assert_eq!(h.metadata.get("format").as_deref(), Some("pt"));
        assert_eq!(h.metadata.to_map().len(), 1);
    }

    #[test]
    fn scalar_tensor_has_one_element() {
        let h = parse(&one("F64", "[]", "[0,8]"), 8).unwrap();
        assert_eq!(h.tensors[0].bytes(), 8);
    }

    #[test]
    fn each_problem_has_its_own_message() {
        let cases: [(String, u64, &str); 14] = [
            ("".into(), 0, "not valid JSON"),
            ("[1]".into(), 0, "not an object (it is an array)"),
            (r#"{"a":3}"#.into(), 0, "entry is a number, not an object"),
            (
                r#"{"a":{"shape":[],"data_offsets":[0,4]}}"#.into(),
                4,
                "missing \"dtype\"",
            ),
            (one("Q4", "[]", "[0,4]"), 4, "unknown dtype \"Q4\""),
            (one("F4", "[2]", "[0,1]"), 1, "not supported"),
            (one("F32", "[-1]", "[0,4]"), 4, "negative dimension -1"),
            (one("F32", "[1.5]", "[0,4]"), 4, "non-integer dimension 1.5"),
            (
                one("F32", "[4294967296,4294967296]", "[0,4]"),
                4,
                "overflows",
            ),
            (one("F32", "[1]", "[0]"), 4, "two non-negative integers"),
            (one("F32", "[1]", "[8,4]"), 8, "begin after they end"),
            (one("F32", "[2]", "[0,4]"), 4, "needs 8 bytes but"),
            (
                one("F32", "[2]", "[0,8]"),
                4,
                "past the end of the data region",
            ),
            (r#"{"__metadata__":{"n":1}}"#.into(), 0, "\"n\" is a number"),
        ];
        for (json, data_len, want) in cases {
            let err = parse(&json, data_len).unwrap_err();
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
        assert!(parse(&one("U8", "[4]", "[0,4]"), 9)
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

    #[test]
    fn a_duplicate_is_reported_before_an_invalid_entry() {
        let dup = r#"{"a":3, "b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                      "a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        let err = parse(dup, 2).unwrap_err();
        assert!(err.contains("duplicate tensor name \"a\""), "{err}");
        let meta = r#"{"__metadata__":{}, "c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                       "__metadata__":{}, "c":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        let err = parse(meta, 2).unwrap_err();
        assert!(
            err.contains("duplicate tensor name \"__metadata__\""),
            "{err}"
        );
    }

    #[test]
    fn shapes_have_at_most_max_rank_dimensions() {
        let header = |rank: usize| one("U8", &format!("[{}]", vec!["1"; rank].join(",")), "[0,1]");
        assert_eq!(
            parse(&header(MAX_RANK), 1).unwrap().tensors[0].shape.len(),
            MAX_RANK
        );
        let err = parse(&header(MAX_RANK + 1), 1).unwrap_err();
        assert!(err.contains("shape has more than 64 dimensions"), "{err}");
    }

    #[test]
    fn messages_show_values_on_one_line() {
        let err = parse(
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[ 0 ,\n 1 ,\t\"x y\" ]}}",
            1,
        )
        .unwrap_err();
        assert!(err.ends_with("found [0,1,\"x y\"]"), "{err}");
        let long = one("U8", "[1]", &format!("\"{}\"", "7".repeat(100)));
        let err = parse(&long, 1).unwrap_err();
        assert!(
            err.ends_with(&format!("found \"{}…", "7".repeat(59))),
            "{err}"
        );
    }

    #[test]
    fn fields_and_kinds_as_json_has_them() {
        // Unknown fields are ignored and a repeated field keeps its last value.
        let h = parse(
            r#"{"a":{"x":{"deep":[[[]]]},"dtype":"F64","dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
            2,
        )
        .unwrap();
        assert_eq!(h.tensors[0].dtype, "U8");
        for (field, want) in [
            (r#""dtype":null"#, "\"dtype\" is null, not a string"),
            (r#""dtype":true"#, "\"dtype\" is a boolean, not a string"),
            (r#""shape":{}"#, "\"shape\" is an object, not a list"),
            (
                r#""shape":[[1]]"#,
                "dimension that is an array, not an integer",
            ),
            (r#""shape":[18446744073709551616]"#, "non-integer dimension"),
        ] {
            let json =
                format!(r#"{{"a":{{"dtype":"U8","shape":[1],"data_offsets":[0,1],{field}}}}}"#);
            let err = parse(&json, 1).unwrap_err();
            assert!(err.contains(want), "{json}: {err}");
        }
    }

    #[test]
    fn metadata_is_kept_as_its_json_text() {
        let json = r#"{"__metadata__" : {"format":"pt", "note":"a \"quoted\"\nline", "format":"np"},
                       "a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        let h = parse(json, 1).unwrap();
        assert!(h.metadata.json().starts_with("{\"format\":\"pt\""));
        assert!(h.metadata.json().ends_with("\"np\"}"));
        assert_eq!(
            h.metadata.get("note").as_deref(),
            Some("a \"quoted\"\nline")
        );
        assert_eq!(h.metadata.get("format").as_deref(), Some("np"));
        assert!(!h.metadata.is_empty());
        let bare = parse(&one("U8", "[1]", "[0,1]"), 1).unwrap();
        assert!(bare.metadata.is_empty());
        assert_eq!(bare.metadata.json(), "");
        // Reading the file moves the text within the header's buffer: same result.
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("m.safetensors");
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.push(0);
        std::fs::write(&path, file).unwrap();
        assert_eq!(read_header(&path).unwrap(), h);
        let err = parse(r#"{"__metadata__":{"a":"b","n":[1]}}"#, 0).unwrap_err();
        assert!(err.contains("\"n\" is an array"), "{err}");
    }
}
