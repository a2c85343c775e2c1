//! The child side: a child process is the parent's own binary started again with
//! [`CHILD_ENV`] set; [`child_main_if_requested`], called first thing in `main`, sees it and
//! runs the child's loop instead of the program.
//!
//! A child maps the control segment (its mailbox) and, for chips, the collective segment,
//! runs the start hook, reports ready, and then answers commands until the parent says stop
//! or goes away: it reads its doorbell pipe, which returns end-of-file when the parent is gone
//! (and the parent-death signal, set before `exec`, ends it in any case).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::ops::Range;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;

use simpler_core::Worker;

use crate::buffer::{SharedBuffer, SharedBufferId};
use crate::collective::shm::{ShmCollectives, segment_bytes};
use crate::error::ChildId;
use crate::mailbox::{self, MAILBOX_BYTES, Mailbox};
use crate::shm::{self, Segment};

/// The environment variable that makes a process a node child; its value names the child's
/// role and index, the parent's pid and the descriptors it inherits.
pub const CHILD_ENV: &str = "SIMPLER_NODE_CHILD";

/// Command kinds (the mailbox's `cmd_kind`).
pub(crate) const CMD_CALL: u32 = 1;
pub(crate) const CMD_MAP: u32 = 2;
pub(crate) const CMD_SHUTDOWN: u32 = 3;
pub(crate) const CMD_UNMAP: u32 = 4;
/// A node task: the buffers it declared, then a call.
pub(crate) const CMD_TASK: u32 = 5;
/// Answer statuses.
pub(crate) const STATUS_OK: u32 = 0;
pub(crate) const STATUS_ERR: u32 = 1;

/// A function the parent can run in a child: gets the child's context and the call's bytes,
/// returns the answer's bytes or a message.
pub type ChildFn = fn(&mut ChildCtx, &[u8]) -> Result<Vec<u8>, String>;

/// A check run in each child before it reports ready.
pub type StartHook = fn(&mut ChildCtx) -> Result<(), String>;

/// Builds chip `i`'s chip-level worker (its platform and cores), in the chip's process.
pub type ChipWorkerFn = fn(usize) -> Result<Worker, String>;

/// What children can do: named functions and a start hook. Built the same way in the parent
/// and in the children (the same binary builds it in `main`).
#[derive(Default)]
pub struct ChildFns {
    fns: HashMap<&'static str, ChildFn>,
    on_start: Option<StartHook>,
    chip_worker: Option<ChipWorkerFn>,
}

impl ChildFns {
    /// No functions.
    pub fn new() -> ChildFns {
        ChildFns::default()
    }

    /// Adds function `name`.
    pub fn register(mut self, name: &'static str, f: ChildFn) -> ChildFns {
        self.fns.insert(name, f);
        self
    }

    /// Runs `hook` in each child before it reports ready (an error fails the node's start
    /// with the child's message).
    pub fn on_start(mut self, hook: StartHook) -> ChildFns {
        self.on_start = Some(hook);
        self
    }

    /// Gives every chip its own chip-level [`Worker`], built by `make` in the chip's process
    /// before it reports ready (an error fails the node's start with the message) and closed
    /// when the chip shuts down. The worker's threads start there, after `exec`.
    pub fn chip_worker(mut self, make: ChipWorkerFn) -> ChildFns {
        self.chip_worker = Some(make);
        self
    }
}

/// What a child function sees.
pub struct ChildCtx {
    id: ChildId,
    chips: usize,
    collectives: Option<ShmCollectives>,
    buffers: HashMap<SharedBufferId, SharedBuffer>,
    worker: Option<Worker>,
    /// The buffers the running node task declared, in declaration order, with the bytes it
    /// declared of each.
    task_buffers: Vec<(SharedBufferId, Range<usize>)>,
}

impl ChildCtx {
    /// The chip's worker (chips of a node whose `ChildFns` has a
    /// [`chip_worker`](ChildFns::chip_worker)).
    pub fn worker(&self) -> Option<&Worker> {
        self.worker.as_ref()
    }

    /// Which child this is.
    pub fn id(&self) -> ChildId {
        self.id
    }

    /// Number of chips in the node (the collectives' rank count).
    pub fn chips(&self) -> usize {
        self.chips
    }

    /// The chips' communicator (chips only).
    pub fn collectives(&mut self) -> Option<&mut ShmCollectives> {
        self.collectives.as_mut()
    }

