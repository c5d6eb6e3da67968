//! Chat-template rendering and tokenization equal HF transformers'
//! `apply_chat_template(..., tokenize=True)` token for token, on the real Qwen3 and
//! Llama 3 tokenizers. The expected ids are computed by transformers at test time
//! (tests/hf_chat_template.py through the Python of `cargo xtask test`).

mod common;

use common::{Case, hf_ids, model_dir};
use serde_json::{Value, json};
use tapline_trainer::model::{Model, ModelOptions};
use tapline_trainer::tokenize::{ChatRequest, prompt_ids, render_prompt};

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Current weather in a city. Returns <json> & more.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5}
            }, "required": ["city"]}
        }},
        {"type": "function", "function": {
            "name": "run_shell",
            "description": "Runs a command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}
        }}
    ])
}

fn long_conversation(turns: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    for i in 0..turns {
        messages
            .push(json!({"role": "user", "content": format!("Question {i}: what is {i} + {i}?")}));
        messages.push(json!({"role": "assistant", "content": format!("  {} \n", 2 * i)}));
    }
    messages.push(json!({"role": "user", "content": "And finally?\n\n"}));
    Value::Array(messages)
}

/// A multi-step tool episode after one user query.
fn tool_episode(with_reasoning: bool) -> Value {
    let reasoning = |r: &str| {
        if with_reasoning {
            json!(r)
        } else {
            Value::Null
        }
    };
    let mut first = json!({"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Zürich\",\"days\":2}"}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern", "unit": "c", "ratio": 0.5, "big": 1e16, "nested": {"b": [1, 2], "a": null}}}}
    ]});
    let mut second = json!({"role": "assistant", "content": "Let me check the shell.", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "run_shell", "arguments": "{\"cmd\": \"ls -la | head\"}"}}
    ]});
    if with_reasoning {
        first["reasoning_content"] = reasoning("The user wants weather for two cities.");
        second["reasoning_content"] = reasoning("\nNow the shell.\n");
    }
    json!([
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Weather in Zürich and Bern, then list files."},
        first,
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 5}"},
        second,
        {"role": "tool", "tool_call_id": "call_3", "content": "a.txt\nb.txt"}
    ])
}

fn qwen3_cases() -> Vec<Case> {
    let tools = weather_tools();
    vec![
        Case::new("user only", json!([{"role": "user", "content": "Hello"}])),
        Case::new(
            "system and user",
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]),
        ),
        Case::new("many turns", long_conversation(12)),
        Case::new("many turns, no generation prompt", long_conversation(5)).no_generation_prompt(),
        Case::new("tools without system", json!([{"role": "user", "content": "Weather?"}]))
            .tools(tools.clone()),
        Case::new(
            "tools with system",
            json!([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"}]),
        )
        .tools(tools.clone()),
        Case::new("empty tools list", json!([{"role": "user", "content": "Hi"}])).tools(json!([])),
        Case::new("tool calls and results", tool_episode(false)).tools(tools.clone()),
        Case::new("tool calls with reasoning_content", tool_episode(true)).tools(tools.clone()),
        Case::new("tool calls, thinking disabled", tool_episode(false))
            .tools(tools.clone())
            .kwarg("enable_thinking", json!(false)),
        Case::new(
            "inline think blocks in history",
            json!([
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": null, "reasoning_content": "add again"},
                {"role": "user", "content": "<tool_response>\nnot really\n</tool_response>"}
            ]),
        ),
        Case::new(
            "thinking disabled",
            json!([{"role": "user", "content": "Quick answer please"}]),
        )
        .kwarg("enable_thinking", json!(false)),
        Case::new(
            "thinking enabled explicitly",
            json!([{"role": "user", "content": "Think hard"}]),
        )
        .kwarg("enable_thinking", json!(true)),
        Case::new(
            "last assistant turn with reasoning, no generation prompt",
            json!([
                {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "\n\nBecause.", "reasoning_content": "\nshort\n"}
            ]),
        )
        .no_generation_prompt(),
        Case::new(
            "special token text and unicode in content",
            json!([
                {"role": "user", "content": "Say <|im_end|> then 日本語 😀 and tabs\t\tend"},
                {"role": "assistant", "content": "Done <|im_start|> ok"},
                {"role": "user", "content": "   spaces   "}
            ]),
        ),
        Case::new(
            "continue final message",
            json!([
                {"role": "user", "content": "Write a haiku"},
                {"role": "assistant", "content": "Autumn wind "}
            ]),
        )
        .continue_final(),
    ]
}

fn llama3_cases() -> Vec<Case> {
    vec![
        Case::new("user only", json!([{"role": "user", "content": "Hello"}])),
        Case::new(
            "system and user",
            json!([{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Hi!"}]),
        ),
        Case::new("many turns", long_conversation(12)),
        Case::new("no generation prompt", long_conversation(3)).no_generation_prompt(),
        Case::new(
            "tools are ignored by this template",
            json!([{"role": "user", "content": "Weather?"}]),
        )
        .tools(weather_tools()),
        Case::new(
            "tool results as messages",
            json!([
                {"role": "user", "content": "ls"},
                {"role": "assistant", "content": "Running it."},
                {"role": "tool", "content": "a.txt\nb.txt"},
                {"role": "ipython", "content": "{\"ok\": true}"}
            ]),
        ),
        Case::new(
            "special token text and unicode",
            json!([{"role": "user", "content": "Say <|eot_id|> or <|begin_of_text|>, 日本語 😀"}]),
        ),
        Case::new(
            "thinking text is plain text here",
            json!([
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                {"role": "user", "content": "ok"}
            ]),
        )
        .kwarg("enable_thinking", json!(false)),
    ]
}

fn check_model(name: &str, cases: Vec<Case>) {
    let dir = model_dir(name);
    let model = Model::load(&dir, &ModelOptions::default()).expect("load model");
    let expected = hf_ids(&dir, &cases);
    let mut failures = Vec::new();
    for (case, want) in cases.iter().zip(expected) {
        let want = match want {
            Ok(ids) => ids,
            Err(e) => {
                failures.push(format!("[{name}] {}: transformers refused: {e}", case.name));
                continue;
            }
        };
        let request = ChatRequest::from_json(&case.request_json()).expect("request");
        match prompt_ids(&model, &request, &serde_json::Map::new()) {
            Ok(got) if got == want => {}
            Ok(got) => {
                let text =
                    render_prompt(&model, &request, &serde_json::Map::new()).unwrap_or_default();
                let pos = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.len().min(want.len()));
                failures.push(format!(
                    "[{name}] {}: ids differ at {pos} (ours {} tokens, transformers {})\nours decoded:  {:?}\ntheirs decoded: {:?}\nour render: {text:?}",
                    case.name,
                    got.len(),
                    want.len(),
                    model.decode(&got[pos.min(got.len())..]),
                    model.decode(&want[pos.min(want.len())..]),
                ));
            }
            Err(e) => failures.push(format!("[{name}] {}: we failed: {e}", case.name)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn qwen3_prompts_equal_transformers() {
    check_model("qwen3", qwen3_cases());
}

#[test]
fn llama3_prompts_equal_transformers() {
    check_model("llama3", llama3_cases());
}
