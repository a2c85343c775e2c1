//! The on-disk cache of compiled kernel modules.
//!
//! An entry is keyed by everything that changes the machine code: the module's full source,
//! the compiler options, the target architecture and the compiler's version. The file name is
//! a hash of the key, and the file stores the key itself in front of the binary, so a lookup
//! compares the whole key and a hash collision or a stale file recompiles instead of loading
//! the wrong code. Files are written to a temporary name and renamed, so a reader never sees
//! half a file and two processes filling the cache at once do no harm.
//!
//! This module does no CUDA call: the compiler is a closure, so the cache is tested on any
//! machine.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::CudaError;

/// The environment variable that overrides the cache directory.
pub const CACHE_DIR_ENV: &str = "SIMPLER_KERNEL_CACHE";

const MAGIC: &[u8] = b"simpler-kernel-cache 1\n";

/// What identifies one compiled module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    /// Module name (used in the file name, for people).
    pub module: String,
    /// The full source text compiled.
    pub source: String,
    /// Compiler options, in order.
    pub options: Vec<String>,
    /// Target architecture (`sm_90`).
    pub arch: String,
    /// The compiler and its version (`nvrtc 13.0`).
    pub compiler: String,
}

impl CacheKey {
    /// The key as bytes: each part length-prefixed, so no two keys serialise alike.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut part = |s: &str| {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        };
        part(&self.module);
        part(&self.arch);
        part(&self.compiler);
        part(&self.options.join("\u{1f}"));
        part(&self.source);
        out
    }

    /// The file name of the entry: module, architecture and a 64-bit FNV-1a hash of the key.
    pub fn file_name(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.encode() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let module: String = self
            .module
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        format!("{module}-{}-{h:016x}.bin", self.arch)
    }
}

/// Where an entry came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Compiled now (and stored).
    Compiled,
    /// Read from the cache.
    Cached,
}

/// How many modules a load compiled and how many it read from the cache, and the time spent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompileReport {
    /// Modules compiled now.
    pub compiled: usize,
    /// Modules read from the cache.
    pub cached: usize,
    /// Kernels (entry points) in those modules.
    pub kernels: usize,
    /// Wall time of the compiles and cache reads.
    pub elapsed: Duration,
    /// Target architecture.
    pub arch: String,
    /// Compiler and version.
    pub compiler: String,
    /// The cache directory.
    pub dir: PathBuf,
}

impl CompileReport {
    /// Counts one module.
    pub fn add(&mut self, outcome: Outcome, kernels: usize) {
        match outcome {
            Outcome::Compiled => self.compiled += 1,
            Outcome::Cached => self.cached += 1,
        }
        self.kernels += kernels;
    }
}

impl fmt::Display for CompileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "kernels: {} modules ({} kernels) for {} by {}: {} compiled, {} from the cache, \
             {:.3} s (cache {})",
            self.compiled + self.cached,
            self.kernels,
            self.arch,
            self.compiler,
            self.compiled,
            self.cached,
            self.elapsed.as_secs_f64(),
            self.dir.display()
        )
    }
}

