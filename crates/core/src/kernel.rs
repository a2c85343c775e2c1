//! Kernels: registration by id with an engine class, and [`TaskCtx`], the view a kernel body has
//! of its task (arguments, scalars, block index).
//!
//! # Memory access and soundness
//! Kernel bodies reach tensor memory only through [`TaskCtx`]. The runtime orders tasks so that
//! a task's written regions are not touched by any other task while it runs, *provided the
//! orchestration follows the program rule of `01-runtime.md`* (write-after-read is not tracked:
//! a task that overwrites a region earlier tasks still read must be ordered explicitly). Within
//! one task the accessors keep Rust's aliasing rules:
//! - readable arguments (`Input`, `NoDep`) are only read: [`TaskCtx::read`] (contiguous views),
//!   [`TaskCtx::read_rows`] (rows of strided tiles), [`TaskCtx::gather`] (any view, copied);
//! - a written argument is borrowed mutably at most once per block: [`TaskCtx::write`]
//!   (contiguous, single block), [`TaskCtx::write_chunk`] (disjoint per-block chunks),
//!   [`TaskCtx::write_rows`] / [`TaskCtx::write_block_rows`] (rows of strided tiles: exactly the
//!   view's elements, never the neighbours between its rows), [`TaskCtx::scatter`] (any view);
//! - the orchestrator rejects a task whose written argument overlaps another of its arguments.
//!
//! Slices never cover elements outside the view, so tasks writing neighbouring tiles of one
//! matrix never hold aliasing references.

use std::cell::Cell;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::dtype::{DType, Element};
use crate::error::{KernelError, TensorError};
use crate::task::{ArgTag, EngineClass, TaskId};
use crate::tensor::Tensor;

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
    pub(crate) kernel: Option<Arc<KernelSpec>>,
    pub(crate) class: EngineClass,
    pub(crate) block_num: u32,
    pub(crate) sync_start: bool,
    pub(crate) args: Vec<TensorArg>,
    pub(crate) scalars: Vec<u64>,
    pub(crate) predicate: Option<Predicate>,
    pub(crate) timing_slot: Option<u8>,
}

