//! Intel AMX (Advanced Matrix Extensions) support: whether the CPU has the tile units, and the
//! Linux permission a process needs before it may touch the tile registers.
//!
//! Linux keeps the 8 KiB tile-data state out of every thread's saved context until the
//! process asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); a tile
//! instruction executed without that permission faults (SIGILL). The request is made once per
//! process and covers all its threads, so the kernels call [`request_tile_permission`] through
//! [`crate::Isa::hardware`] and take a non-AMX path when it is refused (an old kernel, a
//! seccomp filter, a hypervisor that hides the state).

use std::sync::OnceLock;

/// `arch_prctl` code asking for permission to use an extended state component.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
/// The XSAVE state component of the AMX tile data (XTILEDATA).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// CPUID leaf 7 (sub-leaf 0) EDX bit of AMX-BF16.
#[cfg(target_arch = "x86_64")]
const AMX_BF16_BIT: u32 = 22;
/// CPUID leaf 7 (sub-leaf 0) EDX bit of AMX-TILE.
#[cfg(target_arch = "x86_64")]
const AMX_TILE_BIT: u32 = 24;

/// Whether CPUID leaf 7 reports `bit` in EDX. Read directly because the standard library's
/// detection of the AMX features is not stable yet; whether the OS supports the state is
/// what [`request_tile_permission`] asks.
#[cfg(target_arch = "x86_64")]
fn cpuid_leaf7_edx_has(bit: u32) -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only when the maximum leaf (leaf 0's EAX) says it exists.
    __cpuid(0).eax >= 7 && __cpuid_count(7, 0).edx & (1 << bit) != 0
}

/// Asks Linux, once per process, for the AMX tile-data state; whether it was granted (the
/// answer is cached). `false` on CPUs without AMX, on other operating systems and
/// architectures, and wherever the kernel refuses.
pub fn request_tile_permission() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        {
            if !cpuid_leaf7_edx_has(AMX_TILE_BIT) {
                return false;
            }
            // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, feature) takes two integers, touches no
            // memory of ours and only changes which state the kernel saves for this process;
            // a refusal is reported through the return value.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            };
            r == 0
        }
        #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
        {
            false
        }
    })
}

/// CPUID leaf 7 (sub-leaf 0) EDX bit of AMX-INT8.
#[cfg(target_arch = "x86_64")]
const AMX_INT8_BIT: u32 = 25;

/// Whether the CPU has AMX tiles and, when it does, `(amx-int8, amx-bf16)`. Says nothing about
/// the OS permission ([`request_tile_permission`]).
pub fn cpu_amx_features() -> Option<(bool, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        cpuid_leaf7_edx_has(AMX_TILE_BIT).then(|| {
            (
                cpuid_leaf7_edx_has(AMX_INT8_BIT),
                cpuid_leaf7_edx_has(AMX_BF16_BIT),
            )
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Whether the CPU has AMX tiles with the bf16 dot product (`tdpbf16ps`). Says nothing about
/// the OS permission ([`request_tile_permission`]).
pub(crate) fn bf16_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cpuid_leaf7_edx_has(AMX_TILE_BIT) && cpuid_leaf7_edx_has(AMX_BF16_BIT)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The permission is asked for once and the answer is stable; where granted, the CPU has
    /// AMX-BF16 and the kernels' detected hardware path is AMX.
    #[test]
    fn permission_is_cached_and_consistent_with_the_path() {
        let first = request_tile_permission();
        assert_eq!(request_tile_permission(), first);
        if first && bf16_supported() {
            assert_eq!(crate::Isa::hardware(), crate::Isa::AmxBf16);
        } else {
            assert_ne!(crate::Isa::hardware(), crate::Isa::AmxBf16);
            println!("AMX-BF16 not available here (tile permission granted: {first})");
        }
    }
}
