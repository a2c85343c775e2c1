//! Checkpoint round trips (single file, sharded, `[in, out]` layout, bf16 norms) and every
//! error path: missing config, missing weights, truncated file, missing tensor, wrong shape,
//! unknown and unsupported dtypes, bad index, tensors the model does not use; a tied head that
//! ignores a stray `lm_head.weight`; headers checked before any weight is loaded; header entries
//! the parser refuses, named; a path that is not a directory.

use std::path::{Path, PathBuf};

use half::bf16;
use simpler_models::qwen3::golden;
use simpler_models::qwen3::{
    CheckpointError, FixtureOptions, LoadOptions, Qwen3Config, SaveOptions, WeightLayout,
    generate_fixture, generate_weights, load_checkpoint, save_checkpoint,
};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("simpler-models-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn small() -> Qwen3Config {
    let mut c = Qwen3Config::preset("tiny").unwrap();
    c.vocab_size = 300;
    c
}

#[test]
fn round_trip_single_file_gives_identical_results() {
    let f = generate_fixture(&small(), &FixtureOptions::small(2, 40), None);
    let dir = tmp("single");
    save_checkpoint(&dir, &f.weights, &SaveOptions::default()).unwrap();
    let ticks = std::sync::atomic::AtomicU64::new(0);
    let p = |_d: u64, _t: u64| {
        ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    };
    let w = load_checkpoint(
        &dir,
        &LoadOptions {
            progress: Some(&p),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(ticks.load(std::sync::atomic::Ordering::Relaxed) > 0);
    assert_eq!(w.config, f.weights.config);
    assert!(w.lm_head.is_none(), "tied model gets no lm_head");
    for (a, b) in w.layers.iter().zip(&f.weights.layers) {
        assert_eq!(**a, **b);
    }
    assert_eq!(w.embedding, f.weights.embedding);
    let a = golden::decode_model(&w, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    let b = golden::decode_model(&f.weights, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    assert_eq!(a, b);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An f16 checkpoint (every bf16 tensor stored as f16, as older tools write them) loads as the
/// bf16 checkpoint whose values are the f16 ones rounded to bf16: the loader's f16 path reads
/// each element as f16 and rounds it once, the same model to the bit.
#[test]
fn an_f16_checkpoint_loads_as_its_values_rounded_to_bf16() {
    let f = generate_fixture(&small(), &FixtureOptions::small(2, 40), None);
    let to_f16 = |b: &[u8]| -> Vec<u8> {
        b.chunks_exact(2)
            .flat_map(|x| {
                let v = bf16::from_le_bytes([x[0], x[1]]).to_f32();
                half::f16::from_f32(v).to_le_bytes()
            })
            .collect()
    };
    let via_f16 = |b: &[u8]| -> Vec<u8> {
        b.chunks_exact(2)
            .flat_map(|x| {
                let h = half::f16::from_le_bytes([x[0], x[1]]);
                bf16::from_f32(h.to_f32()).to_le_bytes()
            })
            .collect()
    };
    let (dir16, dir_ref) = (tmp("f16"), tmp("f16-ref"));
    let mut converted = 0;
    for (dir, f16) in [(&dir16, true), (&dir_ref, false)] {
        save_checkpoint(dir, &f.weights, &SaveOptions::default()).unwrap();
        rewrite(dir, |t| {
            for (dtype, _, bytes) in t.values_mut() {
                if *dtype == safetensors::Dtype::BF16 {
                    let h = to_f16(bytes);
                    if f16 {
                        (*dtype, *bytes) = (safetensors::Dtype::F16, h);
                        converted += 1;
                    } else {
                        *bytes = via_f16(&h);
                    }
                }
            }
        });
    }
    assert!(converted >= 7, "{converted} tensors converted");
    let a = load_checkpoint(&dir16, &LoadOptions::default()).unwrap();
    let b = load_checkpoint(&dir_ref, &LoadOptions::default()).unwrap();
    assert_eq!(a.embedding, b.embedding);
    for (x, y) in a.layers.iter().zip(&b.layers) {
        assert_eq!(**x, **y);
    }
    // And it is the model: f16 holds these weights' values to within its rounding.
    let ga = golden::decode_model(&a, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    let gb = golden::decode_model(&b, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    assert_eq!(ga, gb);
    std::fs::remove_dir_all(&dir16).unwrap();
    std::fs::remove_dir_all(&dir_ref).unwrap();
}

#[test]
fn round_trip_sharded_in_out_layout_untied() {
    let mut c = small();
    c.tie_word_embeddings = false;
    let w0 = generate_weights(&c, 7, false, None);
    let dir = tmp("sharded");
    let opts = SaveOptions {
        layout: WeightLayout::InOut,
        max_shard_bytes: Some(400_000),
        norms_bf16: true,
    };
    save_checkpoint(&dir, &w0, &opts).unwrap();
    assert!(dir.join("model.safetensors.index.json").exists());
    assert!(
        dir.join("model-00002-of-00004.safetensors").exists()
            || std::fs::read_dir(&dir).unwrap().count() > 3
    );
    // Loading [in, out] files as [out, in] fails on the first non-square projection.
    let err = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, CheckpointError::Shape { .. }), "{err}");
    let w = load_checkpoint(
        &dir,
        &LoadOptions {
            layout: WeightLayout::InOut,
            progress: None,
            layers: None,
        },
    )
    .unwrap();
    // The first layer only: the second layer's tensors are skipped, not refused.
    let first = load_checkpoint(
        &dir,
        &LoadOptions {
            layout: WeightLayout::InOut,
            layers: Some(1),
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert_eq!((first.layers.len(), first.config.num_hidden_layers), (1, 1));
    assert_eq!(first.layers[0].wq, w0.layers[0].wq);
    for n in [0, c.num_hidden_layers + 1] {
        let opts = LoadOptions {
            layout: WeightLayout::InOut,
            layers: Some(n),
            ..LoadOptions::default()
        };
        let e = load_checkpoint(&dir, &opts).unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers"), "{e}");
    }
    for (a, b) in w.layers.iter().zip(&w0.layers) {
        assert_eq!(a.wq, b.wq);
        assert_eq!(a.w_down, b.w_down);
        let rounded: Vec<f32> = b
            .input_norm
            .iter()
            .map(|v| bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(a.input_norm, rounded);
    }
    assert_eq!(w.lm_head, w0.lm_head);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes a one-tensor-short or otherwise edited checkpoint: the tensors of `w` except
/// `skip`, plus raw header edits through `edit`.
fn write_raw(dir: &Path, header: &str, data: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

#[test]
fn errors_name_the_tensor_and_the_file() {
    let c = small();
    let w = generate_weights(&c, 3, false, None);
    let dir = tmp("errors");
    // Missing config.
    std::fs::create_dir_all(&dir).unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(e, CheckpointError::MissingConfig { .. }) && e.to_string().contains("config.json"),
        "{e}"
    );
    // Missing weights.
    std::fs::write(dir.join("config.json"), c.to_json()).unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(matches!(e, CheckpointError::MissingWeights { .. }), "{e}");
    // Bad config names the field.
    std::fs::write(
        dir.join("config.json"),
        c.to_json()
            .replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains("num_key_value_heads") && e.to_string().contains("config.json"),
        "{e}"
    );

    // A weight that is not finite (every output would be NaN, and greedy decoding would
    // silently pick token 0): refused, naming the tensor and the element.
    let mut bad = w.clone();
    let mut layer = (*bad.layers[1]).clone();
    layer.w_up[7] = half::bf16::NAN;
    bad.layers[1] = std::sync::Arc::new(layer);
    save_checkpoint(&dir, &bad, &SaveOptions::default()).unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::NonFinite { tensor, index: 7, .. } if tensor == "model.layers.1.mlp.up_proj.weight"),
        "{e}"
    );

    // Truncated file.
    save_checkpoint(&dir, &w, &SaveOptions::default()).unwrap();
    let file = dir.join("model.safetensors");
    let full = std::fs::read(&file).unwrap();
    std::fs::write(&file, &full[..full.len() - 100]).unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(e, CheckpointError::Truncated { .. })
            && e.to_string().contains("model.safetensors")
            && e.to_string().contains("100 bytes missing"),
        "{e}"
    );
    // The tensor the cut reaches is named: the one whose bytes end last.
    let (last, _) = last_tensor(&full);
    assert!(
        e.to_string().contains(&format!("tensor {last} needs")),
        "{e}"
    );
    // Cut deeper, into the middle of the file: the first tensor past the end is named.
    let (cut_name, cut_at) = tensor_at(&full, full.len() / 2);
    std::fs::write(&file, &full[..cut_at]).unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains(&format!("tensor {cut_name} needs")),
        "{e}"
    );
    // Bytes past the last tensor are named as such.
    let mut long = full.clone();
    long.extend_from_slice(&[0; 24]);
    std::fs::write(&file, &long).unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(e.to_string().contains("24 bytes past them"), "{e}");
    std::fs::write(&file, &full[..5]).unwrap();
    assert!(matches!(
        load_checkpoint(&dir, &LoadOptions::default()).unwrap_err(),
        CheckpointError::Truncated { .. }
    ));

    // A file with only the embedding: the first layer tensor is reported missing.
    let emb_bytes = vec![0u8; c.vocab_size * c.hidden_size * 2];
    let header = format!(
        r#"{{"model.embed_tokens.weight":{{"dtype":"BF16","shape":[{},{}],"data_offsets":[0,{}]}}}}"#,
        c.vocab_size,
        c.hidden_size,
        emb_bytes.len()
    );
    write_raw(&dir, &header, &emb_bytes);
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    match &e {
        CheckpointError::MissingTensor { tensor, file } => {
            assert_eq!(tensor, "model.layers.0.self_attn.q_proj.weight");
            assert!(file.ends_with("model.safetensors"));
        }
        other => panic!("expected a missing tensor, got {other}"),
    }

    // Wrong shape: q_proj as [1, 4].
    let header = r#"{"model.layers.0.self_attn.q_proj.weight":{"dtype":"BF16","shape":[1,4],"data_offsets":[0,8]}}"#;
    write_raw(&dir, header, &[0u8; 8]);
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Shape { tensor, expected, got, .. }
            if tensor == "model.layers.0.self_attn.q_proj.weight" && got == &vec![1, 4] && expected == &vec![256, 256]),
        "{e}"
    );

    // Unknown dtype string, and a dtype the parser knows but the model does not take.
    let header = r#"{"model.layers.0.self_attn.q_proj.weight":{"dtype":"Q4_K","shape":[4],"data_offsets":[0,8]}}"#;
    write_raw(&dir, header, &[0u8; 8]);
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Dtype { tensor, dtype, .. } if tensor == "model.layers.0.self_attn.q_proj.weight" && dtype == "Q4_K"),
        "{e}"
    );
    let n = c.q_width() * c.hidden_size;
    let header = format!(
        r#"{{"model.layers.0.self_attn.q_proj.weight":{{"dtype":"I64","shape":[{},{}],"data_offsets":[0,{}]}}}}"#,
        c.q_width(),
        c.hidden_size,
        n * 8
    );
    write_raw(&dir, &header, &vec![0u8; n * 8]);
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Dtype { dtype, .. } if dtype == "I64"),
        "{e}"
    );

    // Garbage header.
    write_raw(&dir, "not json", &[]);
    assert!(matches!(
        load_checkpoint(&dir, &LoadOptions::default()).unwrap_err(),
        CheckpointError::BadFile { .. }
    ));

    // A single file and an index side by side: which weights to load is ambiguous.
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, "{}").unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::BadIndex { .. }) && e.to_string().contains("ambiguous"),
        "{e}"
    );

    // Bad index: no weight_map; a shard path escaping the directory; a tensor the index
    // names missing from its shard.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(matches!(
        load_checkpoint(&dir, &LoadOptions::default()).unwrap_err(),
        CheckpointError::BadIndex { .. }
    ));
    std::fs::write(
        &index,
        r#"{"weight_map": {"model.norm.weight": "../x.safetensors"}}"#,
    )
    .unwrap();
    assert!(matches!(
        load_checkpoint(&dir, &LoadOptions::default()).unwrap_err(),
        CheckpointError::BadIndex { .. }
    ));
    std::fs::write(
        &index,
        r#"{"weight_map": {"model.norm.weight": "absent.safetensors"}}"#,
    )
    .unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Io { file, .. } if file.ends_with("absent.safetensors")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rewrites `dir/model.safetensors` with `edit` applied to its tensors
