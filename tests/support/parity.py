"""The parity suite's corpus: request bodies for every API vLLM serves, generated from a seed, and a
chat template that exercises what those bodies carry (tools, tool calls and results, reasoning,
a template kwarg, thinking).

Bodies come from a few conversations that grow turn by turn (so later bodies share earlier ones'
prefixes and vLLM reports cached tokens) over shared system prompts and documents; some carry a
cache salt, some a LoRA adapter. Each body is ``(api, path, body, sent)``: ``sent`` False marks a
body the picker must fall back on (approximate) and vLLM would not serve alike (a
``previous_response_id`` it never stored): checked for the fallback, never sent.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TOOLS_TEMPLATE = (
    "{% if tools %}<s>tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% if persona is defined and persona %}<s>persona: {{ persona }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<s>tool {{ m['tool_call_id'] }}: {{ m['content'] }}</s>\n"
    "{% else %}<s>{{ m['role'] }}: "
    "{% if m['reasoning_content'] is defined and m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "<call {{ c['id'] }}>{{ c['function']['name'] }}({{ c['function']['arguments'] | tojson }})</call>"
    "{% endfor %}{% endif %}</s>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: "
    "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}{% endif %}"
)
"""A string-format template (vLLM joins text parts) that renders tools as JSON, tool calls with
their ids and arguments, tool results, reasoning, a ``persona`` kwarg and ``enable_thinking``."""

TOPICS = ["astronomy", "cooking", "maritime law", "chess openings", "tide tables", "glassblowing"]
WORDS = ["cache", "prefix", "token", "router", "replica", "model", "block", "hash", "queue", "load"]
LORA = "tiny-lora"


@dataclass(frozen=True)
class Case:
    api: str
    path: str
    body: dict[str, Any]
    sent: bool = True
    shape: str = ""


def _tool(name: str, rng: random.Random, described: bool = True) -> dict[str, Any]:
    """A function tool; without a description, vLLM still hands the template ``"description": null``."""
    tool: dict[str, Any] = {"name": name}
    if described:
        tool["description"] = f"Looks up {name} in the {rng.choice(WORDS)} table."
    tool["parameters"] = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
    return tool


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))


def corpus(n: int, seed: int = 0, lora: bool = True) -> list[Case]:
    """``n`` bodies (at least), cycling over the four APIs, each API's conversations growing."""
    rng = random.Random(seed)
    out: list[Case] = []
    makers = [_completions, _chat, _responses, _messages]
    state: dict[str, Any] = {}
    i = 0
    while len(out) < n:
        make = makers[i % len(makers)]
        case = make(rng, i, state)
        body = case.body
        if rng.random() < 0.15:
            body["cache_salt"] = f"tenant-{rng.randrange(2)}"
        if lora and rng.random() < 0.15 and case.sent:
            body["model"] = LORA
        out.append(case)
        i += 1
    return out


def _system(rng: random.Random) -> str:
    g = rng.randrange(len(TOPICS))
    return f"You are an expert on {TOPICS[g]}. " * (4 + 2 * g)


def _completions(rng: random.Random, i: int, state: dict[str, Any]) -> Case:
    doc = state.setdefault("doc", [_system(random.Random(s)) + _sentence(rng, 30) for s in range(3)])
    base = rng.choice(doc)
    question = f"Question {i}: {_sentence(rng, rng.randrange(3, 12))}?"
    r = rng.random()
    if r < 0.6:
        return Case(
            "completions", "/v1/completions", {"prompt": base + question, "max_tokens": 1}, shape="string"
        )
    if r < 0.8:
        return Case(
            "completions",
            "/v1/completions",
            {"prompt": [base + question, base + "Another " + question], "max_tokens": 1},
            shape="list",
        )
    # token ids: filled in by the suite with the picker's own ids of a text (any valid ids do)
    return Case(
        "completions",
        "/v1/completions",
        {"prompt": base + question, "max_tokens": 1, "_as_ids": True},
        shape="ids",
    )


def _chat(rng: random.Random, i: int, state: dict[str, Any]) -> Case:
    convs: dict[int, list[dict[str, Any]]] = state.setdefault("chat", {})
    g = rng.randrange(4)
    msgs = convs.setdefault(g, [{"role": "system", "content": _system(rng)}])
    body: dict[str, Any] = {"max_tokens": 1}
    shape = "multi-turn"
    msgs.append({"role": "user", "content": f"Turn {i}: {_sentence(rng, rng.randrange(4, 14))}"})
    if g % 2 == 0:
        body["tools"] = [
            {"type": "function", "function": _tool(f"lookup_{g}", random.Random(g), described=g == 0)}
        ]
        shape = "tools"
    r = rng.random()
    if r < 0.1:
        body["add_generation_prompt"] = False
        shape = "no-generation-prompt"
    elif r < 0.2:
        body["chat_template_kwargs"] = {"persona": "a terse pirate", "unused_kwarg": 3}
        shape = "template-kwargs"
    elif r < 0.27:
        body["reasoning_effort"] = "low"
        shape = "reasoning-effort"
    sent = list(msgs)
    if rng.random() < 0.1:
        sent.append({"role": "assistant", "content": "Partial answer so"})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        shape = "continue-final"
    elif rng.random() < 0.15:
        sent[-1] = {
            "role": "user",
            "content": [
                {"type": "text", "text": "Part one."},
                {"type": "text", "text": str(msgs[-1]["content"])},
            ],
        }
        shape = "content-parts"
    body["messages"] = sent
    # the conversation goes on: an assistant turn, sometimes a tool call and its result
    if g % 2 == 0 and rng.random() < 0.6:
        call_id = f"call_{i}"
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": f"lookup_{g}", "arguments": json.dumps({"key": f"k{i}"})},
                    }
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": f"value {i}: {_sentence(rng, 5)}"})
    else:
        msgs.append({"role": "assistant", "content": f"Answer {i}: {_sentence(rng, 6)}"})
    if len(msgs) > 14:
        del msgs[1:5]
    return Case("chat", "/v1/chat/completions", body, shape=shape)


