//! The node's errors: start-up, children that fail or die, shared memory, collectives.

use std::fmt;
use std::io;

/// Which child: a chip (a rank of the collectives) or a host-side sub worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChildId {
    /// Chip `i` (its collective rank is `i`).
    Chip(usize),
    /// Sub worker `i`.
    Sub(usize),
}

impl ChildId {
    /// Whether it is a chip (a rank of the collectives).
    pub fn is_chip(self) -> bool {
        matches!(self, ChildId::Chip(_))
    }
}

impl fmt::Display for ChildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChildId::Chip(i) => write!(f, "chip {i}"),
            ChildId::Sub(i) => write!(f, "sub worker {i}"),
        }
    }
}

/// How a child process ended, as `waitid` reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    /// It exited with this code.
    Exited(i32),
    /// A signal ended it.
    Signaled(i32),
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Exited(code) => write!(f, "exited with status {code}"),
            ExitStatus::Signaled(sig) => match signal_name(*sig) {
                Some(name) => write!(f, "killed by signal {sig} ({name})"),
                None => write!(f, "killed by signal {sig}"),
            },
        }
    }
}

/// Names of the signals that usually end a process (`strsignal` is not thread-safe).
fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => return None,
    })
}

/// Every error of the node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration is not usable.
    #[error("node config: {field} = {value}: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// `Node::start` was called with other threads running: children must be started first
    /// (the parent-death signal follows the thread that started a child).
    #[error(
        "node started with {threads} threads running; start the node before any thread \
         (first thing in main, after `child_main_if_requested`)"
    )]
    ThreadsRunning {
        /// Threads of the process at the call.
        threads: usize,
    },
    /// An operating-system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A child did not report ready before the deadline.
    #[error("{child} (pid {pid}) did not become ready within {deadline_ms} ms")]
    ReadyTimeout {
        /// The child.
        child: ChildId,
        /// Its process id.
        pid: i32,
        /// The deadline.
        deadline_ms: u128,
    },
    /// A child failed while starting (its own message).
    #[error("{child} (pid {pid}) failed to start: {message}")]
    StartFailed {
        /// The child.
        child: ChildId,
        /// Its process id.
        pid: i32,
        /// What the child said.
        message: String,
    },
    /// A child process ended while the node needed it.
    #[error("{child} (pid {pid}) died: {status}")]
    ChildDied {
        /// The child.
        child: ChildId,
        /// Its process id.
        pid: i32,
        /// How it ended.
        status: ExitStatus,
    },
    /// A function run in a child returned an error.
    #[error("{child}: {function} failed: {message}")]
    CallFailed {
        /// The child.
        child: ChildId,
        /// The function's name.
        function: String,
        /// The child's message.
        message: String,
    },
    /// A child did not answer a command within the call timeout.
    #[error("{child} (pid {pid}) did not answer {command} within {timeout_ms} ms")]
    CallTimeout {
        /// The child.
        child: ChildId,
        /// Its process id.
        pid: i32,
        /// The command.
        command: String,
        /// The timeout.
        timeout_ms: u128,
    },
    /// A command or its answer does not fit in a mailbox.
    #[error("{what} is {len} bytes, a mailbox holds {cap}")]
    TooLarge {
        /// What did not fit.
        what: &'static str,
        /// Its size.
        len: usize,
        /// The capacity.
        cap: usize,
    },
    /// No such child or buffer.
    #[error("no {0}")]
    NotFound(String),
    /// A task of [`Node::run`](crate::Node::run) cannot be submitted as written.
    #[error("node task {task} ({function}): {reason}")]
    InvalidTask {
        /// The task's index in the run.
        task: usize,
        /// Its function.
        function: String,
        /// Why it is refused.
        reason: String,
    },
    /// A task of [`Node::run`](crate::Node::run) failed (the first in submit order); the tasks
    /// that depend on it, directly or not, did not run, every other task did.
    #[error(
        "node task {task} ({function}) failed on {child}: {message} ({} dependent tasks poisoned)",
        poisoned.len()
    )]
    TaskFailed {
        /// The task's index in the run.
        task: usize,
        /// The child whose function failed (in a group: the chip that abandoned the
        /// collectives, if one did, else the first failed chip in chip order).
        child: ChildId,
        /// The function.
        function: String,
        /// The child's message.
        message: String,
        /// Every task poisoned by a failure of this run, in submit order.
        poisoned: Vec<usize>,
    },
    /// A task of [`Node::run`](crate::Node::run) did not finish within its deadline; the node
    /// is broken (a function stuck in a child cannot be stopped but by ending the child).
    #[error(
        "node task {task} ({function}) on {child} (pid {pid}) did not finish within {timeout_ms} ms"
    )]
    TaskTimeout {
        /// The task's index in the run.
        task: usize,
        /// A child that had not answered.
        child: ChildId,
        /// Its process id.
        pid: i32,
        /// The function.
        function: String,
        /// The task's deadline.
        timeout_ms: u128,
    },
    /// The node failed earlier and must be closed and rebuilt.
    #[error("the node failed earlier and must be rebuilt: {0}")]
    Broken(String),
}

