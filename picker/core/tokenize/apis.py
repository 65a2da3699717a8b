"""Each API vLLM 0.32 serves, as the chat request (or text prompt) vLLM renders from it.

vLLM turns an Anthropic ``/v1/messages`` body and an OpenAI ``/v1/responses`` body into the same
chat conversation a ``/v1/chat/completions`` body gives, then renders that with the chat template:

- ``/v1/messages``: ``vllm/entrypoints/anthropic/serving.py``
  (``AnthropicServingMessages.to_chat_completion_request``): the top-level ``system`` (a string,
  or its text blocks joined, Claude Code's ``x-anthropic-billing-header`` block dropped) becomes
  one leading system message; ``text`` blocks become text parts (one part alone: a string);
  ``thinking`` blocks the assistant's ``reasoning``; ``tool_use`` blocks ``tool_calls`` (their
  ``input`` as the arguments); a user's ``tool_result`` block a ``tool`` message placed before the
  rest of its message; ``tools`` become function tools (``input_schema`` as the parameters).
- ``/v1/responses``: ``vllm/entrypoints/openai/responses/utils.py``
  (``construct_input_messages``): ``instructions`` becomes a system message; a string ``input`` a
  user message; input items become messages: ``function_call`` items join the preceding
  assistant message's ``tool_calls``, ``function_call_output`` items become ``tool`` messages,
  ``reasoning`` items the assistant's ``reasoning``; a last assistant item whose ``status`` is
  ``in_progress`` or ``incomplete`` is continued (``continue_final_message``).

Where the prompt depends on what the picker cannot see, :class:`Unrenderable` says why, with a
reason from :data:`REASONS` (a bounded metric label), and the request is matched approximately:

- ``previous_response``: ``previous_response_id`` or ``previous_input_messages`` (the history is
  in the serving replica's response store);
- ``media``: image, audio, video or file parts (vLLM expands them into placeholder tokens the
  picker does not reproduce);
- ``tool_use_id``: a ``tool_use`` block without an ``id`` (vLLM makes one from the clock);
- ``thinking``: ``thinking.type: disabled`` or ``output_config.effort`` with a template that reads
  ``reasoning_effort`` or ``enable_thinking`` (vLLM probes the template at run time);
- ``unsupported``: a shape vLLM rejects, or one the picker does not follow (tool additions and
  removals, namespaced or custom tools, tool references, encrypted reasoning, ``prompt_embeds``,
  ``truncate_prompt_tokens``, a request-supplied ``chat_template``);
- ``template``: the chat template raised, or is missing.

Pure functions over decoded JSON; nothing here does I/O.
"""

from __future__ import annotations

import json
from typing import Any, Literal

Reason = Literal["previous_response", "media", "tool_use_id", "thinking", "unsupported", "template"]
REASONS: tuple[Reason, ...] = (
    "previous_response",
    "media",
    "tool_use_id",
    "thinking",
    "unsupported",
    "template",
)
"""Every fallback reason: the label values of ``kvpick_tokenize_approximate``."""

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's per-request attribution block, which vLLM drops from system prompts."""

MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"


