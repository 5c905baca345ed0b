//! 4-bit NormalFloat (NF4, Dettmers et al. 2023, "QLoRA"), as bitsandbytes
//! stores it: blocks of [`BLOCK`] values, each block's values divided by its
//! largest magnitude (its absmax, kept in fp32) and mapped to the nearest of
//! the 16 levels of [`CODEBOOK`], two 4-bit indices per byte (the first
//! value of a pair in the high half).
//!
//! The arithmetic follows bitsandbytes' blockwise kernels: a value is
//! multiplied by the reciprocal of its block's absmax (in f32) and compared
//! with the midpoints between neighbouring levels (a value above a midpoint
//! goes up; a NaN, and so every value of an all-zero block, compares below
//! all of them); dequantizing multiplies the level by the absmax in f32
//! and rounds the product to the output type.
//!
//! ```
//! use oomfix_strategies::lora::nf4;
//! let values: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) / 16.0).collect();
//! let q = nf4::quantize(&values);
//! assert_eq!(q.codes().len(), 64); // two values per byte
//! assert_eq!(q.absmax(), [4.0, 3.9375]);
//! let back = q.dequantize();
//! assert_eq!(back[0], -4.0); // the absmax itself is exact
//! assert!(values.iter().zip(&back).all(|(a, b)| (a - b).abs() <= 0.61));
//! ```

use half::bf16;
use rayon::prelude::*;

/// Values per block, each block with its own absmax.
pub const BLOCK: usize = 64;

/// Absmax values per block of double quantization (each quantized to 8
/// bits with one fp32 scale per block).
pub const DOUBLE_BLOCK: usize = 256;

/// The 16 levels of NF4, ascending: the quantiles of a standard normal
/// distribution scaled to [-1, 1], with an exact zero (QLoRA's appendix;
/// bitsandbytes' `get_4bit_type("nf4")`).
pub const CODEBOOK: [f32; 16] = {
    let mut levels = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        levels[i] = LEVELS_F64[i] as f32;
        i += 1;
    }
    levels
};

/// The decimal levels as bitsandbytes writes them, in f64: the thresholds
/// are their midpoints, computed in f64 and rounded to f32 as its decision
/// tree's constants are.
const LEVELS_F64: [f64; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// The 15 midpoints between neighbouring levels, ascending.
fn thresholds() -> &'static [f32; 15] {
    static T: std::sync::OnceLock<[f32; 15]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|i| ((LEVELS_F64[i] + LEVELS_F64[i + 1]) / 2.0) as f32))
}

/// The index of the level nearest to `x` (a value already divided by its
/// block's absmax): the number of midpoints `x` is above (0 for a NaN).
///
/// ```
/// use oomfix_strategies::lora::nf4::{index_of, CODEBOOK};
/// assert_eq!(index_of(0.0), 7);
/// assert_eq!(index_of(1.0), 15);
/// assert_eq!(index_of(-1.0), 0);
/// assert_eq!(index_of(f32::NAN), 0);
/// assert!((0..16).all(|i| index_of(CODEBOOK[i]) as usize == i));
/// ```
pub fn index_of(x: f32) -> u8 {
    thresholds().iter().filter(|&&t| x > t).count() as u8
}

/// A vector of values in NF4: packed indices and one fp32 absmax per block.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    codes: Vec<u8>,
    absmax: Vec<f32>,
    len: usize,
}

/// Quantizes `values` to NF4 in blocks of [`BLOCK`] (the last block may be
/// shorter; an odd count leaves the last byte's low half at zero's index).
pub fn quantize(values: &[f32]) -> Nf4 {
    let blocks = values.len().div_ceil(BLOCK);
    let mut codes = vec![0u8; values.len().div_ceil(2)];
    let mut absmax = vec![0f32; blocks];
    codes
        .par_chunks_mut(BLOCK / 2)
        .zip(absmax.par_iter_mut())
        .zip(values.par_chunks(BLOCK))
        .for_each(|((codes, absmax), block)| {
            *absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = 1.0 / *absmax;
            let zero = index_of(0.0 * scale);
            // index_of over the block, one midpoint at a time across all its
            // values (a loop the compiler vectorizes).
            let n = block.len();
            let mut scaled = [0f32; BLOCK];
            scaled[..n]
                .iter_mut()
                .zip(block)
                .for_each(|(x, v)| *x = v * scale);
            let mut index = [0u8; BLOCK];
            for &t in thresholds() {
                index[..n]
                    .iter_mut()
                    .zip(&scaled[..n])
                    .for_each(|(i, &x)| *i += u8::from(x > t));
            }
            for (byte, pair) in codes.iter_mut().zip(index[..n].chunks(2)) {
                *byte = (pair[0] << 4) | pair.get(1).copied().unwrap_or(zero);
            }
        });
    Nf4 {
        codes,
        absmax,
        len: values.len(),
    }
}

