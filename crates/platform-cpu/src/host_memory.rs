//! How much host memory a run may still take: the smaller of the kernel's `MemAvailable` and
//! the room left under this process's cgroup limit (v2 `memory.max` − `memory.current`, or
//! v1 `memory.limit_in_bytes` − `memory.usage_in_bytes`). A container's limit is usually far
//! below the host's free memory, and the OOM killer acts on the cgroup's, silently.

use std::path::Path;

/// Memory a run may take, and where the figure comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes available to this process now.
    pub available: u64,
    /// Which limit binds (e.g. "MemAvailable" or "cgroup memory.max").
    pub source: String,
}

/// The memory available now, or `None` where neither `/proc/meminfo` nor a cgroup limit can
/// be read (not Linux).
pub fn available() -> Option<HostMemory> {
    available_from(Path::new("/proc/meminfo"), Path::new("/sys/fs/cgroup"))
}

/// [`available`] over the given files (tests point these at fixtures).
pub fn available_from(meminfo: &Path, cgroup_root: &Path) -> Option<HostMemory> {
    let mem = std::fs::read_to_string(meminfo)
        .ok()
        .and_then(|t| mem_available(&t))
        .map(|b| HostMemory {
            available: b,
            source: "MemAvailable".into(),
        });
    let cg = cgroup_room(cgroup_root);
    match (mem, cg) {
        (Some(m), Some(c)) => Some(if c.available < m.available { c } else { m }),
        (m, c) => m.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut it = line.split_whitespace().skip(1);
    let kib: u64 = it.next()?.parse().ok()?;
    kib.checked_mul(1024)
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A key's value in a cgroup `memory.stat` file (`None` where absent or unreadable).
fn stat_value(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Room under the cgroup limit: v2 first (`max` means none), then v1 (a huge value means none).
/// The usage counts the page cache, and the inactive file pages of it are what the kernel
/// reclaims first under the limit: they are taken off (the "working set", as the kubelet
/// reads it), or a container that has just read its weights would show almost no room.
fn cgroup_room(root: &Path) -> Option<HostMemory> {
    if let (Ok(max), Some(current)) = (
        std::fs::read_to_string(root.join("memory.max")),
        read_u64(&root.join("memory.current")),
    ) {
        let max = max.trim();
        if max == "max" {
            return None;
        }
        let limit: u64 = max.parse().ok()?;
        let cache = stat_value(&root.join("memory.stat"), "inactive_file").unwrap_or(0);
        return Some(HostMemory {
            available: limit.saturating_sub(current.saturating_sub(cache)),
            source: format!("cgroup memory.max {:.1} GiB", limit as f64 / GIB),
        });
    }
    let v1 = root.join("memory");
    let limit = read_u64(&v1.join("memory.limit_in_bytes"))?;
    let usage = read_u64(&v1.join("memory.usage_in_bytes"))?;
    // v1 reports "no limit" as a page-rounded i64::MAX.
    if limit >= 1 << 60 {
        return None;
    }
    let cache = stat_value(&v1.join("memory.stat"), "total_inactive_file").unwrap_or(0);
    Some(HostMemory {
        available: limit.saturating_sub(usage.saturating_sub(cache)),
        source: format!("cgroup memory.limit_in_bytes {:.1} GiB", limit as f64 / GIB),
    })
}

const GIB: f64 = (1u64 << 30) as f64;

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("simpler-hostmem-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("memory")).unwrap();
        d
    }

    #[test]
    fn the_smaller_of_meminfo_and_the_cgroup_room_binds() {
        let d = dir("v2");
        let meminfo = d.join("meminfo");
        std::fs::write(&meminfo, "MemTotal: 100 kB\nMemAvailable:    2048 kB\n").unwrap();
        // No cgroup files: MemAvailable.
        let m = available_from(&meminfo, &d).unwrap();
        assert_eq!((m.available, m.source.as_str()), (2 << 20, "MemAvailable"));
        // v2 with room 1 MiB: the cgroup binds.
        std::fs::write(d.join("memory.max"), "3145728\n").unwrap();
        std::fs::write(d.join("memory.current"), "2097152\n").unwrap();
        let m = available_from(&meminfo, &d).unwrap();
        assert_eq!(m.available, 1 << 20);
        assert!(m.source.contains("memory.max"), "{}", m.source);
        // "max": no limit.
        std::fs::write(d.join("memory.max"), "max\n").unwrap();
        assert_eq!(available_from(&meminfo, &d).unwrap().available, 2 << 20);
        // Usage above the limit leaves no room (not an underflow).
        std::fs::write(d.join("memory.max"), "100\n").unwrap();
        std::fs::write(d.join("memory.current"), "200\n").unwrap();
        assert_eq!(available_from(&meminfo, &d).unwrap().available, 0);
        // Inactive file pages (reclaimable cache) are not counted as used.
        std::fs::write(d.join("memory.max"), "3145728\n").unwrap();
        std::fs::write(d.join("memory.current"), "3145728\n").unwrap();
        std::fs::write(
            d.join("memory.stat"),
            "anon 1048576\nfile 2097152\ninactive_file 1048576\nactive_file 1048576\n",
        )
        .unwrap();
        assert_eq!(available_from(&meminfo, &d).unwrap().available, 1 << 20);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn cgroup_v1_limits_and_unreadable_files() {
        let d = dir("v1");
        std::fs::write(d.join("memory/memory.limit_in_bytes"), "4096\n").unwrap();
        std::fs::write(d.join("memory/memory.usage_in_bytes"), "1024\n").unwrap();
        let m = available_from(&d.join("absent"), &d).unwrap();
        assert_eq!(m.available, 3072);
        // The hierarchy's inactive file pages are reclaimable: not counted as used.
        std::fs::write(
            d.join("memory/memory.stat"),
            "cache 2048\ninactive_file 1\ntotal_inactive_file 1024\n",
        )
        .unwrap();
        assert_eq!(
            available_from(&d.join("absent"), &d).unwrap().available,
            4096
        );
        std::fs::remove_file(d.join("memory/memory.stat")).unwrap();
        std::fs::write(
            d.join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        assert_eq!(available_from(&d.join("absent"), &d), None);
        assert_eq!(mem_available("MemAvailable: lots kB"), None);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn this_machine_reports_something_plausible() {
        if let Some(m) = available() {
            assert!(m.available > 0, "{m:?}");
        }
    }
}
