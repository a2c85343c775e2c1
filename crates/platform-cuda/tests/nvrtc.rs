//! Every CUDA kernel module compiles through NVRTC for sm_90 (Hopper), with no GPU: NVRTC is
//! a library, so a machine with `libnvrtc.so.13` on its library path checks the kernels.
//! Without NVRTC the tests print why and pass, unless `SIMPLER_REQUIRE_NVRTC=1` (CI sets it)
//! makes the absence a failure.

#![cfg(feature = "cuda")]

use simpler_cuda::{CudaError, KernelCache, compile_cubin, compile_modules, nvrtc_version};

fn nvrtc_or_skip(test: &str) -> bool {
    match nvrtc_version() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("SIMPLER_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("SIMPLER_REQUIRE_NVRTC=1 but {e}");
            }
            eprintln!("SKIPPED {test}: {e}");
            false
        }
    }
}

fn tmp_cache(name: &str) -> KernelCache {
    let d = std::env::temp_dir().join(format!("simpler-nvrtc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    KernelCache::new(d)
}

/// All modules for sm_90: the first load compiles each, the second reads each from the cache.
#[test]
fn every_module_compiles_for_sm_90_and_the_second_load_compiles_nothing() {
    if !nvrtc_or_skip("every_module_compiles_for_sm_90") {
        return;
    }
    let cache = tmp_cache("all");
    let all = simpler_kernels_cuda::ALL;
    let kernels: usize = all.iter().map(|m| m.kernels.len()).sum();
    let (mods, first) = compile_modules(&cache, all, "sm_90").unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{first}");
    assert_eq!(
        (first.compiled, first.cached, first.kernels),
        (all.len(), 0, kernels)
    );
    for (src, cubin) in &mods {
        // A cubin is an ELF image.
        assert_eq!(&cubin[..4], b"\x7fELF", "module {}", src.name);
    }
    let (again, second) = compile_modules(&cache, all, "sm_90").unwrap();
    eprintln!("{second}");
    assert_eq!((second.compiled, second.cached), (0, all.len()));
    assert_eq!(
        mods.iter().map(|m| &m.1).collect::<Vec<_>>(),
        again.iter().map(|m| &m.1).collect::<Vec<_>>()
    );
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

/// A kernel NVRTC rejects is an error naming the module, the architecture and the log line.
#[test]
fn a_broken_kernel_is_rejected_with_the_compilers_log() {
    if !nvrtc_or_skip("a_broken_kernel_is_rejected") {
        return;
    }
    let src = "extern \"C\" __global__ void k(float* p) { p[0] = undefined_name; }";
    let e = compile_cubin("broken", src, "sm_90").unwrap_err();
    match &e {
        CudaError::Compile { module, arch, log } => {
            assert_eq!((module.as_str(), arch.as_str()), ("broken", "sm_90"));
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other}"),
    }
}

/// The machine code is for the architecture asked for: sm_90 and sm_80 cubins differ.
#[test]
fn the_architecture_reaches_the_compiler() {
    if !nvrtc_or_skip("the_architecture_reaches_the_compiler") {
        return;
    }
    let src = simpler_kernels_cuda::NORM.full_text();
    let a = compile_cubin("norm", &src, "sm_90").unwrap();
    let b = compile_cubin("norm", &src, "sm_80").unwrap();
    assert_ne!(a, b);
    let e = compile_cubin("norm", &src, "sm_1").unwrap_err();
    assert!(matches!(e, CudaError::Compile { .. }), "{e}");
}
