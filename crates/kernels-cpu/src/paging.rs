//! The paged KV layout's arithmetic, in one place for the kernels and the models that drive
//! them: a sequence's logical token `t` lives in pool row
//! `block_table[t / page_size] * page_size + t % page_size`, and a block table is valid for
//! `tokens` when it names every page those tokens touch and each page lies inside the pool.
//! (The golden reference keeps its own plain version, so a mistake here cannot hide there.)

use std::ops::Range;

/// Pool row of logical token `t` of a sequence whose block-table row is `block_table`.
///
/// # Panics
/// If the table does not cover `t` (checked first with [`check_table`]).
pub fn slot(block_table: &[u32], page_size: usize, t: usize) -> usize {
    block_table[t / page_size] as usize * page_size + t % page_size
}

/// Why a block table cannot serve a sequence.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PagingError {
    /// A page size of zero.
    #[error("page size 0")]
    ZeroPageSize,
    /// Fewer table entries than the tokens' pages.
    #[error("tokens {tokens:?} need {needed} blocks, the table has {have}")]
    ShortTable {
        /// The tokens.
        tokens: Range<usize>,
        /// Blocks they touch.
        needed: usize,
        /// Entries in the table.
        have: usize,
    },
    /// A page past the pool's end.
    #[error("page {page} outside the pool of {slots} slots")]
    PageOutsidePool {
        /// The page.
        page: u32,
        /// Rows of the pool.
        slots: usize,
    },
}

/// Checks that `block_table` names every page of `tokens` and that each lies inside a pool of
/// `slots` rows.
pub fn check_table(
    block_table: &[u32],
    page_size: usize,
    tokens: Range<usize>,
    slots: usize,
) -> Result<(), PagingError> {
    if page_size == 0 {
        return Err(PagingError::ZeroPageSize);
    }
    if tokens.is_empty() {
        return Ok(());
    }
    let blocks = tokens.start / page_size..(tokens.end - 1) / page_size + 1;
    let table = block_table
        .get(blocks.clone())
        .ok_or(PagingError::ShortTable {
            tokens: tokens.clone(),
            needed: blocks.end,
            have: block_table.len(),
        })?;
    match table
        .iter()
        .find(|&&p| (p as usize).saturating_add(1).saturating_mul(page_size) > slots)
    {
        Some(&page) => Err(PagingError::PageOutsidePool { page, slots }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_table() {
        let table = [7u32, 2, 5];
        assert_eq!(slot(&table, 4, 0), 28);
        assert_eq!(slot(&table, 4, 5), 9);
        assert_eq!(slot(&table, 4, 11), 23);
    }

    #[test]
    fn tables_are_checked_against_tokens_and_the_pool() {
        let table = [0u32, 1, 9];
        assert_eq!(check_table(&table, 4, 0..8, 16), Ok(()));
        assert_eq!(check_table(&table, 4, 0..0, 0), Ok(()));
        assert!(matches!(
            check_table(&table, 4, 0..13, 64),
            Err(PagingError::ShortTable {
                needed: 4,
                have: 3,
                ..
            })
        ));
        assert_eq!(
            check_table(&table, 4, 8..9, 16),
            Err(PagingError::PageOutsidePool { page: 9, slots: 16 })
        );
        assert!(check_table(&[u32::MAX], 1 << 40, 0..1, 16).is_err());
        assert_eq!(
            check_table(&table, 0, 0..1, 16),
            Err(PagingError::ZeroPageSize)
        );
    }
}
