//! The node's orchestration: task graphs over chips, groups of chips and sub workers, ordered
//! by the shared buffers each task reads and writes.
//!
//! [`Node::run`] first records a graph (the closure submits [`NodeTask`]s and may create
//! buffers and open scopes; nothing runs yet), then executes it: the parent posts every task
//! whose predecessors have finished to its idle children, waits in one `poll` for any answer,
//! a death or the nearest deadline, and repeats. Independent tasks on different children
//! therefore run at the same time; one child runs one task at a time.
//!
//! Dependencies come from the bytes of shared buffers each task declares (a whole buffer, or a
//! byte range of it; `deps.rs`): a task waits for every earlier task that touches a common
//! byte unless both only read; `after` adds explicit edges. Every edge points to an earlier
//! task, so the graph has no cycle and cannot deadlock.
//!
//! A task whose function fails poisons its consumers, transitively: they never run, every
//! other task does, and `run` then returns the first failure (in submit order) with the
//! child's message and the poisoned tasks. A deadline passing or a child dying ends the node
//! (a function stuck in a child cannot be stopped otherwise): `run` returns at once.
//!
//! # Memory ordering
//! No new shared-memory protocol: a dependent task sees what its predecessors wrote to a
//! shared buffer through the mailboxes' release/acquire pairs (`mailbox.rs`). Child A writes
//! the buffer, then stores its `done_seq` with `Release`; the parent sees the task finished
//! only by loading that `done_seq` with `Acquire`, and only then posts the dependent task to
//! child B by storing B's `cmd_seq` with `Release`, which B loads with `Acquire` before it
//! runs the function. So A's writes happen before B's reads (and, for write-after-read, B's
//! reads before a later writer's writes, by the same chain). Tasks with no edge between them
//! may run at the same time and must not touch common bytes unless they synchronise
//! themselves (atomics in the buffer).

use std::collections::HashSet;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::buffer::SharedBufferId;
use crate::child::{self, CMD_TASK, CMD_UNMAP, STATUS_OK};
use crate::deps::{Access, History};
use crate::error::{ChildId, NodeError};
use crate::mailbox::CMD_CAP;
use crate::node::{Node, Until};

/// A task of the current run, in submit order from 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeTaskId(pub usize);

/// Where a task runs.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    Chip(usize),
    Group(Vec<usize>),
    Sub(usize),
    /// Whichever sub worker is idle first.
    AnySub,
}

/// One task: a function registered in [`ChildFns`](crate::ChildFns), run in one chip, in a
/// group of chips (each gets the same arguments; it knows its rank), or in a sub worker, with
/// the shared buffers it reads and writes (whole, or byte ranges of them) declared for the
/// dependencies. The function reaches them, in the order they were declared, through
/// [`ChildCtx::task_buffer`](crate::ChildCtx::task_buffer) and
/// [`ChildCtx::task_bytes`](crate::ChildCtx::task_bytes).
#[derive(Clone, Debug)]
pub struct NodeTask {
    target: Target,
    function: String,
    args: Vec<u8>,
    /// Every declared buffer in declaration order (what the function sees): its bytes (`None`:
    /// all of them) and whether the task writes them.
    declared: Vec<(SharedBufferId, Option<Range<usize>>, bool)>,
    after: Vec<NodeTaskId>,
    timeout: Option<Duration>,
}

impl NodeTask {
    fn new(target: Target, function: &str, args: &[u8]) -> NodeTask {
        NodeTask {
            target,
            function: function.to_string(),
            args: args.to_vec(),
            declared: Vec::new(),
            after: Vec::new(),
            timeout: None,
        }
    }

    /// `function` on chip `chip` (a chip-level orchestration or kernel launch run on that
    /// chip's own worker, reached through [`ChildCtx::worker`](crate::ChildCtx::worker)).
    pub fn chip(chip: usize, function: &str, args: &[u8]) -> NodeTask {
        NodeTask::new(Target::Chip(chip), function, args)
    }

