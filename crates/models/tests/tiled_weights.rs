//! A Qwen3 model whose bf16 matrices the upload tiles (`qwen3::layout`: on the AMX path, every
//! matrix of whole 16-row groups and 32-column steps): a tied LM head (the embedding buffer, so
//! the gather reads tiled rows too) against the golden, and the weights read back in row order.
//! Elsewhere the same checks run on row-major weights. Every test of this binary chooses
//! tiling (the choice is per process), and a second, different choice is refused.

mod common;

use common::qwen3::upload_read_back_and_decode;
use simpler_kernels_cpu::WeightLayout;
use simpler_models::qwen3::Qwen3Config;
use simpler_models::qwen3::layout::{Bf16LayoutChoice, bf16_layout, choose_bf16_layout};

#[test]
fn tied_tiled_model_matches_the_golden_and_reads_back_in_row_order() {
    choose_bf16_layout(Bf16LayoutChoice::Tiled).unwrap();
    let mut c = Qwen3Config::preset("tiny").unwrap();
    // Whole 16-row groups for the tied head / embedding too.
    c.vocab_size = 1024;
    assert!(c.tie_word_embeddings);
    println!(
        "embedding layout on this process: {:?}",
        bf16_layout(c.vocab_size, c.hidden_size)
    );
    upload_read_back_and_decode(&c, &[1, 40, 129, 7, 64], "tiled");
}

#[test]
fn ragged_shapes_stay_row_major() {
    choose_bf16_layout(Bf16LayoutChoice::Tiled).unwrap();
    assert_eq!(bf16_layout(1000, 256), WeightLayout::RowMajor);
    assert_eq!(bf16_layout(1024, 48), WeightLayout::RowMajor);
}

#[test]
fn a_different_choice_after_the_first_is_refused() {
    choose_bf16_layout(Bf16LayoutChoice::Tiled).unwrap();
    let e = choose_bf16_layout(Bf16LayoutChoice::RowMajor).unwrap_err();
    assert_eq!(e.fixed, Bf16LayoutChoice::Tiled);
    assert!(e.to_string().contains("already Tiled"), "{e}");
    // Still tiled where it was (the refused choice changed nothing).
    choose_bf16_layout(Bf16LayoutChoice::Tiled).unwrap();
}
