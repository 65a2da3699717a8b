"""Every API's body → the chat request vLLM renders (``picker.core.tokenize.apis``), the vLLM
semantics of the chat renderer (``picker.core.tokenize.chat``), and the fallbacks, counted by
reason. The real-vLLM proof of all of it is ``tests/vllm/test_parity.py``; these pin the shapes
on their own, fast."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import generate_latest

from picker.core.request import SEP, parse
from picker.core.tokenize.apis import REASONS, Unrenderable, chat_tools, from_anthropic, from_responses
from picker.core.tokenize.chat import ChatTemplate
from picker.core.tokenize.hf import HFPromptTokenizer
from picker.serving.telemetry import Telemetry
from tests.support.parity import TOOLS_TEMPLATE

pytestmark = pytest.mark.precise
ECHO = "{{ messages | tojson }}|{{ tools | tojson }}|{{ add_generation_prompt }}"


def test_anthropic_system_blocks_tool_use_and_results() -> None:
    doc = {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=1"},
            {"type": "text", "text": "A"},
            {"type": "text", "text": "B"},
        ],
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "t"},
                    {"type": "tool_use", "id": "u1", "name": "f", "input": {"k": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "u1", "content": [{"type": "text", "text": "r"}]},
                    {"type": "text", "text": "next"},
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    chat = from_anthropic(doc)
    assert chat["messages"] == [
        {"role": "system", "content": "AB"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "reasoning": "hm",
            "tool_calls": [
                {"id": "u1", "type": "function", "function": {"name": "f", "arguments": {"k": 1}}}
            ],
            "content": "t",
        },
        {"role": "tool", "tool_call_id": "u1", "content": "r"},
        {"role": "user", "content": "next"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}
    ]


def test_anthropic_inline_system_merged_only_when_the_template_needs_it() -> None:
    doc = {"system": "S", "messages": [{"role": "system", "content": "I"}, {"role": "user", "content": "q"}]}
    assert [m["role"] for m in from_anthropic(doc)["messages"]] == ["system", "system", "user"]
    assert from_anthropic(doc, merge_inline_system=True)["messages"][0] == {"role": "system", "content": "SI"}
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system first') }}{% endif %}{% endfor %}",
        {},
    )
    assert strict.merges_inline_system and not ChatTemplate(ECHO, {}).merges_inline_system


def test_responses_items_become_vllm_messages() -> None:
    doc = {
        "instructions": "I",
        "input": [
            {"role": "user", "content": "q"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
            {
                "type": "reasoning",
                "id": "r",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "t"}],
            },
            {"role": "assistant", "content": "b", "status": "incomplete"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {}}],
    }
    chat = from_responses(doc)
    assert chat["messages"] == [
        {"role": "system", "content": "I"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "a",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}, "type": "function"}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c"},
        {"role": "assistant", "reasoning": "t", "content": "b"},
    ]
    assert chat["continue_final_message"] and not chat["add_generation_prompt"]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {}}}
    ]


def test_chat_renders_with_vllms_shapes_and_kwargs() -> None:
    t = ChatTemplate(TOOLS_TEMPLATE, {"bos_token": "<s>"})
    doc: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": None, "extra": "dropped"},
            {
                "role": "assistant",
                "content": "x",
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "oops"}}],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "f", "extra": 1}}],
        "chat_template_kwargs": {"persona": "p", "unused": "auto", "add_generation_prompt": False},
    }
    text = t.render(doc)
    assert text.startswith(
        '<s>tools:\n{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}'
    )
    assert text.endswith(
        "<s>persona: p\n<s>user: </s>\n<s>assistant: x<call 1>f({})</call></s>\n<s>assistant: "
    ), (
        "null content renders as no parts (not 'None'), malformed arguments as {} (vLLM coerces them), "
        "the request's add_generation_prompt wins over chat_template_kwargs"
    )
    cont = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "so far"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert t.render(cont) == "<s>user: q</s>\n<s>assistant: so far", "cut after the continued text"
    assert chat_tools(None) is None


@pytest.mark.parametrize(
    ("path", "doc", "reason"),
    [
        ("/v1/responses", {"input": "q", "previous_response_id": "r1"}, "previous_response"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            "media",
        ),
        (
            "/v1/messages",
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}
                ]
            },
            "tool_use_id",
        ),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "q"}], "thinking": {"type": "disabled"}},
            "thinking",
        ),
        (
            "/v1/responses",
            {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "x", "input": ""}]},
            "unsupported",
        ),
        ("/v1/chat/completions", {"messages": [], "chat_template": "{{ x }}"}, "unsupported"),
        ("/v1/completions", {"prompt": "q", "truncate_prompt_tokens": 4}, "unsupported"),
    ],
)
def test_fallbacks_are_counted_by_reason(path: str, doc: dict[str, Any], reason: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = HFPromptTokenizer(raw, ChatTemplate(TOOLS_TEMPLATE, {}), cache_entries=0)
    assert tok.encode(doc, path) is None
    assert {r: n for r, n in tok.approximate.items() if n} == {reason: 1}
    t = Telemetry()
    t.tokenizer = tok
    from picker.core.endpoints.pool import Pool
    from picker.core.prefix.index import PrefixIndex

    t.refresh(Pool(), PrefixIndex(1000))
    t.refresh(Pool(), PrefixIndex(1000))  # mirrored once, not twice
    assert t.registry.get_sample_value("kvpick_tokenize_approximate_total", {"reason": reason}) == 1
    assert set(REASONS) <= {
        s.labels["reason"] for m in t.registry.collect() for s in m.samples if "reason" in s.labels
    }
    assert b"kvpick_tokenize_approximate_total" in generate_latest(t.registry)


def test_unrenderable_carries_a_bounded_reason() -> None:
    with pytest.raises(Unrenderable) as exc:
        from_responses({"input": 3})
    assert exc.value.reason in REASONS


def test_anthropic_routing_text_holds_system_and_tool_blocks() -> None:
    doc = {
        "model": "m",
        "system": [{"type": "text", "text": "S"}],
        "messages": [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "u", "name": "f", "input": {"b": 1, "a": 2}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u", "content": "r"}]},
        ],
    }
    req, _ = parse(json.dumps(doc).encode(), "/v1/messages", {})
    assert req.routing_text == f'system\nS{SEP}assistant\nf{{"a":2,"b":1}}{SEP}user\nr'
