//! Kernel compilation through NVRTC (loaded at run time; its absence is an error, never a
//! panic), straight to machine code for one architecture, through the on-disk cache.

use std::ffi::{CString, c_char, c_int};

use cudarc::nvrtc::{result, sys};
use simpler_kernels_cuda::KernelSource;

use crate::cache::{CacheKey, CompileReport, KernelCache};
use crate::{CompiledModules, CudaError};

/// Options every module is compiled with (besides the architecture).
pub(crate) const OPTIONS: &[&str] = &["--std=c++17", "--fmad=true"];

/// The NVRTC version, `(major, minor)`, after checking that the library loads.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    // SAFETY: `is_culib_present` only tries to open the library by its candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NvrtcMissing(
            "no libnvrtc found on the library search path".into(),
        ));
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are to live locals.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::NvrtcMissing(format!("nvrtcVersion failed: {e}")))?;
    Ok((major, minor))
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `create_program` and is destroyed only here. A failure
        // leaks the program and nothing else can be done about it in a destructor.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// The program's log as text.
fn program_log(prog: &Program) -> String {
    // SAFETY: `prog.0` is a live program.
    match unsafe { result::get_program_log(prog.0) } {
        Ok(log) => {
            let bytes: Vec<u8> = log
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).trim().to_string()
        }
        Err(e) => format!("(no log: {e})"),
    }
}

/// Compiles `source` to a cubin for `arch` (`sm_90`).
pub fn compile_cubin(module: &str, source: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    nvrtc_version()?;
    let fail = |log: String| CudaError::Compile {
        module: module.to_string(),
        arch: arch.to_string(),
        log,
    };
    let src = CString::new(source).map_err(|_| fail("the source contains a NUL byte".into()))?;
    let name = CString::new(format!("{module}.cu")).map_err(|_| fail("bad module name".into()))?;
    let prog = Program(
        result::create_program(&src, Some(&name)).map_err(|e| fail(format!("create: {e}")))?,
    );
    let mut options: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    // SAFETY: `prog.0` is a live program; the options are owned strings.
    if let Err(e) = unsafe { result::compile_program(prog.0, &options) } {
        return Err(fail(format!("{e}: {}", program_log(&prog))));
    }
    let mut size = 0usize;
    // SAFETY: live program, pointer to a local.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| fail(format!("no cubin ({e}); is `{arch}` a real architecture?")))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the `size` bytes NVRTC reported for this program.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| fail(format!("reading the cubin: {e}")))?;
    Ok(cubin)
}

/// The cache key of `source` for `arch` under NVRTC `version`.
pub(crate) fn cache_key(source: &KernelSource, arch: &str, version: (i32, i32)) -> CacheKey {
    CacheKey {
        module: source.name.to_string(),
        source: source.full_text(),
        options: OPTIONS.iter().map(|s| s.to_string()).collect(),
        arch: arch.to_string(),
        compiler: format!("nvrtc {}.{}", version.0, version.1),
    }
}

/// Every module of `sources` as a cubin for `arch`, through `cache`, with the report of what
/// was compiled and what was read.
pub fn compile_modules(
    cache: &KernelCache,
    sources: &[KernelSource],
    arch: &str,
) -> Result<(CompiledModules, CompileReport), CudaError> {
    let version = nvrtc_version()?;
    let start = std::time::Instant::now();
    let mut report = CompileReport {
        arch: arch.to_string(),
        compiler: format!("nvrtc {}.{}", version.0, version.1),
        dir: cache.dir().to_path_buf(),
        ..CompileReport::default()
    };
    let mut out = Vec::with_capacity(sources.len());
    for src in sources {
        let key = cache_key(src, arch, version);
        let (cubin, outcome) =
            cache.get_or_compile(&key, || compile_cubin(src.name, &key.source, arch))?;
        report.add(outcome, src.kernels.len());
        out.push((*src, cubin));
    }
    report.elapsed = start.elapsed();
    Ok((out, report))
}
