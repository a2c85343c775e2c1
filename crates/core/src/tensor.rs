//! Tensor views over buffers, metadata-only view operations, and the element-region relation the
//! dependency map uses to decide whether two views overlap.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::dtype::DType;
use crate::error::TensorError;
use crate::task::TaskId;

/// Most dimensions a tensor view has.
pub const MAX_DIMS: usize = 5;

/// Identifies a buffer: a user buffer, or one runtime-allocated output. Ids are unique in the
/// process (across workers and runs), so a view's id names exactly one buffer's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_RUN_EPOCH: AtomicU64 = AtomicU64::new(1);

impl BufferId {
    /// A buffer id no other buffer of this process has had.
    pub(crate) fn fresh() -> BufferId {
        BufferId(NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed))
    }
}

/// A run epoch no other run of this process has had (outputs carry their run's epoch, so an
/// output of another run or another worker is rejected instead of reaching its memory).
pub(crate) fn fresh_run_epoch() -> u64 {
    NEXT_RUN_EPOCH.fetch_add(1, Ordering::Relaxed)
}

/// A view `{buffer, dtype, start_offset, shape, strides, version, owner_task}` over a buffer.
///
/// Views are plain metadata: [`Tensor::view`], [`Tensor::reshape`], [`Tensor::transpose`] and
/// [`Tensor::slice`] never touch memory. Offsets and strides count elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tensor {
    pub(crate) buffer: BufferId,
    /// Base address of the buffer on its platform.
    pub(crate) addr: usize,
    /// Size of the whole buffer in bytes.
    pub(crate) buffer_bytes: u64,
    pub(crate) dtype: DType,
    pub(crate) offset: u64,
    pub(crate) ndim: u8,
    pub(crate) shape: [u64; MAX_DIMS],
    pub(crate) strides: [u64; MAX_DIMS],
    pub(crate) version: u32,
    pub(crate) owner: Option<TaskId>,
    /// Run that allocated the buffer (runtime outputs only; 0 for user buffers).
    pub(crate) run_epoch: u64,
}

fn contiguous_strides(shape: &[u64]) -> [u64; MAX_DIMS] {
    let mut strides = [0u64; MAX_DIMS];
    let mut acc = 1u64;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc = acc.saturating_mul(shape[d].max(1));
    }
    strides
}

impl Tensor {
    /// A contiguous row-major tensor starting at the beginning of a buffer.
    pub(crate) fn new_contiguous(
        buffer: BufferId,
        addr: usize,
        buffer_bytes: u64,
        dtype: DType,
        shape: &[u64],
    ) -> Result<Tensor, TensorError> {
        let mut t = Tensor {
            buffer,
            addr,
            buffer_bytes,
            dtype,
            offset: 0,
            ndim: 0,
            shape: [0; MAX_DIMS],
            strides: [0; MAX_DIMS],
            version: 0,
            owner: None,
            run_epoch: 0,
        };
        t.set_geometry(0, shape, &contiguous_strides(shape)[..shape.len()])?;
        Ok(t)
    }

    fn set_geometry(
        &mut self,
        offset: u64,
        shape: &[u64],
        strides: &[u64],
    ) -> Result<(), TensorError> {
        if shape.is_empty() || shape.len() > MAX_DIMS {
            return Err(TensorError::Rank {
                ndim: shape.len(),
                max: MAX_DIMS,
            });
        }
        if strides.len() != shape.len() {
            return Err(TensorError::StrideRank {
                shape: shape.to_vec(),
                strides: strides.to_vec(),
            });
        }
        let mut last = offset;
        let mut empty = false;
        for (&n, &s) in shape.iter().zip(strides) {
            if n == 0 {
                empty = true;
            } else {
                last = (n - 1)
                    .checked_mul(s)
                    .and_then(|x| x.checked_add(last))
                    .ok_or_else(|| TensorError::Overflow {
                        shape: shape.to_vec(),
                    })?;
            }
        }
        // Element and byte counts of the view must fit 64 bits (a broadcast view could claim
        // more elements than any buffer holds).
        shape
            .iter()
            .try_fold(self.dtype.size() as u64, |acc, &n| acc.checked_mul(n))
            .ok_or_else(|| TensorError::Overflow {
                shape: shape.to_vec(),
            })?;
        let elems = self.buffer_bytes / self.dtype.size() as u64;
        if !empty && last >= elems {
            return Err(TensorError::OutOfBounds {
                offset,
                shape: shape.to_vec(),
                strides: strides.to_vec(),
                last_element: last,
                buffer_elements: elems,
            });
        }
        self.offset = offset;
        self.ndim = shape.len() as u8;
        self.shape = [0; MAX_DIMS];
        self.strides = [0; MAX_DIMS];
        self.shape[..shape.len()].copy_from_slice(shape);
        self.strides[..shape.len()].copy_from_slice(strides);
        Ok(())
    }

