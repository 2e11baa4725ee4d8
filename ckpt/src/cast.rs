//! Element type conversion of little-endian buffers, with torch's semantics: floats round to
//! nearest even, float -> integer truncates toward zero, anything -> bool is `!= 0`, integer ->
//! integer wraps. float8 is read (decoded exactly, `fp8`) but never written: encoding to float8
//! needs a scaling recipe, not a cast.

use half::{bf16, f16};

use crate::error::{Error, Result};
use titan_dcp::Dtype;

/// One element, widened.
#[derive(Clone, Copy)]
enum Value {
    F(f64),
    /// Stored as f32 when the source was f32 or narrower, so f32 -> bf16/f16 rounds once.
    F32(f32),
    I(i64),
    U(u64),
}

fn is_float8(d: Dtype) -> bool {
    matches!(d, Dtype::F8E4M3 | Dtype::F8E5M2)
}

/// Whether `from -> to` can be converted.
pub fn check(from: Dtype, to: Dtype) -> Result<()> {
    if from == to || !is_float8(to) {
        Ok(())
    } else {
        Err(Error::usage(format!(
            "converting {from} to {to} is not supported (float8 is read and dequantized, never \
             written)"
        )))
    }
}

fn read(d: Dtype, b: &[u8]) -> Value {
    match d {
        Dtype::Bool | Dtype::U8 => Value::U(b[0] as u64),
        Dtype::I8 => Value::I(b[0] as i8 as i64),
        Dtype::I16 => Value::I(i16::from_le_bytes([b[0], b[1]]) as i64),
        Dtype::U16 => Value::U(u16::from_le_bytes([b[0], b[1]]) as u64),
        Dtype::I32 => Value::I(i32::from_le_bytes(b[..4].try_into().unwrap()) as i64),
        Dtype::U32 => Value::U(u32::from_le_bytes(b[..4].try_into().unwrap()) as u64),
        Dtype::I64 => Value::I(i64::from_le_bytes(b[..8].try_into().unwrap())),
        Dtype::U64 => Value::U(u64::from_le_bytes(b[..8].try_into().unwrap())),
        Dtype::F16 => Value::F32(f16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::BF16 => Value::F32(bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::F32 => Value::F32(f32::from_le_bytes(b[..4].try_into().unwrap())),
        Dtype::F64 => Value::F(f64::from_le_bytes(b[..8].try_into().unwrap())),
        Dtype::F8E4M3 | Dtype::F8E5M2 => Value::F32(decode(d, b[0])),
    }
}

fn as_f32(v: Value) -> f32 {
    match v {
        Value::F(x) => x as f32,
        Value::F32(x) => x,
        Value::I(x) => x as f32,
        Value::U(x) => x as f32,
    }
}

fn as_f64(v: Value) -> f64 {
    match v {
        Value::F(x) => x,
        Value::F32(x) => x as f64,
        Value::I(x) => x as f64,
        Value::U(x) => x as f64,
    }
}

/// Integer view: floats truncate toward zero; integers keep their bits for wrapping casts.
fn as_i64(v: Value) -> i64 {
    match v {
        Value::F(x) => x.trunc() as i64,
        Value::F32(x) => x.trunc() as i64,
        Value::I(x) => x,
        Value::U(x) => x as i64,
    }
}

fn is_nonzero(v: Value) -> bool {
    match v {
        Value::F(x) => x != 0.0,
        Value::F32(x) => x != 0.0,
        Value::I(x) => x != 0,
        Value::U(x) => x != 0,
    }
}

fn write(d: Dtype, v: Value, out: &mut [u8]) {
    match d {
        Dtype::Bool => out[0] = is_nonzero(v) as u8,
        Dtype::U8 => out[0] = as_i64(v) as u8,
        Dtype::I8 => out[0] = as_i64(v) as i8 as u8,
        Dtype::I16 => out.copy_from_slice(&(as_i64(v) as i16).to_le_bytes()),
        Dtype::U16 => out.copy_from_slice(&(as_i64(v) as u16).to_le_bytes()),
        Dtype::I32 => out.copy_from_slice(&(as_i64(v) as i32).to_le_bytes()),
        Dtype::U32 => out.copy_from_slice(&(as_i64(v) as u32).to_le_bytes()),
        Dtype::I64 => out.copy_from_slice(&as_i64(v).to_le_bytes()),
        Dtype::U64 => out.copy_from_slice(&(as_i64(v) as u64).to_le_bytes()),
        Dtype::F16 => out.copy_from_slice(&f16::from_f32(as_f32(v)).to_le_bytes()),
        Dtype::BF16 => out.copy_from_slice(&bf16::from_f32(as_f32(v)).to_le_bytes()),
        Dtype::F32 => out.copy_from_slice(&as_f32(v).to_le_bytes()),
        Dtype::F64 => out.copy_from_slice(&as_f64(v).to_le_bytes()),
        Dtype::F8E4M3 | Dtype::F8E5M2 => unreachable!("checked by cast::check"),
    }
}

/// Converts `input` (elements of `from`) into `out` (resized to hold them as `to`).
pub fn convert(from: Dtype, to: Dtype, input: &[u8], out: &mut Vec<u8>) {
    let (fs, ts) = (from.size(), to.size());
    let n = input.len() / fs;
    out.resize(n * ts, 0);
    if from == to {
        out.copy_from_slice(input);
        return;
    }
    // The common training cases get tight loops; the rest goes through `Value`.
    match (from, to) {
        (Dtype::F32, Dtype::BF16) => {
            for (i, o) in input.chunks_exact(4).zip(out.chunks_exact_mut(2)) {
                let x = f32::from_le_bytes(i.try_into().unwrap());
                o.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
            }
        }
        (Dtype::BF16, Dtype::F32) => {
            for (i, o) in input.chunks_exact(2).zip(out.chunks_exact_mut(4)) {
                let x = bf16::from_le_bytes([i[0], i[1]]).to_f32();
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        _ => {
            for (i, o) in input.chunks_exact(fs).zip(out.chunks_exact_mut(ts)) {
                write(to, read(from, i), o);
            }
        }
    }
}

/// Element `i` of a buffer as f64 (for diffs).
pub fn element_f64(d: Dtype, b: &[u8], i: usize) -> f64 {
    let s = d.size();
    as_f64(read(d, &b[i * s..(i + 1) * s]))
}

/// Element `i` as an exact integer (for diffs of integer tensors).
pub fn element_i128(d: Dtype, b: &[u8], i: usize) -> i128 {
    let s = d.size();
    match read(d, &b[i * s..(i + 1) * s]) {
        Value::I(x) => x as i128,
        Value::U(x) => x as i128,
        Value::F(x) => x as i128,
        Value::F32(x) => x as i128,
    }
}

// The float8 dtypes' exact decode (fp8.rs dequantizes with it; casts read float8 through it).

/// float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, only
/// S.1111.111 is NaN) as the bits of the f32 torch's `.float()` gives: every finite value is
/// exact, and NaN is 0x7FF00000 with the sign (what torch's decode yields, so that a NaN's bits
/// survive a later multiply exactly as in torch).
const fn e4m3fn_bits(b: u8) -> u32 {
    let sign = ((b >> 7) as u32) << 31;
    let exp = ((b >> 3) & 0xF) as u32;
    let man = (b & 0x7) as u32;
    if exp == 0xF && man == 0x7 {
        return sign | 0x7FF0_0000;
    }
    if exp != 0 {
        // Normal: (1 + man/8) * 2^(exp - 7), rebased to f32's bias of 127.
        return sign | ((exp + 120) << 23) | (man << 20);
    }
    if man == 0 {
        return sign;
    }
    // Subnormal: man * 2^-9. Normalise: shift the mantissa's leading one into the implicit bit.
    let lead = 31 - man.leading_zeros(); // 0, 1 or 2
    let frac = (man << (23 - lead)) & 0x7F_FFFF;
    sign | ((127 - 9 + lead) << 23) | frac
}

const fn e4m3fn_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3fn_bits(i as u8);
        i += 1;
    }
    t
}

/// Every e4m3fn byte's f32 bits.
static E4M3FN: [u32; 256] = e4m3fn_table();

/// One float8 e4m3fn value as f32 (exact; see [`E4M3FN`] for NaN).
pub fn e4m3fn_to_f32(b: u8) -> f32 {
    f32::from_bits(E4M3FN[b as usize])
}

/// One float8 e5m2 value as f32: e5m2 is the upper byte of an IEEE half, so the half's exact
/// widening is the value.
pub fn e5m2_to_f32(b: u8) -> f32 {
    half::f16::from_bits((b as u16) << 8).to_f32()
}

/// A float8 element's f32 value, for the float8 dtypes.
pub fn decode(d: Dtype, b: u8) -> f32 {
    match d {
        Dtype::F8E5M2 => e5m2_to_f32(b),
        _ => e4m3fn_to_f32(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_follow_torch() {
        let mut out = Vec::new();
        let x: Vec<u8> = [1.0f32, -2.5, 1.0 + 1.0 / 256.0, 3.0e38]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        convert(Dtype::F32, Dtype::BF16, &x, &mut out);
        let back: Vec<f32> = out
            .chunks(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        // 1.00390625 is halfway between two bf16 values: ties to even -> 1.0.
        assert_eq!(&back[..3], &[1.0, -2.5, 1.0]);
        convert(Dtype::F32, Dtype::I64, &x[..8], &mut out);
        assert_eq!(i64::from_le_bytes(out[8..16].try_into().unwrap()), -2);
        let ints: Vec<u8> = [0i64, 5, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        convert(Dtype::I64, Dtype::Bool, &ints, &mut out);
        assert_eq!(out, vec![0, 1, 1]);
        convert(Dtype::I64, Dtype::U8, &ints, &mut out);
        assert_eq!(out, vec![0, 5, 255]);
        assert!(check(Dtype::F32, Dtype::F8E4M3).is_err());
        convert(Dtype::F8E4M3, Dtype::F32, &[0x38, 0x7E, 0x01], &mut out);
        let f: Vec<f32> = out
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(f, vec![1.0, 448.0, 2f32.powi(-9)]);
    }
}
