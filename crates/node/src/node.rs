//! The parent side: [`Node`] starts one child process per chip and per sub worker, talks to
//! them through their mailboxes, creates shared buffers, and ends them.
//!
//! The parent starts no thread. It waits for its children in one `poll` over their doorbell
//! pipes (written by a child after each answer) and their pidfds (readable once a child has
//! exited), so one wait sees answers and deaths alike, bounded by a deadline. A pidfd, unlike
//! the pipe's hang-up (which comes when the child closes its descriptors, before it is gone),
//! says that the exit status is there to collect, so a death is reported with its true status.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::buffer::{SharedBuffer, SharedBufferId};
use crate::child::{self, CHILD_ENV, CMD_CALL, CMD_MAP, CMD_SHUTDOWN, CMD_UNMAP, STATUS_OK, Spec};
use crate::collective::shm::{self as shm_coll, segment_bytes};
use crate::error::{ChildId, ExitStatus, NodeError};
use crate::mailbox::{self, CMD_CAP, MAILBOX_BYTES, Mailbox};
use crate::shm::{self, Named, SHM_PREFIX, Segment};

/// How to start a node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Chip children (the collectives' ranks).
    pub chips: usize,
    /// Sub-worker children (host functions; no collectives).
    pub sub_workers: usize,
    /// Every child reports ready within this time, or the start fails.
    pub ready_deadline: Duration,
    /// Every command is answered within this time, or the node fails.
    pub call_timeout: Duration,
    /// Staging bytes per chip for the shared-memory collectives (the largest all-to-all one
    /// chip can send; all-reduce works in pieces of this size).
    pub collective_bytes: usize,
    /// Extra environment variables for the children.
    pub env: Vec<(String, String)>,
}

impl Default for NodeConfig {
    fn default() -> NodeConfig {
        NodeConfig {
            chips: 1,
            sub_workers: 0,
            ready_deadline: Duration::from_secs(30),
            call_timeout: Duration::from_secs(600),
            collective_bytes: 1 << 20,
            env: Vec::new(),
        }
    }
}

/// A running node: its children and shared buffers.
pub struct Node {
    pub(crate) config: NodeConfig,
    ctl: Segment,
    /// The chips' collective segment (none without chips). The parent only touches its
    /// barrier words: to learn who abandoned a group call and to reset them after one.
    coll: Option<Segment>,
    pub(crate) children: Vec<Child>,
    pub(crate) buffers: BTreeMap<SharedBufferId, SharedBuffer>,
    next_buffer: u64,
    /// Distinguishes the named segments of several nodes of one process.
    tag: u64,
    /// Set when a child failed: the children are gone and the node only closes.
    failed: Option<String>,
}