    /// The buffer this view looks into.
    pub fn buffer(&self) -> BufferId {
        self.buffer
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Start offset in elements.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape[..self.ndim as usize]
    }
    /// Strides in elements.
    pub fn strides(&self) -> &[u64] {
        &self.strides[..self.ndim as usize]
    }
    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.ndim as usize
    }
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape().iter().product()
    }
    /// Size of the elements in bytes.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }
    /// Version of the buffer's contents when this view was made (see `docs/trace-format.md`).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// The task that created this tensor as an `Output`, if any.
    pub fn owner(&self) -> Option<TaskId> {
        self.owner
    }
    /// Whether the elements are laid out densely in row-major order.
    pub fn is_contiguous(&self) -> bool {
        let want = contiguous_strides(self.shape());
        self.shape()
            .iter()
            .zip(self.strides())
            .zip(want.iter())
            .all(|((&n, &s), &w)| n <= 1 || s == w)
    }

    /// Whether no two elements of the view share a memory location (rows of a written view
    /// handed out as separate `&mut` slices must not alias).
    pub fn is_non_overlapping(&self) -> bool {
        let mut dims: Vec<(u64, u64)> = self
            .shape()
            .iter()
            .zip(self.strides())
            .filter(|(n, _)| **n > 1)
            .map(|(&n, &s)| (s, n))
            .collect();
        dims.sort_unstable();
        let mut extent = 0u64; // offset of the last element of the dims seen so far
        for (stride, n) in dims {
            if stride <= extent {
                return false;
            }
            extent += (n - 1) * stride;
        }
        true
    }

    /// A view with an explicit offset (elements from the buffer start), shape and strides.
    pub fn view(&self, offset: u64, shape: &[u64], strides: &[u64]) -> Result<Tensor, TensorError> {
        let mut t = *self;
        t.set_geometry(offset, shape, strides)?;
        Ok(t)
    }

    /// The same elements with another shape; the view must be contiguous.
    pub fn reshape(&self, shape: &[u64]) -> Result<Tensor, TensorError> {
        if !self.is_contiguous() {
            return Err(TensorError::NotContiguous {
                shape: self.shape().to_vec(),
                strides: self.strides().to_vec(),
            });
        }
        let new: u64 = shape.iter().product();
        if new != self.numel() {
            return Err(TensorError::ReshapeCount {
                from: self.shape().to_vec(),
                to: shape.to_vec(),
            });
        }
        let strides = contiguous_strides(shape);
        self.view(self.offset, shape, &strides[..shape.len().min(MAX_DIMS)])
    }

    /// Swaps two dimensions.
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Tensor, TensorError> {
        let n = self.ndim();
        if d0 >= n || d1 >= n {
            return Err(TensorError::Dim {
                dim: d0.max(d1),
                ndim: n,
            });
        }
        let mut t = *self;
        t.shape.swap(d0, d1);
        t.strides.swap(d0, d1);
        Ok(t)
    }

    /// Restricts dimension `dim` to `start..end`.
    pub fn slice(&self, dim: usize, start: u64, end: u64) -> Result<Tensor, TensorError> {
        let n = self.ndim();
        if dim >= n {
            return Err(TensorError::Dim { dim, ndim: n });
        }
        if start > end || end > self.shape[dim] {
            return Err(TensorError::SliceRange {
                dim,
                start,
                end,
                size: self.shape[dim],
            });
        }
        let mut t = *self;
        t.offset += start * self.strides[dim];
        t.shape[dim] = end - start;
        Ok(t)
    }

    /// The element region this view covers, for the dependency map.
    pub(crate) fn region(&self) -> Region {
        Region::of(self)
    }

    /// First element and one past the last element the view touches (offsets from the buffer
    /// start, in elements of the view's dtype; equal for an empty view).
    pub(crate) fn element_span(&self) -> (u64, u64) {
        if self.shape().contains(&0) {
            return (self.offset, self.offset);
        }
        let last: u64 = (0..self.ndim())
            .map(|d| (self.shape[d] - 1) * self.strides[d])
            .sum();
        (self.offset, self.offset + last + 1)
    }

    /// Whether this view and `other` certainly share no byte. Exact for views the region
    /// relation can compare; otherwise decided by enumerating the elements when both views are
    /// small (at most `limit` elements each) and of one dtype, and `false` (cannot exclude)
    /// beyond that.
    pub(crate) fn disjoint_from(&self, other: &Tensor, limit: u64) -> bool {
        match self.region().relate(&other.region()) {
            Relation::Disjoint => true,
            Relation::Covers | Relation::Partial => false,
            Relation::Conservative => {
                if self.dtype.size() != other.dtype.size()
                    || self.numel() > limit
                    || other.numel() > limit
                {
                    return false;
                }
                let mut mine = Vec::with_capacity(self.numel() as usize);
                self.for_each_offset(|o| mine.push(o));
                mine.sort_unstable();
                let mut shared = false;
                other.for_each_offset(|o| shared |= mine.binary_search(&o).is_ok());
                !shared
            }
        }
    }

    /// Iterates the element offsets (from the buffer start) in logical row-major order.
    pub(crate) fn for_each_offset(&self, mut f: impl FnMut(u64)) {
        let n = self.ndim();
        if self.numel() == 0 {
            return;
        }
        let mut idx = [0u64; MAX_DIMS];
        loop {
            let off = self.offset + (0..n).map(|d| idx[d] * self.strides[d]).sum::<u64>();
            f(off);
            let mut d = n;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < self.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
}

/// The bytes a view touches, in a form cheap to compare.
///
/// Extents are in bytes, so views of one buffer with different dtypes are compared on the
/// memory they share, never on element indices of different sizes. The exact per-dimension
/// comparison works in elements and is used only between views of one element size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    pub(crate) buffer: BufferId,
    /// First byte touched.
    pub(crate) lo: u64,
    /// One past the last byte touched (`lo == hi` for an empty view).
    pub(crate) hi: u64,
    pub(crate) contiguous: bool,
    /// Element size in bytes.
    pub(crate) elem: u8,
    /// Offset, shape and strides in elements of `elem` bytes.
    pub(crate) offset: u64,
    pub(crate) ndim: u8,
    pub(crate) shape: [u64; MAX_DIMS],
    pub(crate) strides: [u64; MAX_DIMS],
}

