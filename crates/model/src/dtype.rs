//! Element types of checkpoint and store tensors, and conversions to f32.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// A safetensors element type. Only the ones a `qwen4_exp` checkpoint uses are decoded to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum DType {
    BF16,
    F16,
    F32,
    F64,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    #[serde(rename = "BOOL")]
    Bool,
}

impl DType {
    /// Parses the safetensors spelling (`"BF16"`, `"F32"`, ...).
    pub fn parse(s: &str) -> Result<DType> {
        Ok(match s {
            "BF16" => DType::BF16,
            "F16" => DType::F16,
            "F32" => DType::F32,
            "F64" => DType::F64,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "I16" => DType::I16,
            "I8" => DType::I8,
            "U64" => DType::U64,
            "U32" => DType::U32,
            "U16" => DType::U16,
            "U8" => DType::U8,
            "BOOL" => DType::Bool,
            other => bail!("unknown dtype {other:?}"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U64 => "U64",
            DType::U32 => "U32",
            DType::U16 => "U16",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::F16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The floating types a weight may be stored in (and decoded to f32 from).
    pub fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round-to-nearest-even, as `static_cast<bfloat16_t>(float)` in MLX and `torch.bfloat16` do.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Decodes little-endian `dtype` elements to f32. `out.len()` elements are read from `bytes`.
pub fn decode_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let n = out.len();
    if bytes.len() < n * dtype.size() {
        bail!("{} bytes hold fewer than {n} {dtype} elements", bytes.len());
    }
    match dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        other => bail!("{other} is not a floating type"),
    }
    Ok(())
}

/// Decodes a whole float tensor to a new f32 vector.
pub fn to_f32_vec(dtype: DType, bytes: &[u8]) -> Result<Vec<f32>> {
    let n = bytes.len() / dtype.size();
    let mut v = vec![0f32; n];
    decode_f32(dtype, bytes, &mut v)?;
    Ok(v)
}

/// Rounds float elements to bf16 bit patterns (the precision MLX quantizes from).
pub fn to_bf16_vec(dtype: DType, bytes: &[u8]) -> Result<Vec<u16>> {
    if dtype == DType::BF16 {
        return Ok(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect());
    }
    Ok(to_f32_vec(dtype, bytes)?.into_iter().map(f32_to_bf16).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0)), 1.0);
        // 1 + 2^-8 is exactly between two bf16 values: ties go to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), f32_to_bf16(1.0));
        // 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 3.0 / 256.0)), 1.0 + 1.0 / 64.0);
    }

    #[test]
    fn parse_names() {
        for d in [DType::BF16, DType::F16, DType::F32, DType::I64, DType::U32, DType::Bool] {
            assert_eq!(DType::parse(d.name()).unwrap(), d);
        }
        assert!(DType::parse("F8_E4M3").is_err());
    }
}
