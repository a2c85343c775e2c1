//! `multiversion!`: one plain-Rust body compiled twice, once for the portable path and once
//! with AVX2+FMA+F16C enabled (the compiler vectorises it with 256-bit registers), dispatched
//! on [`crate::Isa::current`]. For kernels whose best AVX2 code is what the compiler makes of a
//! lane-blocked loop; the matrix and attention kernels use hand-written intrinsics instead.

/// Defines `$vis fn $name(args) -> ret { body }` dispatching to an AVX2 build of `body`.
macro_rules! multiversion {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
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
            if $crate::isa::Isa::current() >= $crate::isa::Isa::Avx2 {
                // SAFETY: `Isa::current` returns Avx2 or wider only when this CPU supports AVX2, FMA and
                // F16C, the features `avx2` is compiled for.
                return unsafe { avx2($($arg),*) };
            }
            generic($($arg),*)
        }
    };
}

pub(crate) use multiversion;