/// How region `a` relates to region `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Relation {
    /// No element in common.
    Disjoint,
    /// Every element of `b` is in `a`.
    Covers,
    /// Some elements in common, `a` does not cover `b`.
    Partial,
    /// The layouts cannot be compared cheaply: treated as overlapping, not covering.
    Conservative,
}

impl Relation {
    pub(crate) fn overlaps(self) -> bool {
        !matches!(self, Relation::Disjoint)
    }
}

impl Region {
    fn of(t: &Tensor) -> Region {
        let (lo, hi) = t.element_span();
        // In bounds of the buffer (checked when the view was made), so no overflow.
        let size = t.dtype.size() as u64;
        Region {
            buffer: t.buffer,
            lo: lo * size,
            hi: hi * size,
            contiguous: t.is_contiguous(),
            elem: size as u8,
            offset: t.offset,
            ndim: t.ndim,
            shape: t.shape,
            strides: t.strides,
        }
    }

    fn is_empty(&self) -> bool {
        self.lo == self.hi
    }

    /// Per-dimension box of this view in the coordinates of a row-major parent whose strides
    /// are this view's strides, plus the residue of the offset modulo the innermost stride.
    /// `None` if the view does not sit in such a parent as an axis-aligned box.
    fn boxed(&self) -> Option<([u64; MAX_DIMS], u64)> {
        let n = self.ndim as usize;
        let s = &self.strides;
        if s[..n].contains(&0) {
            return None;
        }
        for i in 1..n {
            if !s[i - 1].is_multiple_of(s[i]) {
                return None;
            }
        }
        let mut start = [0u64; MAX_DIMS];
        let mut rem = self.offset;
        for i in 0..n {
            start[i] = rem / s[i];
            rem %= s[i];
            if i >= 1 && start[i] + self.shape[i] > s[i - 1] / s[i] {
                return None;
            }
        }
        Some((start, rem))
    }

