//! The orchestrator's only blocking point: waiting for ring room, with the provable deadlock
//! checks of `docs/runtime.md` ("When a run cannot proceed") and the 500 ms backstop.
//!
//! While the orchestrator waits, nothing it has not yet submitted can run, and no scope can end.
//! So if the ring's oldest unreclaimed task belongs to a scope that is still open, the watermark
//! can never advance: that is a proof. Likewise if the innermost scope alone fills the window,
//! and in serial mode (where nothing executes until the orchestration returns) any wait at all.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::diag::human_bytes;
use crate::error::{Diagnosis, ErrorCode, Locator, RunError};
use crate::orch::Orchestrator;
use crate::slot::state;
use crate::task::TaskId;

/// Waiting longer than this without any progress is reported (as a backstop, not a proof).
pub(crate) const BACKSTOP: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resource {
    Window,
    Heap,
    DepPool,
    TensorMap,
}

impl Orchestrator {
    /// Waits until ring `ring` has a slot, `bytes` of heap, `deps` pool entries and the map has
    /// room for `entries` entries. Returns the heap start position.
    pub(crate) fn wait_for_room(
        &mut self,
        ring: u8,
        bytes: u64,
        deps: u64,
        entries: u64,
        kname: &str,
    ) -> Result<u64, RunError> {
        let r = ring as usize;
        if deps > self.cursors[r].dep_cap {
            let cap = self.cursors[r].dep_cap;
            let used = self.cursors[r].dep_used();
            // The head is named in the text only: the locator's task and kernel are the
            // refused task's (which has no id yet).
            let (_, head_note) = self.head_of(ring);
            return Err(self.fail(
                RunError::new(
                    ErrorCode::DepPoolOverflow,
                    format!("kernel {kname:?} has {deps} producers but ring {ring}'s dependency pool holds {cap} entries ({used} in use; {head_note})"),
                    format!(
                        "raise ring_dep_pool to {} for this run: CallConfig.runtime_env.ring_dep_pool",
                        deps.saturating_mul(2).checked_next_power_of_two().unwrap_or(u64::MAX)
                    ),
                )
                .diagnosed(Diagnosis::Proven)
                .at(Locator { ring: Some(ring), kernel: Some(kname.into()), ..Locator::default() }),
            ));
        }
        if entries > self.map.capacity() {
            // No completion can make room for more entries than the map holds.
            return Err(self.fail(
                RunError::new(
                    ErrorCode::TensormapOverflow,
                    format!(
                        "kernel {kname:?} records {entries} readers and writers, the dependency map holds {}",
                        self.map.capacity()
                    ),
                    format!(
                        "raise tensormap_capacity to {} for this run: CallConfig.tensormap_capacity",
                        suggested_map(entries)
                    ),
                )
                .diagnosed(Diagnosis::Proven)
                .at(Locator { ring: Some(ring), kernel: Some(kname.into()), ..Locator::default() }),
            ));
        }
        let mut waited = false;
        let mut last_progress = Instant::now();
        let mut last_completed = self.completed();
        loop {
            let rings = &self.run.arena.rings;
            self.cursors[r].reclaim(&rings.rings[r]);
            let c = &self.cursors[r];
            let blocked = if !c.window_fits() {
                Some(Resource::Window)
            } else if c.heap_fit(bytes).is_none() {
                Some(Resource::Heap)
            } else if !c.dep_fits(deps) {
                Some(Resource::DepPool)
            } else if !self.map.make_room(entries, rings) {
                Some(Resource::TensorMap)
            } else {
                None
            };
            let Some(res) = blocked else {
                return Ok(self.cursors[r].heap_fit(bytes).expect("checked above"));
            };
            if res == Resource::TensorMap && self.map.keeps_completed() {
                // A capturing run keeps every entry: no completion frees map room.
                let held = self.map.len();
                return Err(self.fail(
                    RunError::new(
                        ErrorCode::TensormapOverflow,
                        format!(
                            "a captured run keeps every dependency-map entry: {held} held, and kernel {kname:?} needs {entries} more than the {} the map holds",
                            self.map.capacity()
                        ),
                        format!(
                            "raise tensormap_capacity to {} for the capture: CallConfig.tensormap_capacity",
                            suggested_map(held.saturating_add(entries))
                        ),
                    )
                    .diagnosed(Diagnosis::Proven)
                    .at(Locator { ring: Some(ring), kernel: Some(kname.into()), ..Locator::default() }),
                ));
            }
            if !waited {
                waited = true;
                self.ring_waits += 1;
            }
            if let Some(e) = self.prove_deadlock(ring, res, bytes, deps, kname) {
                return Err(self.fail(e.diagnosed(Diagnosis::Proven)));
            }
            self.check_fatal()?;
            // Progress: a completion, or a kernel still executing (a long kernel is not a hang).
            let completed = self.completed();
            if completed != last_completed || self.any_core_running() {
                last_completed = completed;
                last_progress = Instant::now();
            } else if last_progress.elapsed() >= BACKSTOP {
                let e = self.describe(
                    ring,
                    res,
                    bytes,
                    deps,
                    kname,
                    "no task completed for 500 ms while the orchestrator waited",
                );
                return Err(self.fail(e.diagnosed(Diagnosis::Backstop)));
            }
            // `RoomSignal`'s protocol: say that we wait (and fence), then look at the head's
            // state. A consumption of the head is never missed (model-checked), so the park
            // timeout is not what wakes us for it (ring room is freed only by consuming the
            // head, reclamation being in order). The timeout is for the rest: a completion
            // that frees dependency-map room without consuming a slot, and the clock of the
            // backstop above.
            self.run.room.begin_wait();
            if !self.head_consumed(ring) {
                self.parker.park_timeout(Duration::from_millis(2));
            }
            self.run.room.end_wait();
        }
    }

