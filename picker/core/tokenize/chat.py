"""Chat templates rendered as vLLM 0.32 renders them (``OnlineRenderer.preprocess_chat`` →
``safe_apply_chat_template`` → HF ``apply_chat_template`` → ``render_jinja_template``):

- a sandboxed jinja2 environment with ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``, the
  ``tojson`` filter without HTML escaping, and ``raise_exception`` / ``strftime_now`` globals;
- the conversation vLLM builds from the messages (``parse_chat_messages``): each message rebuilt
  with its role and content and only the keys vLLM keeps (an assistant's ``tool_calls`` and
  ``reasoning``, a tool's ``tool_call_id``, a ``name``); null content as no parts; text parts
  (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``) joined with newlines
  ("string" format) or kept as ``{"type": "text"}`` parts when the template iterates over a
  message's content ("openai" format, detected on its AST as vLLM does,
  :mod:`picker.core.tokenize.content_format`); a tool message's text parts joined; Claude Code's
  billing header dropped from system text; tool-call ``arguments`` parsed to a mapping (malformed:
  ``{}``, as vLLM coerces them);
- ``tools`` as vLLM dumps them (:func:`picker.core.tokenize.apis.chat_tools`);
- the keyword arguments vLLM passes: ``add_generation_prompt`` (default true),
  ``continue_final_message``, ``documents``, ``reasoning_effort`` (and ``enable_thinking`` with
  it), over the request's ``chat_template_kwargs``, values ``None`` and ``"auto"`` dropped, then
  only those the template reads or HF's ``apply_chat_template`` names; the tokenizer's special
  tokens (``bos_token`` …) under them;
- ``continue_final_message``: the render cut after the final message's text, as HF cuts it.

What cannot be reproduced raises :class:`~picker.core.tokenize.apis.Unrenderable` with a reason
(media parts, a template error, ...), and the request is routed approximately.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from picker.core.tokenize import content_format
from picker.core.tokenize.apis import BILLING_HEADER, Unrenderable, chat_tools, tool_arguments

HF_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""The parameters of transformers 5's ``apply_chat_template``: vLLM passes a request's template
kwarg through when the template reads it or it is one of these."""
NOT_FOR_TEMPLATE = frozenset(HF_PARAMS - {"documents", "add_generation_prompt", "continue_final_message"})
"""Those ``apply_chat_template`` consumes itself (the template never sees them)."""
TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Content-part type → the key holding its text (vLLM's text part types)."""
UNSET = (None, "auto")
"""Values vLLM's ``merge_kwargs`` treats as unset."""
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """HF's ``{% generation %}`` tag, rendered as its body (no assistant mask is asked for)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.template = env.from_string(source)
        self.special_tokens = special_tokens
        self.openai_format = content_format.detect(env, source) == "openai"
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        """The names the template reads: a request's template kwarg reaches it only if named here
        (or in :data:`HF_PARAMS`)."""
        self.reads_reasoning = bool({"reasoning_effort", "enable_thinking"} & self.variables)
        self.developer_role = '"developer"' in source or "'developer'" in source
        self.merges_inline_system = self._rejects_inline_system()
        """vLLM's ``/v1/messages`` probe: the template raises on a system message after the first
        turn, so inline system messages are merged into the leading one."""

    def _rejects_inline_system(self) -> bool:
        msgs = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
        try:
            self.template.render(messages=msgs, add_generation_prompt=False)
        except jinja2.TemplateError:
            return True
        except Exception:  # vLLM catches only TemplateError; anything else would fail there too
            return False
        return False

    def render(self, doc: dict[str, Any]) -> str:
        """The prompt text vLLM renders for a chat-completions body ``doc``."""
        raw = doc.get("messages")
        if not isinstance(raw, list):
            raise Unrenderable("unsupported", "'messages' must be a list")
        messages = [self._message(m) for m in raw]
        if doc.get("chat_template") is not None:
            raise Unrenderable("unsupported", "a request-supplied chat template")
        if not self.developer_role and any(m["role"] == "developer" for m in messages):
            raise Unrenderable("unsupported", "developer messages the template does not take")
        kwargs = self._kwargs(doc)
        tools = kwargs.pop("tools", None)
        agp = bool(kwargs.pop("add_generation_prompt", False))
        cfm = kwargs.pop("continue_final_message", False)
        documents = kwargs.pop("documents", None)
        if cfm and agp:
            raise Unrenderable("unsupported", "continue_final_message with add_generation_prompt")
        final_text = ""
        if cfm:
            final_text = self._tag_final(messages)
        try:
            text = self.template.render(
                **{**self.special_tokens, **kwargs},
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=agp,
                continue_final_message=cfm,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise Unrenderable("template", f"chat template: {exc}") from exc
        except (TypeError, ValueError, AttributeError, LookupError) as exc:
            raise Unrenderable("template", f"chat template arguments: {exc}") from exc
        if cfm:
            text = _cut_final(text, final_text)
        return text

    def _kwargs(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments vLLM renders with (see the module doc)."""
        user = doc.get("chat_template_kwargs") or {}
        if not isinstance(user, dict):
            raise Unrenderable("unsupported", "chat_template_kwargs must be an object")
        if "chat_template" in user or "tokenize" in user:
            raise Unrenderable("unsupported", "chat_template_kwargs vLLM rejects")
        effort = doc.get("reasoning_effort")
        extra: dict[str, Any] = {
            "add_generation_prompt": doc.get("add_generation_prompt", True),
            "continue_final_message": doc.get("continue_final_message", False),
            "documents": doc.get("documents"),
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
        merged = {**user, **{k: v for k, v in extra.items() if not _unset(v)}}
        out: dict[str, Any] = {"tools": chat_tools(doc.get("tools"))}
        out.update((k, v) for k, v in merged.items() if isinstance(k, str) and not _unset(v))
        accept = self.variables | HF_PARAMS
        return {k: v for k, v in out.items() if k in accept and (k == "tools" or k not in NOT_FOR_TEMPLATE)}

    def _tag_final(self, messages: list[dict[str, Any]]) -> str:
        """HF's ``continue_final_message``: tag the final message's (last) text; return it."""
        if not messages or "content" not in messages[-1]:
            raise Unrenderable("unsupported", "continue_final_message without a final message")
        if "content" not in self.source:
            raise Unrenderable("template", "continue_final_message with a template that reads no content")
        final = messages[-1]["content"]
        if isinstance(final, list):
            for part in reversed(final):
                if "text" in part:
                    text = str(part["text"])
                    part["text"] = text + CONTINUE_TAG
                    return text
            raise Unrenderable("unsupported", "continue_final_message with no text to continue")
        if not isinstance(final, str):
            raise Unrenderable("unsupported", "continue_final_message with no text to continue")
        messages[-1]["content"] = final + CONTINUE_TAG
        return final

    def _message(self, m: Any) -> dict[str, Any]:
        """One message as vLLM's ``_parse_chat_message_content`` rebuilds it."""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Unrenderable("unsupported", "a message is not an object with a role")
        role = m["role"]
        content = m.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = content
        else:
            raise Unrenderable("unsupported", "message content must be a string, parts or null")
        texts = [t for t in (_part_text(p) for p in parts) if t is not None]
        if role == "system":
            texts = _strip_billing(texts)
        out: dict[str, Any] = {"role": role}
        if self.openai_format:
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise Unrenderable("unsupported", "tool_calls must be a list")
                if calls:
                    out["tool_calls"] = [_parsed_call(c) for c in calls]
            reasoning = m.get("reasoning")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in m:
                out["tool_call_id"] = m["tool_call_id"]
            if self.openai_format:  # vLLM joins a tool message's text parts in either format
                out["content"] = "\n".join(texts)
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        if isinstance(m.get("task"), str):
            out["task"] = m["task"]
        if role == "developer":
            out["tools"] = m.get("tools")
        return out


def _unset(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v == "auto")


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise Unrenderable("unsupported", "a content part is not an object")
    kind = part.get("type")
    key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        if kind == "tool_reference":
            raise Unrenderable("unsupported", "a tool_reference part")
        raise Unrenderable("media", f"a {kind!r} content part")
    text = part.get(key)
    if text is None:
        return None  # vLLM skips a text part without text
    if not isinstance(text, str):
        raise Unrenderable("unsupported", "a text part whose text is not a string")
    return text


def _strip_billing(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        if not t.startswith(BILLING_HEADER):
            out.append(t)
            continue
        rest = t.partition("\n")[2]
        if rest:
            out.append(rest)
    return out


def _parsed_call(call: Any) -> Any:
    if not isinstance(call, dict):
        raise Unrenderable("unsupported", "a tool call is not an object")
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise Unrenderable("unsupported", "a tool call that is not a function call")
    return {**call, "function": {**fn, "arguments": tool_arguments(fn.get("arguments"))}}


def _cut_final(text: str, final: str) -> str:
    """HF ``render_jinja_template``'s cut after the continued message's text."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise Unrenderable("template", "the template dropped part of the final message")
    at = text.rindex(tag)
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
