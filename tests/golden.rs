//! Golden cases of `smollm2-golden.json` through the tokenizer, the engine API and
//! `flotilla generate --json`.

#[path = "common/model.rs"]
mod model;

use crate::model::{assert_golden, engine, golden, model};

#[test]
fn tokenizer_matches_golden_prompt_ids() {
    let m = model();
    for c in golden() {
        assert_eq!(
            m.tokenizer.encode(&c.prompt).expect("encode"),
            c.prompt_ids,
            "case {}",
            c.name
        );
    }
}

#[test]
fn engine_matches_golden_greedy_and_logits() {
    assert_golden(&mut engine(model(), 64));
}

#[test]
fn generate_json_matches_golden() {
    for c in golden() {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args([
                "generate",
                "--json",
                "--temperature",
                "0",
                "--prompt",
                &c.prompt,
            ])
            .args(["--max-tokens", &c.greedy_ids.len().to_string()])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("run flotilla");
        assert!(
            out.status.success(),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json output");
        let ids = |k: &str| -> Vec<u32> {
            j[k].as_array()
                .expect(k)
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect()
        };
        assert_eq!(ids("prompt_ids"), c.prompt_ids, "case {}", c.name);
        assert_eq!(ids("output_ids"), c.greedy_ids, "case {}", c.name);
        assert!(!j["text"].as_str().expect("text").contains("<|im_end|>"));
    }
}

/// A flag pair that would do nothing is refused, naming both flags.
#[test]
fn generate_refuses_bf16_products_on_the_cpu() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["generate", "--backend", "cpu", "--cuda-gemm", "bf16"])
        .args(["--prompt", "hi", "--max-tokens", "1"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run flotilla");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--cuda-gemm bf16 has no effect with --backend cpu"),
        "{err}"
    );
}

#[test]
fn generate_chat_answers_paris() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args([
            "generate",
            "--chat",
            "--temperature",
            "0",
            "--max-tokens",
            "32",
        ])
        .args(["--prompt", "What is the capital of France?"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run flotilla");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "The capital of France is Paris."
    );
}
