//! Element types a tensor can hold, and the plain-data Rust types that map onto them.

use serde::{Deserialize, Serialize};

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of an f32).
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer (also raw bytes).
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 | DType::U64 => 8,
            DType::I8 | DType::U8 => 1,
        }
    }

    /// Lower-case name, as used in trace files and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::I8 => "i8",
            DType::U8 => "u8",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can be read from or written to tensor memory.
///
/// Only plain-data types for which every bit pattern is a valid value implement it (sealed), so
/// reinterpreting reused ring-heap memory as `&[T]` is always sound.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The tensor element type this Rust type represents.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}

element!(
    f32 => F32,
    half::f16 => F16,
    half::bf16 => BF16,
    i32 => I32,
    u32 => U32,
    i64 => I64,
    u64 => U64,
    i8 => I8,
    u8 => U8,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F32.size(), size_of::<f32>());
        assert_eq!(DType::BF16.size(), size_of::<half::bf16>());
        assert_eq!(DType::F16.size(), size_of::<half::f16>());
        assert_eq!(DType::I64.size(), size_of::<i64>());
        assert_eq!(<half::bf16 as Element>::DTYPE, DType::BF16);
    }
}
