"""A multi-turn harness with the official openai client and the tapline SDK.

Run a tapline sidecar in front of an OpenAI-compatible server first, for example
`tapline-sidecar --upstream http://127.0.0.1:8000`, then `python examples/harness_openai.py`.
The same code is in README.md ("Adding tapline to a harness"), where the SDK's tests run it.
"""
import openai
import tapline

TASKS = [{"id": "add-17-25", "prompt": "What is 17 + 25? End with ANSWER: <number>.", "answer": "42"}]

def run(task: dict, sample: int) -> None:
    # The samples of one task share a group id: the trainer compares them with each other.
    with tapline.episode(task_id=task["id"], group_id=f"{task['id']}/b1", metadata={"sample": sample}) as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key="unused")
        messages = [{"role": "user", "content": task["prompt"]}]
        for turn in range(3):
            raw = llm.chat.completions.with_raw_response.create(model="my-model", messages=messages)
            reply = raw.parse().choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            answered = "ANSWER:" in reply
            ep.reward(float(answered), name="format_ok", span_id=tapline.span_id(raw))  # this call
            if answered:
                break
            messages.append({"role": "user", "content": "Please end with ANSWER: <number>."})
        correct = answered and reply.rsplit("ANSWER:", 1)[1].strip() == task["answer"]
        ep.reward(float(correct), name="correct")  # a named reward component
        ep.reward(float(correct) - 0.1 * turn)  # the final scalar reward
        if not answered:
            ep.end("timed_out")  # else the block ends it "succeeded"

for task in TASKS:
    for sample in range(4):
        run(task, sample)