    /// `function` on every chip of `chips` at once (e.g. a collective): it starts when all of
    /// them are idle, and has finished when all of them have answered.
    pub fn group(chips: &[usize], function: &str, args: &[u8]) -> NodeTask {
        NodeTask::new(Target::Group(chips.to_vec()), function, args)
    }

    /// Host function `function` on sub worker `sub`.
    pub fn sub(sub: usize, function: &str, args: &[u8]) -> NodeTask {
        NodeTask::new(Target::Sub(sub), function, args)
    }

    /// Host function `function` on whichever sub worker is idle first, once its predecessors
    /// have finished (the function learns which from [`ChildCtx::id`](crate::ChildCtx::id)).
    /// Ready tasks take idle sub workers in submit order, so a later task never takes the sub
    /// worker an earlier ready one could have had. Refused (`InvalidTask`) by a node without
    /// sub workers.
    pub fn any_sub(function: &str, args: &[u8]) -> NodeTask {
        NodeTask::new(Target::AnySub, function, args)
    }

    /// The task reads `buf`: it waits for the earlier tasks that write any of its bytes.
    pub fn reads(mut self, buf: SharedBufferId) -> NodeTask {
        self.declared.push((buf, None, false));
        self
    }

    /// The task writes `buf` (or reads and writes it): it waits for the earlier tasks that
    /// read or write any of its bytes.
    pub fn writes(mut self, buf: SharedBufferId) -> NodeTask {
        self.declared.push((buf, None, true));
        self
    }

    /// The task reads `bytes` of `buf` only: it waits for the earlier tasks that write any
    /// of those bytes, and tasks that write only other bytes of the buffer may run beside it.
    /// A range past the buffer's end, or whose start is after its end, is refused at submit
    /// ([`NodeError::InvalidTask`]); an empty one orders nothing.
    pub fn reads_bytes(mut self, buf: SharedBufferId, bytes: Range<usize>) -> NodeTask {
        self.declared.push((buf, Some(bytes), false));
        self
    }

    /// The task writes `bytes` of `buf` only (or reads and writes them): it waits for the
    /// earlier tasks that read or write any of those bytes. Tasks writing disjoint ranges of
    /// one buffer run at the same time (e.g. each chip its rows of a shared output). Checked
    /// as [`NodeTask::reads_bytes`].
    pub fn writes_bytes(mut self, buf: SharedBufferId, bytes: Range<usize>) -> NodeTask {
        self.declared.push((buf, Some(bytes), true));
        self
    }

    /// The task waits for `task` as well.
    pub fn after(mut self, task: NodeTaskId) -> NodeTask {
        self.after.push(task);
        self
    }

    /// The task's deadline, from when it is posted (default: `NodeConfig.call_timeout`).
    pub fn timeout(mut self, timeout: Duration) -> NodeTask {
        self.timeout = Some(timeout);
        self
    }
}

/// What a recorded task does.
enum Work {
    Call {
        function: String,
        payload: Vec<u8>,
    },
    /// Unmaps a scope's buffer everywhere (the scope's end): runs after every user of the
    /// buffer has finished, whether it succeeded or not, and is never poisoned.
    Free(SharedBufferId),
}

struct Rec {
    work: Work,
    /// Child indices (the node's slots); for an any-sub task, empty until it is posted.
    targets: Vec<usize>,
    /// The sub workers an any-sub task may take (empty for every other task).
    any_of: Vec<usize>,
    timeout: Duration,
    preds_left: usize,
    succs: Vec<usize>,
    state: State,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Waiting,
    Running { deadline: Instant },
    Done,
    Failed,
    Poisoned,
}

/// Records a run's graph; given to [`Node::run`]'s closure.
pub struct NodeOrch<'a> {
    node: &'a mut Node,
    tasks: Vec<Rec>,
    /// The declared accesses the next tasks may depend on.
    history: History,
    /// Buffers created in each open scope (innermost last).
    scopes: Vec<Vec<SharedBufferId>>,
    /// Buffers whose scope has ended.
    ended: HashSet<SharedBufferId>,
    /// Every buffer created while recording (freed at once if recording fails).
    created: Vec<SharedBufferId>,
}