impl NodeError {
    /// The node's error code (`docs/node.md`, *Error codes*): 200 and up, apart from the chip
    /// level's codes.
    pub fn code(&self) -> u32 {
        match self {
            NodeError::Config { .. } => 200,
            NodeError::ThreadsRunning { .. } => 201,
            NodeError::Os { .. } => 202,
            NodeError::ReadyTimeout { .. } => 203,
            NodeError::StartFailed { .. } => 204,
            NodeError::ChildDied { .. } => 205,
            NodeError::CallFailed { .. } => 206,
            NodeError::CallTimeout { .. } => 207,
            NodeError::TooLarge { .. } => 208,
            NodeError::NotFound(_) => 209,
            NodeError::Broken(_) => 210,
            NodeError::InvalidTask { .. } => 211,
            NodeError::TaskFailed { .. } => 212,
            NodeError::TaskTimeout { .. } => 213,
        }
    }

    pub(crate) fn os(op: impl Into<String>) -> NodeError {
        NodeError::Os {
            op: op.into(),
            source: io::Error::last_os_error(),
        }
    }

    pub(crate) fn io(op: impl Into<String>, source: io::Error) -> NodeError {
        NodeError::Os {
            op: op.into(),
            source,
        }
    }
}

/// Errors of a collective call. Every rank of a call returns the same error kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// The arguments of this rank are inconsistent (counts do not add up to the buffer).
    #[error("{op} on rank {rank}: {reason}")]
    BadArgs {
        /// The collective.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// Another rank's arguments were refused, so nothing was exchanged.
    #[error("{op}: rank {rank} refused its arguments")]
    PeerRefused {
        /// The collective.
        op: &'static str,
        /// The rank that refused.
        rank: usize,
    },
    /// What a source sends differs from what this rank expects to receive.
    #[error("{op}: rank {src} sends {sent} bytes to rank {dst}, which expects {expected}")]
    CountMismatch {
        /// The collective.
        op: &'static str,
        /// Sender.
        src: usize,
        /// Receiver.
        dst: usize,
        /// Bytes sent.
        sent: usize,
        /// Bytes expected.
        expected: usize,
    },
    /// A message does not fit in the backend's staging memory.
    #[error(
        "{op}: rank {rank} sends {len} bytes, the staging area holds {cap} (raise NodeConfig.collective_bytes)"
    )]
    TooLarge {
        /// The collective.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// Bytes.
        len: usize,
        /// Capacity.
        cap: usize,
    },
    /// Another rank gave up on the group (its function failed), so this call cannot
    /// complete; the failing rank's own error says why.
    #[error("{op} on rank {rank}: the group was abandoned by rank {by}")]
    Abandoned {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank that abandoned the group first.
        by: usize,
    },
    /// The backend does not implement this element type or operation.
    #[error("{op}: {what} is not supported by the {backend} backend")]
    Unsupported {
        /// The collective.
        op: &'static str,
        /// What is unsupported.
        what: String,
        /// The backend.
        backend: &'static str,
    },
}
