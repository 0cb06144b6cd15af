//! The Hugging Face path (GGUF weights converted to an HF safetensors directory, half-split
//! RoPE) reproduces the golden greedy ids; corrupt model files give typed errors.

#[path = "common/model.rs"]
mod model;

use std::io::Write;

use crate::model::{engine, golden, greedy, model};
use flotilla::kernels::WeightMatrix;
use flotilla::model::gguf::GgufError;
use flotilla::model::{ModelError, load_model};
use safetensors::{Dtype, tensor::TensorView};

/// GGUF rows of q/k are permuted for adjacent-pair RoPE; undo it (llama.cpp `convert_hf_to_gguf`
/// `permute`): HF row `h·d + j·d/2 + i` = GGUF row `h·d + 2i + j`.
fn unpermute(w: &WeightMatrix, head_dim: usize) -> Vec<f32> {
    let src = w.to_f32();
    let mut dst = vec![0f32; src.len()];
    let c = w.cols;
    for r in 0..w.rows {
        let (h, rr) = (r / head_dim, r % head_dim);
        let (i, j) = (rr / 2, rr % 2);
        let to = h * head_dim + j * head_dim / 2 + i;
        dst[to * c..(to + 1) * c].copy_from_slice(&src[r * c..(r + 1) * c]);
    }
    dst
}

#[test]
fn hf_directory_reproduces_golden_greedy() {
    let m = model();
    let w = &m.weights;
    let cfg = &w.config;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![w.embed.rows, w.embed.cols],
            w.embed.to_f32(),
        ),
        (
            "model.norm.weight".into(),
            vec![w.norm.len()],
            w.norm.clone(),
        ),
    ];
    for (i, l) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let mat = |x: &WeightMatrix| vec![x.rows, x.cols];
        tensors.push((
            p("input_layernorm.weight"),
            vec![cfg.hidden_size],
            l.attn_norm.clone(),
        ));
        tensors.push((
            p("post_attention_layernorm.weight"),
            vec![cfg.hidden_size],
            l.ffn_norm.clone(),
        ));
        tensors.push((
            p("self_attn.q_proj.weight"),
            mat(&l.wq),
            unpermute(&l.wq, cfg.head_dim),
        ));
        tensors.push((
            p("self_attn.k_proj.weight"),
            mat(&l.wk),
            unpermute(&l.wk, cfg.head_dim),
        ));
        tensors.push((p("self_attn.v_proj.weight"), mat(&l.wv), l.wv.to_f32()));
        tensors.push((p("self_attn.o_proj.weight"), mat(&l.wo), l.wo.to_f32()));
        tensors.push((p("mlp.gate_proj.weight"), mat(&l.w_gate), l.w_gate.to_f32()));
        tensors.push((p("mlp.up_proj.weight"), mat(&l.w_up), l.w_up.to_f32()));
        tensors.push((p("mlp.down_proj.weight"), mat(&l.w_down), l.w_down.to_f32()));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), bytemuck::cast_slice(d)).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors"))
        .expect("write");
    drop(tensors);
    let mut hf_cfg = cfg.to_hf_json();
    hf_cfg["eos_token_id"] = serde_json::json!(2);
    std::fs::write(dir.path().join("config.json"), hf_cfg.to_string()).expect("config");
    m.tokenizer
        .inner()
        .save(dir.path().join("tokenizer.json"), false)
        .expect("tokenizer.json");
    let tc = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "chat_template": m.chat_template.as_ref().expect("template").source,
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), tc.to_string()).expect("tc");

    let hf = load_model(dir.path()).expect("load HF dir");
    assert_eq!(
        hf.config().rope_layout,
        flotilla::kernels::RopeLayout::HalfSplit
    );
    assert!(hf.tokenizer.is_eos(2));
    let mut e = engine(&hf, 64);
    for c in golden() {
        assert_eq!(
            hf.tokenizer.encode(&c.prompt).expect("encode"),
            c.prompt_ids
        );
        let (logits, ids) = greedy(
            &mut e,
            &c.prompt_ids,
            c.greedy_ids.len(),
            &hf.tokenizer.eos_ids,
        );
        assert_eq!(ids, c.greedy_ids, "case {}", c.name);
        for &(id, want) in &c.top5 {
            assert!(
                (logits[id as usize] - want).abs() < 2e-2,
                "case {} token {id}",
                c.name
            );
        }
    }
    let chat = hf.render_user_prompt("Hi").expect("render");
    assert!(chat.ends_with("<|im_start|>assistant\n"), "{chat}");
}

