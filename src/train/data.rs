//! Training data: token windows from a token file, a text file, or random tokens.
//!
//! * `.bin`: little-endian token ids as nanoGPT's `prepare.py` writes them
//!   (u16 by default, u32 when the vocabulary needs it or when asked);
//! * any other file: its bytes, one token per byte (a byte-level fallback that
//!   needs a vocabulary of at least 256);
//! * no file: uniformly random tokens from a seeded generator.
//!
//! Windows of `seq_len + 1` tokens are read in order and wrap around; the
//! trainer turns each into inputs and next-token targets.

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// Width of the ids in a `.bin` token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    /// 2 bytes per id (nanoGPT's default).
    U16,
    /// 4 bytes per id.
    U32,
}

/// Where a [`DataSource`] stands in its stream: what a checkpoint saves to
/// resume it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPosition {
    /// The state of the synthetic generator.
    Synthetic(u64),
    /// The next read position in a token stream of `len` ids.
    Tokens {
        /// Next read position.
        pos: u64,
        /// Number of ids in the stream.
        len: u64,
    },
}

/// Where tokens come from.
#[derive(Debug, Clone)]
pub enum DataSource {
    /// Random ids in `0..vocab` from a seeded xorshift generator.
    Synthetic {
        /// Generator state.
        state: u64,
    },
    /// Tokens loaded from a file, read in order with wrap-around.
    Tokens {
        /// The file they came from.
        path: PathBuf,
        /// All ids.
        ids: Vec<u32>,
        /// Next read position.
        pos: usize,
    },
}

impl DataSource {
    /// Random tokens, reproducible from `seed`.
    pub fn synthetic(seed: u64) -> Self {
        DataSource::Synthetic {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        }
    }