pub(crate) struct Child {
    pub(crate) id: ChildId,
    pub(crate) pid: i32,
    /// The child's doorbell (we write).
    cmd: File,
    /// Our doorbell (the child writes).
    done: File,
    /// The doorbell hung up: the child is exiting; only `pidfd` is polled from then on (a
    /// hung-up pipe would make every `poll` return at once).
    hung_up: bool,
    /// Readable once the child has exited. Opened right after the spawn, while the pid is
    /// our unreaped child, so it cannot name another process.
    pidfd: OwnedFd,
    /// Last command posted.
    seq: u64,
    /// Set once reaped.
    status: Option<ExitStatus>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Until {
    Ready,
    Answered,
}

static NODE_TAGS: AtomicU64 = AtomicU64::new(0);

impl Node {
    /// Starts the children and waits until every one is ready. Call it before the process
    /// starts any thread; the binary's `main` must call
    /// [`child_main_if_requested`](crate::child_main_if_requested) first.
    pub fn start(config: NodeConfig) -> Result<Node, NodeError> {
        let n = config.chips.saturating_add(config.sub_workers);
        if n == 0 || n > 256 {
            return Err(NodeError::Config {
                field: "chips + sub_workers",
                value: format!("{} + {}", config.chips, config.sub_workers),
                reason: "must be between 1 and 256",
            });
        }
        if config.collective_bytes > 1 << 32 {
            return Err(NodeError::Config {
                field: "collective_bytes",
                value: config.collective_bytes.to_string(),
                reason: "must be at most 4 GiB",
            });
        }
        let threads = std::fs::read_dir("/proc/self/task")
            .map_err(|e| NodeError::io("reading /proc/self/task", e))?
            .count();
        if threads != 1 {
            return Err(NodeError::ThreadsRunning { threads });
        }
        shm::sweep_stale();
        let exe = std::env::current_exe().map_err(|e| NodeError::io("current_exe", e))?;
        let (ctl, ctl_fd) = Segment::anonymous("simpler-node-control", n * MAILBOX_BYTES)?;
        let (coll, coll_fd) = match config.chips {
            0 => (None, None),
            chips => {
                let bytes = segment_bytes(chips, config.collective_bytes).ok_or_else(|| {
                    NodeError::Config {
                        field: "collective_bytes",
                        value: config.collective_bytes.to_string(),
                        reason: "the collective segment's size overflows",
                    }
                })?;
                let (seg, fd) = Segment::anonymous("simpler-node-collectives", bytes)?;
                (Some(seg), Some(fd))
            }
        };
        let mut node = Node {
            ctl,
            coll,
            children: Vec::with_capacity(n),
            buffers: BTreeMap::new(),
            next_buffer: 0,
            tag: NODE_TAGS.fetch_add(1, Ordering::Relaxed),
            failed: None,
            config,
        };
        let ids = (0..node.config.chips)
            .map(ChildId::Chip)
            .chain((0..node.config.sub_workers).map(ChildId::Sub));
        for (slot, id) in ids.enumerate() {
            // On error `node` drops, which ends the children started so far.
            let child = node.spawn(
                slot,
                id,
                &exe,
                ctl_fd.as_raw_fd(),
                coll_fd.as_ref().map(|f| f.as_raw_fd()),
            )?;
            node.children.push(child);
        }
        drop((ctl_fd, coll_fd));
        let all: Vec<usize> = (0..n).collect();
        node.wait(&all, node.config.ready_deadline, Until::Ready, "ready")?;
        if let Some(i) = (0..n).find(|&i| node.mailbox(i).state() == mailbox::FAILED) {
            let message = String::from_utf8_lossy(&node.mailbox(i).answer().1).into_owned();
            let err = NodeError::StartFailed {
                child: node.children[i].id,
                pid: node.children[i].pid,
                message,
            };
            return Err(node.fail(err));
        }
        Ok(node)
    }

    /// Number of chips.
    pub fn chips(&self) -> usize {
        self.config.chips
    }

    /// The children and their process ids.
    pub fn children(&self) -> Vec<(ChildId, i32)> {
        self.children.iter().map(|c| (c.id, c.pid)).collect()
    }

    /// Runs `function` in one child with `args`; returns its answer.
    pub fn call(
        &mut self,
        child: ChildId,
        function: &str,
        args: &[u8],
    ) -> Result<Vec<u8>, NodeError> {
        Ok(self.call_group(function, &[(child, args)])?.remove(0))
    }

    /// Runs `function` in several children at once (each with its own arguments), and waits
    /// for all of them: what collectives need, since every rank must take part. Returns the
    /// answers in the order of `calls`. A chip whose function fails abandons the collectives,
    /// so the other chips' collective calls fail at once instead of waiting for it; its error
    /// is then the call's. Otherwise the first child (in the order of `calls`) whose function
    /// failed makes the error. The collectives are reset after the call either way.
    pub fn call_group(
        &mut self,
        function: &str,
        calls: &[(ChildId, &[u8])],
    ) -> Result<Vec<Vec<u8>>, NodeError> {
        self.check_usable()?;
        let mut targets = Vec::with_capacity(calls.len());
        let mut payloads = Vec::with_capacity(calls.len());
        for &(id, args) in calls {
            let i = self.index(id)?;
            if targets.contains(&i) {
                return Err(NodeError::Config {
                    field: "call_group targets",
                    value: id.to_string(),
                    reason: "a child appears twice",
                });
            }
            let payload = child::encode_call(function, args);
            if payload.len() > CMD_CAP {
                return Err(NodeError::TooLarge {
                    what: "a call's name and arguments",
                    len: payload.len(),
                    cap: CMD_CAP,
                });
            }
            targets.push(i);
            payloads.push(payload);
        }
        for (&i, payload) in targets.iter().zip(&payloads) {
            self.post(i, CMD_CALL, payload)?;
        }
        self.wait(
            &targets,
            self.config.call_timeout,
            Until::Answered,
            function,
        )?;
        let answers: Vec<(u32, Vec<u8>)> =
            targets.iter().map(|&i| self.mailbox(i).answer()).collect();
        // Every target has answered and every other child is idle, so no chip is inside a
        // collective: the barrier can be reset for the next call.
        let abandoner = self.coll_abandoned_by();
        self.reset_collectives();
        let failed = |k: &usize| answers[*k].0 != STATUS_OK;
        let root_cause = abandoner.and_then(|r| {
            (0..targets.len())
                .filter(failed)
                .find(|&k| self.children[targets[k]].id == ChildId::Chip(r))
        });
        if let Some(k) = root_cause.or_else(|| (0..targets.len()).find(failed)) {
            let msg = &answers[k].1;
            return Err(NodeError::CallFailed {
                child: self.children[targets[k]].id,
                function: function.to_string(),
                message: String::from_utf8_lossy(msg).into_owned(),
            });
        }
        Ok(answers.into_iter().map(|(_, bytes)| bytes).collect())
    }

