"""Expected token ids for the trainer's chat-template tests, computed by transformers.

Messages go through vLLM's normalization first (`vllm_postprocess`), as they do on a
vLLM server. Reads {"model_dir": DIR, "cases": [{"messages": [...], "tools": [...]?,
"add_generation_prompt": bool, "kwargs": {...}}]} on stdin and prints one JSON object
{"ids": [[...], ...]} whose entries are `apply_chat_template(..., tokenize=True)` for
each case, or {"error": "..."} for a case transformers refuses.
"""

import json
import sys

from transformers import AutoTokenizer


def vllm_postprocess(messages):
    """What vLLM does to a conversation before templating: a null content becomes "",
    and tool-call `arguments` strings are parsed into objects ("" or null: {})."""
    for message in messages:
        if message.get("content", "") is None:
            message["content"] = ""
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            for item in message["tool_calls"]:
                function = item.get("function", {})
                arguments = function.get("arguments")
                if arguments:
                    if not isinstance(arguments, (dict, list)):
                        try:
                            function["arguments"] = json.loads(arguments)
                        except ValueError:
                            pass
                else:
                    function["arguments"] = {}
    return messages


def main():
    request = json.load(sys.stdin)
    tokenizer = AutoTokenizer.from_pretrained(request["model_dir"])
    out = []
    for case in request["cases"]:
        kwargs = dict(case.get("kwargs") or {})
        if "tools" in case:
            kwargs["tools"] = case["tools"]
        try:
            result = tokenizer.apply_chat_template(
                vllm_postprocess(case["messages"]),
                tokenize=True,
                add_generation_prompt=case.get("add_generation_prompt", True),
                continue_final_message=case.get("continue_final_message", False),
                **kwargs,
            )
        except Exception as error:  # reported to the Rust test, which fails with it
            out.append({"error": f"{type(error).__name__}: {error}"})
            continue
        if hasattr(result, "keys"):
            result = result["input_ids"]
        out.append([int(i) for i in result])
    json.dump({"ids": out}, sys.stdout)


if __name__ == "__main__":
    main()