    /// A shared buffer the parent created (and this child has mapped).
    pub fn buffer(&self, id: SharedBufferId) -> Option<&SharedBuffer> {
        self.buffers.get(&id)
    }

    /// The `k`-th buffer the running node task declared (`NodeTask::reads`, `writes`,
    /// `reads_bytes` and `writes_bytes`, in the order of those calls); `None` outside a node
    /// task or past the last.
    pub fn task_buffer(&self, k: usize) -> Option<&SharedBuffer> {
        self.buffers.get(&self.task_buffers.get(k)?.0)
    }

    /// The bytes of the `k`-th declared buffer the task declared (`0..len` for a whole
    /// buffer): the only bytes of it the node ordered this task against, so the only ones it
    /// may touch while tasks that declared other bytes run.
    pub fn task_bytes(&self, k: usize) -> Option<Range<usize>> {
        Some(self.task_buffers.get(k)?.1.clone())
    }

    /// How many buffers the running node task declared.
    pub fn task_buffers(&self) -> usize {
        self.task_buffers.len()
    }
}

/// How a child is started: everything it needs, passed in [`CHILD_ENV`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Spec {
    pub(crate) id: ChildId,
    pub(crate) chips: usize,
    /// Index of its mailbox in the control segment.
    pub(crate) slot: usize,
    pub(crate) parent: i32,
    pub(crate) ctl_fd: RawFd,
    pub(crate) cmd_fd: RawFd,
    pub(crate) done_fd: RawFd,
    /// The collective segment (chips only) and its per-rank capacity.
    pub(crate) coll_fd: Option<RawFd>,
    pub(crate) coll_cap: usize,
}

impl Spec {
    pub(crate) fn encode(&self) -> String {
        let (role, index) = match self.id {
            ChildId::Chip(i) => ("chip", i),
            ChildId::Sub(i) => ("sub", i),
        };
        format!(
            "{role},{index},{},{},{},{},{},{},{},{}",
            self.chips,
            self.slot,
            self.parent,
            self.ctl_fd,
            self.cmd_fd,
            self.done_fd,
            self.coll_fd.unwrap_or(-1),
            self.coll_cap
        )
    }

    pub(crate) fn decode(s: &str) -> Option<Spec> {
        let mut it = s.split(',');
        let role = it.next()?;
        let mut num = || it.next()?.parse::<i64>().ok();
        let index = usize::try_from(num()?).ok()?;
        let id = match role {
            "chip" => ChildId::Chip(index),
            "sub" => ChildId::Sub(index),
            _ => return None,
        };
        let chips = usize::try_from(num()?).ok()?;
        let slot = usize::try_from(num()?).ok()?;
        let parent = i32::try_from(num()?).ok()?;
        let fd = |v: i64| i32::try_from(v).ok();
        let ctl_fd = fd(num()?)?;
        let cmd_fd = fd(num()?)?;
        let done_fd = fd(num()?)?;
        let coll = fd(num()?)?;
        let coll_cap = usize::try_from(num()?).ok()?;
        // The child takes ownership of each descriptor: one named twice would be closed twice,
        // and stdin/out/err are not the parent's pipes or segments.
        let mut fds = vec![ctl_fd, cmd_fd, done_fd];
        if coll >= 0 {
            fds.push(coll);
        }
        fds.sort_unstable();
        if fds[0] <= 2 || fds.windows(2).any(|w| w[0] == w[1]) {
            return None;
        }
        Some(Spec {
            id,
            chips,
            slot,
            parent,
            ctl_fd,
            cmd_fd,
            done_fd,
            coll_fd: (coll >= 0).then_some(coll),
            coll_cap,
        })
    }
}

/// In a node child, runs the child and exits the process; elsewhere returns at once. Call it
/// first thing in `main`, before any thread starts and before parsing arguments.
pub fn child_main_if_requested(fns: &ChildFns) {
    let Ok(value) = std::env::var(CHILD_ENV) else {
        return;
    };
    let Some(spec) = Spec::decode(&value) else {
        eprintln!("simpler-node: malformed {CHILD_ENV}={value}");
        std::process::exit(2);
    };
    std::process::exit(run(fns, &spec));
}