    /// Creates a shared buffer of `len` zeroed bytes, mapped in this process and in every
    /// child before this returns.
    pub fn create_buffer(&mut self, len: usize) -> Result<SharedBufferId, NodeError> {
        self.check_usable()?;
        if len == 0 {
            return Err(NodeError::Config {
                field: "create_buffer len",
                value: "0".into(),
                reason: "must be at least one byte",
            });
        }
        let id = SharedBufferId(self.next_buffer);
        self.next_buffer += 1;
        let name = format!("{SHM_PREFIX}{}.{}.{}", std::process::id(), self.tag, id.0);
        // `named` unlinks the name when it drops: after every child mapped it, or on error.
        let (named, segment) = Named::create(&name, len)?;
        let payload = child::encode_map(id, len, named.path());
        let all: Vec<usize> = (0..self.children.len()).collect();
        for &i in &all {
            self.post(i, CMD_MAP, &payload)?;
        }
        self.wait(
            &all,
            self.config.call_timeout,
            Until::Answered,
            "map buffer",
        )?;
        drop(named);
        let mut failed = None;
        let mut mapped = Vec::with_capacity(all.len());
        for &i in &all {
            let (status, msg) = self.mailbox(i).answer();
            if status == STATUS_OK {
                mapped.push(i);
            } else if failed.is_none() {
                failed = Some((i, String::from_utf8_lossy(&msg).into_owned()));
            }
        }
        if let Some((i, mut message)) = failed {
            // The children that mapped it unmap it again: the id is not the node's, so
            // `free_buffer` could not reach their mappings, and a task naming it would find
            // the buffer in some children only. The map's failure stays the error reported.
            match self.unmap_in(&mapped, id) {
                Ok(None) => {}
                Ok(Some(e)) | Err(e) => {
                    message = format!("{message} (undoing the map in the other children: {e})")
                }
            }
            return Err(NodeError::CallFailed {
                child: self.children[i].id,
                function: "map buffer".into(),
                message,
            });
        }
        self.buffers.insert(id, SharedBuffer::new(id, segment));
        Ok(id)
    }

    /// Unmaps a shared buffer in every child and here; its memory is freed once no process
    /// maps it.
    pub fn free_buffer(&mut self, id: SharedBufferId) -> Result<(), NodeError> {
        self.check_usable()?;
        if !self.buffers.contains_key(&id) {
            return Err(NodeError::NotFound(format!("shared buffer {}", id.0)));
        }
        let all: Vec<usize> = (0..self.children.len()).collect();
        let refused = self.unmap_in(&all, id)?;
        self.buffers.remove(&id);
        refused.map_or(Ok(()), Err)
    }