/// A directory of compiled modules.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    /// A cache in `dir` (created on the first store).
    pub fn new(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// The default cache: `$SIMPLER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/simpler/kernels`,
    /// else `$HOME/.cache/simpler/kernels`, else `simpler-kernels` in the temporary directory.
    pub fn default_location() -> KernelCache {
        let non_empty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let dir = if let Some(d) = non_empty(CACHE_DIR_ENV) {
            PathBuf::from(d)
        } else if let Some(d) = non_empty("XDG_CACHE_HOME") {
            PathBuf::from(d).join("simpler").join("kernels")
        } else if let Some(d) = non_empty("HOME") {
            PathBuf::from(d)
                .join(".cache")
                .join("simpler")
                .join("kernels")
        } else {
            std::env::temp_dir().join("simpler-kernels")
        };
        KernelCache { dir }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The binary for `key`: read from the cache when a file holds exactly this key, else
    /// made by `compile` and stored. A missing, truncated or foreign file is recompiled; a
    /// cache that cannot be written is an error (a second run would compile everything again
    /// without saying why).
    pub fn get_or_compile(
        &self,
        key: &CacheKey,
        compile: impl FnOnce() -> Result<Vec<u8>, CudaError>,
    ) -> Result<(Vec<u8>, Outcome), CudaError> {
        let path = self.dir.join(key.file_name());
        let encoded = key.encode();
        if let Ok(bytes) = std::fs::read(&path)
            && let Some(binary) = entry_binary(&bytes, &encoded)
        {
            return Ok((binary.to_vec(), Outcome::Cached));
        }
        let binary = compile()?;
        self.store(&path, &encoded, &binary)?;
        Ok((binary, Outcome::Compiled))
    }

    fn store(&self, path: &Path, key: &[u8], binary: &[u8]) -> Result<(), CudaError> {
        let err = |p: &Path, e: std::io::Error| CudaError::Cache {
            path: p.to_path_buf(),
            detail: e.to_string(),
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| err(&self.dir, e))?;
        let mut bytes = Vec::with_capacity(MAGIC.len() + 16 + key.len() + binary.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(key.len() as u64).to_le_bytes());
        bytes.extend_from_slice(key);
        bytes.extend_from_slice(&(binary.len() as u64).to_le_bytes());
        bytes.extend_from_slice(binary);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &bytes).map_err(|e| err(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| err(path, e))
    }
}

/// The binary of a cache file if the file is whole and holds exactly `key`.
fn entry_binary<'a>(bytes: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let rest = bytes.strip_prefix(MAGIC)?;
    let (klen, rest) = rest.split_first_chunk::<8>()?;
    let klen = usize::try_from(u64::from_le_bytes(*klen)).ok()?;
    if rest.len() < klen || &rest[..klen] != key {
        return None;
    }
    let (blen, binary) = rest[klen..].split_first_chunk::<8>()?;
    let blen = usize::try_from(u64::from_le_bytes(*blen)).ok()?;
    (binary.len() == blen).then_some(binary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn key() -> CacheKey {
        CacheKey {
            module: "norm".into(),
            source: "__global__ void f() {}".into(),
            options: vec!["--gpu-architecture=sm_90".into()],
            arch: "sm_90".into(),
            compiler: "nvrtc 13.0".into(),
        }
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("simpler-cache-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn second_lookup_compiles_nothing() {
        let dir = tmpdir("second");
        let cache = KernelCache::new(&dir);
        let calls = Cell::new(0);
        let compile = || {
            calls.set(calls.get() + 1);
            Ok(vec![1u8, 2, 3])
        };
        let (b, o) = cache.get_or_compile(&key(), compile).unwrap();
        assert_eq!((b, o), (vec![1, 2, 3], Outcome::Compiled));
        let (b, o) = cache.get_or_compile(&key(), compile).unwrap();
        assert_eq!((b, o), (vec![1, 2, 3], Outcome::Cached));
        assert_eq!(calls.get(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_part_of_the_key_matters() {
        let dir = tmpdir("parts");
        let cache = KernelCache::new(&dir);
        cache.get_or_compile(&key(), || Ok(vec![0])).unwrap();
        let variants = [
            CacheKey {
                source: "__global__ void g() {}".into(),
                ..key()
            },
            CacheKey {
                options: vec!["--fmad=false".into()],
                ..key()
            },
            CacheKey {
                arch: "sm_80".into(),
                ..key()
            },
            CacheKey {
                compiler: "nvrtc 13.1".into(),
                ..key()
            },
        ];
        for (i, k) in variants.iter().enumerate() {
            let (b, o) = cache.get_or_compile(k, || Ok(vec![i as u8 + 1])).unwrap();
            assert_eq!(
                (b, o),
                (vec![i as u8 + 1], Outcome::Compiled),
                "variant {i}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file under the right name that holds another key (a collision, or a file from
    /// elsewhere), or a truncated one, is recompiled and replaced.
    #[test]
    fn foreign_or_truncated_files_are_recompiled() {
        let dir = tmpdir("foreign");
        let cache = KernelCache::new(&dir);
        let path = dir.join(key().file_name());
        let other = CacheKey {
            source: "other".into(),
            ..key()
        };
        cache.get_or_compile(&other, || Ok(vec![9; 100])).unwrap();
        std::fs::rename(dir.join(other.file_name()), &path).unwrap();
        let (b, o) = cache.get_or_compile(&key(), || Ok(vec![7])).unwrap();
        assert_eq!((b, o), (vec![7], Outcome::Compiled));
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(&path, &whole[..whole.len() - 1]).unwrap();
        let (_, o) = cache.get_or_compile(&key(), || Ok(vec![7])).unwrap();
        assert_eq!(o, Outcome::Compiled);
        let (_, o) = cache.get_or_compile(&key(), || Ok(vec![8])).unwrap();
        assert_eq!(o, Outcome::Cached);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_compile_stores_nothing() {
        let dir = tmpdir("failed");
        let cache = KernelCache::new(&dir);
        let e = cache
            .get_or_compile(&key(), || Err(CudaError::invalid("source", "bad")))
            .unwrap_err();
        assert!(e.to_string().contains("invalid source"));
        assert!(!dir.join(key().file_name()).exists());
    }

    #[test]
    fn an_unwritable_cache_is_an_error_naming_the_path() {
        let file = tmpdir("unwritable");
        std::fs::write(&file, b"not a directory").unwrap();
        let cache = KernelCache::new(file.join("sub"));
        let e = cache.get_or_compile(&key(), || Ok(vec![1])).unwrap_err();
        assert!(matches!(e, CudaError::Cache { .. }), "{e}");
        assert!(e.to_string().contains("sub"), "{e}");
        std::fs::remove_file(&file).unwrap();
    }
}