/// The child's life; returns its exit code.
fn run(fns: &ChildFns, spec: &Spec) -> i32 {
    // The parent-death signal was set between fork and exec; if the parent died before that,
    // this process was re-parented and must not run.
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } != spec.parent {
        return 3;
    }
    // `decode` refused a descriptor named twice or below 3; one that is not open (a variable
    // set by hand) is refused here, before anything takes ownership of it.
    let fds = [spec.ctl_fd, spec.cmd_fd, spec.done_fd];
    if let Some(fd) = fds.into_iter().chain(spec.coll_fd).find(|&fd| {
        // SAFETY: F_GETFD reads a descriptor's flags and touches no memory.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        flags < 0
    }) {
        eprintln!("simpler-node {}: descriptor {fd} is not open", spec.id);
        return 4;
    }
    // SAFETY: the parent passed these descriptors to this process for these pipes (each open,
    // checked above, and distinct, checked by `decode`) and nothing else in this process owns
    // them.
    let (mut doorbell, mut answer_bell) = unsafe {
        (
            File::from_raw_fd(spec.cmd_fd),
            File::from_raw_fd(spec.done_fd),
        )
    };
    shm::close_on_exec(&doorbell);
    shm::close_on_exec(&answer_bell);
    // SAFETY: the parent passed this descriptor to this process for the control segment and
    // nothing else in this process owns it.
    let ctl_fd = unsafe { OwnedFd::from_raw_fd(spec.ctl_fd) };
    let ctl = match Segment::from_fd(ctl_fd, "the control segment") {
        Ok(s) => s,
        Err(e) => {
            eprintln!("simpler-node {}: {e}", spec.id);
            return 4;
        }
    };
    let mailbox_end = spec
        .slot
        .checked_add(1)
        .and_then(|n| n.checked_mul(MAILBOX_BYTES));
    if mailbox_end.is_none_or(|end| ctl.len() < end) {
        eprintln!("simpler-node {}: control segment too small", spec.id);
        return 4;
    }
    // SAFETY: the slot's mailbox lies in the mapping (checked), which lives until this function
    // returns, is page-aligned, and this child is the only one using this slot.
    let mbox = unsafe { Mailbox::new(ctl.ptr().add(spec.slot * MAILBOX_BYTES)) };
    let ring = |bell: &mut File| bell.write_all(&[1]).is_ok();

    let mut ctx = ChildCtx {
        id: spec.id,
        chips: spec.chips,
        collectives: None,
        buffers: HashMap::new(),
        worker: None,
        task_buffers: Vec::new(),
    };
    let started = (|| {
        if let (ChildId::Chip(rank), Some(fd)) = (spec.id, spec.coll_fd) {
            // SAFETY: the parent passed this descriptor to this process for the collective
            // segment and nothing else in this process owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let seg = Segment::from_fd(fd, "the collective segment").map_err(|e| e.to_string())?;
            let need = segment_bytes(spec.chips, spec.coll_cap);
            if rank >= spec.chips || need.is_none_or(|need| seg.len() < need) {
                return Err(format!(
                    "the collective segment ({} bytes) does not hold rank {rank} of {} chips with {} bytes each",
                    seg.len(),
                    spec.chips,
                    spec.coll_cap
                ));
            }
            ctx.collectives = Some(ShmCollectives::new(seg, rank, spec.chips, spec.coll_cap));
            if let Some(make) = fns.chip_worker {
                ctx.worker = Some(guarded(|| make(rank))?);
            }
        }
        match fns.on_start {
            Some(hook) => guarded(|| hook(&mut ctx)),
            None => Ok(()),
        }
    })();
    match started {
        Ok(()) => mbox.set_state(mailbox::READY, b""),
        Err(msg) => {
            mbox.set_state(mailbox::FAILED, msg.as_bytes());
            ring(&mut answer_bell);
            return 1;
        }
    }
    if !ring(&mut answer_bell) {
        return 0;
    }

    let mut scratch = [0u8; 64];
    loop {
        match doorbell.read(&mut scratch) {
            Ok(0) => return 0, // the parent is gone
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return 0,
        }
        while let Some((seq, kind, payload)) = mbox.pending() {
            let (status, answer) = match kind {
                CMD_CALL | CMD_TASK => {
                    let answer = if kind == CMD_CALL {
                        call(fns, &mut ctx, &payload)
                    } else {
                        task(fns, &mut ctx, &payload)
                    };
                    // A failed rank of a group call or group task makes no more collective
                    // calls: release the ranks waiting for it now rather than at the node's
                    // timeout. The parent resets the segment once no chip is busy.
                    if answer.0 != STATUS_OK
                        && let Some(comm) = &ctx.collectives
                    {
                        comm.abandon();
                    }
                    answer
                }
                CMD_MAP => map_buffer(&mut ctx, &payload),
                CMD_UNMAP => {
                    let id = payload.get(..8).and_then(|b| b.try_into().ok());
                    match id
                        .and_then(|b| ctx.buffers.remove(&SharedBufferId(u64::from_le_bytes(b))))
                    {
                        Some(_) => (STATUS_OK, Vec::new()),
                        None => (STATUS_ERR, b"no such buffer".to_vec()),
                    }
                }
                CMD_SHUTDOWN => {
                    let closed = ctx.worker.take().map_or(Ok(()), Worker::close);
                    match closed {
                        Ok(()) => mbox.complete(seq, STATUS_OK, b""),
                        Err(e) => mbox.complete(seq, STATUS_ERR, e.to_string().as_bytes()),
                    }
                    ring(&mut answer_bell);
                    return 0;
                }
                other => (STATUS_ERR, format!("unknown command {other}").into_bytes()),
            };
            mbox.complete(seq, status, &answer);
            if !ring(&mut answer_bell) {
                return 0;
            }
        }
    }
}