    /// A number that grows by one with every completion (submitted minus outstanding).
    fn completed(&self) -> i64 {
        self.run.submitted.load(Ordering::Relaxed) as i64
            - self.run.outstanding.load(Ordering::Acquire)
    }

    pub(crate) fn any_core_running(&self) -> bool {
        self.run
            .cores
            .iter()
            .any(|c| c.current.load(Ordering::Relaxed) != 0)
    }

    fn head_consumed(&self, ring: u8) -> bool {
        let c = &self.cursors[ring as usize];
        c.reclaimed < c.next_local
            && self.run.arena.rings.rings[ring as usize]
                .slot(c.reclaimed)
                .state
                .load(Ordering::Acquire)
                == state::CONSUMED
    }

    fn prove_deadlock(
        &self,
        ring: u8,
        res: Resource,
        bytes: u64,
        deps: u64,
        kname: &str,
    ) -> Option<RunError> {
        let c = &self.cursors[ring as usize];
        let inner = self.scopes.last().expect("scope");
        if res == Resource::Window && inner.ring == ring && inner.tasks >= (c.window - 1) as u64 {
            let suggested = (inner.tasks + 1).next_power_of_two() * 2;
            let (_, head_note) = self.head_of(ring);
            return Some(
                RunError::new(
                    ErrorCode::ScopeDeadlock,
                    format!(
                        "the scope opened at {}:{} holds {} tasks, filling ring {ring}'s task window: {} of {} slots in flight; {head_note}; no slot can be freed before the scope ends",
                        inner.site.file(),
                        inner.site.line(),
                        inner.tasks,
                        c.in_flight(),
                        c.window
                    ),
                    format!(
                        "raise ring_task_window to {suggested} for this run: CallConfig.runtime_env.ring_task_window (or split the work into smaller scopes)"
                    ),
                )
                .at(Locator { ring: Some(ring), task: Some(TaskId::in_run(self.run_tag, ring, c.reclaimed)), kernel: Some(kname.into()), ..Locator::default() }),
            );
        }
        if self.serial {
            return Some(self.describe(
                ring,
                res,
                bytes,
                deps,
                kname,
                "serial mode runs nothing until the orchestration returns, so the rings must hold the whole graph",
            ));
        }
        if res != Resource::TensorMap && c.reclaimed < c.next_local {
            let head = c.meta(c.reclaimed);
            if !head.scope_released && self.scope_is_open(head.scope_seq) {
                return Some(self.describe(
                    ring,
                    res,
                    bytes,
                    deps,
                    kname,
                    "the oldest unreclaimed task belongs to a scope that is still open, and no scope can end while the orchestrator waits",
                ));
            }
        }
        None
    }