class Unrenderable(ValueError):
    """The request needs something the picker cannot reproduce; :attr:`reason` is one of
    :data:`REASONS`."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason


def api_of(path: str) -> str:
    """The API a request path names: ``messages``, ``responses``, ``chat`` or ``completions``
    (the query string ignored)."""
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith(MESSAGES_PATH):
        return "messages"
    if p.endswith(RESPONSES_PATH):
        return "responses"
    if p.endswith("/chat/completions"):
        return "chat"
    return "completions"


# --- /v1/messages (Anthropic) ---------------------------------------------------------------


def from_anthropic(doc: dict[str, Any], merge_inline_system: bool = False) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body vLLM builds from an Anthropic ``/v1/messages`` body.
    ``merge_inline_system``: the template requires system-first ordering (vLLM probes it once,
    :func:`picker.core.tokenize.chat.ChatTemplate.merges_inline_system`), so inline system
    messages join the leading one."""
    messages = doc.get("messages")
    if not isinstance(messages, list):
        raise Unrenderable("unsupported", "'messages' must be a list")
    out: list[dict[str, Any]] = []
    system_parts: list[str] = []
    system = doc.get("system")
    if isinstance(system, str):
        if system:
            system_parts.append(system)
    elif isinstance(system, list):
        for block in system:
            if not isinstance(block, dict):
                raise Unrenderable("unsupported", "a system block is not an object")
            text = block.get("text")
            if (
                block.get("type") == "text"
                and isinstance(text, str)
                and text
                and not text.startswith(BILLING_HEADER)
            ):
                system_parts.append(text)
    elif system is not None:
        raise Unrenderable("unsupported", "'system' must be a string or a list of blocks")
    if merge_inline_system:
        for msg in messages:
            if isinstance(msg, dict) and msg.get("role") == "system":
                text = _system_text(msg.get("content"))
                if text:
                    system_parts.append(text)
    if system_parts:
        out.append({"role": "system", "content": "".join(system_parts)})
    for msg in messages:
        if not isinstance(msg, dict):
            raise Unrenderable("unsupported", "a message is not an object")
        role = msg.get("role")
        if role == "system":
            if not merge_inline_system:
                text = _system_text(msg.get("content"))
                if text:
                    out.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise Unrenderable("unsupported", f"message role {role!r}")
        chat: dict[str, Any] = {"role": role}
        content = msg.get("content")
        if isinstance(content, str):
            chat["content"] = content
        elif isinstance(content, list):
            _anthropic_blocks(content, role, chat, out)
        else:
            raise Unrenderable("unsupported", "message content must be a string or blocks")
        if not (role == "user" and "content" not in chat):
            out.append(chat)
    body: dict[str, Any] = {"messages": out}
    config = doc.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    if effort is not None:  # thinking.type "disabled" overrides it: the caller checks that
        body["reasoning_effort"] = effort
    tools = doc.get("tools")
    if tools is not None:
        body["tools"] = _anthropic_tools(tools)
    if "chat_template_kwargs" in doc:
        body["chat_template_kwargs"] = doc["chat_template_kwargs"]
    return body


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        return None
    parts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "text":
            text = block.get("text")
            if isinstance(text, str) and text and not text.startswith(BILLING_HEADER):
                parts.append(text)
    return "".join(parts) if parts else None


def _anthropic_blocks(blocks: list[Any], role: str, chat: dict[str, Any], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        if not isinstance(block, dict):
            raise Unrenderable("unsupported", "a content block is not an object")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text:
                parts.append({"type": "text", "text": text})
        elif kind in ("image", "document"):
            raise Unrenderable("media", f"a {kind} block")
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            pass
        elif kind == "tool_use":
            if not block.get("id"):
                raise Unrenderable("tool_use_id", "a tool_use block without an id")
            args = block.get("input") or {}
            if not isinstance(args, dict):
                raise Unrenderable("unsupported", "tool_use input is not an object")
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": args},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.append(_tool_result(block))
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {_py_str(result) if result else ''}"})
        elif kind == "tool_reference":
            pass
        else:
            raise Unrenderable("unsupported", f"content block type {kind!r}")
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 else parts


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                raise Unrenderable("media", "an image in a tool_result")
            elif kind == "tool_reference":
                raise Unrenderable("unsupported", "a tool_reference in a tool_result")
        text = "\n".join(texts)
    elif content is not None:
        raise Unrenderable("unsupported", "tool_result content must be a string or blocks")
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text}


def _py_str(value: Any) -> str:
    """``str()`` of a decoded JSON value, as Python (and so vLLM) prints it."""
    return str(value)


def _anthropic_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise Unrenderable("unsupported", "'tools' must be a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise Unrenderable("unsupported", "a tool without a name")
        if "input_schema" not in tool:
            raise Unrenderable("unsupported", "a tool without input_schema")
        fn: dict[str, Any] = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool["input_schema"],
        }
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        if tool.get("defer_loading") is not None:
            fn["defer_loading"] = tool["defer_loading"]
        out.append({"type": "function", "function": fn})
    return out


# --- /v1/responses ----------------------------------------------------------------------------