/// Runs `f`, turning a panic into an error message.
fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-string panic".into());
        Err(format!("panicked: {msg}"))
    })
}

fn call(fns: &ChildFns, ctx: &mut ChildCtx, payload: &[u8]) -> (u32, Vec<u8>) {
    let Some((name, args)) = decode_call(payload) else {
        return (STATUS_ERR, b"malformed call".to_vec());
    };
    let Some(f) = fns.fns.get(name) else {
        return (
            STATUS_ERR,
            format!("no function {name:?} in this binary").into_bytes(),
        );
    };
    match guarded(|| f(ctx, args)) {
        Ok(bytes) if bytes.len() > mailbox::RES_CAP => (
            STATUS_ERR,
            format!(
                "answer of {} bytes does not fit the mailbox ({})",
                bytes.len(),
                mailbox::RES_CAP
            )
            .into_bytes(),
        ),
        Ok(bytes) => (STATUS_OK, bytes),
        Err(msg) => (STATUS_ERR, msg.into_bytes()),
    }
}

/// A node task: its buffers are set for the call (each must be mapped here), then cleared.
fn task(fns: &ChildFns, ctx: &mut ChildCtx, payload: &[u8]) -> (u32, Vec<u8>) {
    let Some((bufs, call_payload)) = decode_task(payload) else {
        return (STATUS_ERR, b"malformed task".to_vec());
    };
    for (b, bytes) in &bufs {
        let Some(buf) = ctx.buffers.get(b) else {
            return (
                STATUS_ERR,
                format!("shared buffer {} is not mapped here", b.0).into_bytes(),
            );
        };
        if bytes.start > bytes.end || bytes.end > buf.len() {
            return (STATUS_ERR, b"malformed task".to_vec());
        }
    }
    ctx.task_buffers = bufs;
    let answer = call(fns, ctx, call_payload);
    ctx.task_buffers.clear();
    answer
}

/// A task's payload: buffer count (u32), then per buffer its id, first byte and end byte (u64
/// each), then a call's payload.
pub(crate) fn encode_task(
    bufs: &[(SharedBufferId, Range<usize>)],
    name: &str,
    args: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 24 * bufs.len() + 4 + name.len() + args.len());
    out.extend_from_slice(&(bufs.len() as u32).to_le_bytes());
    for (b, bytes) in bufs {
        for word in [b.0, bytes.start as u64, bytes.end as u64] {
            out.extend_from_slice(&word.to_le_bytes());
        }
    }
    out.extend_from_slice(&encode_call(name, args));
    out
}

type TaskBuffers = Vec<(SharedBufferId, Range<usize>)>;

fn decode_task(payload: &[u8]) -> Option<(TaskBuffers, &[u8])> {
    let n = u32::from_le_bytes(payload.get(..4)?.try_into().ok()?) as usize;
    let end = n.checked_mul(24)?.checked_add(4)?;
    let word = |c: &[u8]| u64::from_le_bytes(c.try_into().unwrap_or_default());
    // The slice first: a malformed count must not size an allocation.
    let records = payload.get(4..end)?;
    let mut bufs = Vec::with_capacity(n);
    for c in records.chunks_exact(24) {
        let start = usize::try_from(word(&c[8..16])).ok()?;
        let stop = usize::try_from(word(&c[16..24])).ok()?;
        bufs.push((SharedBufferId(word(&c[..8])), start..stop));
    }
    Some((bufs, &payload[end..]))
}