impl NodeOrch<'_> {
    /// Submits a task; it runs once the closure has returned and its predecessors finished.
    pub fn submit(&mut self, task: NodeTask) -> Result<NodeTaskId, NodeError> {
        let index = self.tasks.len();
        let invalid = |reason: String| NodeError::InvalidTask {
            task: index,
            function: task.function.clone(),
            reason,
        };
        let targets = match &task.target {
            Target::Chip(c) => vec![self.node.index(ChildId::Chip(*c))?],
            Target::Sub(s) => vec![self.node.index(ChildId::Sub(*s))?],
            // Chosen when the task is posted, among `any_of` below.
            Target::AnySub => Vec::new(),
            Target::Group(chips) => {
                if chips.is_empty() {
                    return Err(invalid("a group needs at least one chip".into()));
                }
                let mut targets = Vec::with_capacity(chips.len());
                for &c in chips {
                    let i = self.node.index(ChildId::Chip(c))?;
                    if targets.contains(&i) {
                        return Err(invalid(format!("chip {c} appears twice in the group")));
                    }
                    targets.push(i);
                }
                // Chips come first among the children, in order: this is chip order, in
                // which a group's first failure is reported.
                targets.sort_unstable();
                targets
            }
        };
        let any_of = if task.target == Target::AnySub {
            let subs: Vec<usize> = (0..self.node.config.sub_workers)
                .map(|s| self.node.index(ChildId::Sub(s)))
                .collect::<Result<_, _>>()?;
            if subs.is_empty() {
                return Err(invalid("any_sub: the node has no sub worker".into()));
            }
            subs
        } else {
            Vec::new()
        };
        let mut accesses = Vec::with_capacity(task.declared.len());
        for (buf, bytes, write) in &task.declared {
            let buf = *buf;
            if self.ended.contains(&buf) {
                return Err(invalid(format!(
                    "shared buffer {} is used after its scope ended",
                    buf.to_bits()
                )));
            }
            let Some(len) = self.node.buffers.get(&buf).map(|b| b.len()) else {
                return Err(NodeError::NotFound(format!(
                    "shared buffer {}",
                    buf.to_bits()
                )));
            };
            let bytes = bytes.clone().unwrap_or(0..len);
            if bytes.start > bytes.end || bytes.end > len {
                return Err(invalid(format!(
                    "bytes {}..{} of shared buffer {}: {}",
                    bytes.start,
                    bytes.end,
                    buf.to_bits(),
                    if bytes.start > bytes.end {
                        "the start is after the end".to_string()
                    } else {
                        format!("the buffer holds {len} bytes")
                    }
                )));
            }
            accesses.push(Access {
                buf,
                bytes,
                write: *write,
            });
        }
        for &NodeTaskId(t) in &task.after {
            if t >= index {
                return Err(invalid(format!("after({t}): no such earlier task")));
            }
        }
        let declared: Vec<(SharedBufferId, Range<usize>)> =
            accesses.iter().map(|a| (a.buf, a.bytes.clone())).collect();
        let payload = child::encode_task(&declared, &task.function, &task.args);
        if payload.len() > CMD_CAP {
            return Err(NodeError::TooLarge {
                what: "a task's function name and arguments",
                len: payload.len(),
                cap: CMD_CAP,
            });
        }
        // Every refusal comes before this point: from here the task is recorded (a refused
        // task left in the history would give later tasks, and its buffers' frees, edges to
        // a task that does not exist).
        let mut preds: Vec<usize> = task.after.iter().map(|t| t.0).collect();
        preds.extend(self.history.submit(index, &accesses));
        let timeout = task.timeout.unwrap_or(self.node.config.call_timeout);
        self.push(
            Work::Call {
                function: task.function,
                payload,
            },
            targets,
            timeout,
            preds,
        );
        self.tasks[index].any_of = any_of;
        Ok(NodeTaskId(index))
    }

    fn push(&mut self, work: Work, targets: Vec<usize>, timeout: Duration, mut preds: Vec<usize>) {
        let index = self.tasks.len();
        preds.sort_unstable();
        preds.dedup();
        for &p in &preds {
            self.tasks[p].succs.push(index);
        }
        self.tasks.push(Rec {
            work,
            targets,
            any_of: Vec::new(),
            timeout,
            preds_left: preds.len(),
            succs: Vec::new(),
            state: State::Waiting,
        });
    }

    /// Creates a shared buffer of `len` zeroed bytes (see [`Node::create_buffer`]). Inside a
    /// scope it belongs to the scope: it is freed once the scope has ended and every task
    /// that uses it has finished, and naming it in a task after the scope is refused.
    pub fn create_buffer(&mut self, len: usize) -> Result<SharedBufferId, NodeError> {
        // Nothing runs while the graph is recorded, so every child is idle.
        let id = self.node.create_buffer(len)?;
        self.created.push(id);
        if let Some(scope) = self.scopes.last_mut() {
            scope.push(id);
        }
        Ok(id)
    }

    /// Runs `body` in a scope: the buffers it creates through
    /// [`NodeOrch::create_buffer`] end with it (see there). Ending them is a task on every
    /// child that writes the buffer, so it waits for all its users (and for every child to be
    /// idle); it is never poisoned.
    pub fn scope<R>(
        &mut self,
        body: impl FnOnce(&mut Self) -> Result<R, NodeError>,
    ) -> Result<R, NodeError> {
        self.scopes.push(Vec::new());
        let result = body(self);
        let bufs = self.scopes.pop().unwrap_or_default();
        let all: Vec<usize> = (0..self.node.children.len()).collect();
        for buf in bufs {
            let preds = self.history.end(buf);
            let timeout = self.node.config.call_timeout;
            self.push(Work::Free(buf), all.clone(), timeout, preds);
            self.ended.insert(buf);
        }
        result
    }
}

