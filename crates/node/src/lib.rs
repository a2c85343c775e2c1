//! The node level: one host driving several chips and sub workers, each in a child process.
//!
//! A [`Node`] starts one child per chip and per sub worker (the program's own binary, started
//! again with [`CHILD_ENV`] naming the child's role: [`child_main_if_requested`] must be the
//! first call of `main`), waits for each to report ready within a deadline, and talks to them
//! through shared-memory mailboxes (`mailbox.rs` states the protocol). Buffers created at any
//! time ([`Node::create_buffer`]) are mapped in every process. Chips exchange data through
//! [`Collectives`] (all-to-all with variable sizes, all-reduce); the shared-memory backend is
//! [`ShmCollectives`]. [`clock_offset`] estimates how far another host's monotonic clock is
//! from this one's (for merging the traces of ranks on several hosts). `docs/node.md`
//! describes the process model and teardown.

mod buffer;
mod child;
pub mod clock_offset;
pub mod collective;
mod deps;
mod error;
mod futex;
mod launch;
mod mailbox;
mod node;
mod orch;
mod shm;

pub use buffer::{SharedBuffer, SharedBufferId};
pub use child::{
    CHILD_ENV, ChildCtx, ChildFn, ChildFns, ChipWorkerFn, StartHook, child_main_if_requested,
};
pub use clock_offset::{OffsetEstimate, PingSample, estimate_offset};
#[cfg(feature = "mpi")]
pub use collective::mpi::MpiCollectives;
pub use collective::shm::ShmCollectives;
pub use collective::{Collectives, ReduceOp, ReduceType, exchange_counts};
pub use error::{ChildId, CollectiveError, ExitStatus, NodeError};
pub use launch::{mpirun_command, under_mpirun};
pub use node::{Node, NodeConfig};
pub use orch::{NodeOrch, NodeTask, NodeTaskId};
pub use shm::{SHM_PREFIX, segments_of_this_process};