/// A call's payload: name length (u32), name, arguments.
pub(crate) fn encode_call(name: &str, args: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len() + args.len());
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(args);
    out
}

fn decode_call(payload: &[u8]) -> Option<(&str, &[u8])> {
    let len = u32::from_le_bytes(payload.get(..4)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(payload.get(4..4 + len)?).ok()?;
    Some((name, &payload[4 + len..]))
}

/// A map command's payload: id (u64), length (u64), path.
pub(crate) fn encode_map(id: SharedBufferId, len: usize, path: &std::path::Path) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&id.0.to_le_bytes());
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out.extend_from_slice(path.as_os_str().as_encoded_bytes());
    out
}

fn map_buffer(ctx: &mut ChildCtx, payload: &[u8]) -> (u32, Vec<u8>) {
    let decoded = (|| {
        let id = u64::from_le_bytes(payload.get(..8)?.try_into().ok()?);
        let len = u64::from_le_bytes(payload.get(8..16)?.try_into().ok()?) as usize;
        let path = PathBuf::from(std::str::from_utf8(payload.get(16..)?).ok()?);
        Some((SharedBufferId(id), len, path))
    })();
    let Some((id, len, path)) = decoded else {
        return (STATUS_ERR, b"malformed map command".to_vec());
    };
    match Segment::open(&path, len) {
        Ok(seg) => {
            ctx.buffers.insert(id, SharedBuffer::new(id, seg));
            (STATUS_OK, Vec::new())
        }
        Err(e) => (STATUS_ERR, e.to_string().into_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips() {
        for id in [ChildId::Chip(3), ChildId::Sub(0)] {
            let spec = Spec {
                id,
                chips: 4,
                slot: 5,
                parent: 1234,
                ctl_fd: 7,
                cmd_fd: 8,
                done_fd: 9,
                coll_fd: matches!(id, ChildId::Chip(_)).then_some(10),
                coll_cap: 4096,
            };
            assert_eq!(Spec::decode(&spec.encode()), Some(spec));
        }
        assert_eq!(Spec::decode("gpu,1,2,3,4,5,6,7,8,9"), None);
        assert_eq!(Spec::decode("chip,1"), None);
    }

    /// The child owns every descriptor its variable names: one named twice (closed twice) or
    /// a standard stream is refused.
    #[test]
    fn a_spec_naming_a_descriptor_twice_or_a_standard_stream_is_refused() {
        let spec = |fds: [i32; 4]| {
            format!(
                "chip,0,2,0,1,{},{},{},{},64",
                fds[0], fds[1], fds[2], fds[3]
            )
        };
        assert!(Spec::decode(&spec([7, 8, 9, 10])).is_some());
        assert!(Spec::decode(&spec([7, 8, 9, -1])).is_some());
        for bad in [
            [7, 7, 9, 10],
            [7, 8, 9, 8],
            [7, 8, 7, -1],
            [2, 8, 9, 10],
            [0, 8, 9, -1],
        ] {
            assert_eq!(Spec::decode(&spec(bad)), None, "{bad:?}");
        }
    }

    #[test]
    fn call_payload_round_trips() {
        let p = encode_call("name", &[1, 2, 3]);
        assert_eq!(decode_call(&p), Some(("name", &[1u8, 2, 3][..])));
        assert_eq!(decode_call(&[9, 0, 0, 0, b'a']), None);
    }

    #[test]
    fn task_payload_round_trips() {
        let bufs = [(SharedBufferId(3), 0..16), (SharedBufferId(u64::MAX), 8..9)];
        let p = encode_task(&bufs, "f", &[7]);
        let (got, call) = decode_task(&p).unwrap();
        assert_eq!(got, bufs);
        assert_eq!(decode_call(call), Some(("f", &[7u8][..])));
        assert_eq!(decode_task(&[2, 0, 0, 0, 1, 2, 3]), None);
        assert_eq!(decode_task(&[0xff, 0xff, 0xff, 0xff]), None);
    }
}
