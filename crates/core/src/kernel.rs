//! Kernels: registration by id with an engine class, and [`TaskCtx`], the view a kernel body has
//! of its task (arguments, scalars, block index).
//!
//! # Memory access and soundness
//! Kernel bodies reach tensor memory through [`TaskCtx`]. The runtime orders tasks so that a
//! task's written regions are not touched by any other task while it runs, *provided the
//! orchestration follows the tagging rule of `01-runtime.md`* (write-after-read is not tracked:
//! a task that overwrites a region earlier tasks still read must be ordered explicitly). Within
//! one task the accessors keep Rust's aliasing rules: `Input`/`NoDep` arguments are only read,
//! written arguments are only reached through one `&mut` borrow per block
//! ([`TaskCtx::write`] for single-block tasks, [`TaskCtx::write_chunk`] for disjoint per-block
//! chunks), and the orchestrator rejects a task whose written argument overlaps another of its
//! arguments.

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
        KernelSpec { id, name: name.into(), class, body: Arc::new(body) }
    }
}

impl std::fmt::Debug for KernelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelSpec").field("id", &self.id).field("name", &self.name).field("class", &self.class).finish()
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
            return Err(format!("kernel id {id} is above the maximum {}", MAX_KERNEL_ID - 1));
        }
        let i = id as usize;
        if self.by_id.len() <= i {
            self.by_id.resize(i + 1, None);
        }
        if let Some(old) = &self.by_id[i] {
            return Err(format!("kernel id {id} is already registered as {:?}", old.name));
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
        self.kernel.as_ref().map(|k| k.name.clone()).unwrap_or_else(|| "<dummy>".to_string())
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
        TaskCtx { desc, block, core, cancel, gang, borrowed: Cell::new(0) }
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
            None => Err(KernelError::new("sync_barrier needs a task submitted with require_sync_start")),
        }
    }

    /// Number of tensor arguments.
    pub fn num_args(&self) -> usize {
        self.desc.args.len()
    }
    /// Tensor argument `i` (tag and view).
    pub fn arg(&self, i: usize) -> Result<&TensorArg, KernelError> {
        self.desc.args.get(i).ok_or_else(|| {
            KernelError::new(format!("argument {i} requested but the task has {} tensor arguments", self.num_args()))
        })
    }
    /// The view of tensor argument `i`.
    pub fn tensor(&self, i: usize) -> Result<&Tensor, KernelError> {
        Ok(&self.arg(i)?.tensor)
    }
    /// Raw 64-bit scalar `i`.
    pub fn scalar(&self, i: usize) -> Result<u64, KernelError> {
        self.desc.scalars.get(i).copied().ok_or_else(|| {
            KernelError::new(format!("scalar {i} requested but the task has {} scalars", self.desc.scalars.len()))
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
        usize::try_from(self.scalar(i)?).map_err(|_| KernelError::new(format!("scalar {i} does not fit usize")))
    }

    fn typed<T: Element>(&self, i: usize) -> Result<(&TensorArg, usize, usize), KernelError> {
        let a = self.arg(i)?;
        if a.tensor.dtype != T::DTYPE {
            return Err(TensorError::DType { wanted: T::DTYPE, actual: a.tensor.dtype }.into());
        }
        let r = a.tensor.region();
        let start = a.tensor.addr + r.lo as usize * T::DTYPE.size();
        Ok((a, start, (r.hi - r.lo) as usize))
    }

    fn claim(&self, i: usize, what: &str) -> Result<(), KernelError> {
        let bit = 1u32 << i;
        if self.borrowed.get() & bit != 0 {
            return Err(KernelError::new(format!("argument {i} is already borrowed mutably in this block ({what})")));
        }
        self.borrowed.set(self.borrowed.get() | bit);
        Ok(())
    }

    /// Reads an `Input` or `NoDep` argument: the elements from the view's first to its last
    /// element (for strided views, index with [`Tensor::strides`] relative to the view start).
    pub fn read<T: Element>(&self, i: usize) -> Result<&[T], KernelError> {
        let (a, start, len) = self.typed::<T>(i)?;
        if a.tag.is_written() {
            return Err(KernelError::new(format!(
                "argument {i} is tagged {}; reach written arguments through write()/write_chunk()",
                a.tag.name()
            )));
        }
        if len == 0 {
            return Ok(&[]);
        }
        // SAFETY: `start..start+len*size` lies inside the argument's buffer (checked when the
        // view was made) which outlives the run; the address is aligned for T because buffers
        // are page-aligned and offsets count T-sized elements; every bit pattern is a valid T
        // (sealed `Element`); the runtime orders this task after every writer of the region and
        // no task writes it while this one runs (the program rule in the module docs), and this
        // task does not write it (the orchestrator rejects written arguments overlapping others).
        Ok(unsafe { std::slice::from_raw_parts(start as *const T, len) })
    }

    /// Reads an `Input`/`NoDep` argument as a scalar-per-element `Vec<f32>` (any float dtype).
    pub fn read_f32(&self, i: usize) -> Result<Vec<f32>, KernelError> {
        let a = self.arg(i)?;
        Ok(match a.tensor.dtype {
            DType::F32 => self.read::<f32>(i)?.to_vec(),
            DType::BF16 => self.read::<half::bf16>(i)?.iter().map(|x| x.to_f32()).collect(),
            DType::F16 => self.read::<half::f16>(i)?.iter().map(|x| x.to_f32()).collect(),
            d => return Err(KernelError::new(format!("argument {i} holds {d}, not a float type"))),
        })
    }

    /// The whole span of a written argument (`Output`, `InOut`, `OutputExisting`) of a
    /// single-block task, mutably. Multi-block tasks use [`TaskCtx::write_chunk`].
    pub fn write<T: Element>(&self, i: usize) -> Result<&mut [T], KernelError> {
        if self.desc.block_num != 1 {
            return Err(KernelError::new(format!(
                "write({i}) in a task of {} blocks would alias across blocks; use write_chunk",
                self.desc.block_num
            )));
        }
        self.written_span(i, None)
    }

    /// This block's chunk of a contiguous written argument: elements
    /// `block_idx*chunk .. (block_idx+1)*chunk` (clipped to the view). Chunks of different blocks
    /// never overlap.
    pub fn write_chunk<T: Element>(&self, i: usize, chunk: usize) -> Result<&mut [T], KernelError> {
        self.written_span(i, Some(chunk))
    }

    fn written_span<T: Element>(&self, i: usize, chunk: Option<usize>) -> Result<&mut [T], KernelError> {
        let (a, start, len) = self.typed::<T>(i)?;
        if !a.tag.is_written() {
            return Err(KernelError::new(format!("argument {i} is tagged {} and cannot be written", a.tag.name())));
        }
        let (lo, hi) = match chunk {
            None => (0, len),
            Some(c) => {
                if !a.tensor.is_contiguous() {
                    return Err(KernelError::new(format!("write_chunk({i}) needs a contiguous view")));
                }
                let lo = (self.block as usize).saturating_mul(c).min(len);
                (lo, lo.saturating_add(c).min(len))
            }
        };
        self.claim(i, "write")?;
        if hi == lo {
            return Ok(&mut []);
        }
        // SAFETY: as in `read` for bounds, alignment and validity. Exclusivity: the runtime lets
        // no other task touch this region while this task runs (program rule); within the task,
        // either there is one block (`write`) or each block gets a disjoint chunk indexed by its
        // unique block index (`write_chunk`), and `claim` stops a block from borrowing the same
        // argument twice.
        Ok(unsafe { std::slice::from_raw_parts_mut((start as *mut T).add(lo), hi - lo) })
    }

    /// The whole span of a written argument, with no aliasing checks across blocks.
    ///
    /// # Safety
    /// No other block of this task may access the elements this block writes or reads through
    /// the returned slice while it is alive.
    pub unsafe fn write_unchecked<T: Element>(&self, i: usize) -> Result<&mut [T], KernelError> {
        let (a, start, len) = self.typed::<T>(i)?;
        if !a.tag.is_written() {
            return Err(KernelError::new(format!("argument {i} is tagged {} and cannot be written", a.tag.name())));
        }
        self.claim(i, "write_unchecked")?;
        if len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: bounds, alignment and validity as in `read`; exclusivity across blocks is the
        // caller's contract (this fn's `# Safety`), across tasks the runtime's ordering.
        Ok(unsafe { std::slice::from_raw_parts_mut(start as *mut T, len) })
    }
}
