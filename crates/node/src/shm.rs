//! Shared memory: anonymous segments (memfd) handed to children at start-up by file
//! descriptor, and named segments under `/dev/shm` for buffers created later.
//!
//! No segment outlives its node. Anonymous segments have no name at all: the kernel frees them
//! when the last descriptor and mapping go. A named segment exists only between its creation
//! and the moment every child has mapped it: the parent then unlinks it (and unlinks it on
//! every error path too, through [`Named`]'s `Drop`). If the parent dies inside that window
//! (SIGKILL), the name stays; the next node of the same user removes every
//! `simpler-node.<pid>.` segment whose process no longer exists ([`sweep_stale`]).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use memmap2::MmapRaw;

use crate::error::NodeError;

/// Where named segments live.
pub(crate) const SHM_DIR: &str = "/dev/shm";
/// Prefix of every named segment: `simpler-node.<parent pid>.<node>.<buffer>`.
pub const SHM_PREFIX: &str = "simpler-node.";

/// A mapped segment (shared, read-write). Contents are reached through raw pointers only: other
/// processes write them, so no Rust reference to the bytes is ever made.
pub(crate) struct Segment {
    map: MmapRaw,
}

impl Segment {
    /// An anonymous segment of `len` bytes (zeroed) and its descriptor, close-on-exec (the
    /// spawner clears the flag for the one child process that inherits it).
    pub(crate) fn anonymous(name: &str, len: usize) -> Result<(Segment, OwnedFd), NodeError> {
        let cname = CString::new(name).expect("segment names have no NUL");
        // SAFETY: `cname` is a valid NUL-terminated string; the flags are valid.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(NodeError::os(format!("memfd_create {name}")));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let file = File::from(fd);
        file.set_len(len as u64)
            .map_err(|e| NodeError::io(format!("sizing {name} to {len} bytes"), e))?;
        let map =
            MmapRaw::map_raw(&file).map_err(|e| NodeError::io(format!("mapping {name}"), e))?;
        Ok((Segment { map }, OwnedFd::from(file)))
    }

    /// Maps a segment's descriptor (in a child, the one it inherited), taking ownership.
    pub(crate) fn from_fd(fd: OwnedFd, what: &str) -> Result<Segment, NodeError> {
        let file = File::from(fd);
        let map =
            MmapRaw::map_raw(&file).map_err(|e| NodeError::io(format!("mapping {what}"), e))?;
        Ok(Segment { map })
    }

    /// Maps the named segment `path` (in a child), which must be `len` bytes.
    pub(crate) fn open(path: &Path, len: usize) -> Result<Segment, NodeError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| NodeError::io(format!("opening {}", path.display()), e))?;
        let map = MmapRaw::map_raw(&file)
            .map_err(|e| NodeError::io(format!("mapping {}", path.display()), e))?;
        if map.len() != len {
            return Err(NodeError::Os {
                op: format!("mapping {}", path.display()),
                source: std::io::Error::other(format!("{} bytes, expected {len}", map.len())),
            });
        }
        Ok(Segment { map })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

/// A named segment while it has a name: unlinked on drop.
pub(crate) struct Named {
    path: PathBuf,
}

impl Named {
    /// Creates `/dev/shm/<name>` (exclusively, mode 0600) of `len` zeroed bytes and maps it.
    pub(crate) fn create(name: &str, len: usize) -> Result<(Named, Segment), NodeError> {
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| NodeError::io(format!("creating {}", path.display()), e))?;
        let named = Named { path };
        file.set_len(len as u64)
            .map_err(|e| NodeError::io(format!("sizing {}", named.path.display()), e))?;
        let map = MmapRaw::map_raw(&file)
            .map_err(|e| NodeError::io(format!("mapping {}", named.path.display()), e))?;
        Ok((named, Segment { map }))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Named {
    fn drop(&mut self) {
        // The mappings keep the memory; only the name goes.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes named segments left by node processes that no longer exist.
pub(crate) fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SHM_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if pid > 0 && !process_exists(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that `pid` exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Named segments of this process that exist now (the tests assert there are none).
pub fn segments_of_this_process() -> Vec<PathBuf> {
    let prefix = format!("{SHM_PREFIX}{}.", std::process::id());
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    dir.flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .map(|e| e.path())
        .collect()
}

/// Clears close-on-exec on `fd`. Called between fork and exec: async-signal-safe.
pub(crate) fn inherit(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor number; F_SETFD with 0 only clears FD_CLOEXEC.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets close-on-exec on `fd` (a child marks what it inherited, so that processes it starts
/// do not hold the node's pipes open).
pub(crate) fn close_on_exec(fd: &impl AsRawFd) {
    // SAFETY: fcntl on a descriptor this process owns; only sets FD_CLOEXEC.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
}