impl Nf4 {
    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed indices: two per byte, the first value in the high half.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// Each block's absmax.
    pub fn absmax(&self) -> &[f32] {
        &self.absmax
    }

    /// Bytes held: the codes and the fp32 absmax values.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.absmax.len()
    }

    /// From packed `codes` and `absmax` values of `len` values (as
    /// [`codes`](Self::codes) and [`absmax`](Self::absmax) give them);
    /// `None` when the sizes disagree.
    pub fn from_parts(codes: Vec<u8>, absmax: Vec<f32>, len: usize) -> Option<Nf4> {
        (codes.len() == len.div_ceil(2) && absmax.len() == len.div_ceil(BLOCK)).then_some(Nf4 {
            codes,
            absmax,
            len,
        })
    }

    /// The values in f32: each level times its block's absmax.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len];
        self.dequantize_with(&mut out, |v| v);
        out
    }

    /// The values in bf16: each level times its block's absmax in f32,
    /// rounded to the nearest bf16 (ties to even).
    pub fn dequantize_bf16(&self) -> Vec<bf16> {
        let mut out = vec![bf16::ZERO; self.len];
        self.dequantize_with(&mut out, bf16::from_f32);
        out
    }

    /// Writes the values into `out` (of [`len`](Self::len) elements),
    /// converted from f32 by `convert`.
    pub fn dequantize_with<T: Send>(&self, out: &mut [T], convert: impl Fn(f32) -> T + Sync) {
        assert_eq!(out.len(), self.len, "output of the wrong length");
        dequantize_into(&self.codes, &self.absmax, out, convert);
    }
}

/// Writes the values of packed `codes` with their blocks' `absmax` into
/// `out` (its length the number of values), each level times its block's
/// absmax in f32, converted by `convert`.
pub fn dequantize_into<T: Send>(
    codes: &[u8],
    absmax: &[f32],
    out: &mut [T],
    convert: impl Fn(f32) -> T + Sync,
) {
    out.par_chunks_mut(BLOCK)
        .zip(codes.par_chunks(BLOCK / 2))
        .zip(absmax.par_iter())
        .for_each(|((out, codes), &absmax)| {
            for (pair, byte) in out.chunks_mut(2).zip(codes) {
                pair[0] = convert(CODEBOOK[(byte >> 4) as usize] * absmax);
                if let Some(second) = pair.get_mut(1) {
                    *second = convert(CODEBOOK[(byte & 0x0f) as usize] * absmax);
                }
            }
        });
}

/// The 256 levels of 8-bit absmax codes, ascending: bitsandbytes' signed
/// dynamic map (`create_dynamic_map(signed=True)`), its default for the
/// absmax values of double-quantized NF4. For `i` in 0..7 the `2^i`
/// midpoints of `linspace(0.1, 1, 2^i + 1)`, times `10^(i-6)`, and their
/// negatives; then 0 and 1.
pub fn dynamic_map() -> &'static [f32; 256] {
    static MAP: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    MAP.get_or_init(|| {
        let mut data: Vec<f32> = Vec::with_capacity(256);
        for i in 0..7i32 {
            let items = (1usize << i) + 1;
            let bound = |j: usize| 0.1f32 + (1.0 - 0.1f32) * j as f32 / (items - 1) as f32;
            let magnitude = 10f32.powi(i - 6);
            for j in 0..items - 1 {
                let mean = (bound(j) + bound(j + 1)) / 2.0;
                data.push(magnitude * mean);
                data.push(-magnitude * mean);
            }
        }
        data.push(0.0);
        data.push(1.0);
        data.sort_by(f32::total_cmp);
        data.try_into().expect("254 + 2 levels")
    })
}

/// The index of the level of [`dynamic_map`] nearest to `x` (in [-1, 1]);
/// the lower on a tie, 0 for a NaN.
fn dynamic_index(x: f32) -> u8 {
    let map = dynamic_map();
    let above = map.partition_point(|&level| level < x);
    if above == 0 || x.is_nan() {
        return 0;
    }
    if above == map.len() {
        return 255;
    }
    let (lo, hi) = (map[above - 1], map[above]);
    if hi - x < x - lo {
        above as u8
    } else {
        (above - 1) as u8
    }
}