def from_responses(doc: dict[str, Any]) -> dict[str, Any]:
    """The chat request vLLM renders from an OpenAI ``/v1/responses`` body."""
    if doc.get("previous_response_id") is not None or doc.get("previous_input_messages") is not None:
        raise Unrenderable("previous_response", "the history is in the replica's response store")
    messages: list[dict[str, Any]] = []
    instructions = doc.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    item = doc.get("input")
    continue_final = False
    if isinstance(item, str):
        messages.append({"role": "user", "content": item})
    elif isinstance(item, list):
        for it in item:
            if not isinstance(it, dict):
                raise Unrenderable("unsupported", "an input item is not an object")
            msg = _response_item(it, messages[-1] if messages else None)
            if msg is not None:
                messages.append(msg)
        if item:
            last = item[-1]
            continue_final = (
                isinstance(last, dict)
                and last.get("type", "message") in ("message", "reasoning")
                and last.get("status") in ("in_progress", "incomplete")
            )
    else:
        raise Unrenderable("unsupported", "'input' must be a string or a list of items")
    body: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
    }
    reasoning = doc.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        body["reasoning_effort"] = reasoning["effort"]
    tools = _response_tools(doc.get("tools"))
    if tools:
        body["tools"] = tools
    if "chat_template_kwargs" in doc:
        body["chat_template_kwargs"] = doc["chat_template_kwargs"]
    return body


def _response_item(item: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``_construct_message_from_response_item``: a new message, or None when the item
    joined ``prev`` (the preceding assistant message)."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        if item.get("namespace"):
            raise Unrenderable("unsupported", "a namespaced function call")
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise Unrenderable("unsupported", f"a function_call without {key!r}")
        call = {
            "id": item["call_id"],
            "function": {"name": item["name"], "arguments": item["arguments"]},
            "type": "function",
        }
        if assistant is not None:
            calls = assistant.get("tool_calls")
            if calls is None:
                assistant["tool_calls"] = [call]
                return None
            calls.append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind in ("custom_tool_call", "custom_tool_call_output"):
        raise Unrenderable("unsupported", "custom tool calls")
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise Unrenderable("unsupported", "encrypted reasoning")
        parts, summary = item.get("content"), item.get("summary")
        thought = ""
        if isinstance(parts, list) and parts:
            thought = _text_of(parts[0])
        elif isinstance(summary, list) and summary:
            thought = _text_of(summary[0])
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = thought
            return None
        return {"role": "assistant", "reasoning": thought}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if kind not in (None, "message") or not isinstance(role, str):
        raise Unrenderable("unsupported", f"input item type {kind!r}")
    content = item.get("content")
    if role == "assistant":
        text: str | None = None
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and content:
            text = content[0].get("text") if isinstance(content[0], dict) else None
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    return item


def _text_of(part: Any) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("text"), str):
        raise Unrenderable("unsupported", "a reasoning part without text")
    return str(part["text"])


def _response_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise Unrenderable("unsupported", "'tools' must be a list")
    out = []
    for tool in tools:
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("name"), str)
        ):
            raise Unrenderable("unsupported", "only function tools are followed")
        fn: dict[str, Any] = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
        }
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


# --- /v1/chat/completions ---------------------------------------------------------------------


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM hands them to the template (``ChatCompletionToolsParam.model_dump()``):
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` with ``strict``
    and ``defer_loading`` only when set, every other key dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unrenderable("unsupported", "'tools' must be a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise Unrenderable("unsupported", "a tool without a function")
        f = tool["function"]
        if not isinstance(f.get("name"), str):
            raise Unrenderable("unsupported", "a function tool without a name")
        fn: dict[str, Any] = {
            "name": f["name"],
            "description": f.get("description"),
            "parameters": f.get("parameters"),
        }
        strict = f.get("strict")
        if strict is not None:
            fn["strict"] = strict
        defer = f.get("defer_loading", tool.get("defer_loading"))
        if defer is not None:
            fn["defer_loading"] = defer
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def tool_arguments(args: Any) -> dict[str, Any]:
    """An assistant tool call's ``arguments`` as the template sees them (vLLM's
    ``_postprocess_messages``): a JSON object string parsed, a mapping kept, anything else
    (empty, malformed, not an object) an empty mapping."""
    if not args:
        return {}
    if isinstance(args, dict):
        return args
    parsed: Any = None
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
    else:
        parsed = args
    return parsed if isinstance(parsed, dict) else {}
