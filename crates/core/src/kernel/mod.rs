//! Kernels: registration by id with an engine class, and [`TaskCtx`], the view a kernel body has
//! of its task (arguments, scalars, block index).
//!
//! # Memory access and soundness
//! Kernel bodies reach tensor memory only through [`TaskCtx`]. The runtime orders tasks so that
//! no other task touches a task's written regions, nor writes its read regions, while it runs:
//! readers wait for the live writers of overlapping bytes, writers for the live readers and
//! writers (the TensorMap). The untracked forms — `NoDep` arguments and manual scopes — are
//! requested only through `unsafe` functions whose contracts promise the same ordering. Within
//! one task the accessors keep Rust's aliasing rules:
//! - readable arguments (`Input`, `NoDep`) are only read: [`TaskCtx::read`] (contiguous views),
//!   [`TaskCtx::read_rows`] (rows of strided tiles), [`TaskCtx::gather`] (any view, copied);
//! - a written argument is borrowed mutably at most once per block: [`TaskCtx::write`]
//!   (contiguous, single block), [`TaskCtx::write_chunk`] (disjoint per-block chunks),
//!   [`TaskCtx::write_rows`] / [`TaskCtx::write_block_rows`] (rows of strided tiles: exactly the
//!   view's elements, never the neighbours between its rows), [`TaskCtx::scatter`] (any view);
//! - the blocks of a multi-block task share a written argument one way only: the first block
//!   to take a share fixes the split (chunk size, rows, columns with their granule, or
//!   rectangles), and a block asking for a different split gets an error, never an overlapping
//!   share;
//! - rectangles chosen at run time ([`TaskCtx::write_rect`]) are checked against every
//!   rectangle of the argument the task's blocks took before, and an overlapping one is refused;
//! - the orchestrator rejects a task whose written argument overlaps another of its arguments.
//!
//! Slices never cover elements outside the view, so tasks writing neighbouring tiles of one
//! matrix never hold aliasing references.

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::dtype::{DType, Element};
use crate::error::{KernelError, TensorError};
use crate::task::{ArgTag, EngineClass, TaskId};
use crate::tensor::Tensor;

mod rows;
mod shares;

pub use rows::{Rows, RowsMut};
pub use shares::tapered_range;

/// A kernel's id, chosen by whoever registers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelId(pub u32);

/// Largest kernel id accepted (ids index a table).
pub const MAX_KERNEL_ID: u32 = 1 << 16;

/// A kernel body: runs one block of a task.
pub type KernelFn = Arc<dyn Fn(&TaskCtx<'_>) -> Result<(), KernelError> + Send + Sync>;

/// A dispatch predicate: evaluated when the task becomes ready; `false` completes the task
/// without running its kernel. It may read the task's scalars and `Input` tensors.
pub type Predicate = fn(&TaskCtx<'_>) -> bool;

/// A kernel to register.
#[derive(Clone)]
pub struct KernelSpec {
    /// Id.
    pub id: KernelId,
    /// Human-readable name (used in reports and errors).
    pub name: String,
    /// Engine class.
    pub class: EngineClass,
    /// Body.
    pub body: KernelFn,
}

impl KernelSpec {
    /// A kernel running `body`.
    pub fn new(
        id: KernelId,
        name: impl Into<String>,
        class: EngineClass,
        body: impl Fn(&TaskCtx<'_>) -> Result<(), KernelError> + Send + Sync + 'static,
    ) -> KernelSpec {
        KernelSpec {
            id,
            name: name.into(),
            class,
            body: Arc::new(body),
        }
    }
}

impl std::fmt::Debug for KernelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelSpec")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("class", &self.class)
            .finish()
    }
}

/// The kernels known to a worker, indexed by id. Immutable once a run has taken a snapshot.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    by_id: Vec<Option<Arc<KernelSpec>>>,
}

impl Registry {
    pub(crate) fn insert(&mut self, spec: KernelSpec) -> Result<(), String> {
        let id = spec.id.0;
        if id >= MAX_KERNEL_ID {
            return Err(format!(
                "kernel id {id} is above the maximum {}",
                MAX_KERNEL_ID - 1
            ));
        }
        let i = id as usize;
        if self.by_id.len() <= i {
            self.by_id.resize(i + 1, None);
        }
        if let Some(old) = &self.by_id[i] {
            return Err(format!(
                "kernel id {id} is already registered as {:?}",
                old.name
            ));
        }
        self.by_id[i] = Some(Arc::new(spec));
        Ok(())
    }

    pub(crate) fn get(&self, id: KernelId) -> Option<&Arc<KernelSpec>> {
        self.by_id.get(id.0 as usize).and_then(|k| k.as_ref())
    }
}

/// One tensor argument as a kernel sees it.
#[derive(Clone, Copy, Debug)]
pub struct TensorArg {
    /// Direction tag.
    pub tag: ArgTag,
    /// The view (for `Output`, the runtime-allocated tensor).
    pub tensor: Tensor,
}

/// Everything about a submitted task that cores need; immutable once published.
pub(crate) struct TaskDesc {
    pub(crate) id: TaskId,
    /// The submitting run's epoch (process-unique, never reused; 0 outside a run).
    pub(crate) epoch: u64,
    pub(crate) kernel: Option<Arc<KernelSpec>>,
    pub(crate) class: EngineClass,
    pub(crate) block_num: u32,
    pub(crate) sync_start: bool,
    pub(crate) args: Vec<TensorArg>,
    pub(crate) scalars: Vec<u64>,
    pub(crate) predicate: Option<Predicate>,
    pub(crate) timing_slot: Option<u8>,
    /// How each written argument is split over the blocks, fixed by the first block that
    /// asks (see [`Splits`]).
    pub(crate) splits: Splits,
}