/// Absmax values quantized again (double quantization, as bitsandbytes'
/// `compress_statistics`): their mean is taken off, the rest quantized to
/// the 8-bit [`dynamic_map`] in blocks of [`DOUBLE_BLOCK`], each block with
/// an fp32 scale (its own absmax).
#[derive(Debug, Clone, PartialEq)]
pub struct DoubleAbsmax {
    codes: Vec<u8>,
    scales: Vec<f32>,
    offset: f32,
}

impl DoubleAbsmax {
    /// `absmax` quantized.
    pub fn quantize(absmax: &[f32]) -> DoubleAbsmax {
        let offset = if absmax.is_empty() {
            0.0
        } else {
            (absmax.iter().map(|&v| f64::from(v)).sum::<f64>() / absmax.len() as f64) as f32
        };
        let mut codes = vec![0u8; absmax.len()];
        let scales = codes
            .chunks_mut(DOUBLE_BLOCK)
            .zip(absmax.chunks(DOUBLE_BLOCK))
            .map(|(codes, block)| {
                let scale = block.iter().fold(0f32, |m, v| m.max((v - offset).abs()));
                let inverse = 1.0 / scale;
                for (c, v) in codes.iter_mut().zip(block) {
                    *c = dynamic_index((v - offset) * inverse);
                }
                scale
            })
            .collect();
        DoubleAbsmax {
            codes,
            scales,
            offset,
        }
    }

    /// From `codes` (one per absmax value), `scales` (one per
    /// [`DOUBLE_BLOCK`] codes) and `offset`, as the accessors give them.
    pub fn from_parts(codes: Vec<u8>, scales: Vec<f32>, offset: f32) -> DoubleAbsmax {
        DoubleAbsmax {
            codes,
            scales,
            offset,
        }
    }

    /// One code per absmax value.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// One fp32 scale per [`DOUBLE_BLOCK`] codes.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// The mean taken off before quantizing.
    pub fn offset(&self) -> f32 {
        self.offset
    }

    /// Absmax value `i`: its level times its block's scale, plus the offset
    /// (in f32).
    pub fn value(&self, i: usize) -> f32 {
        dynamic_map()[self.codes[i] as usize] * self.scales[i / DOUBLE_BLOCK] + self.offset
    }

