use serde_json::json;

use super::*;

#[test]
fn context_messages_are_exact() {
    // The prompt alone fills the context.
    let e = check_context(5000, None, 4096, "max_tokens").unwrap_err();
    assert_eq!(
        e.message,
        "This model's maximum context length is 4096 tokens, but the prompt has 5000 tokens, \
         which leaves no room for a completion. Please shorten the prompt."
    );
    assert!(!e.message.contains("max_tokens") && !e.message.contains('-'));
    assert_eq!((e.status().as_u16(), e.param.as_deref()), (400, None));
    assert_eq!(e.code.as_deref(), Some("context_length_exceeded"));
    let e = check_context(4096, Some(10), 4096, "max_tokens").unwrap_err();
    assert!(e.message.contains("the prompt has 4096 tokens") && !e.message.contains("max_tokens"));
    // Prompt plus requested count.
    let e = check_context(100, Some(4050), 4096, "max_tokens").unwrap_err();
    assert_eq!(
        e.message,
        "This model's maximum context length is 4096 tokens. However, you requested 4150 tokens \
         (100 in the prompt, 4050 for max_tokens). Please reduce the prompt or max_tokens, which \
         can be at most 3996 with this prompt."
    );
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    let e = check_context(100, Some(u32::MAX), 4096, "max_completion_tokens").unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
    assert!(
        e.message.contains(
            "4294967395 tokens (100 in the prompt, 4294967295 for max_completion_tokens)"
        )
    );
    // A request that just fits, and the default.
    assert_eq!(
        check_context(100, Some(3996), 4096, "max_tokens").unwrap(),
        3996
    );
    assert_eq!(check_context(100, None, 4096, "max_tokens").unwrap(), 3996);
    assert_eq!(
        check_context(0, None, usize::MAX, "max_tokens").unwrap(),
        u32::MAX
    );
    let e = check_context(1, Some(0), 10, "max_tokens").unwrap_err();
    assert_eq!(
        (e.status().as_u16(), e.param.as_deref()),
        (400, Some("max_tokens"))
    );
    let e = check_context(0, None, 0, "max_tokens").unwrap_err();
    assert_eq!((e.status().as_u16(), e.param), (400, None));
}

#[test]
fn unknown_model_is_404() {
    assert!(check_model("m", &["m", "n"]).is_ok());
    let e = check_model("BAD", &["m"]).unwrap_err();
    assert_eq!(e.status().as_u16(), 404);
    assert_eq!(e.code.as_deref(), Some("model_not_found"));
    assert_eq!(e.param.as_deref(), Some("model"));
    assert_eq!(
        e.message,
        "The model 'BAD' does not exist or is not served here."
    );
    assert_eq!(e.body()["error"]["code"], json!("model_not_found"));
    assert!(check_model("M", &["m"]).is_err());
    assert!(check_model::<&str>("m", &[]).is_err());
    let long = "é".repeat(1000);
    assert!(model_not_found(&long).message.chars().count() < 320);
}
