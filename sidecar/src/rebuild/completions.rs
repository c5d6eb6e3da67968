//! Legacy OpenAI completions (`/v1/completions`), as JSON or as `data:` chunks ending
//! with `data: [DONE]`.
//!
//! A completions body or chunk has the chat completions shape (`choices[]` with an
//! `index` and a `finish_reason`, `usage`, `model`), so [`super::chat`] parses both
//! with one state machine. What only completions carry is read here: a choice's text in
//! `text` (not in a `message` or `delta`), its log-probs as `logprobs.token_logprobs`,
//! and (vLLM) the prompt's token ids on each choice instead of on the response.

use super::{get_str, u32_array};
use crate::json::Json as Value;

/// The text a legacy choice carries on itself.
pub(super) fn choice_text<'a>(choice: &'a Value<'_>) -> Option<&'a str> {
    get_str(choice, "text")
}

/// The prompt's token ids on a choice (vLLM), when they are there.
pub(super) fn choice_prompt_token_ids(choice: &Value<'_>) -> Option<Vec<u32>> {
    choice
        .get("prompt_token_ids")
        .is_some_and(Value::is_array)
        .then(|| u32_array(choice.get("prompt_token_ids")))
}

/// Appends the log-probs of a legacy `logprobs` object (`token_logprobs`), if it has them.
pub(super) fn push_token_logprobs(out: &mut Vec<f64>, logprobs: &Value<'_>) {
    if let Some(list) = logprobs.get("token_logprobs").and_then(Value::as_array) {
        out.extend(list.iter().filter_map(Value::as_f64));
    }
}

#[cfg(test)]
mod tests {
    use tapline_proto::Api;

    use super::super::rebuild;

    #[test]
    fn json_choices_carry_text_logprobs_and_prompt_ids() {
        let body = br#"{"model":"m","choices":[{"index":0,"text":" Paris","logprobs":{"token_logprobs":[-0.5,-1.0]},"prompt_token_ids":[7,8],"token_ids":[1,2],"finish_reason":"length"}],"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}"#;
        let r = rebuild(Api::Completions, false, body);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(r.prompt_token_ids, [7, 8]);
        let c = &r.completions[0];
        assert_eq!(c.text, " Paris");
        assert_eq!(c.logprobs, [-0.5, -1.0]);
        assert_eq!(c.token_ids, [1, 2]);
        assert_eq!(c.finish_reason, "length");
        assert_eq!(r.usage.map(|u| u.total_tokens), Some(4));
    }

    #[test]
    fn streamed_choices_are_joined_by_index() {
        let body = concat!(
            "data: {\"model\":\"m\",\"choices\":[{\"index\":1,\"text\":\"b\",\"prompt_token_ids\":[7]}]}\n\n",
            "data: {\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"a\",\"logprobs\":{\"token_logprobs\":[-0.25]}}]}\n\n",
            "data: {\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"c\",\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let r = rebuild(Api::Completions, true, body.as_bytes());
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(r.prompt_token_ids, [7]);
        let texts: Vec<&str> = r.completions.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(texts, ["ac", "b"]);
        assert_eq!(r.completions[0].logprobs, [-0.25]);
        assert_eq!(r.completions[0].finish_reason, "stop");
    }
}