def _responses(rng: random.Random, i: int, state: dict[str, Any]) -> Case:
    convs: dict[int, list[dict[str, Any]]] = state.setdefault("responses", {})
    instructions: dict[int, str] = state.setdefault("instructions", {})
    g = rng.randrange(3)
    items = convs.setdefault(g, [])
    instr = instructions.setdefault(g, _system(rng))
    body: dict[str, Any] = {"max_output_tokens": 16, "store": False, "instructions": instr}
    shape = "items"
    if not items and rng.random() < 0.5:
        body["input"] = f"Single question {i}: {_sentence(rng, 8)}"
        return Case("responses", "/v1/responses", body, shape="string")
    items.append({"role": "user", "content": f"Turn {i}: {_sentence(rng, rng.randrange(4, 12))}"})
    if g == 0:
        body["tools"] = [{"type": "function", **_tool("lookup", random.Random(7))}]
        shape = "tools"
    sent = list(items)
    r = rng.random()
    if r < 0.1:
        sent.append(
            {
                "type": "message",
                "role": "assistant",
                "status": "incomplete",
                "content": [{"type": "output_text", "text": "So far", "annotations": []}],
            }
        )
        shape = "continue-final"
    elif r < 0.2:
        sent[-1] = {"role": "user", "content": [{"type": "input_text", "text": str(items[-1]["content"])}]}
        shape = "input-parts"
    elif r < 0.26:
        body["previous_response_id"] = f"resp_{i}"
        return Case(
            "responses", "/v1/responses", {**body, "input": sent}, sent=False, shape="previous_response"
        )
    body["input"] = sent
    if g == 0 and rng.random() < 0.6:
        items.append(
            {
                "type": "function_call",
                "call_id": f"fc{i}",
                "name": "lookup",
                "arguments": json.dumps({"key": i}),
            }
        )
        items.append(
            {"type": "function_call_output", "call_id": f"fc{i}", "output": f"found {_sentence(rng, 4)}"}
        )
    elif rng.random() < 0.3:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{i}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": f"thinking {i}"}],
            }
        )
        items.append({"role": "assistant", "content": f"Reply {i}: {_sentence(rng, 5)}"})
    else:
        items.append(
            {
                "type": "message",
                "id": f"msg_{i}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": f"Reply {i}: {_sentence(rng, 5)}", "annotations": []}
                ],
            }
        )
    if len(items) > 12:
        del items[0:4]
    return Case("responses", "/v1/responses", body, shape=shape)


def _messages(rng: random.Random, i: int, state: dict[str, Any]) -> Case:
    convs: dict[int, list[dict[str, Any]]] = state.setdefault("messages", {})
    systems: dict[int, Any] = state.setdefault("systems", {})
    g = rng.randrange(3)
    msgs = convs.setdefault(g, [])
    if g not in systems:
        text = _system(rng)
        systems[g] = (
            text
            if g == 0
            else [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
                {"type": "text", "text": text},
                {"type": "text", "text": " Be brief."},
            ]
        )
    body: dict[str, Any] = {"max_tokens": 1, "system": systems[g]}
    shape = "system-string" if g == 0 else "system-blocks"
    msgs.append(
        {
            "role": "user",
            "content": [{"type": "text", "text": f"Turn {i}: {_sentence(rng, rng.randrange(4, 12))}"}]
            if rng.random() < 0.5
            else f"Turn {i}: {_sentence(rng, 6)}",
        }
    )
    if g == 1:
        body["tools"] = [
            {
                "name": "lookup",
                "description": "Looks things up.",
                "input_schema": {"type": "object", "properties": {"key": {"type": "string"}}},
            }
        ]
        shape = "tools"
    body["messages"] = list(msgs)
    r = rng.random()
    if r < 0.08:
        body["thinking"] = {"type": "disabled"}
        sent_case = Case("messages", "/v1/messages", body, sent=False, shape="thinking-disabled")
        msgs.append({"role": "assistant", "content": f"Reply {i}"})
        return sent_case
    if r < 0.16:
        body["chat_template_kwargs"] = {"persona": "a careful clerk"}
        shape = "template-kwargs"
    if g == 1 and rng.random() < 0.6:
        tid = f"toolu_{i}"
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"need lookup {i}", "signature": "sig"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": tid, "name": "lookup", "input": {"key": f"k{i}"}},
                ],
            }
        )
        msgs.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": tid,
                        "content": [{"type": "text", "text": f"v{i}"}],
                    },
                    {"type": "text", "text": "Thanks."},
                ],
            }
        )
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": f"Done {i}."}]})
    else:
        msgs.append({"role": "assistant", "content": f"Reply {i}: {_sentence(rng, 5)}"})
    if len(msgs) > 12:
        del msgs[0:4]
        while msgs and msgs[0]["role"] != "user":
            del msgs[0]
    return Case("messages", "/v1/messages", body, shape=shape)
