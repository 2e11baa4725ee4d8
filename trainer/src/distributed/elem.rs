//! Element types the cpu collectives reduce, and the in-place reduction kernels.

use half::{bf16, f16};
use tch::Kind;

use super::comm::ReduceOp;

/// The element types the cpu backend understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F64,
    Bf16,
    F16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl Elem {
    pub fn from_kind(kind: Kind) -> Option<Elem> {
        Some(match kind {
            Kind::Float => Elem::F32,
            Kind::Double => Elem::F64,
            Kind::BFloat16 => Elem::Bf16,
            Kind::Half => Elem::F16,
            Kind::Int64 => Elem::I64,
            Kind::Int => Elem::I32,
            Kind::Int16 => Elem::I16,
            Kind::Int8 => Elem::I8,
            Kind::Uint8 => Elem::U8,
            Kind::Bool => Elem::Bool,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            Elem::F64 | Elem::I64 => 8,
            Elem::F32 | Elem::I32 => 4,
            Elem::Bf16 | Elem::F16 | Elem::I16 => 2,
            Elem::I8 | Elem::U8 | Elem::Bool => 1,
        }
    }
}

fn zip<T: Copy>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    debug_assert_eq!(dst.len(), src.len());
    let n = dst.len() / size_of::<T>();
    // SAFETY: both buffers are aligned for T (tensor storage and the u64-backed scratch buffer,
    // offsets are multiples of the element size) and hold n elements; they do not overlap.
    let (d, s) = unsafe {
        (
            std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<T>(), n),
            std::slice::from_raw_parts(src.as_ptr().cast::<T>(), n),
        )
    };
    for (d, s) in d.iter_mut().zip(s) {
        *d = f(*d, *s);
    }
}

/// `dst = op(dst, src)` elementwise, both holding elements of type `elem`.
pub fn reduce_into(elem: Elem, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    use ReduceOp::{Max, Sum};
    match (elem, op) {
        (Elem::F32, Sum) => zip::<f32>(dst, src, |a, b| a + b),
        (Elem::F32, Max) => zip::<f32>(dst, src, max_nan),
        (Elem::F64, Sum) => zip::<f64>(dst, src, |a, b| a + b),
        (Elem::F64, Max) => zip::<f64>(dst, src, max_nan),
        (Elem::Bf16, Sum) => zip::<bf16>(dst, src, |a, b| bf16::from_f32(a.to_f32() + b.to_f32())),
        (Elem::Bf16, Max) => zip::<bf16>(dst, src, |a, b| {
            bf16::from_f32(max_nan(a.to_f32(), b.to_f32()))
        }),
        (Elem::F16, Sum) => zip::<f16>(dst, src, |a, b| f16::from_f32(a.to_f32() + b.to_f32())),
        (Elem::F16, Max) => zip::<f16>(dst, src, |a, b| {
            f16::from_f32(max_nan(a.to_f32(), b.to_f32()))
        }),
        (Elem::I64, Sum) => zip::<i64>(dst, src, i64::wrapping_add),
        (Elem::I64, Max) => zip::<i64>(dst, src, std::cmp::max),
        (Elem::I32, Sum) => zip::<i32>(dst, src, i32::wrapping_add),
        (Elem::I32, Max) => zip::<i32>(dst, src, std::cmp::max),
        (Elem::I16, Sum) => zip::<i16>(dst, src, i16::wrapping_add),
        (Elem::I16, Max) => zip::<i16>(dst, src, std::cmp::max),
        (Elem::I8, Sum) => zip::<i8>(dst, src, i8::wrapping_add),
        (Elem::I8, Max) => zip::<i8>(dst, src, std::cmp::max),
        (Elem::U8, Sum) => zip::<u8>(dst, src, u8::wrapping_add),
        (Elem::U8, Max) => zip::<u8>(dst, src, std::cmp::max),
        // torch: sum of bools is logical or, as is max.
        (Elem::Bool, _) => zip::<u8>(dst, src, |a, b| (a | b != 0) as u8),
    }
}

/// Max that propagates NaN, as torch's all_reduce(MAX) does (a NaN grad-norm must stay NaN).
fn max_nan<T: PartialOrd + Copy>(a: T, b: T) -> T {
    #[allow(clippy::eq_op)]
    let a_nan = a != a;
    if a_nan || a >= b { a } else { b }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
        let mut out = vec![0u8; std::mem::size_of_val(v)];
        // SAFETY: plain-old-data copy.
        unsafe {
            std::ptr::copy_nonoverlapping(v.as_ptr().cast::<u8>(), out.as_mut_ptr(), out.len())
        };
        out
    }

    #[test]
    fn sums_and_maxes() {
        let mut d = bytes(&[1.0f32, -2.0, f32::NAN]);
        reduce_into(
            Elem::F32,
            ReduceOp::Max,
            &mut d,
            &bytes(&[0.5f32, 3.0, 1.0]),
        );
        let v: Vec<f32> = d
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v[..2], [1.0, 3.0]);
        assert!(v[2].is_nan());
        let mut d = bytes(&[i64::MAX - 1, 5]);
        reduce_into(Elem::I64, ReduceOp::Sum, &mut d, &bytes(&[1i64, -7]));
        assert_eq!(d, bytes(&[i64::MAX, -2i64]));
        let mut d = bytes(&[bf16::from_f32(1.5)]);
        reduce_into(
            Elem::Bf16,
            ReduceOp::Sum,
            &mut d,
            &bytes(&[bf16::from_f32(2.25)]),
        );
        assert_eq!(d, bytes(&[bf16::from_f32(3.75)]));
    }
}