/// The per-block split of each argument of a multi-block task, fixed once per task: the first
/// block to take a share of argument `i` records how it split it (`write_chunk` with its chunk,
/// `write_block_rows`, `write_block_cols` with its granule), and a block asking for another
/// split fails instead of getting a share that overlaps another block's. Shares of one split
/// are disjoint by construction, so fixing the split is what keeps every block's `&mut` apart.
///
/// Single-block tasks need no per-argument record (one block, and `claim` stops double
/// borrows) and carry an empty one, so the common task's descriptor stays small.
///
/// The rectangles handed out by [`TaskCtx::write_rect`] are listed too (every block's, of every
/// argument, for the task's whole run): a rectangle is only handed out after it was checked
/// against that list, so no two rectangles of one argument ever overlap, whichever blocks ask.
#[derive(Default)]
pub(crate) struct Splits {
    shares: Box<[AtomicU64]>,
    rects: Mutex<Vec<Rect>>,
}

/// One rectangle a block of a task took with [`TaskCtx::write_rect`].
struct Rect {
    arg: usize,
    block: u32,
    rows: Range<usize>,
    cols: Range<usize>,
}

impl Rect {
    /// Whether the two share an element (empty rectangles share none).
    fn overlaps(&self, rows: &Range<usize>, cols: &Range<usize>) -> bool {
        let meet = |a: &Range<usize>, b: &Range<usize>| a.start.max(b.start) < a.end.min(b.end);
        meet(&self.rows, rows) && meet(&self.cols, cols)
    }
}

impl Splits {
    /// The record for a task of `blocks` blocks and `args` tensor arguments.
    pub(crate) fn new(blocks: u32, args: usize) -> Splits {
        if blocks > 1 {
            Splits {
                shares: (0..args).map(|_| AtomicU64::new(0)).collect(),
                rects: Mutex::default(),
            }
        } else {
            Splits::default()
        }
    }

    /// Makes this the fresh record [`Splits::new`] gives, reusing its storage when the shape
    /// matches (a replayed task refilling its slot).
    pub(crate) fn reset(&mut self, blocks: u32, args: usize) {
        if blocks > 1 && self.shares.len() == args {
            for s in self.shares.iter_mut() {
                *s.get_mut() = 0;
            }
            // A poisoned lock only means a block panicked while holding it; the list is
            // cleared either way.
            self.rects
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
        } else {
            *self = Splits::new(blocks, args);
        }
    }
}

/// Kinds of split (top bits of a [`Splits`] entry; the low bits hold the parameter).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Split {
    Chunk = 1,
    BlockRows = 2,
    BlockCols = 3,
    Rects = 4,
}

impl Split {
    const PARAM_BITS: u32 = 61;

    fn describe(code: u64) -> String {
        let param = code & ((1 << Split::PARAM_BITS) - 1);
        match code >> Split::PARAM_BITS {
            1 => format!("write_chunk with chunk {param}"),
            2 => "write_block_rows".to_string(),
            3 => format!("write_block_cols with granule {param}"),
            _ => "write_rect".to_string(),
        }
    }
}

impl TaskDesc {
    pub(crate) fn empty() -> TaskDesc {
        TaskDesc {
            id: TaskId(0),
            epoch: 0,
            kernel: None,
            class: EngineClass::Vector,
            block_num: 1,
            sync_start: false,
            args: Vec::new(),
            scalars: Vec::new(),
            predicate: None,
            timing_slot: None,
            splits: Splits::default(),
        }
    }

    pub(crate) fn kernel_name(&self) -> String {
        self.kernel
            .as_ref()
            .map(|k| k.name.clone())
            .unwrap_or_else(|| "<dummy>".to_string())
    }
}

/// A barrier the blocks of a sync-start task meet at.
pub(crate) trait GangBarrier: Sync {
    fn wait(&self);
}

/// What a kernel body sees: its task's arguments and scalars, and which block it runs.
pub struct TaskCtx<'a> {
    desc: &'a TaskDesc,
    block: u32,
    core: u32,
    cancel: &'a AtomicBool,
    gang: Option<&'a dyn GangBarrier>,
    /// Whether tensor addresses are host memory (`PlatformInfo::host_kernels`); when false the
    /// accessors refuse every tensor instead of dereferencing a device address.
    host_memory: bool,
    /// Arguments already borrowed mutably in this block (bit i = argument i).
    borrowed: Cell<u32>,
    /// Of those, the ones borrowed only as rectangles ([`TaskCtx::write_rect`]), which may be
    /// borrowed again as further rectangles.
    rect_borrowed: Cell<u32>,
}