impl TaskDesc {
    pub(crate) fn empty() -> TaskDesc {
        TaskDesc {
            id: TaskId(0),
            kernel: None,
            class: EngineClass::Vector,
            block_num: 1,
            sync_start: false,
            args: Vec::new(),
            scalars: Vec::new(),
            predicate: None,
            timing_slot: None,
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
    /// Arguments already borrowed mutably in this block (bit i = argument i).
    borrowed: Cell<u32>,
}

impl<'a> TaskCtx<'a> {
    pub(crate) fn new(
        desc: &'a TaskDesc,
        block: u32,
        core: u32,
        cancel: &'a AtomicBool,
        gang: Option<&'a dyn GangBarrier>,
    ) -> TaskCtx<'a> {
        TaskCtx {
            desc,
            block,
            core,
            cancel,
            gang,
            borrowed: Cell::new(0),
        }
    }

    /// The task's id.
    pub fn task_id(&self) -> TaskId {
        self.desc.id
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
    /// This block's share of `n` items when the last quarter of the blocks (of 8 or more) get
    /// shrinking shares: halving one after the other down to 1/8 of a full share when every
    /// share stays non-empty, else half-size (with at least two items per block). Cores take
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
        if a.tensor.dtype != T::DTYPE {
            return Err(TensorError::DType {
                wanted: T::DTYPE,
                actual: a.tensor.dtype,
            }
            .into());
        }
        let r = a.tensor.region();
        let start = a.tensor.addr + r.lo as usize * T::DTYPE.size();
        Ok((a, start, (r.hi - r.lo) as usize))
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
        if !a.tag.is_written() {
            return Err(KernelError::new(format!(
                "argument {i} is tagged {} and cannot be written",
                a.tag.name()
            )));
        }
        self.claim(i, what)
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
        // the region, and no task writes it while this one runs (the program rule in the module
        // docs); this task does not write it (written arguments may not overlap others).
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
        }
        let base = a.tensor.addr as *const T;
        let mut out = Vec::with_capacity(a.tensor.numel() as usize);
        a.tensor.for_each_offset(|off| {
            // SAFETY: `off` is an element of the view, inside its buffer; no other task writes it
            // concurrently (program rule) and, for a written argument, this is the task's only
            // block; a raw read creates no reference, and any bit pattern is a valid `T`.
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
        // task touches the region while this one runs (program rule), the task has one block,
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
        let all = RowsMut::<T>::new(i, &a.tensor, None)?.n_rows;
        let rows = RowsMut::new(i, &a.tensor, Some(self.block_range(all)))?;
        self.writable(i, a, "write_block_rows")?;
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
        let width = rows.g.row_len;
        let units = self.block_range_tapered(width.div_ceil(g));
        rows.col0 = (units.start * g).min(width);
        rows.ncols = (units.end * g).min(width) - rows.col0;
        self.writable(i, a, "write_block_cols")?;
        Ok(rows)
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

/// Weight of a full-size block in the geometric taper; the tail's weights halve from here.
const TAPER_FULL: usize = 8;

/// Sum of the first `k` tail weights of the geometric taper: `F/2, F/4, .., 1, 1, ..`.
fn geometric_tail(k: usize) -> usize {
    let (mut sum, mut w, mut t) = (0, TAPER_FULL / 2, 0);
    while t < k && w > 1 {
        sum += w;
        w /= 2;
        t += 1;
    }
    sum + (k - t)
}

/// Share `i` of `n` items over `blocks` blocks, tapered so a task's last blocks are small:
/// with 8 or more blocks, the last quarter's shares halve one after the other (1/2, 1/4, 1/8,
/// then 1/8 of a full share) when there are enough items for every share to be non-empty;
/// failing that, the last quarter's shares are half size (with at least two items per block);
/// otherwise the shares are equal. With at least as many items as blocks, no share is empty.
pub(crate) fn tapered_range(n: usize, blocks: usize, i: usize) -> Range<usize> {
    let blocks = blocks.max(1);
    let tail = if blocks >= 8 { blocks / 4 } else { 0 };
    let full = blocks - tail;
    let geometric = tail > 0 && n >= TAPER_FULL * full + geometric_tail(tail);
    let halves = tail > 0 && !geometric && n >= 2 * blocks;
    // Prefix of the weights before block `j`.
    let before = |j: usize| {
        let (head, k) = (j.min(full), j.saturating_sub(full));
        if geometric {
            TAPER_FULL * head + geometric_tail(k)
        } else if halves {
            2 * head + k
        } else {
            j
        }
    };
    let total = before(blocks) as u128;
    let at = |j: usize| (n as u128 * before(j) as u128 / total) as usize;
    at(i.min(blocks))..at((i + 1).min(blocks))
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

/// Geometry of a view seen as rows (innermost stride 1, leading dimensions flattened).
#[derive(Clone, Copy)]
struct RowGeometry {
    base: usize,
    n_rows: usize,
    row_len: usize,
    ndim: usize,
    shape: [u64; crate::tensor::MAX_DIMS],
    strides: [u64; crate::tensor::MAX_DIMS],
    offset: u64,
}

impl RowGeometry {
    fn new(i: usize, t: &Tensor) -> Result<RowGeometry, KernelError> {
        let n = t.ndim();
        if t.strides()[n - 1] != 1 && t.shape()[n - 1] > 1 {
            return Err(KernelError::new(format!(
                "argument {i}: rows need an innermost stride of 1 (strides {:?}); use gather/scatter",
                t.strides()
            )));
        }
        let mut shape = [0; crate::tensor::MAX_DIMS];
        let mut strides = [0; crate::tensor::MAX_DIMS];
        shape[..n].copy_from_slice(t.shape());
        strides[..n].copy_from_slice(t.strides());
        Ok(RowGeometry {
            base: t.addr,
            n_rows: t.shape()[..n - 1].iter().product::<u64>() as usize,
            row_len: t.shape()[n - 1] as usize,
            ndim: n,
            shape,
            strides,
            offset: t.offset,
        })
    }

    /// Element offset (from the buffer start) of row `r`.
    fn row_offset(&self, mut r: usize) -> usize {
        let mut off = self.offset;
        for d in (0..self.ndim - 1).rev() {
            let n = self.shape[d] as usize;
            off += (r % n) as u64 * self.strides[d];
            r /= n;
        }
        off as usize
    }
}

/// The rows of a readable view. `row(r)` is exactly the view's elements of row `r`.
pub struct Rows<'a, T> {
    g: RowGeometry,
    _p: std::marker::PhantomData<&'a [T]>,
}

impl<'a, T: Element> Rows<'a, T> {
    fn new(i: usize, t: &Tensor) -> Result<Rows<'a, T>, KernelError> {
        Ok(Rows {
            g: RowGeometry::new(i, t)?,
            _p: std::marker::PhantomData,
        })
    }
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.g.n_rows
    }
    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.g.n_rows == 0
    }
    /// Elements per row.
    pub fn row_len(&self) -> usize {
        self.g.row_len
    }
    /// Row `r` (panics if `r >= len()`, like slice indexing).
    pub fn row(&self, r: usize) -> &'a [T] {
        assert!(r < self.g.n_rows, "row {r} of {}", self.g.n_rows);
        let start = self.g.base + self.g.row_offset(r) * size_of::<T>();
        // SAFETY: the row is `row_len` consecutive elements of the view (innermost stride 1),
        // inside the buffer; read-only access to a region no task writes concurrently (program
        // rule); aligned, valid for any bit pattern.
        unsafe { std::slice::from_raw_parts(start as *const T, self.g.row_len) }
    }
    /// Iterates the rows.
    pub fn iter(&self) -> impl Iterator<Item = &'a [T]> + '_ {
        (0..self.g.n_rows).map(move |r| self.row(r))
    }
}

