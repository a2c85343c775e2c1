//! Linux's permission gate for the AMX tile registers.
//!
//! The AMX tile data (8 KiB of state) is an XSAVE component that Linux leaves disabled for a
//! process until the process asks for it: the first tile instruction of a thread that never
//! asked raises SIGILL. Asking (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) grants it
//! to every thread of the process, now and later, so one request per process is enough; the
//! answer is cached. A kernel that wants tiles calls [`request_tile_permission`] and takes
//! another path when it says no (an old kernel, a seccomp filter, a CPU without AMX).

use std::sync::OnceLock;

/// `arch_prctl` code that asks for an extended state component (`asm/prctl.h`).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
/// XSAVE component number of the AMX tile data.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Asks Linux (once per process) for the AMX tile state; `true` when granted. Later calls
/// return the first answer.
pub fn request_tile_permission() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(request_once)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_once() -> bool {
    if !cpu_has_amx_tile() {
        return false;
    }
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, n)` takes two integer arguments, reads and
    // writes no user memory, and only changes which XSAVE components this process may use;
    // an unknown request or component is answered with an error return, not a fault.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

/// Whether the CPU has AMX tiles and, when it does, `(amx-int8, amx-bf16)`: CPUID leaf 7
/// sub-leaf 0, EDX bits 24 (tile), 25 (int8) and 22 (bf16). Read directly because
/// `is_x86_feature_detected!` does not accept the AMX names on stable Rust.
#[cfg(target_arch = "x86_64")]
pub fn cpu_amx_features() -> Option<(bool, bool)> {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only when the maximum leaf (leaf 0's EAX) reaches it.
    if __cpuid(0).eax < 7 {
        return None;
    }
    let edx = __cpuid_count(7, 0).edx;
    (edx & (1 << 24) != 0).then_some((edx & (1 << 25) != 0, edx & (1 << 22) != 0))
}

/// Whether the CPU has AMX tiles (see [`cpu_amx_features`]).
#[cfg(not(target_arch = "x86_64"))]
pub fn cpu_amx_features() -> Option<(bool, bool)> {
    None
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_amx_tile() -> bool {
    cpu_amx_features().is_some()
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_once() -> bool {
    false
}