    /// Every absmax value.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.codes.len()).map(|i| self.value(i)).collect()
    }

    /// Bytes held: the codes, the scales and the offset.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len() + 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain blockwise reference, written from the definition: each
    /// value's nearest level after dividing by its block's absmax, in f64
    /// (the lower level on a tie), and level × absmax back.
    fn reference(values: &[f32]) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let mut indices = Vec::new();
        let mut absmaxes = Vec::new();
        let mut back = Vec::new();
        for block in values.chunks(BLOCK) {
            let absmax = block.iter().map(|v| v.abs()).fold(0f32, f32::max);
            absmaxes.push(absmax);
            for &v in block {
                let x = f64::from(v * (1.0 / absmax));
                let mut best = 0;
                for (i, level) in LEVELS_F64.iter().enumerate() {
                    if (x - level).abs() < (x - LEVELS_F64[best]).abs() {
                        best = i;
                    }
                }
                indices.push(best as u8);
                back.push(CODEBOOK[best] * absmax);
            }
        }
        (indices, absmaxes, back)
    }

    /// Deterministic pseudo-normal values (a sum of uniforms), with scale
    /// changing by block, exact zeros and exact levels mixed in.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let mut uniform = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..n)
            .map(|i| {
                let scale = 0.01 * (1 + (i / BLOCK) % 7) as f32;
                match i % 97 {
                    0 => 0.0,
                    1 => CODEBOOK[i % 16] * scale,
                    _ => ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * scale,
                }
            })
            .collect()
    }

    fn unpack(q: &Nf4) -> Vec<u8> {
        q.codes()
            .iter()
            .flat_map(|b| [b >> 4, b & 0x0f])
            .take(q.len())
            .collect()
    }

    #[test]
    fn the_codebook_is_the_published_one() {
        assert_eq!(CODEBOOK[1], -0.6961928009986877_f64 as f32);
        assert_eq!(CODEBOOK[14], 0.7229568362236023_f64 as f32);
        assert_eq!((CODEBOOK[0], CODEBOOK[7], CODEBOOK[15]), (-1.0, 0.0, 1.0));
        // bitsandbytes' decision tree's first constants.
        let t = thresholds();
        assert_eq!(t[7], 0.03979014977812767_f64 as f32);
        assert_eq!(t[11], 0.3893125355243683_f64 as f32);
        assert_eq!(t[6], -0.045525018125772476_f64 as f32);
        assert_eq!(t[0], -0.8480964004993439_f64 as f32);
        assert!(t.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn round_trips_equal_the_blockwise_reference_bit_for_bit() {
        for (n, seed) in [
            (64 * 1000, 1),
            (64 * 37 + 10, 2),
            (1, 3),
            (63, 4),
            (4096 * 3, 5),
        ] {
            let v = values(n, seed);
            let q = quantize(&v);
            let (indices, absmax, back) = reference(&v);
            assert_eq!(unpack(&q), indices, "indices, n = {n}");
            assert_eq!(q.absmax(), absmax.as_slice());
            let ours = q.dequantize();
            assert!(
                ours.iter()
                    .zip(&back)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "values, n = {n}"
            );
            let bf: Vec<u16> = q.dequantize_bf16().iter().map(|b| b.to_bits()).collect();
            let expected: Vec<u16> = back.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            assert_eq!(bf, expected);
            // Quantizing the dequantized values gives the same codes again.
            assert_eq!(quantize(&ours), q);
        }
    }

    #[test]
    fn packing_is_bitsandbytes_layout() {
        // Block absmax 2: values 2·level for levels 15, 0, 7, 8, then -2.
        let v = [2.0, -2.0, 0.0, 2.0 * CODEBOOK[8], -2.0];
        let q = quantize(&v);
        assert_eq!(q.absmax(), [2.0]);
        // (15 << 4 | 0), (7 << 4 | 8), (0 << 4 | zero's index 7).
        assert_eq!(q.codes(), [0xf0, 0x78, 0x07]);
        assert_eq!(q.dequantize(), v);
        assert_eq!(q.bytes(), 3 + 4);
    }

    #[test]
    fn ties_and_zero_blocks() {
        // A value just above a midpoint goes up, the midpoint itself down.
        let t = thresholds()[7];
        assert_eq!(index_of(t), 7);
        assert_eq!(index_of(f32::from_bits(t.to_bits() + 1)), 8);
        // An all-zero block: every value's index is 0 (0 × ∞ is NaN, as in
        // bitsandbytes), and the values come back as (negative) zeros.
        let q = quantize(&[0.0; 64]);
        assert_eq!(q.absmax(), [0.0]);
        assert!(q.dequantize().iter().all(|v| *v == 0.0));
        assert!(Nf4::from_parts(vec![0; 3], vec![1.0], 5).is_some());
        assert!(Nf4::from_parts(vec![0; 3], vec![1.0], 7).is_none());
    }

    #[test]
    fn the_dynamic_map_has_256_ascending_levels_from_minus_one_to_one() {
        let map = dynamic_map();
        assert!(map.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!((map[0], map[255]), (-0.99296875, 1.0));
        assert!(map.contains(&0.0));
        // The smallest magnitude: 1e-6 × (0.1 + 1) / 2.
        let smallest = map
            .iter()
            .filter(|v| **v > 0.0)
            .fold(1f32, |m, v| m.min(*v));
        assert!((smallest - 0.55e-6).abs() < 1e-12, "{smallest}");
        assert_eq!(dynamic_index(1.0), 255);
        assert_eq!(
            dynamic_index(0.0) as usize,
            map.iter().position(|v| *v == 0.0).unwrap()
        );
        assert!((0..256).all(|i| dynamic_index(map[i]) as usize == i || map[i] == map[i - 1]));
    }

    #[test]
    fn double_quantized_absmax_stays_within_a_level() {
        let v = values(64 * 1000, 7);
        let q = quantize(&v);
        let d = DoubleAbsmax::quantize(q.absmax());
        assert_eq!(d.codes().len(), 1000);
        assert_eq!(d.scales().len(), 4);
        assert_eq!(d.bytes(), 1000 + 16 + 4);
        let back = d.dequantize();
        let mean = q.absmax().iter().sum::<f32>() / 1000.0;
        assert!((d.offset() - mean).abs() < 1e-6);
        for (i, (a, b)) in q.absmax().iter().zip(&back).enumerate() {
            // The widest gap between neighbouring levels near ±1 is 0.9/64·... < 2%
            // of the block's scale.
            let scale = d.scales()[i / DOUBLE_BLOCK];
            assert!((a - b).abs() <= 0.02 * scale, "{i}: {a} {b}");
        }
        // The value that sets a block's scale comes back up to rounding.
        let (i, _) = q
            .absmax()
            .iter()
            .take(DOUBLE_BLOCK)
            .enumerate()
            .max_by(|x, y| (x.1 - mean).abs().total_cmp(&(y.1 - mean).abs()))
            .unwrap();
        assert!((back[i] - q.absmax()[i]).abs() <= 1e-6 * q.absmax()[i].abs().max(1.0));
    }
}