    /// How `self` relates to `other` (both on any buffers).
    pub(crate) fn relate(&self, other: &Region) -> Relation {
        if self.buffer != other.buffer || self.is_empty() || other.is_empty() {
            return Relation::Disjoint;
        }
        if self.hi <= other.lo || other.hi <= self.lo {
            return Relation::Disjoint;
        }
        let extent_covers = self.lo <= other.lo && other.hi <= self.hi;
        if self.contiguous && other.contiguous {
            return if extent_covers {
                Relation::Covers
            } else {
                Relation::Partial
            };
        }
        if self.contiguous && extent_covers {
            return Relation::Covers;
        }
        let n = self.ndim as usize;
        if self.elem == other.elem
            && self.ndim == other.ndim
            && self.strides[..n] == other.strides[..n]
            && let (Some((a, ra)), Some((b, rb))) = (self.boxed(), other.boxed())
        {
            if ra != rb {
                return Relation::Disjoint;
            }
            let mut covers = true;
            for d in 0..n {
                let (a0, a1) = (a[d], a[d] + self.shape[d]);
                let (b0, b1) = (b[d], b[d] + other.shape[d]);
                if a1 <= b0 || b1 <= a0 {
                    return Relation::Disjoint;
                }
                covers &= a0 <= b0 && b1 <= a1;
            }
            return if covers {
                Relation::Covers
            } else {
                Relation::Partial
            };
        }
        Relation::Conservative
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn buf(elems: u64) -> Tensor {
        Tensor::new_contiguous(BufferId(1), 0x1000, elems * 4, DType::F32, &[elems]).unwrap()
    }

    #[test]
    fn views_are_checked_against_the_buffer() {
        let b = buf(64);
        let m = b.reshape(&[8, 8]).unwrap();
        assert!(m.slice(0, 2, 9).is_err());
        assert!(b.view(60, &[8], &[1]).is_err());
        assert!(b.reshape(&[7, 9]).is_err());
        let t = m.transpose(0, 1).unwrap();
        assert!(!t.is_contiguous());
        assert!(t.reshape(&[64]).is_err());
        assert_eq!(m.slice(1, 2, 4).unwrap().offset(), 2);
        assert_eq!(m.slice(0, 3, 4).unwrap().offset(), 24);
    }

    #[test]
    fn disjoint_strided_views_are_proven_disjoint() {
        let b = buf(64);
        let range = b.slice(0, 55, 59).unwrap();
        let column = b
            .reshape(&[8, 8])
            .unwrap()
            .slice(0, 5, 8)
            .unwrap()
            .slice(1, 6, 7)
            .unwrap();
        assert_eq!(
            range.region().relate(&column.region()),
            Relation::Conservative
        );
        assert!(range.disjoint_from(&column, 1 << 16));
        assert!(column.disjoint_from(&range, 1 << 16));
        let hit = b.slice(0, 54, 59).unwrap();
        assert!(!hit.disjoint_from(&column, 1 << 16));
    }

    #[test]
    fn self_overlapping_views_are_detected() {
        let b = buf(64);
        assert!(b.reshape(&[8, 8]).unwrap().is_non_overlapping());
        assert!(
            b.reshape(&[8, 8])
                .unwrap()
                .transpose(0, 1)
                .unwrap()
                .is_non_overlapping()
        );
        // Rows of 4 elements advancing by 2: rows overlap.
        assert!(!b.view(0, &[4, 4], &[2, 1]).unwrap().is_non_overlapping());
        // A broadcast (stride 0) dimension aliases.
        assert!(!b.view(0, &[4, 4], &[0, 1]).unwrap().is_non_overlapping());
        assert!(b.view(0, &[1, 4], &[0, 1]).unwrap().is_non_overlapping());
    }

    #[test]
    fn views_of_different_dtypes_are_compared_in_bytes() {
        // Bytes 32..64 of one buffer, as f32 elements 8..16 and as u8 elements 32..64.
        let f = Tensor::new_contiguous(BufferId(1), 0x1000, 64, DType::F32, &[16]).unwrap();
        let u = Tensor::new_contiguous(BufferId(1), 0x1000, 64, DType::U8, &[64]).unwrap();
        let (f_hi, u_hi) = (f.slice(0, 8, 16).unwrap(), u.slice(0, 32, 64).unwrap());
        assert_eq!(f_hi.region().relate(&u_hi.region()), Relation::Covers);
        assert_eq!(u_hi.region().relate(&f_hi.region()), Relation::Covers);
        assert!(!f_hi.disjoint_from(&u_hi, 1 << 16));
        // Bytes 0..32 as f32 against bytes 32..64 as u8: disjoint.
        let f_lo = f.slice(0, 0, 8).unwrap();
        assert_eq!(f_lo.region().relate(&u_hi.region()), Relation::Disjoint);
        // bf16 elements 15..17 straddle f32 elements 7 and 8.
        let h = Tensor::new_contiguous(BufferId(1), 0x1000, 64, DType::BF16, &[32]).unwrap();
        let mid = h.slice(0, 15, 17).unwrap();
        assert_eq!(mid.region().relate(&f_lo.region()), Relation::Partial);
        assert_eq!(mid.region().relate(&f_hi.region()), Relation::Partial);
    }

    #[test]
    fn tiles_of_one_matrix_are_compared_exactly() {
        let m = buf(64).reshape(&[8, 8]).unwrap();
        let left = m.slice(1, 0, 4).unwrap();
        let right = m.slice(1, 4, 8).unwrap();
        let top_left = m.slice(0, 0, 4).unwrap().slice(1, 0, 4).unwrap();
        assert_eq!(left.region().relate(&right.region()), Relation::Disjoint);
        assert_eq!(left.region().relate(&top_left.region()), Relation::Covers);
        assert_eq!(top_left.region().relate(&left.region()), Relation::Partial);
        assert_eq!(m.region().relate(&left.region()), Relation::Covers);
    }

    /// Views of one 576-byte buffer in f32, bf16 or u8: a 6x6xW parent (W = 16 bytes per
    /// row / element size) with a random sub-box, optional transpose, optional step-2 columns.
    fn arb_view() -> impl Strategy<Value = Tensor> {
        (
            prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::U8)],
            0u64..6,
            1u64..=6,
            0u64..6,
            1u64..=6,
            0u64..16,
            1u64..=16,
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(dtype, r0, rn, c0, cn, d0, dn, tr, step)| {
                let w = 16 / dtype.size() as u64;
                let p =
                    Tensor::new_contiguous(BufferId(1), 0x1000, 576, dtype, &[6, 6, w]).unwrap();
                let r0 = r0.min(5);
                let rn = rn.min(6 - r0);
                let c0 = c0.min(5);
                let cn = cn.min(6 - c0);
                let d0 = d0 % w;
                let dn = dn.min(w - d0);
                let mut v = p
                    .slice(0, r0, r0 + rn)
                    .unwrap()
                    .slice(1, c0, c0 + cn)
                    .unwrap();
                if step {
                    let dn2 = dn.div_ceil(2).min((w - d0).div_ceil(2));
                    let mut st = v.strides().to_vec();
                    st[2] = 2;
                    v = v.view(v.offset() + d0, &[rn, cn, dn2], &st).unwrap();
                } else {
                    v = v.slice(2, d0, d0 + dn).unwrap();
                }
                if tr { v.transpose(0, 2).unwrap() } else { v }
            })
    }

    /// The bytes a view touches.
    fn bytes(t: &Tensor) -> std::collections::BTreeSet<u64> {
        let size = t.dtype().size() as u64;
        let mut s = std::collections::BTreeSet::new();
        t.for_each_offset(|o| s.extend(o * size..(o + 1) * size));
        s
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// The relation is never wrong, also between views of different dtypes: Disjoint means
        /// no common byte, Covers means a superset of the bytes. `disjoint_from` never claims
        /// disjoint views that share a byte, and is exact between views of one dtype.
        #[test]
        fn relation_is_sound(a in arb_view(), b in arb_view()) {
            let (ea, eb) = (bytes(&a), bytes(&b));
            let common = ea.intersection(&eb).count();
            match a.region().relate(&b.region()) {
                Relation::Disjoint => prop_assert_eq!(common, 0),
                Relation::Covers => prop_assert!(eb.is_subset(&ea)),
                Relation::Partial => prop_assert!(common > 0 && !eb.is_subset(&ea)),
                Relation::Conservative => {}
            }
            let disjoint = a.disjoint_from(&b, 1 << 16);
            if disjoint {
                prop_assert_eq!(common, 0);
            }
            if a.dtype() == b.dtype() {
                prop_assert_eq!(disjoint, common == 0);
            }
        }

        /// Views of different dtypes that share a byte are never judged disjoint.
        #[test]
        fn mixed_dtype_views_sharing_bytes_overlap(a in arb_view(), b in arb_view()) {
            let common = bytes(&a).intersection(&bytes(&b)).count();
            if common > 0 {
                prop_assert!(a.region().relate(&b.region()).overlaps());
                prop_assert!(b.region().relate(&a.region()).overlaps());
                prop_assert!(!a.disjoint_from(&b, 1 << 16));
            }
        }
    }
}