    /// Unmaps buffer `id` in the children `targets`: `Err` where the node failed to ask or to
    /// hear them (it is then failed), `Ok(Some)` with the first child that refused.
    fn unmap_in(
        &mut self,
        targets: &[usize],
        id: SharedBufferId,
    ) -> Result<Option<NodeError>, NodeError> {
        for &i in targets {
            self.post(i, CMD_UNMAP, &id.0.to_le_bytes())?;
        }
        self.wait(
            targets,
            self.config.call_timeout,
            Until::Answered,
            "unmap buffer",
        )?;
        Ok(targets.iter().find_map(|&i| {
            let (status, msg) = self.mailbox(i).answer();
            (status != STATUS_OK).then(|| NodeError::CallFailed {
                child: self.children[i].id,
                function: "unmap buffer".into(),
                message: String::from_utf8_lossy(&msg).into_owned(),
            })
        }))
    }

    /// A shared buffer of this node.
    pub fn buffer(&self, id: SharedBufferId) -> Option<&SharedBuffer> {
        self.buffers.get(&id)
    }

    /// Stops every child and waits for it to exit. After a failure the children are already
    /// gone and this only releases the node. A child that does not exit cleanly is an error
    /// (it is killed and reaped all the same).
    pub fn close(mut self) -> Result<(), NodeError> {
        if self.failed.is_some() {
            self.teardown();
            return Ok(());
        }
        let all: Vec<usize> = (0..self.children.len()).collect();
        for &i in &all {
            self.post(i, CMD_SHUTDOWN, &[])?;
        }
        self.wait(&all, self.config.call_timeout, Until::Answered, "shutdown")?;
        // A chip whose worker failed to close says so, and exits all the same.
        let refused = all.iter().find_map(|&i| {
            let (status, msg) = self.mailbox(i).answer();
            (status != STATUS_OK).then(|| (i, String::from_utf8_lossy(&msg).into_owned()))
        });
        // Each child exits right after answering.
        let deadline = Instant::now() + self.config.call_timeout;
        for i in all {
            let exited = wait_exit(&self.children[i].pidfd, deadline);
            let status = self.reap(i);
            if !exited || status != ExitStatus::Exited(0) {
                let child = &self.children[i];
                let err = NodeError::ChildDied {
                    child: child.id,
                    pid: child.pid,
                    status,
                };
                return Err(self.fail(err));
            }
        }
        match refused {
            Some((i, message)) => Err(NodeError::CallFailed {
                child: self.children[i].id,
                function: "shutdown".into(),
                message,
            }),
            None => Ok(()),
        }
    }