/// Mutable rows of a written view (all of them, or one block's share of the rows or of the
/// columns).
pub struct RowsMut<'a, T> {
    g: RowGeometry,
    first: usize,
    n_rows: usize,
    /// First column of the share.
    col0: usize,
    /// Columns of the share.
    ncols: usize,
    _p: std::marker::PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> RowsMut<'a, T> {
    fn new(
        i: usize,
        t: &Tensor,
        part: Option<Range<usize>>,
    ) -> Result<RowsMut<'a, T>, KernelError> {
        if !t.is_non_overlapping() {
            return Err(KernelError::new(format!(
                "argument {i}: the view's rows alias each other"
            )));
        }
        let g = RowGeometry::new(i, t)?;
        let r = part.unwrap_or(0..g.n_rows);
        Ok(RowsMut {
            g,
            first: r.start,
            n_rows: r.len(),
            col0: 0,
            ncols: g.row_len,
            _p: std::marker::PhantomData,
        })
    }
    /// Number of rows in this share.
    pub fn len(&self) -> usize {
        self.n_rows
    }
    /// Whether the share is empty.
    pub fn is_empty(&self) -> bool {
        self.n_rows == 0
    }
    /// Index (in the whole view) of this share's first row.
    pub fn first_row(&self) -> usize {
        self.first
    }
    /// Elements per row of this share (the view's row length unless the share is a column
    /// range).
    pub fn row_len(&self) -> usize {
        self.ncols
    }
    /// Index (in the view's rows) of this share's first column.
    pub fn first_col(&self) -> usize {
        self.col0
    }
    /// Elements per row of the whole view.
    pub fn view_row_len(&self) -> usize {
        self.g.row_len
    }
    /// Row `r` of this share (panics if `r >= len()`).
    pub fn row(&mut self, r: usize) -> &mut [T] {
        assert!(r < self.n_rows, "row {r} of {}", self.n_rows);
        let start = self.g.base + self.g.row_offset(self.first + r) * size_of::<T>();
        // SAFETY: columns col0..col0+ncols (inside the row: set at creation) of one row of a
        // non-overlapping view (checked at creation), inside the buffer, reached only through
        // this `&mut self` borrow; other blocks hold disjoint shares (rows or columns) and other
        // tasks do not touch the region (program rule).
        unsafe { slice_mut(start, self.col0, self.col0 + self.ncols) }
    }
    /// Iterates the rows of this share (each a distinct `&mut` slice).
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut [T]> + '_ {
        let g = self.g;
        let (first, c0, c1) = (self.first, self.col0, self.col0 + self.ncols);
        (0..self.n_rows).map(move |r| {
            let start = g.base + g.row_offset(first + r) * size_of::<T>();
            // SAFETY: as in `row`; rows of a non-overlapping view are pairwise disjoint, so the
            // slices this iterator yields never alias each other, and they are tied to the
            // `&mut self` borrow.
            unsafe { slice_mut(start, c0, c1) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::tapered_range;
    use proptest::prelude::*;

    #[test]
    fn geometric_taper_of_a_projection() {
        // 3072 rows in 16-row units over 12 blocks: 9 full shares, then about 1/2, 1/4, 1/8.
        let lens: Vec<usize> = (0..12).map(|i| tapered_range(192, 12, i).len()).collect();
        assert_eq!(lens.iter().sum::<usize>(), 192);
        assert!(
            lens[..9].iter().all(|&l| (19..=20).contains(&l)),
            "{lens:?}"
        );
        assert_eq!(&lens[9..], &[10, 5, 3], "{lens:?}");
        // Too few items for the geometric taper: half-size shares.
        let lens: Vec<usize> = (0..8).map(|i| tapered_range(20, 8, i).len()).collect();
        assert_eq!(lens, [2, 3, 3, 3, 3, 3, 1, 2], "{lens:?}");
    }

    proptest! {
        #[test]
        fn tapered_shares_cover_in_order_and_shrink_at_the_end(n in 0usize..5000, blocks in 1usize..300) {
            let shares: Vec<_> = (0..blocks).map(|i| tapered_range(n, blocks, i)).collect();
            prop_assert_eq!(shares[0].start, 0);
            prop_assert_eq!(shares[blocks - 1].end, n);
            for w in shares.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            if blocks <= n {
                prop_assert!(shares.iter().all(|r| !r.is_empty()), "{shares:?}");
            }
            if blocks >= 8 && n >= 4 * blocks {
                let first = shares[0].len();
                let last = shares[blocks - 1].len();
                prop_assert!(last < first, "{first} {last}");
            }
            if blocks >= 8 && n >= 8 * blocks {
                // Geometric: the last share is at most a quarter of a full one (+ rounding).
                let first = shares[0].len();
                let last = shares[blocks - 1].len();
                prop_assert!(4 * last <= first + 4, "{first} {last}");
                for w in shares[blocks - blocks / 4 - 1..].windows(2) {
                    prop_assert!(w[1].len() <= w[0].len() + 1, "{shares:?}");
                }
            }
            if blocks < 8 || n < 2 * blocks {
                let (lo, hi) = shares.iter().map(|r| r.len()).fold((usize::MAX, 0), |(a, b), l| (a.min(l), b.max(l)));
                prop_assert!(hi - lo <= 1);
            }
        }
    }
}
