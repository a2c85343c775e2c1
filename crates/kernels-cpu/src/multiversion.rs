//! `multiversion!`: one plain-Rust body compiled for the portable path and again with AVX2+FMA+F16C
//! enabled (the compiler vectorises it with 256-bit registers), and, when the definition starts
//! with `avx512;`, a third time with AVX-512 F/BW/VL (512-bit registers), dispatched on
//! [`crate::Isa::current`]. For kernels whose best vector code is what the compiler makes of a
//! lane-blocked loop; the matrix and attention kernels use hand-written intrinsics instead.
//!
//! A body that writes no `mul_add` (and Rust contracts none) computes the same operations in
//! the same order in every build, so the builds agree bit for bit.

/// Defines `$vis fn $name(args) -> ret { body }` dispatching to an AVX2 build of `body` (and,
/// after a leading `avx512;`, to an AVX-512 build on the Avx512Bf16 path and wider).
macro_rules! multiversion {
    (avx512; $($item:tt)*) => {
        $crate::multiversion::multiversion!(@builds [avx512] $($item)*);
    };
    (@builds [$($wide:ident)?] $(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                generic($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            {
                let isa = $crate::isa::Isa::current();
                $crate::multiversion::multiversion!(@avx512 [$($wide)?] isa ($($arg: $ty),*) $(-> $ret)?);
                if isa >= $crate::isa::Isa::Avx2 {
                    // SAFETY: `Isa::current` returns Avx2 or wider only when this CPU supports
                    // AVX2, FMA and F16C, the features `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
    // The AVX-512 build and its dispatch, where asked for.
    (@avx512 [] $($unused:tt)*) => {};
    (@avx512 [avx512] $isa:ident ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        fn avx512($($arg: $ty),*) $(-> $ret)? {
            generic($($arg),*)
        }
        if $isa >= $crate::isa::Isa::Avx512Bf16 {
            // SAFETY: `Isa::current` is Avx512Bf16 or wider only on a CPU with AVX-512 F/BW/VL
            // (and AVX2, FMA, F16C), the features `avx512` is compiled for.
            return unsafe { avx512($($arg),*) };
        }
    };
    ($($item:tt)*) => {
        $crate::multiversion::multiversion!(@builds [] $($item)*);
    };
}

pub(crate) use multiversion;