    fn spawn(
        &self,
        slot: usize,
        id: ChildId,
        exe: &std::path::Path,
        ctl_fd: RawFd,
        coll_fd: Option<RawFd>,
    ) -> Result<Child, NodeError> {
        let (cmd_r, cmd_w) = std::io::pipe().map_err(|e| NodeError::io("pipe", e))?;
        let (done_r, done_w) = std::io::pipe().map_err(|e| NodeError::io("pipe", e))?;
        let spec = Spec {
            id,
            chips: self.config.chips,
            slot,
            parent: std::process::id() as i32,
            ctl_fd,
            cmd_fd: cmd_r.as_raw_fd(),
            done_fd: done_w.as_raw_fd(),
            coll_fd: coll_fd.filter(|_| matches!(id, ChildId::Chip(_))),
            coll_cap: self.config.collective_bytes,
        };
        let inherited = [
            spec.ctl_fd,
            spec.cmd_fd,
            spec.done_fd,
            spec.coll_fd.unwrap_or(-1),
        ];
        let mut cmd = Command::new(exe);
        cmd.env(CHILD_ENV, spec.encode())
            .envs(self.config.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: it makes only fcntl, prctl and signal calls and
        // allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                // Every descriptor the node makes is close-on-exec, so each child inherits
                // exactly its own pipe ends and the segments.
                for fd in inherited.into_iter().filter(|&fd| fd >= 0) {
                    shm::inherit(fd)?;
                }
                // Killed when the parent (the thread that forked, hence starting the node
                // before any thread) dies, whatever killed it.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // A terminal's Ctrl-C reaches the whole process group; the parent decides.
                libc::signal(libc::SIGINT, libc::SIG_IGN);
                Ok(())
            })
        };
        let process = cmd
            .spawn()
            .map_err(|e| NodeError::io(format!("starting {id} ({})", exe.display()), e))?;
        // std's `Child` neither kills nor waits on drop: the node reaps the pid itself.
        let pid = process.id() as i32;
        drop(process);
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as RawFd;
        if pidfd < 0 {
            let e = NodeError::os(format!("pidfd_open {id}"));
            // SAFETY: our own unreaped child; killed and reaped so that nothing is left.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            return Err(e);
        }
        // SAFETY: a new descriptor nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
        // Only the child holds these ends now, so its exit hangs up our doorbell.
        drop((cmd_r, done_w));
        Ok(Child {
            id,
            pid,
            cmd: File::from(OwnedFd::from(cmd_w)),
            done: File::from(OwnedFd::from(done_r)),
            hung_up: false,
            pidfd,
            seq: 0,
            status: None,
        })
    }

    /// The chip that abandoned the collectives since their last reset, if one did.
    pub(crate) fn coll_abandoned_by(&self) -> Option<usize> {
        self.coll.as_ref().and_then(shm_coll::abandoned_by)
    }

    /// Clears the collectives' barrier for the next group. Only while no chip is inside a
    /// collective (every chip idle).
    pub(crate) fn reset_collectives(&self) {
        if let Some(seg) = &self.coll {
            shm_coll::reset(seg);
        }
    }

    pub(crate) fn mailbox(&self, i: usize) -> Mailbox<'_> {
        assert!(i < self.children.len());
        // SAFETY: the control segment holds one mailbox per child (page multiples, so
        // aligned), lives as long as `self`, and mailbox `i` is used by this parent and child
        // `i` only.
        unsafe { Mailbox::new(self.ctl.ptr().add(i * MAILBOX_BYTES)) }
    }

    pub(crate) fn index(&self, id: ChildId) -> Result<usize, NodeError> {
        self.children
            .iter()
            .position(|c| c.id == id)
            .ok_or_else(|| NodeError::NotFound(id.to_string()))
    }

    pub(crate) fn check_usable(&self) -> Result<(), NodeError> {
        match &self.failed {
            Some(why) => Err(NodeError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    /// Posts a command to child `i` and rings its doorbell.
    pub(crate) fn post(&mut self, i: usize, kind: u32, payload: &[u8]) -> Result<(), NodeError> {
        self.children[i].seq += 1;
        let seq = self.children[i].seq;
        self.mailbox(i).post(seq, kind, payload);
        if (&self.children[i].cmd).write_all(&[1]).is_err() {
            // EPIPE: the child is gone (SIGPIPE is ignored in Rust programs).
            let status = self.reap(i);
            let err = NodeError::ChildDied {
                child: self.children[i].id,
                pid: self.children[i].pid,
                status,
            };
            return Err(self.fail(err));
        }
        Ok(())
    }

    pub(crate) fn is_done(&self, i: usize, until: Until) -> bool {
        match until {
            Until::Ready => self.mailbox(i).state() != mailbox::STARTING,
            Until::Answered => self.mailbox(i).done_seq() == self.children[i].seq,
        }
    }

    /// Waits until every child in `targets` is done, one dies, or the deadline passes.
    fn wait(
        &mut self,
        targets: &[usize],
        timeout: Duration,
        until: Until,
        what: &str,
    ) -> Result<(), NodeError> {
        let deadline = Instant::now() + timeout;
        let mut pending = targets.to_vec();
        loop {
            pending.retain(|&i| !self.is_done(i, until));
            let Some(&first) = pending.first() else {
                return Ok(());
            };
            let now = Instant::now();
            if now >= deadline {
                let child = &self.children[first];
                let err = match until {
                    Until::Ready => NodeError::ReadyTimeout {
                        child: child.id,
                        pid: child.pid,
                        deadline_ms: timeout.as_millis(),
                    },
                    Until::Answered => NodeError::CallTimeout {
                        child: child.id,
                        pid: child.pid,
                        command: what.to_string(),
                        timeout_ms: timeout.as_millis(),
                    },
                };
                return Err(self.fail(err));
            }
            self.poll_children(&pending, deadline - now, until)?;
        }
    }

    /// One `poll` over the pidfds and doorbells of `pending` for at most `timeout`: drains
    /// the doorbells that rang, and fails the node with `ChildDied` if one of them exited
    /// without having answered (judged by `until`). Returns after any event or the timeout;
    /// the caller re-checks the mailboxes.
    pub(crate) fn poll_children(
        &mut self,
        pending: &[usize],
        timeout: Duration,
        until: Until,
    ) -> Result<(), NodeError> {
        // Per pending child: its pidfd, then its doorbell unless that hung up.
        let mut fds = Vec::with_capacity(2 * pending.len());
        let mut owner = Vec::with_capacity(2 * pending.len());
        for &i in pending {
            let child = &self.children[i];
            fds.push(pollfd(child.pidfd.as_raw_fd()));
            owner.push((i, true));
            if !child.hung_up {
                fds.push(pollfd(child.done.as_raw_fd()));
                owner.push((i, false));
            }
        }
        if let Err(e) = poll(&mut fds, timeout) {
            return Err(self.fail(NodeError::io("poll", e)));
        }
        let mut exited = Vec::new();
        for (pfd, &(i, is_pidfd)) in fds.iter().zip(&owner) {
            if pfd.revents == 0 {
                continue;
            }
            if is_pidfd {
                exited.push(i);
                continue;
            }
            if pfd.revents & libc::POLLIN != 0 {
                let mut scratch = [0u8; 64];
                match (&self.children[i].done).read(&mut scratch) {
                    Ok(0) => self.children[i].hung_up = true,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => self.children[i].hung_up = true,
                }
            } else {
                self.children[i].hung_up = true;
            }
        }
        // A child that answered and then exited is judged by the next command.
        for i in exited {
            if self.is_done(i, until) {
                continue;
            }
            let status = self.reap(i);
            let child = &self.children[i];
            let err = NodeError::ChildDied {
                child: child.id,
                pid: child.pid,
                status,
            };
            return Err(self.fail(err));
        }
        Ok(())
    }

    /// Records the failure, ends every child, returns the error.
    pub(crate) fn fail(&mut self, err: NodeError) -> NodeError {
        self.failed = Some(err.to_string());
        self.teardown();
        err
    }

    /// Kills and reaps every child still running.
    fn teardown(&mut self) {
        for i in 0..self.children.len() {
            self.reap(i);
        }
    }

    /// Ends child `i` if it still runs (SIGKILL; no effect on one that already exited, whose
    /// status stays) and collects its exit status.
    fn reap(&mut self, i: usize) -> ExitStatus {
        let child = &mut self.children[i];
        if let Some(status) = child.status {
            return status;
        }
        // Through the pidfd, not the pid: a child reaped behind our back (SIGCHLD set to
        // SIG_IGN, or a handler that reaps: the ECHILD case below) frees its pid for reuse,
        // and `kill(pid)` could then reach an unrelated process. The pidfd names this child
        // only. SAFETY: a descriptor we own, a null siginfo and no flags.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                child.pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        // Reaped through the pidfd too: a `waitpid` on a reused pid could wait for, and reap,
        // another child of this process.
        // SAFETY: siginfo_t is plain data; all zeros is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let reaped = loop {
            // SAFETY: waits on a pidfd we own; `info` is a valid out pointer.
            let r = unsafe {
                libc::waitid(
                    libc::P_PIDFD,
                    child.pidfd.as_raw_fd() as libc::id_t,
                    &mut info,
                    libc::WEXITED,
                )
            };
            if r == 0 {
                break true;
            }
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                // ECHILD: someone else reaped it (a SIGCHLD handler set to SIG_IGN).
                break false;
            }
        };
        let status = if !reaped {
            // Reported as killed, which is what we did.
            ExitStatus::Signaled(libc::SIGKILL)
        } else {
            // SAFETY: `waitid` filled `info` for a child's exit, whose `si_status` is set.
            let code = unsafe { info.si_status() };
            if info.si_code == libc::CLD_EXITED {
                ExitStatus::Exited(code)
            } else {
                ExitStatus::Signaled(code)
            }
        };
        child.status = Some(status);
        status
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// `poll` for at most `timeout` (rounded up to a millisecond); EINTR counts as a return.
fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> std::io::Result<()> {
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Waits until the process of `pidfd` has exited; false at the deadline.
fn wait_exit(pidfd: &OwnedFd, deadline: Instant) -> bool {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        let mut fds = [pollfd(pidfd.as_raw_fd())];
        if poll(&mut fds, deadline - now).is_err() {
            return false;
        }
        if fds[0].revents != 0 {
            return true;
        }
    }
}