/// (`name -> (dtype, shape, bytes)`).
fn rewrite(
    dir: &Path,
    edit: impl FnOnce(
        &mut std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    ),
) {
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut all: std::collections::BTreeMap<_, _> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut all);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = all
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();
}

#[test]
fn tensors_the_model_does_not_use_are_refused_by_name() {
    let c = small();
    let w = generate_weights(&c, 5, false, None);
    let h = c.hidden_size;
    for (extra, shape) in [
        ("model.layers.0.self_attn.q_proj.bias", vec![c.q_width()]),
        (
            "model.layers.2.mlp.up_proj.weight",
            vec![c.intermediate_size, h],
        ),
        ("model.rotary_emb.inv_freq", vec![c.head_dim / 2]),
    ] {
        let dir = tmp("unexpected");
        save_checkpoint(&dir, &w, &SaveOptions::default()).unwrap();
        rewrite(&dir, |t| {
            let n: usize = shape.iter().product();
            t.insert(
                extra.into(),
                (safetensors::Dtype::F32, shape.clone(), vec![0; 4 * n]),
            );
        });
        let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::Unexpected { tensor, .. } if tensor == extra),
            "{extra}: {e}"
        );
        assert!(e.to_string().contains(extra) && e.to_string().contains("model.safetensors"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_tied_checkpoint_uses_the_embedding_as_head_whatever_else_it_holds() {
    let c = small();
    assert!(c.tie_word_embeddings);
    let w = generate_weights(&c, 6, false, None);
    let dir = tmp("tied-head");
    save_checkpoint(&dir, &w, &SaveOptions::default()).unwrap();
    // A stray, different lm_head.weight, as some tools write beside a tied embedding.
    rewrite(&dir, |t| {
        let n = c.vocab_size * c.hidden_size;
        let junk: Vec<u8> = (0..n)
            .flat_map(|i| bf16::from_f32(i as f32).to_bits().to_le_bytes())
            .collect();
        t.insert(
            "lm_head.weight".into(),
            (
                safetensors::Dtype::BF16,
                vec![c.vocab_size, c.hidden_size],
                junk,
            ),
        );
    });
    let loaded = load_checkpoint(&dir, &LoadOptions::default()).unwrap();
    assert!(loaded.lm_head.is_none(), "the head must be the embedding");
    assert_eq!(loaded.embedding, w.embedding);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_header_is_checked_before_any_weight_is_loaded() {
    let c = small();
    let w = generate_weights(&c, 8, false, None);
    let dir = tmp("headers-first");
    save_checkpoint(&dir, &w, &SaveOptions::default()).unwrap();
    // The final norm is loaded last; a wrong shape there must fail before the first tensor
    // is converted (the progress callback counts loaded tensors).
    rewrite(&dir, |t| {
        let n = c.hidden_size + 1;
        t.insert(
            "model.norm.weight".into(),
            (safetensors::Dtype::F32, vec![n], vec![0; 4 * n]),
        );
    });
    let ticks = std::sync::atomic::AtomicU64::new(0);
    let p = |_d: u64, _t: u64| {
        ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    };
    let e = load_checkpoint(
        &dir,
        &LoadOptions {
            progress: Some(&p),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Shape { tensor, .. } if tensor == "model.norm.weight"),
        "{e}"
    );
    assert_eq!(ticks.load(std::sync::atomic::Ordering::Relaxed), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rewrites `dir/model.safetensors` (saved from `full`) with `edit` applied to its header's
/// JSON and the data section as it was: edits the safetensors writer would refuse.
fn edit_header(
    dir: &Path,
    full: &[u8],
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    let (_, base) = spans(full);
    let mut header: serde_json::Value = serde_json::from_slice(&full[8..base]).unwrap();
    edit(header.as_object_mut().unwrap());
    write_raw(dir, &header.to_string(), &full[base..]);
}

/// A header entry the parser refuses without naming it (a dtype whose size disagrees with the
/// offsets, offsets past the end of the file, an overflowing shape) or names without saying
/// why (overlapping offsets): the error names the file, the tensor, its dtype, shape and
/// offsets.
#[test]
fn an_inconsistent_header_entry_is_named() {
    let c = small();
    let w = generate_weights(&c, 9, false, None);
    let dir = tmp("bad-entry");
    save_checkpoint(&dir, &w, &SaveOptions::default()).unwrap();
    let full = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (spans_of, _) = spans(&full);
    let q = "model.layers.0.self_attn.q_proj.weight";
    let (last, _) = last_tensor(&full);
    let (_, q_start, q_end) = spans_of.iter().find(|s| s.0 == q).unwrap().clone();
    let data = full.len() - spans(&full).1;
    let bf16_bytes = c.q_width() * c.hidden_size * 2;
    type Edit<'a> = Box<dyn FnOnce(&mut serde_json::Map<String, serde_json::Value>) + 'a>;
    // (what, header edit, the tensor named, what the error says about it)
    let cases: Vec<(&str, Edit<'_>, &str, String)> = vec![
        (
            "an int8 tensor with its bf16 size",
            Box::new(|h| h[q]["dtype"] = "I8".into()),
            q,
            format!(
                "dtype I8, shape [{}, {}], data_offsets [{q_start}, {q_end}]: the dtype and shape make {} bytes, the offsets span {bf16_bytes} (and I8 is not a dtype this loader reads",
                c.q_width(),
                c.hidden_size,
                bf16_bytes / 2
            ),
        ),
        (
            "offsets past the end of the file",
            Box::new(|h| h[last.as_str()]["data_offsets"][1] = (data + 1000).into()),
            &last,
            format!("run past the end of the file's data section ({data} bytes)"),
        ),
        (
            "a shape whose size overflows",
            Box::new(|h| h[q]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40])),
            q,
            "its byte count overflows".into(),
        ),
        (
            "offsets overlapping the tensor before",
            Box::new(|h| {
                h[q]["data_offsets"] = serde_json::json!([q_start - 2, q_end - 2]);
            }),
            q,
            format!("must start where the tensor before it ends, at {q_start} (it overlaps"),
        ),
    ];
    for (what, edit, tensor, why) in cases {
        edit_header(&dir, &full, edit);
        let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::BadTensor { tensor: t, file, why: y }
                if t == tensor && file.ends_with("model.safetensors") && y.contains(&why)),
            "{what}: {e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file (or nothing) given for the checkpoint directory is said to be one, not a directory
/// without a config.json; a directory where a safetensors file should be is named as such.
#[test]
fn a_path_that_is_not_a_directory_is_named() {
    let dir = tmp("not-a-dir");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("afile");
    std::fs::write(&file, b"weights?").unwrap();
    for (path, what) in [
        (file, "is a file, not a directory"),
        (dir.join("absent"), "does not exist"),
    ] {
        let e = load_checkpoint(&path, &LoadOptions::default()).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::NotADirectory { dir, .. } if dir == &path)
                && e.to_string().contains(what),
            "{e}"
        );
    }
    let c = small();
    std::fs::write(dir.join("config.json"), c.to_json()).unwrap();
    std::fs::create_dir_all(dir.join("model.safetensors")).unwrap();
    let e = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Io { file, .. } if file.ends_with("model.safetensors"))
            && e.to_string().contains("not a regular file"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A safetensors file's tensors as (name, start, end) in data-section bytes, and the data
/// section's offset in the file: read directly, a second reading of the format.
fn spans(file: &[u8]) -> (Vec<(String, usize, usize)>, usize) {
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    let mut out: Vec<(String, usize, usize)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = &v["data_offsets"];
            (
                k.clone(),
                o[0].as_u64().unwrap() as usize,
                o[1].as_u64().unwrap() as usize,
            )
        })
        .collect();
    out.sort_by_key(|s| s.1);
    (out, 8 + n)
}

/// The tensor whose bytes end last, and its end in the file.
fn last_tensor(file: &[u8]) -> (String, usize) {
    let (s, base) = spans(file);
    let t = s.iter().max_by_key(|t| t.2).unwrap();
    (t.0.clone(), base + t.2)
}

/// The tensor holding file byte `at`, and the file offset just past its first byte (a cut
/// there leaves it short).
fn tensor_at(file: &[u8], at: usize) -> (String, usize) {
    let (s, base) = spans(file);
    let t = s
        .iter()
        .find(|t| base + t.1 <= at && at < base + t.2)
        .unwrap();
    (t.0.clone(), base + t.1 + 1)
}

/// The generation defaults a checkpoint suggests (what `transformers`' `generate` applies when
/// not told otherwise) are listed so that the commands can say they did not apply them; the
/// ids that describe the model are not among them; a file that is not an object is refused.
#[test]
fn generation_defaults_are_listed_for_the_commands_to_name() {
    let d = tmp("gen-defaults");
    std::fs::create_dir_all(&d).unwrap();
    assert!(
        simpler_models::qwen3::generation_defaults(&d)
            .unwrap()
            .is_empty()
    );
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [255, 254], "bos_token_id": 1, "transformers_version": "4.51.0",
            "do_sample": true, "top_p": 0.95, "temperature": 0.6, "top_k": 20}"#,
    )
    .unwrap();
    assert_eq!(
        simpler_models::qwen3::generation_defaults(&d).unwrap(),
        [
            "do_sample=true",
            "temperature=0.6",
            "top_k=20",
            "top_p=0.95"
        ]
    );
    // A link that leads nowhere is named, not taken as an absent file (whose defaults and
    // EOS ids would then be config.json's, silently).
    std::fs::remove_file(d.join("generation_config.json")).unwrap();
    std::os::unix::fs::symlink(d.join("nowhere"), d.join("generation_config.json")).unwrap();
    let e = simpler_models::qwen3::generation_defaults(&d)
        .unwrap_err()
        .to_string();
    assert!(e.contains("generation_config.json"), "{e}");
    std::fs::remove_file(d.join("generation_config.json")).unwrap();
    std::fs::write(d.join("generation_config.json"), "[1, 2]").unwrap();
    let e = simpler_models::qwen3::generation_defaults(&d)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("generation_config.json") && e.contains("not a JSON object"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