impl Node {
    /// Records a task graph with `build`, then runs it; returns `build`'s value once every
    /// task has finished.
    ///
    /// Errors: `build`'s own (nothing runs); [`NodeError::TaskFailed`] for the first failed
    /// task in submit order, after every task it does not poison has run;
    /// [`NodeError::TaskTimeout`] or [`NodeError::ChildDied`] at once, with the node broken.
    pub fn run<R>(
        &mut self,
        build: impl FnOnce(&mut NodeOrch<'_>) -> Result<R, NodeError>,
    ) -> Result<R, NodeError> {
        self.check_usable()?;
        let mut orch = NodeOrch {
            node: self,
            tasks: Vec::new(),
            history: History::default(),
            scopes: Vec::new(),
            ended: HashSet::new(),
            created: Vec::new(),
        };
        let value = match orch.scope(build) {
            Ok(value) => value,
            Err(e) => {
                // Nothing ran: the buffers of the recording go at once. The closure's error is
                // the one returned. A free fails when `e` broke the node (then nothing is
                // left to free) or a child refused the unmap (the rest then live until the
                // node ends).
                for buf in std::mem::take(&mut orch.created) {
                    if self.free_buffer(buf).is_err() {
                        break;
                    }
                }
                return Err(e);
            }
        };
        let mut tasks = std::mem::take(&mut orch.tasks);
        self.execute(&mut tasks)?;
        Ok(value)
    }

    fn execute(&mut self, tasks: &mut [Rec]) -> Result<(), NodeError> {
        // The task each child runs.
        let mut busy: Vec<Option<usize>> = vec![None; self.children.len()];
        let mut first_failure: Option<(usize, ChildId, String)> = None;
        // Lowest index that may still be waiting (everything before it has started).
        let mut scan_from = 0;
        loop {
            // Post the ready tasks in submit order. A ready task that cannot start because a
            // child of it is busy reserves its idle children, so a group is not overtaken for
            // ever by later single-chip tasks: it starts when all its chips are idle.
            let mut reserved = vec![false; busy.len()];
            // A chip whose task failed abandoned the collectives (so the chips of its group
            // waiting in one returned at once). Chips start nothing until every chip is idle
            // (none inside a collective); then the segment is reset for the next group.
            let chips_held = match self.coll_abandoned_by() {
                None => false,
                Some(_) => {
                    let chip_busy =
                        (0..busy.len()).any(|i| busy[i].is_some() && self.children[i].id.is_chip());
                    if !chip_busy {
                        self.reset_collectives();
                    }
                    chip_busy
                }
            };
            while scan_from < tasks.len() && tasks[scan_from].state != State::Waiting {
                scan_from += 1;
            }
            // The children that ready tasks pinned to them wait for: an any-sub task takes a
            // free sub worker none of them names, when there is one, so it does not leave a
            // pinned task waiting while another sub worker idles.
            let mut pinned = vec![false; busy.len()];
            for rec in &tasks[scan_from..] {
                if rec.state == State::Waiting && rec.preds_left == 0 && rec.any_of.is_empty() {
                    for &i in &rec.targets {
                        pinned[i] = true;
                    }
                }
            }
            for (t, rec) in tasks.iter_mut().enumerate().skip(scan_from) {
                if rec.state != State::Waiting || rec.preds_left > 0 {
                    continue;
                }
                let held = |i: usize| chips_held && self.children[i].id.is_chip();
                if !rec.any_of.is_empty() {
                    // An any-sub task takes a sub worker free now (one no ready task is pinned
                    // to first); with none free it waits without reserving one (it is scanned
                    // before later tasks, so it takes the next one that frees).
                    match rec
                        .any_of
                        .iter()
                        .filter(|&&i| busy[i].is_none() && !reserved[i])
                        .min_by_key(|&&i| pinned[i])
                    {
                        Some(&i) => rec.targets = vec![i],
                        None => continue,
                    }
                }
                if rec
                    .targets
                    .iter()
                    .any(|&i| busy[i].is_some() || reserved[i] || held(i))
                {
                    for &i in &rec.targets {
                        reserved[i] = true;
                    }
                    continue;
                }
                let (kind, payload) = match &rec.work {
                    Work::Call { payload, .. } => (CMD_TASK, payload.clone()),
                    Work::Free(buf) => (CMD_UNMAP, buf.to_bits().to_le_bytes().to_vec()),
                };
                for &i in &rec.targets {
                    self.post(i, kind, &payload)?;
                    busy[i] = Some(t);
                }
                rec.state = State::Running {
                    deadline: Instant::now() + rec.timeout,
                };
            }
            let running: Vec<usize> = (0..busy.len()).filter(|&i| busy[i].is_some()).collect();
            if running.is_empty() {
                // Nothing runs and nothing could start: every task has finished (edges point
                // backwards, so a waiting task always has an unfinished predecessor).
                debug_assert!(
                    tasks
                        .iter()
                        .all(|r| !matches!(r.state, State::Waiting | State::Running { .. }))
                );
                break;
            }
            // One look at every running child's mailbox, from which both the finished tasks
            // and the children to wait on below are taken. Two looks raced: a child that
            // answered between them left its task unfinished in the first and was not waited
            // on in the second, so the wait polled no descriptor until the task's deadline
            // (`run_errors_carry_the_childs_message` of `tests/node.rs`, each run a fresh
            // process: 18 of 400 hung for the 10-minute default; none of 500 since), and a
            // deadline error could find no child that had not answered.
            let answered: Vec<usize> = running
                .iter()
                .copied()
                .filter(|&c| self.is_done(c, Until::Answered))
                .collect();
            // Collect the tasks every child of which has answered.
            let mut finished = Vec::new();
            for &i in &running {
                let Some(t) = busy[i] else { continue };
                if finished.contains(&t) {
                    continue;
                }
                if tasks[t].targets.iter().all(|c| answered.contains(c)) {
                    finished.push(t);
                }
            }
            if finished.is_empty() {
                let (t, deadline) = running
                    .iter()
                    .filter_map(|&i| busy[i])
                    .filter_map(|t| match tasks[t].state {
                        State::Running { deadline } => Some((t, deadline)),
                        _ => None,
                    })
                    .min_by_key(|&(_, d)| d)
                    .expect("a running child runs a running task");
                let now = Instant::now();
                if now >= deadline {
                    let rec = &tasks[t];
                    let c = *rec
                        .targets
                        .iter()
                        .find(|&c| !answered.contains(c))
                        .expect("an unfinished task has a child that had not answered");
                    let err = NodeError::TaskTimeout {
                        task: t,
                        child: self.children[c].id,
                        pid: self.children[c].pid,
                        function: rec.function().to_string(),
                        timeout_ms: rec.timeout.as_millis(),
                    };
                    return Err(self.fail(err));
                }
                // Only the children that had not answered: one that answered (a group's
                // early finisher) and then exited would keep its pidfd readable and make this
                // wait spin; its death is seen when it is posted to next, or at `close`. Not
                // empty: every running task has a target among them (it is not finished), and
                // one that answers since rings its doorbell, which ends the poll.
                let pending: Vec<usize> = running
                    .iter()
                    .copied()
                    .filter(|c| !answered.contains(c))
                    .collect();
                debug_assert!(
                    !pending.is_empty(),
                    "an unfinished task with every child answered: the wait would watch nothing"
                );
                self.poll_children(&pending, deadline - now, Until::Answered)?;
                continue;
            }
            finished.sort_unstable();
            // The chip that abandoned the collectives since the last reset: its failure is
            // the cause of its group's, not a peer's "abandoned" error.
            let abandoner = self.coll_abandoned_by().map(ChildId::Chip);
            for t in finished {
                let failed: Vec<usize> = tasks[t]
                    .targets
                    .iter()
                    .copied()
                    .filter(|&c| self.mailbox(c).answer().0 != STATUS_OK)
                    .collect();
                let failure = failed
                    .iter()
                    .find(|&&c| Some(self.children[c].id) == abandoner)
                    .or(failed.first())
                    .map(|&c| {
                        (
                            c,
                            String::from_utf8_lossy(&self.mailbox(c).answer().1).into_owned(),
                        )
                    });
                for &c in &tasks[t].targets {
                    busy[c] = None;
                }
                if let Work::Free(buf) = tasks[t].work {
                    if let Some((c, message)) = failure {
                        // Unmapping cannot fail in a sound child: the node is not trusted.
                        let err = NodeError::CallFailed {
                            child: self.children[c].id,
                            function: "unmap buffer".into(),
                            message,
                        };
                        return Err(self.fail(err));
                    }
                    self.buffers.remove(&buf);
                    finish(tasks, t, State::Done);
                    continue;
                }
                match failure {
                    None => finish(tasks, t, State::Done),
                    Some((c, message)) => {
                        if first_failure.as_ref().is_none_or(|f| t < f.0) {
                            first_failure = Some((t, self.children[c].id, message));
                        }
                        finish(tasks, t, State::Failed);
                    }
                }
            }
        }
        match first_failure {
            None => Ok(()),
            Some((task, child, message)) => Err(NodeError::TaskFailed {
                task,
                child,
                function: tasks[task].function().to_string(),
                message,
                poisoned: (0..tasks.len())
                    .filter(|&t| tasks[t].state == State::Poisoned)
                    .collect(),
            }),
        }
    }
}

impl Rec {
    fn function(&self) -> &str {
        match &self.work {
            Work::Call { function, .. } => function,
            Work::Free(_) => "free buffer",
        }
    }
}

/// Marks `t` finished with `state` and releases its successors: after a failure or a
/// poisoning, every successor that calls a function is poisoned in turn (transitively); a
/// scope's free runs regardless.
fn finish(tasks: &mut [Rec], t: usize, state: State) {
    let mut work = vec![(t, state)];
    while let Some((t, state)) = work.pop() {
        tasks[t].state = state;
        for k in 0..tasks[t].succs.len() {
            let s = tasks[t].succs[k];
            if tasks[s].state != State::Waiting {
                continue; // already poisoned through another predecessor
            }
            let poison = state != State::Done && matches!(tasks[s].work, Work::Call { .. });
            if poison {
                work.push((s, State::Poisoned));
                // Marked now, so another path does not push it twice.
                tasks[s].state = State::Poisoned;
            } else {
                tasks[s].preds_left -= 1;
            }
        }
    }
}