    /// Ring `ring`'s oldest unreclaimed task, and the words every fatal report gives it:
    /// "head T (kernel) is STATE", or that none is in flight.
    pub(crate) fn head_of(&self, ring: u8) -> (TaskId, String) {
        let c = &self.cursors[ring as usize];
        let head = TaskId::in_run(self.run_tag, ring, c.reclaimed);
        if c.reclaimed < c.next_local {
            let s = self.run.arena.rings.slot(head);
            let state = state::name(s.state.load(Ordering::Acquire));
            (
                head,
                format!("head {head} ({}) is {state}", s.desc().kernel_name()),
            )
        } else {
            (head, format!("head {head}: none in flight"))
        }
    }

    fn describe(
        &self,
        ring: u8,
        res: Resource,
        bytes: u64,
        deps: u64,
        kname: &str,
        why: &str,
    ) -> RunError {
        let c = &self.cursors[ring as usize];
        let (head, head_note) = self.head_of(ring);
        let (code, what, hint) = match res {
            Resource::Window => (
                ErrorCode::FlowControlDeadlock,
                format!(
                    "ring {ring} task window full: {} of {} slots in flight",
                    c.in_flight(),
                    c.window
                ),
                format!(
                    "raise ring_task_window to {} for this run: CallConfig.runtime_env.ring_task_window",
                    (c.window as u64 * 4).min(1 << 30)
                ),
            ),
            Resource::Heap => (
                ErrorCode::HeapRingDeadlock,
                format!(
                    "ring {ring} heap full: {} of {} in use, {} more needed",
                    human_bytes(c.heap_used()),
                    human_bytes(c.heap_cap),
                    human_bytes(bytes)
                ),
                format!(
                    "raise ring_heap to {} for this run: CallConfig.runtime_env.ring_heap",
                    human_bytes(
                        c.heap_cap
                            .saturating_add(bytes)
                            .saturating_mul(2)
                            .checked_next_power_of_two()
                            .unwrap_or(u64::MAX)
                    )
                ),
            ),
            Resource::DepPool => (
                ErrorCode::DepPoolOverflow,
                format!(
                    "ring {ring} dependency pool full: {} of {} entries in use, {deps} more needed",
                    c.dep_used(),
                    c.dep_cap
                ),
                format!(
                    "raise ring_dep_pool to {} for this run: CallConfig.runtime_env.ring_dep_pool",
                    c.dep_cap
                        .saturating_add(deps)
                        .saturating_mul(2)
                        .checked_next_power_of_two()
                        .unwrap_or(u64::MAX)
                ),
            ),
            Resource::TensorMap => (
                ErrorCode::TensormapOverflow,
                format!(
                    "dependency map full: {} of {} entries held by live readers and writers",
                    self.map.len(),
                    self.map.capacity()
                ),
                format!(
                    "raise tensormap_capacity to {} for this run: CallConfig.tensormap_capacity",
                    self.map.capacity() * 4
                ),
            ),
        };
        RunError::new(code, format!("{what}; {head_note}; {why}"), hint).at(Locator {
            ring: Some(ring),
            task: Some(head),
            kernel: Some(kname.to_string()),
            core: None,
        })
    }
}

/// A dependency-map capacity for `needed` entries with room to spare: twice that, a power of
/// two, within what `CallConfig.tensormap_capacity` accepts (16 to 2^28).
fn suggested_map(needed: u64) -> u64 {
    needed
        .saturating_mul(2)
        .checked_next_power_of_two()
        .unwrap_or(u64::MAX)
        .clamp(16, 1 << 28)
}
