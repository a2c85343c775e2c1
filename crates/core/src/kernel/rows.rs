//! Row views of strided tensors: [`Rows`] and [`RowsMut`] hand out exactly a view's elements
//! of each row, never the neighbours between its rows.

use std::ops::Range;

use super::slice_mut;
use crate::dtype::Element;
use crate::error::KernelError;
use crate::tensor::Tensor;

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
    pub(super) fn new(i: usize, t: &Tensor) -> Result<Rows<'a, T>, KernelError> {
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
        // inside the buffer; read-only access to a region no task writes concurrently (ordered
        // as in `TaskCtx::read`); aligned, valid for any bit pattern.
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
    pub(super) fn new(
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
    /// Narrows the share to columns `cols` of every row (`cols.end <= view_row_len()`).
    pub(super) fn set_cols(&mut self, cols: Range<usize>) {
        debug_assert!(cols.start <= cols.end && cols.end <= self.g.row_len);
        self.col0 = cols.start;
        self.ncols = cols.end - cols.start;
    }
    /// Row `r` of this share (panics if `r >= len()`).
    pub fn row(&mut self, r: usize) -> &mut [T] {
        assert!(r < self.n_rows, "row {r} of {}", self.n_rows);
        let start = self.g.base + self.g.row_offset(self.first + r) * size_of::<T>();
        // SAFETY: columns col0..col0+ncols (inside the row: set at creation) of one row of a
        // non-overlapping view (checked at creation), inside the buffer, reached only through
        // this `&mut self` borrow; other blocks hold disjoint shares (rows or columns) and other
        // tasks do not touch the region (ordered as in `TaskCtx::read`).
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
