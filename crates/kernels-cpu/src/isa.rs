//! Which instruction set the kernels run on: detected once at run time, overridable per thread
//! (tests run every kernel on every path the CPU has) and cappable per process with the
//! `SIMPLER_ISA` environment variable (benches compare paths on one machine).
//!
//! The paths are ordered: each one's CPU features include those of the paths below it
//! (every CPU with AVX-512 BF16 also has AVX2, FMA and F16C), so a kernel that has no code of
//! its own for a path takes the best lower path it has (`Isa::current() >= Isa::Avx2`).

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction-set path the kernels can take, from the most portable to the widest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, any target.
    Portable,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// AVX2 plus AVX-512 F/BW/VL and AVX-512 BF16 (`vdpbf16ps`: bf16 pair dot products into
    /// fp32).
    Avx512Bf16,
    /// AVX-512 BF16 plus AMX-BF16 tiles (`tdpbf16ps`), with the tile state granted by the OS
    /// ([`crate::amx::request_tile_permission`]).
    AmxBf16,
}

impl Isa {
    /// Every path, in order.
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512Bf16, Isa::AmxBf16];

    /// The best path this CPU (and OS) supports, whatever `SIMPLER_ISA` says. Detected on first
    /// use, then cached.
    pub fn hardware() -> Isa {
        static HW: OnceLock<Isa> = OnceLock::new();
        *HW.get_or_init(detect_hardware)
    }

    /// The path kernels take when nothing overrides it on the thread: [`Isa::hardware`],
    /// lowered to the path named by the `SIMPLER_ISA` environment variable when that is set
    /// (`portable`, `avx2`, `avx512-bf16` or `amx-bf16`; a path above the hardware's is
    /// capped at the hardware's). Read once, then cached.
    ///
    /// # Panics
    /// On first use, if `SIMPLER_ISA` is set to a name that is not a path (a typo must not
    /// silently bench the wrong path).
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let hw = Isa::hardware();
            match std::env::var("SIMPLER_ISA") {
                Ok(name) => match Isa::from_name(&name) {
                    Some(want) => want.min(hw),
                    None => panic!(
                        "SIMPLER_ISA={name:?} is not one of {:?}",
                        Isa::ALL.map(Isa::name)
                    ),
                },
                Err(_) => hw,
            }
        })
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        self <= Isa::hardware()
    }

    /// The path kernels called on this thread take now: the [`with_isa`] override if one is
    /// active, else the process-wide [`set_process_isa`] choice if one is set, else
    /// [`Isa::detected`].
    pub fn current() -> Isa {
        OVERRIDE
            .with(|o| o.get())
            .unwrap_or_else(|| match PROCESS.load(Ordering::Relaxed) {
                0 => Isa::detected(),
                i => Isa::ALL[usize::from(i) - 1],
            })
    }

    /// Lower-case name (what `SIMPLER_ISA` takes).
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512Bf16 => "avx512-bf16",
            Isa::AmxBf16 => "amx-bf16",
        }
    }

    /// The path called `name` (as [`Isa::name`] spells it).
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name.trim())
    }
}

/// The [`set_process_isa`] choice: 0 for none, else its index in [`Isa::ALL`] plus one.
static PROCESS: AtomicU8 = AtomicU8::new(0);

/// Makes every thread without a [`with_isa`] override take `isa` (`None`: back to
/// [`Isa::detected`]), so a benchmark can alternate paths step by step in one process (the
/// kernels run on the runtime's worker threads, which a thread-local override cannot reach).
/// A kernel reads the path once per call, so a call in flight when it changes finishes on the
/// path it started on.
///
/// Returns `false` (and changes nothing) when this CPU cannot run `isa`.
pub fn set_process_isa(isa: Option<Isa>) -> bool {
    let v = match isa {
        Some(i) if !i.is_supported() => return false,
        Some(i) => Isa::ALL
            .iter()
            .position(|&a| a == i)
            .map_or(0, |p| p as u8 + 1),
        None => 0,
    };
    PROCESS.store(v, Ordering::Relaxed);
    true
}

thread_local! {
    static OVERRIDE: Cell<Option<Isa>> = const { Cell::new(None) };
}

/// Runs `f` with every kernel called on this thread taking the `isa` path.
///
/// Returns `None` (without running `f`) when this CPU cannot run `isa`.
pub fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> Option<R> {
    if !isa.is_supported() {
        return None;
    }
    struct Restore(Option<Isa>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(isa))));
    Some(f())
}

#[cfg(target_arch = "x86_64")]
fn detect_hardware() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    if !avx2 {
        return Isa::Portable;
    }
    // `is_x86_feature_detected!` also checks that the OS saves the zmm state (XCR0).
    let avx512_bf16 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16");
    if !avx512_bf16 {
        return Isa::Avx2;
    }
    if crate::amx::bf16_supported() && crate::amx::request_tile_permission() {
        return Isa::AmxBf16;
    }
    Isa::Avx512Bf16
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_hardware() -> Isa {
    Isa::Portable
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_paths_are_ordered() {
        for (i, isa) in Isa::ALL.into_iter().enumerate() {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
            if i > 0 {
                assert!(Isa::ALL[i - 1] < isa);
            }
        }
        assert_eq!(Isa::from_name("avx512"), None);
    }

    #[test]
    fn a_supported_path_implies_every_lower_one() {
        let hw = Isa::hardware();
        for isa in Isa::ALL {
            assert_eq!(isa.is_supported(), isa <= hw, "{isa:?}");
            assert_eq!(
                with_isa(isa, Isa::current),
                isa.is_supported().then_some(isa)
            );
        }
        println!("hardware path: {}", hw.name());
    }

    #[test]
    fn the_process_choice_reaches_other_threads_and_yields_to_with_isa() {
        assert!(set_process_isa(Some(Isa::Portable)));
        let seen = std::thread::spawn(Isa::current).join().expect("thread");
        assert_eq!(seen, Isa::Portable);
        if Isa::Avx2.is_supported() {
            assert_eq!(with_isa(Isa::Avx2, Isa::current), Some(Isa::Avx2));
        }
        assert!(set_process_isa(None));
        assert_eq!(
            std::thread::spawn(Isa::current).join().expect("thread"),
            Isa::detected()
        );
    }
}
