//! Which instruction set the kernels run on: detected once at run time, overridable per thread
//! (tests run every kernel on both paths).

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction-set path the kernels can take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, any target.
    Portable,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
}

impl Isa {
    /// The best path this CPU supports (detected on first use, then cached).
    pub fn detected() -> Isa {
        static DETECTED: AtomicU8 = AtomicU8::new(0);
        match DETECTED.load(Ordering::Relaxed) {
            1 => Isa::Portable,
            2 => Isa::Avx2,
            _ => {
                let isa = if avx2_supported() {
                    Isa::Avx2
                } else {
                    Isa::Portable
                };
                DETECTED.store(if isa == Isa::Avx2 { 2 } else { 1 }, Ordering::Relaxed);
                isa
            }
        }
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => Isa::detected() == Isa::Avx2,
        }
    }

    /// The path kernels called on this thread take now: the [`with_isa`] override if one is
    /// active, else [`Isa::detected`].
    pub fn current() -> Isa {
        OVERRIDE.with(|o| o.get()).unwrap_or_else(Isa::detected)
    }

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
        }
    }
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
fn avx2_supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}
