//! User buffers: platform memory the host fills and reads between runs, and that runs bind.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::dtype::{DType, Element};
use crate::error::{BufferError, TensorError};
use crate::platform::Memory;
use crate::tensor::{BufferId, Tensor};

const FREE: u8 = 0;
const BOUND: u8 = 1;
const HOST: u8 = 2;

pub(crate) struct BufferInner {
    pub(crate) id: BufferId,
    pub(crate) mem: Box<dyn Memory>,
    /// FREE, BOUND (to a run in flight) or HOST (a host copy in progress).
    state: AtomicU8,
}

/// A buffer the user owns. Cheap to clone (shared handle). Views over it are made with
/// [`Buffer::tensor`]; a run may use it once it is bound (passed in `RunArgs` or through
/// `Orchestrator::bind`). While a run holds it, host reads and writes fail with
/// [`BufferError::InUse`] instead of racing with kernels.
#[derive(Clone)]
pub struct Buffer {
    pub(crate) inner: Arc<BufferInner>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer(#{}, {} bytes)", self.inner.id.0, self.len())
    }
}

impl Buffer {
    pub(crate) fn new(id: BufferId, mem: Box<dyn Memory>) -> Buffer {
        Buffer {
            inner: Arc::new(BufferInner {
                id,
                mem,
                state: AtomicU8::new(FREE),
            }),
        }
    }

    /// Id.
    pub fn id(&self) -> BufferId {
        self.inner.id
    }
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.inner.mem.len()
    }
    /// Whether the size is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A contiguous row-major view of `shape` from the start of the buffer.
    pub fn tensor(&self, dtype: DType, shape: &[u64]) -> Result<Tensor, TensorError> {
        Tensor::new_contiguous(
            self.inner.id,
            self.inner.mem.addr(),
            self.len() as u64,
            dtype,
            shape,
        )
    }

    /// Marks the buffer bound to a run; false if it is already bound.
    pub(crate) fn bind(&self) -> bool {
        loop {
            match self.inner.state.compare_exchange(
                FREE,
                BOUND,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(BOUND) => return false,
                Err(_) => std::thread::yield_now(),
            }
        }
    }

    pub(crate) fn unbind(&self) {
        self.inner.state.store(FREE, Ordering::Release);
    }

    fn host_access<R>(&self, f: impl FnOnce(*mut u8) -> R) -> Result<R, BufferError> {
        if !self.inner.mem.host_accessible() {
            return Err(BufferError::InUse {
                id: self.inner.id.0,
            });
        }
        if self
            .inner
            .state
            .compare_exchange(FREE, HOST, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(BufferError::InUse {
                id: self.inner.id.0,
            });
        }
        let r = f(self.inner.mem.addr() as *mut u8);
        self.inner.state.store(FREE, Ordering::Release);
        Ok(r)
    }

    /// Copies `data` into the buffer starting at byte `offset`.
    pub fn write_at<T: Element>(&self, offset: usize, data: &[T]) -> Result<(), BufferError> {
        let bytes = std::mem::size_of_val(data);
        if !offset.is_multiple_of(std::mem::align_of::<T>())
            || offset.checked_add(bytes).is_none_or(|e| e > self.len())
        {
            return Err(BufferError::Size {
                id: self.inner.id.0,
                bytes: self.len() as u64,
                given: offset.saturating_add(bytes) as u64,
            });
        }
        self.host_access(|base| {
            // SAFETY: `offset + bytes <= len` (checked above), the memory is host-accessible and
            // no run or other host copy uses it (state HOST held); source and destination are
            // distinct allocations.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, base.add(offset), bytes)
            }
        })
    }

    /// Copies `data` into the start of the buffer.
    pub fn write<T: Element>(&self, data: &[T]) -> Result<(), BufferError> {
        self.write_at(0, data)
    }

    /// Reads `count` elements starting at byte `offset`.
    pub fn read_at<T: Element>(&self, offset: usize, count: usize) -> Result<Vec<T>, BufferError> {
        let bytes = count.saturating_mul(size_of::<T>());
        if !offset.is_multiple_of(std::mem::align_of::<T>())
            || offset.checked_add(bytes).is_none_or(|e| e > self.len())
        {
            return Err(BufferError::Size {
                id: self.inner.id.0,
                bytes: self.len() as u64,
                given: offset.saturating_add(bytes) as u64,
            });
        }
        self.host_access(|base| {
            let mut out = Vec::<T>::with_capacity(count);
            // SAFETY: the range is inside the buffer (checked), host-accessible and not in use
            // by a run; `out` has capacity for `count` elements, every bit pattern is a valid
            // `T` (sealed `Element`), so setting the length after the copy is sound.
            unsafe {
                std::ptr::copy_nonoverlapping(base.add(offset), out.as_mut_ptr() as *mut u8, bytes);
                out.set_len(count);
            }
            out
        })
    }

    /// Reads the whole buffer as elements of `T` (trailing bytes that do not fill a `T` are
    /// left out).
    pub fn read<T: Element>(&self) -> Result<Vec<T>, BufferError> {
        self.read_at(0, self.len() / size_of::<T>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platform::test_memory::HostVec;

    #[test]
    fn host_copies_stay_in_bounds_and_respect_binding() {
        let b = Buffer::new(BufferId::fresh(), Box::new(HostVec::new(32)));
        b.write_at(8, &[1.0f32, 2.0, 3.0]).unwrap();
        assert_eq!(b.read_at::<f32>(8, 3).unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!(b.read::<f32>().unwrap()[..2], [0.0, 0.0]);
        // Out of range, misaligned, or overflowing requests are errors, not copies.
        assert!(b.write_at(24, &[0.0f32; 3]).is_err());
        assert!(b.write_at(usize::MAX - 2, &[0u8; 8]).is_err());
        assert!(b.read_at::<f32>(2, 1).is_err());
        assert!(b.read_at::<u64>(0, usize::MAX).is_err());
        // While bound to a run, host copies fail.
        assert!(b.bind());
        assert!(!b.bind());
        assert!(matches!(b.read::<u8>(), Err(BufferError::InUse { .. })));
        b.unbind();
        assert_eq!(b.read::<u8>().unwrap().len(), 32);
    }
}
