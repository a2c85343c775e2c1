//! A Qwen3 model whose bf16 matrices the upload pairs (`qwen3::layout`: the choice `Pairs`
//! pairs every matrix of whole 16-row groups and 32-column steps on any path; the AVX2 path
//! streams them, the others compute them through the portable kernel): a tied LM head (the
//! embedding buffer, so the gather reads paired rows too) against the golden over several
//! steps, and the weights read back in row order. Every test of this binary chooses pairs (the
//! choice is per process).

mod common;

use common::qwen3::upload_read_back_and_decode;
use simpler_kernels_cpu::WeightLayout;
use simpler_models::qwen3::Qwen3Config;
use simpler_models::qwen3::layout::{Bf16LayoutChoice, bf16_layout, choose_bf16_layout};

#[test]
fn tied_paired_model_matches_the_golden_and_reads_back_in_row_order() {
    choose_bf16_layout(Bf16LayoutChoice::Pairs).unwrap();
    let mut c = Qwen3Config::preset("tiny").unwrap();
    // Whole 16-row groups for the tied head / embedding too.
    c.vocab_size = 1024;
    assert!(c.tie_word_embeddings);
    assert_eq!(
        bf16_layout(c.vocab_size, c.hidden_size),
        WeightLayout::Pairs
    );
    // Batches of 1, 3 and 5 rows: the batch-1 streams, the padded 3 × 4 block, and a pass
    // with a last batch group of one row.
    for lens in [&[40usize][..], &[1, 129, 7], &[1, 40, 129, 7, 64]] {
        upload_read_back_and_decode(&c, lens, &format!("paired, batch {}", lens.len()));
    }
}

#[test]
fn ragged_shapes_stay_row_major_when_paired() {
    choose_bf16_layout(Bf16LayoutChoice::Pairs).unwrap();
    assert_eq!(bf16_layout(1000, 256), WeightLayout::RowMajor);
    assert_eq!(bf16_layout(1024, 48), WeightLayout::RowMajor);
    assert_eq!(bf16_layout(2048, 1024), WeightLayout::Pairs);
}

/// A head_dim that is not a multiple of 16 (the config allows any even one) is refused at
/// upload, by name: the packed activations and the decode projections' per-head shares both
/// need whole 16-column blocks per head.
#[test]
fn a_head_dim_off_the_16_column_blocks_is_refused_at_upload() {
    use simpler_models::qwen3::{FixtureOptions, ResidentModel, generate_fixture};
    let mut c = Qwen3Config::preset("tiny").unwrap();
    c.head_dim = 24;
    let f = generate_fixture(&c, &FixtureOptions::small(1, 129), None);
    let w = common::qwen3::worker();
    let e = match ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None) {
        Ok(_) => panic!("head_dim 24 uploaded"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("head_dim 24 is not a multiple of 16"), "{e}");
}