impl<'a> TaskCtx<'a> {
    /// A block's context; `host_memory` is `PlatformInfo::host_kernels` of the run's platform
    /// (where false, the accessors refuse every tensor).
    pub(crate) fn new(
        desc: &'a TaskDesc,
        block: u32,
        core: u32,
        cancel: &'a AtomicBool,
        gang: Option<&'a dyn GangBarrier>,
        host_memory: bool,
    ) -> TaskCtx<'a> {
        TaskCtx {
            desc,
            block,
            core,
            cancel,
            gang,
            host_memory,
            borrowed: Cell::new(0),
            rect_borrowed: Cell::new(0),
        }
    }

    /// The task's id.
    pub fn task_id(&self) -> TaskId {
        self.desc.id
    }
    /// This execution of the task, unlike any other task's of any run in this process: the
    /// submitting run's epoch (a process-wide counter, never reused) and the task's id. Its
    /// inputs do not change while it runs, so a kernel may keep values derived from them in a
    /// per-thread cache keyed on this (and on which input), for the task's other blocks that
    /// the same thread runs; no later task matches the key.
    pub fn instance(&self) -> (u64, TaskId) {
        (self.desc.epoch, self.desc.id)
    }
    /// This block's index (`0..block_num`).
    pub fn block_idx(&self) -> usize {
        self.block as usize
    }
    /// Number of blocks of the task.
    pub fn block_num(&self) -> usize {
        self.desc.block_num as usize
    }
    /// The core running this block.
    pub fn core(&self) -> usize {
        self.core as usize
    }
    /// This block's share of `n` items split as evenly as possible over the blocks.
    pub fn block_range(&self, n: usize) -> Range<usize> {
        let b = self.block_num();
        let i = self.block_idx();
        let base = n / b;
        let extra = n % b;
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    }
    /// This block's share of `n` items when the last half of the blocks (of 8 or more) get
    /// shrinking shares: halving one after the other down to 1/16 of a full share when every
    /// share stays non-empty, else to 1/8 or 1/4, else half-size (with at least two items per
    /// block). Cores take
    /// a task's blocks in index order, so the task ends on small blocks and its cores finish
    /// close together (a shorter tail than equal shares, at no extra blocks). Shares of
    /// different blocks are disjoint and cover `0..n`.
    pub fn block_range_tapered(&self, n: usize) -> Range<usize> {
        tapered_range(n, self.block_num(), self.block_idx())
    }
    /// Whether the run has failed and the kernel should return early.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
    /// Waits until every block of this sync-start task has reached the barrier.
    ///
    /// Errors for tasks submitted without `require_sync_start` (their blocks may not run
    /// concurrently, so waiting could hang).
    pub fn sync_barrier(&self) -> Result<(), KernelError> {
        match self.gang {
            Some(g) => {
                g.wait();
                Ok(())
            }
            None => Err(KernelError::new(
                "sync_barrier needs a task submitted with require_sync_start",
            )),
        }
    }

    /// Number of tensor arguments.
    pub fn num_args(&self) -> usize {
        self.desc.args.len()
    }
    /// Tensor argument `i` (tag and view).
    pub fn arg(&self, i: usize) -> Result<&TensorArg, KernelError> {
        self.desc.args.get(i).ok_or_else(|| {
            KernelError::new(format!(
                "argument {i} requested but the task has {} tensor arguments",
                self.num_args()
            ))
        })
    }
    /// The view of tensor argument `i`.
    pub fn tensor(&self, i: usize) -> Result<&Tensor, KernelError> {
        Ok(&self.arg(i)?.tensor)
    }
    /// How many scalars the task carries.
    pub fn num_scalars(&self) -> usize {
        self.desc.scalars.len()
    }
    /// Raw 64-bit scalar `i`.
    pub fn scalar(&self, i: usize) -> Result<u64, KernelError> {
        self.desc.scalars.get(i).copied().ok_or_else(|| {
            KernelError::new(format!(
                "scalar {i} requested but the task has {} scalars",
                self.desc.scalars.len()
            ))
        })
    }
    /// Scalar `i` as `f32`.
    pub fn scalar_f32(&self, i: usize) -> Result<f32, KernelError> {
        Ok(f32::from_bits(self.scalar(i)? as u32))
    }
    /// Scalar `i` as `f64`.
    pub fn scalar_f64(&self, i: usize) -> Result<f64, KernelError> {
        Ok(f64::from_bits(self.scalar(i)?))
    }
    /// Scalar `i` as `i64`.
    pub fn scalar_i64(&self, i: usize) -> Result<i64, KernelError> {
        Ok(self.scalar(i)? as i64)
    }
    /// Scalar `i` as `usize`.
    pub fn scalar_usize(&self, i: usize) -> Result<usize, KernelError> {
        usize::try_from(self.scalar(i)?)
            .map_err(|_| KernelError::new(format!("scalar {i} does not fit usize")))
    }

    fn typed<T: Element>(&self, i: usize) -> Result<(&TensorArg, usize, usize), KernelError> {
        let a = self.arg(i)?;
        if !self.host_memory {
            return Err(not_host_memory(i));
        }
        if a.tensor.dtype != T::DTYPE {
            return Err(TensorError::DType {
                wanted: T::DTYPE,
                actual: a.tensor.dtype,
            }
            .into());
        }
        let (lo, hi) = a.tensor.element_span();
        let start = a.tensor.addr + lo as usize * T::DTYPE.size();
        Ok((a, start, (hi - lo) as usize))
    }

    fn readable(&self, i: usize, a: &TensorArg) -> Result<(), KernelError> {
        if a.tag.is_written() {
            return Err(KernelError::new(format!(
                "argument {i} is tagged {}; reach written arguments through the write accessors",
                a.tag.name()
            )));
        }
        Ok(())
    }

    fn writable(&self, i: usize, a: &TensorArg, what: &str) -> Result<(), KernelError> {
        Self::written_tag(i, a)?;
        self.claim(i, what)
    }

    fn written_tag(i: usize, a: &TensorArg) -> Result<(), KernelError> {
        if a.tag.is_written() {
            Ok(())
        } else {
            Err(KernelError::new(format!(
                "argument {i} is tagged {} and cannot be written",
                a.tag.name()
            )))
        }
    }

    fn claim(&self, i: usize, what: &str) -> Result<(), KernelError> {
        let bit = 1u32 << i;
        if self.borrowed.get() & bit != 0 {
            return Err(KernelError::new(format!(
                "argument {i} is already borrowed mutably in this block ({what})"
            )));
        }
        self.borrowed.set(self.borrowed.get() | bit);
        Ok(())
    }

    /// Fixes (or checks) how argument `i` is split over the blocks of a multi-block task.
    fn fix_split(&self, i: usize, split: Split, param: usize) -> Result<(), KernelError> {
        if self.desc.block_num == 1 {
            return Ok(());
        }
        let Some(slot) = self.desc.splits.shares.get(i) else {
            // Descriptors built without a record (tests) have one block.
            return Err(KernelError::new(format!(
                "argument {i}: no split record for a task of {} blocks",
                self.desc.block_num
            )));
        };
        let param = (param as u64).min((1 << Split::PARAM_BITS) - 1);
        let code = ((split as u64) << Split::PARAM_BITS) | param;
        match slot.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(fixed) if fixed == code => Ok(()),
            Err(fixed) => Err(KernelError::new(format!(
                "argument {i}: block {} asks for {} but the task's blocks already split it by {}; every block must take its share the same way",
                self.block,
                Split::describe(code),
                Split::describe(fixed)
            ))),
        }
    }

    fn contiguous(i: usize, a: &TensorArg, what: &str) -> Result<(), KernelError> {
        if a.tensor.is_contiguous() {
            Ok(())
        } else {
            Err(KernelError::new(format!(
                "{what}({i}) needs a contiguous view (shape {:?} strides {:?}); use the *_rows accessors or gather/scatter",
                a.tensor.shape(),
                a.tensor.strides()
            )))
        }
    }

    /// Reads a contiguous `Input` or `NoDep` argument.
    pub fn read<T: Element>(&self, i: usize) -> Result<&[T], KernelError> {
        let (a, start, len) = self.typed::<T>(i)?;
        self.readable(i, a)?;
        Self::contiguous(i, a, "read")?;
        if len == 0 {
            return Ok(&[]);
        }
        // SAFETY: the view is contiguous, so `start..start+len` is exactly its elements, inside
        // the buffer (checked when the view was made), which outlives the run; the address is
        // aligned for T (page-aligned buffers, offsets in T-sized elements); every bit pattern
        // is a valid T (sealed `Element`). The runtime orders this task after every writer of
        // the region and later writers after this task (for `NoDep` and manual scopes, the
        // contracts of `Task::no_dep` / `Orchestrator::manual_scope` promise the same), and the
        // region stays bound and alive until every core left the run; this task does not
        // write it (written arguments may not overlap others).
        Ok(unsafe { std::slice::from_raw_parts(start as *const T, len) })
    }

    /// The rows of an `Input`/`NoDep` view whose innermost stride is 1 (all leading dimensions
    /// flattened): each row is exactly the view's elements, so strided tiles of a larger matrix
    /// are read without touching their neighbours.
    pub fn read_rows<T: Element>(&self, i: usize) -> Result<Rows<'_, T>, KernelError> {
        let (a, _, _) = self.typed::<T>(i)?;
        self.readable(i, a)?;
        Rows::new(i, &a.tensor)
    }

    /// Copies the elements of any view (any strides) in row-major order: readable arguments
    /// always, written ones (e.g. the old values of an `InOut`) in single-block tasks.
    pub fn gather<T: Element>(&self, i: usize) -> Result<Vec<T>, KernelError> {
        let (a, _, _) = self.typed::<T>(i)?;
        if a.tag.is_written() {
            self.single_block(i, "gather")?;
            // A `&mut` handed out for this argument may still be live: reading the bytes
            // underneath it would invalidate it. Gather first, then write.
            if self.borrowed.get() & (1u32 << i) != 0 {
                return Err(KernelError::new(format!(
                    "argument {i} is already borrowed mutably in this block (gather after write)"
                )));
            }
        }
        let base = a.tensor.addr as *const T;
        let mut out = Vec::with_capacity(a.tensor.numel() as usize);
        a.tensor.for_each_offset(|off| {
            // SAFETY: `off` is an element of the view, inside its buffer; no other task writes it
            // concurrently (ordered by the TensorMap or the unsafe contracts, as in `read`); for
            // a written argument this is the task's only block and no `&mut` to it has been
            // handed out (checked above); a raw read creates no reference, and any bit pattern
            // is a valid `T`.
            out.push(unsafe { base.add(off as usize).read() })
        });
        Ok(out)
    }

    /// Reads a contiguous `Input`/`NoDep` argument of any float type as `f32` values.
    pub fn read_f32(&self, i: usize) -> Result<Vec<f32>, KernelError> {
        let a = self.arg(i)?;
        Ok(match a.tensor.dtype {
            DType::F32 => self.read::<f32>(i)?.to_vec(),
            DType::BF16 => self
                .read::<half::bf16>(i)?
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            DType::F16 => self
                .read::<half::f16>(i)?
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            d => {
                return Err(KernelError::new(format!(
                    "argument {i} holds {d}, not a float type"
                )));
            }
        })
    }

    /// A contiguous written argument (`Output`, `InOut`, `OutputExisting`) of a single-block
    /// task, mutably. Multi-block tasks use [`TaskCtx::write_chunk`] or
    /// [`TaskCtx::write_block_rows`].
    // A `&mut` from `&self` is the point: the memory is the task's, not the context's, and
    // `claim` hands each argument out mutably at most once per block.
    #[allow(clippy::mut_from_ref)]
    pub fn write<T: Element>(&self, i: usize) -> Result<&mut [T], KernelError> {
        self.single_block(i, "write")?;
        let (a, start, len) = self.typed::<T>(i)?;
        Self::contiguous(i, a, "write")?;
        self.writable(i, a, "write")?;
        // SAFETY: contiguity, bounds, alignment and validity as in `read`. Exclusivity: no other
        // task touches the region while this one runs (ordered as in `read`), the task has one block,
        // and `writable` stops this block from borrowing the argument twice.
        Ok(unsafe { slice_mut(start, 0, len) })
    }

    /// This block's chunk of a contiguous written argument: elements
    /// `block_idx*chunk .. (block_idx+1)*chunk` (clipped to the view). Chunks of different blocks
    /// never overlap.
    // A `&mut` from `&self` is the point: the memory is the task's, not the context's, and
    // `claim` hands each argument out mutably at most once per block.
    #[allow(clippy::mut_from_ref)]
    pub fn write_chunk<T: Element>(&self, i: usize, chunk: usize) -> Result<&mut [T], KernelError> {
        let (a, start, len) = self.typed::<T>(i)?;
        Self::contiguous(i, a, "write_chunk")?;
        self.writable(i, a, "write_chunk")?;
        self.fix_split(i, Split::Chunk, chunk)?;
        let lo = (self.block as usize).saturating_mul(chunk).min(len);
        let hi = lo.saturating_add(chunk).min(len);
        // SAFETY: as in `write`, except that several blocks may run at once: each gets the chunk
        // indexed by its unique block index, so the slices of different blocks are disjoint.
        Ok(unsafe { slice_mut(start, lo, hi) })
    }

    /// All rows of a written view whose innermost stride is 1, for a single-block task.
    pub fn write_rows<T: Element>(&self, i: usize) -> Result<RowsMut<'_, T>, KernelError> {
        self.single_block(i, "write_rows")?;
        let (a, _, _) = self.typed::<T>(i)?;
        let rows = RowsMut::new(i, &a.tensor, None)?;
        self.writable(i, a, "write_rows")?;
        Ok(rows)
    }

    /// This block's share of the rows of a written view (rows split as by
    /// [`TaskCtx::block_range`]); shares of different blocks are disjoint.
    pub fn write_block_rows<T: Element>(&self, i: usize) -> Result<RowsMut<'_, T>, KernelError> {
        let (a, _, _) = self.typed::<T>(i)?;
        let all = RowsMut::<T>::new(i, &a.tensor, None)?.len();
        let rows = RowsMut::new(i, &a.tensor, Some(self.block_range(all)))?;
        self.writable(i, a, "write_block_rows")?;
        self.fix_split(i, Split::BlockRows, 0)?;
        Ok(rows)
    }

    /// This block's share of the columns of a written view, every row: the view's `row_len`
    /// columns are cut into units of `granule` (the last may be shorter) and the units split
    /// over the blocks as by [`TaskCtx::block_range_tapered`]; shares of different blocks are
    /// disjoint.
    /// For an SPMD task whose blocks each produce some output columns of every row (the
    /// projection tiles of a matrix product).
    pub fn write_block_cols<T: Element>(
        &self,
        i: usize,
        granule: usize,
    ) -> Result<RowsMut<'_, T>, KernelError> {
        let (a, _, _) = self.typed::<T>(i)?;
        let mut rows = RowsMut::<T>::new(i, &a.tensor, None)?;
        let g = granule.max(1);
        let width = rows.view_row_len();
        let units = self.block_range_tapered(width.div_ceil(g));
        rows.set_cols((units.start * g).min(width)..(units.end * g).min(width));
        self.writable(i, a, "write_block_cols")?;
        self.fix_split(i, Split::BlockCols, g)?;
        Ok(rows)
    }

    /// Rows `rows` by columns `cols` of a written view whose innermost stride is 1 (leading
    /// dimensions flattened), for an SPMD task whose blocks choose their output tiles at run
    /// time from data the task reads (how many rows each expert of a MoE step received, say),
    /// where no split fixed at submission fits.
    ///
    /// A block may take several rectangles of one argument. Each is checked against every
    /// rectangle the task's blocks took of that argument before (they stay taken until the
    /// task ends) and refused if it shares an element with one, or if it reaches past the
    /// view; so no two `&mut` rows handed out this way alias, whichever blocks ask and in
    /// whatever order. In a multi-block task every block must reach the argument this way (the
    /// split is fixed as for the other shares), and in any task an argument this block already
    /// borrowed through another accessor is refused. Empty rectangles overlap nothing.
    pub fn write_rect<T: Element>(
        &self,
        i: usize,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<RowsMut<'_, T>, KernelError> {
        let (a, _, _) = self.typed::<T>(i)?;
        let all = RowsMut::<T>::new(i, &a.tensor, None)?;
        let (n_rows, width) = (all.len(), all.view_row_len());
        if rows.start > rows.end || rows.end > n_rows || cols.start > cols.end || cols.end > width {
            return Err(KernelError::new(format!(
                "write_rect({i}): rows {rows:?} by columns {cols:?} is not a rectangle inside the view's {n_rows} rows of {width}"
            )));
        }
        Self::written_tag(i, a)?;
        let bit = 1u32 << i;
        if self.borrowed.get() & bit != 0 && self.rect_borrowed.get() & bit == 0 {
            return Err(KernelError::new(format!(
                "argument {i} is already borrowed mutably in this block (write_rect)"
            )));
        }
        self.fix_split(i, Split::Rects, 0)?;
        {
            // A poisoned lock only means a block panicked while holding it; the list itself is
            // always whole (it is only searched and pushed to).
            let mut taken = self
                .desc
                .splits
                .rects
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(r) = taken
                .iter()
                .find(|r| r.arg == i && r.overlaps(&rows, &cols))
            {
                return Err(KernelError::new(format!(
                    "write_rect({i}): block {} asks for rows {rows:?} by columns {cols:?}, which overlaps rows {:?} by columns {:?} that block {} took",
                    self.block, r.rows, r.cols, r.block
                )));
            }
            taken.push(Rect {
                arg: i,
                block: self.block,
                rows: rows.clone(),
                cols: cols.clone(),
            });
        }
        self.borrowed.set(self.borrowed.get() | bit);
        self.rect_borrowed.set(self.rect_borrowed.get() | bit);
        let mut share = RowsMut::new(i, &a.tensor, Some(rows))?;
        share.set_cols(cols);
        Ok(share)
    }

    /// Writes `values` (row-major, one per element) into any written view of a single-block
    /// task.
    pub fn scatter<T: Element>(&self, i: usize, values: &[T]) -> Result<(), KernelError> {
        self.single_block(i, "scatter")?;
        let (a, _, _) = self.typed::<T>(i)?;
        if values.len() as u64 != a.tensor.numel() {
            return Err(KernelError::new(format!(
                "scatter({i}): {} values for a view of {} elements",
                values.len(),
                a.tensor.numel()
            )));
        }
        if !a.tensor.is_non_overlapping() {
            return Err(KernelError::new(format!(
                "scatter({i}): the view's elements alias each other"
            )));
        }
        self.writable(i, a, "scatter")?;
        let base = a.tensor.addr as *mut T;
        let mut k = 0;
        a.tensor.for_each_offset(|off| {
            // SAFETY: `off` is an element of the view, inside its buffer, written by this block
            // alone (single-block task, argument claimed once, no other task touches the region
            // while this one runs).
            unsafe { base.add(off as usize).write(values[k]) };
            k += 1;
        });
        Ok(())
    }

    fn single_block(&self, i: usize, what: &str) -> Result<(), KernelError> {
        if self.desc.block_num != 1 {
            return Err(KernelError::new(format!(
                "{what}({i}) in a task of {} blocks would alias across blocks; use write_chunk or write_block_rows",
                self.desc.block_num
            )));
        }
        Ok(())
    }

    /// The span (first to last element) of a written argument, with no aliasing checks.
    ///
    /// # Safety
    /// Nothing else may access any element of the span while the slice is alive: not other
    /// blocks of this task and, for a strided view, not other tasks writing elements that lie
    /// between this view's elements.
    // A `&mut` from `&self` is the point: the memory is the task's, not the context's, and
    // `claim` hands each argument out mutably at most once per block.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn write_unchecked<T: Element>(&self, i: usize) -> Result<&mut [T], KernelError> {
        let (a, start, len) = self.typed::<T>(i)?;
        self.writable(i, a, "write_unchecked")?;
        // SAFETY: bounds, alignment and validity as in `read`; exclusivity is the caller's
        // contract (this fn's `# Safety`).
        Ok(unsafe { slice_mut(start, 0, len) })
    }
}

