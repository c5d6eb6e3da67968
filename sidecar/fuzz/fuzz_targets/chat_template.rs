//! The trainer's chat-template renderer (trainer/src/template.rs) with the real Qwen3,
//! Llama 3 and SmolLM2 templates on arbitrary conversations: never a panic, and the same
//! input renders the same text. The templates come from `$TAPLINE_ASSETS` (the test
//! assets `cargo xtask test` fetches); the input is a JSON conversation when it parses as
//! one, else a conversation built from the bytes.
#![no_main]

#[allow(dead_code)]
#[path = "../../../trainer/src/template.rs"]
mod template;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value, json};
use template::{ChatTemplate, RenderInput};

struct Loaded {
    template: ChatTemplate,
    variables: Map<String, Value>,
}

fn read_template(dir: &Path) -> (String, Map<String, Value>) {
    let config: Value = serde_json::from_slice(
        &std::fs::read(dir.join("tokenizer_config.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display())),
    )
    .expect("tokenizer_config.json is JSON");
    let source = std::fs::read_to_string(dir.join("chat_template.jinja"))
        .ok()
        .or_else(|| config["chat_template"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("{} has no chat template", dir.display()));
    let mut variables = Map::new();
    for name in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        if let Some(token) = config[name].as_str() {
            variables.insert(name.into(), json!(token));
        }
    }
    (source, variables)
}

fn templates() -> &'static [Loaded] {
    static LOADED: OnceLock<Vec<Loaded>> = OnceLock::new();
    LOADED.get_or_init(|| {
        let assets = std::env::var_os("TAPLINE_ASSETS").map(PathBuf::from).expect(
            "set TAPLINE_ASSETS to the test assets (cargo xtask fuzz does; `cargo xtask test` fetches them)",
        );
        // SmolLM2's directory comes with the model weights (`cargo xtask test`); the
        // tokenizer packages are enough to fuzz.
        ["qwen3", "llama3", "smollm2-135m-instruct"]
            .iter()
            .filter(|name| *name != &"smollm2-135m-instruct" || assets.join(name).is_dir())
            .map(|name| {
                let (source, variables) = read_template(&assets.join(name));
                Loaded {
                    template: ChatTemplate::new(&source).expect("the real template compiles"),
                    variables,
                }
            })
            .collect()
    })
}

#[derive(Debug, Arbitrary)]
enum Role {
    System,
    User,
    Assistant,
    Tool,
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Content {
    Text(String),
    Parts(Vec<String>),
    Null,
}

#[derive(Debug, Arbitrary)]
struct Call {
    name: String,
    arguments: Vec<(String, String)>,
    as_text: bool,
}

#[derive(Debug, Arbitrary)]
struct Message {
    role: Role,
    content: Content,
    reasoning: Option<String>,
    tool_calls: Vec<Call>,
}

#[derive(Debug, Arbitrary)]
struct Conversation {
    messages: Vec<Message>,
    tools: Option<Vec<String>>,
    add_generation_prompt: bool,
    continue_final_message: bool,
    enable_thinking: Option<bool>,
}

fn message_json(m: Message) -> Value {
    let role = match m.role {
        Role::System => "system".to_owned(),
        Role::User => "user".to_owned(),
        Role::Assistant => "assistant".to_owned(),
        Role::Tool => "tool".to_owned(),
        Role::Other(r) => r,
    };
    let content = match m.content {
        Content::Text(t) => json!(t),
        Content::Parts(parts) => Value::Array(
            parts
                .into_iter()
                .map(|t| json!({"type": "text", "text": t}))
                .collect(),
        ),
        Content::Null => Value::Null,
    };
    let mut out = json!({"role": role, "content": content});
    if let Some(r) = m.reasoning {
        out["reasoning_content"] = json!(r);
    }
    if !m.tool_calls.is_empty() {
        out["tool_calls"] = Value::Array(
            m.tool_calls
                .into_iter()
                .map(|c| {
                    let args: Map<String, Value> =
                        c.arguments.into_iter().map(|(k, v)| (k, json!(v))).collect();
                    let arguments = if c.as_text {
                        json!(Value::Object(args).to_string())
                    } else {
                        Value::Object(args)
                    };
                    json!({"type": "function", "function": {"name": c.name, "arguments": arguments}})
                })
                .collect(),
        );
    }
    out
}

/// The conversation, tools and options of one input.
fn conversation(
    data: &[u8],
) -> Option<(
    Vec<Value>,
    Option<Vec<Value>>,
    bool,
    bool,
    Map<String, Value>,
)> {
    if let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(data) {
        let messages = match obj.remove("messages") {
            Some(Value::Array(m)) => m,
            _ => return None,
        };
        let tools = match obj.remove("tools") {
            Some(Value::Array(t)) => Some(t),
            _ => None,
        };
        let flag = |obj: &Map<String, Value>, k: &str| {
            obj.get(k).and_then(Value::as_bool).unwrap_or(false)
        };
        let (add, cont) = (
            flag(&obj, "add_generation_prompt"),
            flag(&obj, "continue_final_message"),
        );
        let kwargs = match obj.remove("chat_template_kwargs") {
            Some(Value::Object(k)) => k,
            _ => Map::new(),
        };
        return Some((messages, tools, add, cont, kwargs));
    }
    let c = Conversation::arbitrary_take_rest(Unstructured::new(data)).ok()?;
    let tools = c.tools.map(|names| {
        names
            .into_iter()
            .map(|n| json!({"type": "function", "function": {"name": n, "description": "d", "parameters": {"type": "object", "properties": {}}}}))
            .collect()
    });
    let mut kwargs = Map::new();
    if let Some(t) = c.enable_thinking {
        kwargs.insert("enable_thinking".into(), json!(t));
    }
    Some((
        c.messages.into_iter().map(message_json).collect(),
        tools,
        c.add_generation_prompt,
        c.continue_final_message,
        kwargs,
    ))
}

fuzz_target!(|data: &[u8]| {
    let Some((messages, tools, add_generation_prompt, continue_final_message, kwargs)) =
        conversation(data)
    else {
        return;
    };
    for loaded in templates() {
        let mut variables = loaded.variables.clone();
        variables.extend(kwargs.clone());
        let input = RenderInput {
            messages: &messages,
            tools: tools.as_deref(),
            add_generation_prompt,
            continue_final_message,
            variables: &variables,
        };
        let first = loaded.template.render(&input);
        let second = loaded.template.render(&input);
        match (first, second) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "rendering is deterministic"),
            (Err(_), Err(_)) => {}
            (a, b) => panic!("two renders disagree: {a:?} / {b:?}"),
        }
    }
});
