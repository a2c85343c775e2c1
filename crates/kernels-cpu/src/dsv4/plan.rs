//! The planning step of the DeepSeek-V4 sparse attention (`docs/dsv4.md`, "CSA layer"): each
//! token's candidate list in tiles of [`super::ATTN_TILE`] rows, and the order in which the
//! attention's (token, tile) work items run.
//!
//! A token's list is its window tiles (window-cache pool slots, oldest first) followed by its
//! compressed tiles (rows of the compressed cache, best first); each part is padded with
//! [`MASKED`] to whole tiles, so every tile reads one cache. A tile with no valid row is
//! empty: the work order puts every non-empty item first (token-major), then the empty ones,
//! and returns how many are non-empty, so the attention's blocks take real work first and
//! skip the tail without waiting on it.

use super::attention::ATTN_TILE as TILE_ROWS;

/// A padding or invalid candidate: the attention masks it (it changes nothing).
pub const MASKED: i32 = -1;

/// How a token's candidates are laid out: `window_tiles` tiles of window rows, then
/// `compressed_tiles` tiles of compressed rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CandidateLayout {
    /// Tiles of window rows (`ceil(window / TILE_ROWS)`).
    pub window_tiles: usize,
    /// Tiles of compressed rows (`ceil(max compressed candidates / TILE_ROWS)`, 0 for SWA).
    pub compressed_tiles: usize,
}

impl CandidateLayout {
    /// The layout for a window of `window` rows and at most `compressed` compressed rows.
    pub fn new(window: usize, compressed: usize) -> CandidateLayout {
        CandidateLayout {
            window_tiles: window.div_ceil(TILE_ROWS),
            compressed_tiles: compressed.div_ceil(TILE_ROWS),
        }
    }

    /// Tiles per token.
    pub fn tiles(&self) -> usize {
        self.window_tiles + self.compressed_tiles
    }

    /// Candidates per token (`tiles · TILE_ROWS`).
    pub fn len(&self) -> usize {
        self.tiles() * TILE_ROWS
    }

    /// Whether a token has no candidate slot at all.
    pub fn is_empty(&self) -> bool {
        self.tiles() == 0
    }

    /// Whether tile `tile` reads the window cache (else the compressed cache).
    pub fn is_window_tile(&self, tile: usize) -> bool {
        tile < self.window_tiles
    }
}

/// Writes one token's candidate list into `out` (`layout.len()` long): `window` (pool slots,
/// oldest first), masked to the window tiles, then `compressed` (compressed-cache rows, best
/// first), masked to the compressed tiles. Returns each tile's valid-row count in `valid`
/// (`layout.tiles()` long).
///
/// # Panics
/// If a part has more rows than its tiles hold, a row does not fit an `i32`, or a slice has
/// the wrong length.
pub fn plan_token(
    layout: CandidateLayout,
    window: &[u32],
    compressed: &[u32],
    out: &mut [i32],
    valid: &mut [u32],
) {
    assert_eq!(out.len(), layout.len(), "plan_token: out len");
    assert_eq!(valid.len(), layout.tiles(), "plan_token: valid len");
    let wlen = layout.window_tiles * TILE_ROWS;
    assert!(
        window.len() <= wlen,
        "plan_token: {} window rows for {} tiles",
        window.len(),
        layout.window_tiles
    );
    assert!(
        compressed.len() <= out.len() - wlen,
        "plan_token: {} compressed rows for {} tiles",
        compressed.len(),
        layout.compressed_tiles
    );
    let (wout, cout) = out.split_at_mut(wlen);
    for (part, rows) in [(wout, window), (cout, compressed)] {
        part.fill(MASKED);
        for (o, &r) in part.iter_mut().zip(rows) {
            *o = i32::try_from(r).expect("plan_token: row index past i32");
        }
    }
    for (t, v) in valid.iter_mut().enumerate() {
        let tile = &out[t * TILE_ROWS..(t + 1) * TILE_ROWS];
        *v = tile.iter().filter(|&&r| r != MASKED).count() as u32;
    }
}

/// The attention's work order over `valid` (`[tokens, tiles]` valid-row counts, as
/// [`plan_token`] writes them): item `token · tiles + tile` for every non-empty tile, token
/// by token, then every empty one. Returns the number of non-empty items.
///
/// # Panics
/// If `tiles` is zero and `valid` is not empty, `valid` is not whole tokens, or `order` is not
/// `valid.len()` long.
pub fn order_work(valid: &[u32], tiles: usize, order: &mut [u32]) -> usize {
    assert_eq!(order.len(), valid.len(), "order_work: order len");
    if valid.is_empty() {
        return 0;
    }
    assert!(
        tiles > 0 && valid.len().is_multiple_of(tiles),
        "order_work: {} counts for tiles of {tiles}",
        valid.len()
    );
    let mut n = 0;
    for (i, _) in valid.iter().enumerate().filter(|(_, v)| **v > 0) {
        order[n] = i as u32;
        n += 1;
    }
    let busy = n;
    for (i, _) in valid.iter().enumerate().filter(|(_, v)| **v == 0) {
        order[n] = i as u32;
        n += 1;
    }
    busy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_padded_per_part_and_empty_tiles_go_last() {
        let layout = CandidateLayout::new(128, 300);
        assert_eq!((layout.window_tiles, layout.compressed_tiles), (1, 3));
        assert!(layout.is_window_tile(0) && !layout.is_window_tile(1));
        let window: Vec<u32> = (1000..1100).collect();
        let comp: Vec<u32> = vec![7, 3, 9];
        let mut out = vec![0i32; layout.len()];
        let mut valid = vec![0u32; 4];
        plan_token(layout, &window, &comp, &mut out, &mut valid);
        assert_eq!(valid, [100, 3, 0, 0]);
        assert_eq!(&out[98..101], &[1098, 1099, MASKED]);
        assert_eq!(&out[128..132], &[7, 3, 9, MASKED]);
        // Two tokens: the second has a full compressed part.
        let comp2: Vec<u32> = (0..300).collect();
        let mut valid2 = vec![0u32; 4];
        plan_token(layout, &window, &comp2, &mut out, &mut valid2);
        assert_eq!(valid2, [100, 128, 128, 44]);
        let all: Vec<u32> = valid.iter().chain(&valid2).copied().collect();
        let mut order = vec![0u32; 8];
        let busy = order_work(&all, 4, &mut order);
        assert_eq!(busy, 6);
        assert_eq!(order, [0, 1, 4, 5, 6, 7, 2, 3]);
    }

    #[test]
    #[should_panic(expected = "window rows")]
    fn a_window_longer_than_its_tiles_is_refused() {
        let layout = CandidateLayout::new(8, 4);
        let mut out = vec![0i32; layout.len()];
        let mut valid = vec![0u32; 2];
        plan_token(layout, &[0; 129], &[], &mut out, &mut valid);
    }
}