/// `&mut [T]` over elements `lo..hi` of the array starting at address `start`.
///
/// # Safety
/// `start + hi * size_of::<T>()` lies in one live allocation, `start` is aligned for `T`, every
/// bit pattern is a valid `T`, and nothing else accesses these elements while the slice lives.
unsafe fn slice_mut<'a, T: Element>(start: usize, lo: usize, hi: usize) -> &'a mut [T] {
    if hi <= lo {
        return &mut [];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut((start as *mut T).add(lo), hi - lo) }
}

/// The refusal of argument `i` on a platform whose tensor memory is not host memory (out of
/// line: every accessor of every kernel checks for it).
#[cold]
fn not_host_memory(i: usize) -> KernelError {
    KernelError::new(format!(
        "argument {i}: this platform's tensor memory is not host memory (host_kernels is false); host kernels cannot reach it"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platform::Memory;
    use crate::platform::test_memory::HostVec;
    use crate::tensor::BufferId;

    /// An 8x8 f32 matrix in host memory, as a view of buffer `id`.
    fn matrix(mem: &HostVec) -> Tensor {
        Tensor::new_contiguous(BufferId(1), mem.addr(), 256, DType::F32, &[8, 8]).unwrap()
    }

    fn desc(args: Vec<TensorArg>, blocks: u32) -> TaskDesc {
        TaskDesc {
            block_num: blocks,
            splits: Splits::new(blocks, args.len()),
            args,
            ..TaskDesc::empty()
        }
    }

    fn arg(tag: ArgTag, tensor: Tensor) -> TensorArg {
        TensorArg { tag, tensor }
    }

    /// `gather` copies a written argument's old values before it is borrowed mutably, and is
    /// refused after: reading under a live `&mut` would invalidate it (Miri reports that).
    #[test]
    fn gather_of_a_written_argument_is_refused_once_it_is_borrowed() {
        let mem = HostVec::new(256);
        let m = matrix(&mem);
        let cancel = AtomicBool::new(false);
        let d = desc(vec![arg(ArgTag::InOut, m)], 1);
        let ctx = TaskCtx::new(&d, 0, 0, &cancel, None, true);
        let old = ctx.gather::<f32>(0).unwrap();
        let w = ctx.write::<f32>(0).unwrap();
        w[0] = 1.0;
        let e = ctx.gather::<f32>(0).unwrap_err().to_string();
        assert!(e.contains("already borrowed mutably"), "{e}");
        w[1] = old[0] + 2.0;
        assert_eq!((w[0], w[1]), (1.0, 2.0));
    }

    /// Rectangles chosen at run time: blocks hold several at once (one block two of them) and
    /// write them interleaved (Miri would report aliasing `&mut` rows); the writes land where
    /// the rectangles say.
    #[test]
    fn rectangles_of_different_blocks_are_disjoint_while_held_together() {
        let mem = HostVec::new(256);
        let m = matrix(&mem);
        let cancel = AtomicBool::new(false);
        let d = desc(vec![arg(ArgTag::OutputExisting, m)], 3);
        let ctxs: Vec<TaskCtx<'_>> = (0..3)
            .map(|b| TaskCtx::new(&d, b, 0, &cancel, None, true))
            .collect();
        let mut rects = vec![
            ctxs[0].write_rect::<f32>(0, 0..3, 0..8).unwrap(),
            ctxs[1].write_rect::<f32>(0, 3..8, 0..5).unwrap(),
            ctxs[1].write_rect::<f32>(0, 3..8, 5..8).unwrap(),
            ctxs[2].write_rect::<f32>(0, 2..2, 0..8).unwrap(),
        ];
        assert_eq!(
            rects
                .iter()
                .map(|r| (r.first_row(), r.len(), r.first_col(), r.row_len()))
                .collect::<Vec<_>>(),
            [(0, 3, 0, 8), (3, 5, 0, 5), (3, 5, 5, 3), (2, 0, 0, 8)]
        );
        for r in 0..5 {
            for (k, rect) in rects.iter_mut().enumerate() {
                if r < rect.len() {
                    rect.row(r).fill(k as f32 + 1.0);
                }
            }
        }
        drop(rects);
        let read = desc(vec![arg(ArgTag::Input, m)], 1);
        let all = TaskCtx::new(&read, 0, 0, &cancel, None, true)
            .read::<f32>(0)
            .unwrap()
            .to_vec();
        assert_eq!(&all[16..24], &[1.0; 8]);
        assert_eq!(&all[24..32], &[2.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]);
        assert_eq!(&all[56..64], &[2.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]);
    }

    /// Every way to ask for an aliasing rectangle is refused with an error that says why:
    /// overlapping another block's, taking one's own twice, past the view, after another
    /// accessor's borrow (both ways round), mixed with another split, or on a read argument.
    #[test]
    fn overlapping_or_mixed_rectangles_are_refused() {
        let mem = HostVec::new(256);
        let m = matrix(&mem);
        let cancel = AtomicBool::new(false);
        let d = desc(
            vec![arg(ArgTag::OutputExisting, m), arg(ArgTag::Input, m)],
            2,
        );
        let b0 = TaskCtx::new(&d, 0, 0, &cancel, None, true);
        let b1 = TaskCtx::new(&d, 1, 0, &cancel, None, true);
        let mut held = b0.write_rect::<f32>(0, 2..4, 1..6).unwrap();
        let err = |r: Result<RowsMut<'_, f32>, KernelError>| match r {
            Ok(_) => panic!("an aliasing rectangle was handed out"),
            Err(e) => e.to_string(),
        };
        let e = err(b1.write_rect::<f32>(0, 3..8, 5..6));
        assert!(
            e.contains("overlaps rows 2..4 by columns 1..6 that block 0"),
            "{e}"
        );
        let e = err(b0.write_rect::<f32>(0, 2..4, 1..6));
        assert!(e.contains("overlaps"), "{e}");
        let e = err(b1.write_rect::<f32>(0, 0..9, 0..1));
        assert!(e.contains("inside the view's 8 rows of 8"), "{e}");
        let e = err(b1.write_rect::<f32>(0, 0..1, 6..9));
        assert!(e.contains("not a rectangle inside"), "{e}");
        #[allow(clippy::reversed_empty_ranges)]
        let e = err(b1.write_rect::<f32>(0, 5..4, 0..1));
        assert!(e.contains("not a rectangle inside"), "{e}");
        let e = err(b1.write_block_cols::<f32>(0, 2));
        assert!(e.contains("already split it by write_rect"), "{e}");
        let e = err(b1.write_rect::<f32>(1, 0..1, 0..1));
        assert!(e.contains("cannot be written"), "{e}");
        // Touching rectangles (sharing an edge, not an element) are fine (a fresh context:
        // the refused `write_block_cols` above counts as this block's borrow).
        let b1 = TaskCtx::new(&d, 1, 0, &cancel, None, true);
        let mut beside = b1.write_rect::<f32>(0, 2..4, 6..8).unwrap();
        // Both still held: write them interleaved.
        held.row(1).fill(1.0);
        beside.row(1).fill(2.0);
        held.row(0).fill(1.0);
        // Another split fixed first refuses rectangles.
        let cols = desc(vec![arg(ArgTag::OutputExisting, m)], 2);
        let c0 = TaskCtx::new(&cols, 0, 0, &cancel, None, true);
        let c1 = TaskCtx::new(&cols, 1, 0, &cancel, None, true);
        let mut share = c0.write_block_cols::<f32>(0, 1).unwrap();
        let e = err(c1.write_rect::<f32>(0, 0..1, 7..8));
        assert!(e.contains("already split it by write_block_cols"), "{e}");
        share.row(0).fill(0.0);
        // One block: a whole-argument borrow and a rectangle exclude each other.
        let one = desc(vec![arg(ArgTag::OutputExisting, m)], 1);
        let ctx = TaskCtx::new(&one, 0, 0, &cancel, None, true);
        let whole = ctx.write::<f32>(0).unwrap();
        let e = err(ctx.write_rect::<f32>(0, 0..1, 0..1));
        assert!(e.contains("already borrowed mutably in this block"), "{e}");
        whole[0] = 1.0;
        let ctx = TaskCtx::new(&one, 0, 0, &cancel, None, true);
        let mut rect = ctx.write_rect::<f32>(0, 0..1, 0..1).unwrap();
        assert!(ctx.write::<f32>(0).is_err());
        assert!(ctx.gather::<f32>(0).is_err());
        rect.row(0)[0] = 2.0;
    }

    /// A replayed task starts with no rectangles taken.
    #[test]
    fn reset_forgets_the_rectangles() {
        let mem = HostVec::new(256);
        let m = matrix(&mem);
        let cancel = AtomicBool::new(false);
        let mut d = desc(vec![arg(ArgTag::OutputExisting, m)], 2);
        {
            let ctx = TaskCtx::new(&d, 0, 0, &cancel, None, true);
            let _r = ctx.write_rect::<f32>(0, 0..8, 0..8).unwrap();
        }
        d.splits.reset(2, 1);
        let ctx = TaskCtx::new(&d, 1, 0, &cancel, None, true);
        assert!(ctx.write_rect::<f32>(0, 0..8, 0..8).is_ok());
    }

    /// The blocks' shares of one argument are held at the same time and written interleaved:
    /// under Miri, overlapping `&mut` slices would be reported as undefined behaviour.
    #[test]
    fn block_shares_are_disjoint_while_held_together() {
        let mem = HostVec::new(256);
        let m = matrix(&mem);
        let cancel = AtomicBool::new(false);
        let rows = desc(vec![arg(ArgTag::InOut, m)], 3);
        let ctxs: Vec<TaskCtx<'_>> = (0..3)
            .map(|b| TaskCtx::new(&rows, b, 0, &cancel, None, true))
            .collect();
        let mut shares: Vec<RowsMut<'_, f32>> = ctxs
            .iter()
            .map(|c| c.write_block_rows::<f32>(0).unwrap())
            .collect();
        for r in 0..3 {
            for (b, s) in shares.iter_mut().enumerate() {
                if r < s.len() {
                    s.row(r).fill(b as f32);
                }
            }
        }
        drop(shares);
        let cols = desc(vec![arg(ArgTag::InOut, m)], 4);
        let ctxs: Vec<TaskCtx<'_>> = (0..4)
            .map(|b| TaskCtx::new(&cols, b, 0, &cancel, None, true))
            .collect();
        let mut shares: Vec<RowsMut<'_, f32>> = ctxs
            .iter()
            .map(|c| c.write_block_cols::<f32>(0, 2).unwrap())
            .collect();
        for s in shares.iter_mut() {
            let c0 = s.first_col() as f32;
            for row in s.iter_mut() {
                row.fill(c0);
            }
        }
        // A block asking for another split is refused while the others hold theirs.
        assert!(ctxs[0].write_chunk::<f32>(0, 4).is_err());
        drop(shares);
        let chunks = desc(
            vec![arg(ArgTag::OutputExisting, m.reshape(&[64]).unwrap())],
            3,
        );
        let ctxs: Vec<TaskCtx<'_>> = (0..3)
            .map(|b| TaskCtx::new(&chunks, b, 0, &cancel, None, true))
            .collect();
        let mut parts: Vec<&mut [f32]> = ctxs
            .iter()
            .map(|c| c.write_chunk::<f32>(0, 30).unwrap())
            .collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [30, 30, 4]
        );
        for (b, p) in parts.iter_mut().enumerate() {
            p[0] = 100.0 + b as f32;
        }
        drop(parts);
        // Read it back through the read accessors: whole view, strided tile rows, a
        // transposed gather.
        let read = desc(
            vec![
                arg(ArgTag::Input, m),
                arg(
                    ArgTag::Input,
                    m.slice(0, 1, 3).unwrap().slice(1, 2, 5).unwrap(),
                ),
                arg(ArgTag::Input, m.transpose(0, 1).unwrap()),
            ],
            1,
        );
        let ctx = TaskCtx::new(&read, 0, 0, &cancel, None, true);
        let all = ctx.read::<f32>(0).unwrap();
        assert_eq!(all[0], 100.0);
        assert_eq!(all[30], 101.0);
        assert_eq!(all[60], 102.0);
        assert_eq!(all[1], 0.0);
        assert_eq!(all[63], 6.0);
        let tile = ctx.read_rows::<f32>(1).unwrap();
        assert_eq!(
            tile.iter().collect::<Vec<_>>(),
            [&[2.0, 2.0, 4.0][..], &[2.0, 2.0, 4.0]]
        );
        let t = ctx.gather::<f32>(2).unwrap();
        assert_eq!(t[8], all[1]);
        // A written argument is borrowed once per block; a read one is never written.
        let w = desc(vec![arg(ArgTag::InOut, m), arg(ArgTag::Input, m)], 1);
        let ctx = TaskCtx::new(&w, 0, 0, &cancel, None, true);
        let whole = ctx.write::<f32>(0).unwrap();
        assert!(ctx.write::<f32>(0).is_err());
        assert!(ctx.write::<f32>(1).is_err());
        assert!(ctx.read::<f32>(0).is_err());
        whole[0] = 1.0;
        let s = desc(vec![arg(ArgTag::InOut, m.transpose(0, 1).unwrap())], 1);
        let ctx = TaskCtx::new(&s, 0, 0, &cancel, None, true);
        ctx.scatter::<f32>(0, &(0..64).map(|i| i as f32).collect::<Vec<_>>())
            .unwrap();
        let ctx = TaskCtx::new(&read, 0, 0, &cancel, None, true);
        assert_eq!(ctx.read::<f32>(0).unwrap()[1], 8.0);
    }
}