/// A gateway reads a Hugging Face directory's configuration and tokenizer files, never its
/// weights: a directory whose safetensors shard is not even valid still gives a frontend, with
/// the same block-hash salt, context length and tokenization as the GGUF the files came from.
#[test]
fn a_gateway_loads_a_hugging_face_directory_without_its_weights() {
    let m = model();
    let cfg = &m.weights.config;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("config.json"), cfg.to_hf_json().to_string()).expect("config");
    m.tokenizer
        .inner()
        .save(dir.path().join("tokenizer.json"), false)
        .expect("tokenizer.json");
    let tc = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": m.chat_template.as_ref().expect("template").source,
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), tc.to_string()).expect("tc");
    std::fs::write(dir.path().join("model.safetensors"), b"not safetensors").expect("shard");

    assert!(
        load_model(dir.path()).is_err(),
        "an engine needs the weights, which are broken"
    );
    let gguf = flotilla::request_plane::frontend::Frontend::load(
        &flotilla::model::resolve_model_path(None).expect("model"),
        1 << 20,
    )
    .expect("GGUF frontend");
    let hf = flotilla::request_plane::frontend::Frontend::load(dir.path(), 1 << 20)
        .expect("the frontend reads no weights");
    // The salt is that of the directory's own configuration (half-split RoPE).
    let hf_cfg = flotilla::model::config::ModelConfig::from_hf_json(&cfg.to_hf_json())
        .expect("config round-trips");
    assert_eq!(hf.salt, hf_cfg.block_hash_salt());
    assert_eq!(gguf.salt, cfg.block_hash_salt());
    assert_eq!(hf.context_len, gguf.context_len);
    assert_eq!(hf.vocab_size, gguf.vocab_size);
    for c in golden() {
        assert_eq!(
            hf.tokenizer.encode(&c.prompt).expect("encode"),
            c.prompt_ids
        );
    }
}

fn write_tmp(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("tmp");
    f.write_all(bytes).expect("write");
    f
}

fn real_model_bytes() -> Vec<u8> {
    let p = flotilla::model::resolve_model_path(None).expect("model");
    std::fs::read(p).expect("read model")
}

#[test]
fn truncated_gguf_is_a_typed_error() {
    let bytes = real_model_bytes();
    for cut in [10, 1000, 1_000_000, bytes.len() - 100] {
        let f = write_tmp(&bytes[..cut]);
        match load_model(f.path()) {
            Err(ModelError::Gguf(GgufError::Truncated(_))) => {}
            other => panic!("cut {cut}: expected Truncated, got {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn wrong_magic_and_unknown_dtype_are_typed_errors() {
    let mut bytes = real_model_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let f = write_tmp(&bytes);
    assert!(matches!(
        load_model(f.path()),
        Err(ModelError::Gguf(GgufError::BadMagic(_)))
    ));
    // Corrupt the type of the first tensor info (right after its name and dims).
    let mut bytes = real_model_bytes();
    bytes[..4].copy_from_slice(b"GGUF");
    let name = b"token_embd.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("tensor name");
    let ty_off = at + name.len() + 4 + 2 * 8; // n_dims u32 + two u64 dims
    bytes[ty_off..ty_off + 4].copy_from_slice(&77u32.to_le_bytes());
    let f = write_tmp(&bytes);
    assert!(matches!(
        load_model(f.path()),
        Err(ModelError::Gguf(GgufError::UnknownDtype { ty: 77, .. }))
    ));
    // A missing model names its path; only the default path suggests `make model`.
    let own = load_model(std::path::Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(matches!(own, ModelError::NotFound(_)));
    let msg = own.to_string();
    assert!(msg.contains("/nonexistent/model.gguf"), "{msg}");
    assert!(!msg.contains("make model"), "{msg}");
    let default = std::path::Path::new("/nonexistent").join(flotilla::model::DEFAULT_MODEL_PATH);
    let msg = flotilla::model::resolve_model_path(Some(&default))
        .unwrap_err()
        .to_string();
    assert!(msg.contains(&default.display().to_string()), "{msg}");
    assert!(msg.contains("make model"), "{msg}");
}

#[test]
fn model_cache_shares_one_copy() {
    let cache = flotilla::model::ModelCache::new();
    let p = flotilla::model::resolve_model_path(None).expect("model");
    let a = cache.get_or_load(&p).expect("load");
    let b = cache.get_or_load(&p).expect("load");
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert!(std::sync::Arc::ptr_eq(&a.weights, &b.weights));
}