    /// Loads a token file (`.bin`) or a text file (bytes as tokens), checking
    /// every id against `vocab`.
    pub fn from_file(path: &Path, width: TokenWidth, vocab: usize) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| Error::input(path, format!("cannot read data: {e}")))?;
        let is_bin = path.extension().is_some_and(|e| e == "bin");
        let ids: Vec<u32> = if is_bin {
            let w = match width {
                TokenWidth::U16 => 2,
                TokenWidth::U32 => 4,
            };
            if bytes.len() % w != 0 {
                return Err(Error::input(
                    path,
                    format!(
                        "length {} is not a multiple of {w}-byte token ids",
                        bytes.len()
                    ),
                ));
            }
            bytes
                .chunks_exact(w)
                .map(|c| match width {
                    TokenWidth::U16 => u16::from_le_bytes([c[0], c[1]]) as u32,
                    TokenWidth::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                })
                .collect()
        } else {
            if vocab < 256 {
                return Err(Error::input(
                    path,
                    format!(
                        "byte-level text needs a vocabulary of at least 256, the model has {vocab}"
                    ),
                ));
            }
            bytes.into_iter().map(u32::from).collect()
        };
        if ids.len() < 2 {
            return Err(Error::input(path, "holds fewer than 2 tokens"));
        }
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::input(
                path,
                format!("token {i} is id {id}, outside the model's vocabulary of {vocab}"),
            ));
        }
        Ok(DataSource::Tokens {
            path: path.to_path_buf(),
            ids,
            pos: 0,
        })
    }

    /// Where the stream stands.
    pub fn position(&self) -> DataPosition {
        match self {
            DataSource::Synthetic { state } => DataPosition::Synthetic(*state),
            DataSource::Tokens { ids, pos, .. } => DataPosition::Tokens {
                pos: *pos as u64,
                len: ids.len() as u64,
            },
        }
    }

    /// Continues the stream from `position` (from [`position`](Self::position)
    /// on a source of the same kind: synthetic, or tokens of the same length).
    /// On error, says why in a sentence and changes nothing.
    pub fn seek(&mut self, position: DataPosition) -> Result<(), String> {
        match (self, position) {
            (DataSource::Synthetic { state }, DataPosition::Synthetic(s)) if s != 0 => *state = s,
            (DataSource::Tokens { ids, pos, .. }, DataPosition::Tokens { pos: p, len })
                if len == ids.len() as u64 && p < len =>
            {
                *pos = p as usize
            }
            (DataSource::Tokens { ids, path, .. }, DataPosition::Tokens { len, .. }) if len != ids.len() as u64 => {
                return Err(format!(
                    "the data was a stream of {len} tokens; {} holds {}",
                    path.display(),
                    ids.len()
                ))
            }
            (DataSource::Tokens { path, .. }, DataPosition::Synthetic(_)) => {
                return Err(format!("the data was random tokens; this run reads {}", path.display()))
            }
            (DataSource::Synthetic { .. }, DataPosition::Tokens { len, .. }) => {
                return Err(format!("the data was a file of {len} tokens; this run uses random tokens (give --data)"))
            }
            (_, p) => return Err(format!("invalid data position {p:?}")),
        }
        Ok(())
    }

    /// Moves past the next `windows` windows of `seq_len + 1` tokens, as
    /// [`next_windows`](Self::next_windows) would (for another rank's slice).
    pub fn skip_windows(&mut self, windows: usize, seq_len: usize) {
        match self {
            DataSource::Synthetic { state } => {
                for _ in 0..windows * (seq_len + 1) {
                    *state ^= *state << 13;
                    *state ^= *state >> 7;
                    *state ^= *state << 17;
                }
            }
            DataSource::Tokens { ids, pos, .. } => {
                *pos = ((*pos as u128 + windows as u128 * seq_len as u128) % ids.len() as u128)
                    as usize;
            }
        }
    }

    /// The next `batch` windows of `seq_len + 1` tokens, row after row.
    pub fn next_windows(&mut self, batch: usize, seq_len: usize, vocab: usize) -> Vec<u32> {
        let n = batch * (seq_len + 1);
        match self {
            DataSource::Synthetic { state } => (0..n)
                .map(|_| {
                    *state ^= *state << 13;
                    *state ^= *state >> 7;
                    *state ^= *state << 17;
                    (*state % vocab as u64) as u32
                })
                .collect(),
            DataSource::Tokens { ids, pos, .. } => {
                let mut out = Vec::with_capacity(n);
                for _ in 0..batch {
                    for k in 0..=seq_len {
                        out.push(ids[(*pos + k) % ids.len()]);
                    }
                    *pos = (*pos + seq_len) % ids.len();
                }
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_file_windows_overlap_by_one_and_wrap() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let ids: Vec<u8> = (0u16..10).flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(&p, ids).unwrap();
        let mut d = DataSource::from_file(&p, TokenWidth::U16, 16).unwrap();
        assert_eq!(d.next_windows(2, 3, 16), [0, 1, 2, 3, 3, 4, 5, 6]);
        assert_eq!(d.next_windows(1, 4, 16), [6, 7, 8, 9, 0]);
    }

    #[test]
    fn skipping_windows_is_reading_and_dropping_them() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let ids: Vec<u8> = (0u16..10).flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(&p, ids).unwrap();
        let file = DataSource::from_file(&p, TokenWidth::U16, 16).unwrap();
        for source in [DataSource::synthetic(7), file] {
            let (mut read, mut skip) = (source.clone(), source);
            read.next_windows(3, 4, 16);
            skip.skip_windows(3, 4);
            assert_eq!(read.next_windows(2, 4, 16), skip.next_windows(2, 4, 16));
        }
    }

    #[test]
    fn bad_data_is_an_input_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        std::fs::write(&p, [1u8, 0, 99, 0, 7]).unwrap();
        let e = DataSource::from_file(&p, TokenWidth::U16, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 2"), "{e}");
        std::fs::write(&p, [1u8, 0, 99, 0]).unwrap();
        let e = DataSource::from_file(&p, TokenWidth::U16, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("id 99"), "{e}");
        let t = dir.path().join("t.txt");
        std::fs::write(&t, "hello").unwrap();
        assert!(DataSource::from_file(&t, TokenWidth::U16, 64).is_err());
        assert_eq!(
            DataSource::from_file(&t, TokenWidth::U16, 256)
                .unwrap()
                .next_windows(1, 2, 256),
            [104, 101, 108]
        );
    }

    #[test]
    fn seeking_to_a_position_continues_the_stream() {
        let mut a = DataSource::synthetic(3);
        a.next_windows(2, 4, 50);
        let mut b = DataSource::synthetic(9);
        b.seek(a.position()).unwrap();
        assert_eq!(a.next_windows(1, 4, 50), b.next_windows(1, 4, 50));

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        std::fs::write(
            &p,
            (0u16..10)
                .flat_map(|i| i.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
        .unwrap();
        let mut t = DataSource::from_file(&p, TokenWidth::U16, 16).unwrap();
        t.next_windows(1, 3, 16);
        let mut u = DataSource::from_file(&p, TokenWidth::U16, 16).unwrap();
        u.seek(t.position()).unwrap();
        assert_eq!(u.next_windows(1, 2, 16), [3, 4, 5]);

        assert!(u
            .seek(DataPosition::Tokens { pos: 1, len: 11 })
            .unwrap_err()
            .contains("11 tokens"));
        assert!(u.seek(DataPosition::Tokens { pos: 10, len: 10 }).is_err());
        assert!(u.seek(a.position()).unwrap_err().contains("random tokens"));
        assert!(a.seek(t.position()).unwrap_err().contains("--data"));
        assert!(a.seek(DataPosition::Synthetic(0)).is_err());
    }

    #[test]
    fn synthetic_is_reproducible_and_in_range() {
        let a = DataSource::synthetic(7).next_windows(2, 5, 11);
        assert_eq!(a, DataSource::synthetic(7).next_windows(2, 5, 11));
        assert!(a.iter().all(|&t| t < 11));
    }
}
