"""Chat templates rendered as vLLM 0.32 renders them (``apply_hf_chat_template`` → HF
``render_jinja_template``):

- a sandboxed jinja2 environment with ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``, the
  ``tojson`` filter without HTML escaping, and ``raise_exception`` / ``strftime_now`` globals;
- rendered with ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` (vLLM's request
  default: true), ``continue_final_message``, the tokenizer's special tokens (``bos_token`` …) and
  the request's ``chat_template_kwargs``;
- message content in vLLM's "string" format (text parts joined with newlines) unless the template
  iterates over a message's content ("openai" format: a list of ``{"type": "text", ...}`` parts),
  detected on the template's AST as vLLM does (:mod:`picker.core.tokenize.content_format`);
  an assistant message's ``tool_calls[].function.arguments`` JSON string is parsed to a mapping.

A message with non-text parts (images, audio) cannot be rendered here: :class:`Unrenderable`,
and the request is routed approximately.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from picker.core.tokenize import content_format


class Unrenderable(ValueError):
    """The request needs something the picker cannot reproduce (media parts, a template error)."""


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


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.template = env.from_string(source)
        self.special_tokens = special_tokens
        self.openai_format = content_format.detect(env, source) == "openai"

    def render(self, doc: dict[str, Any]) -> str:
        """The prompt text vLLM renders for a chat-completions body ``doc``."""
        messages = [self._message(m) for m in doc.get("messages") or []]
        kwargs = doc.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise Unrenderable("chat_template_kwargs must be an object")
        try:
            return self.template.render(
                **self.special_tokens,
                messages=messages,
                tools=doc.get("tools"),
                documents=doc.get("documents"),
                add_generation_prompt=bool(doc.get("add_generation_prompt", True)),
                continue_final_message=bool(doc.get("continue_final_message", False)),
                **{k: v for k, v in kwargs.items() if isinstance(k, str)},
            )
        except jinja2.exceptions.TemplateError as exc:
            raise Unrenderable(f"chat template: {exc}") from exc
        except TypeError as exc:
            raise Unrenderable(f"chat template arguments: {exc}") from exc

    def _message(self, m: Any) -> dict[str, Any]:
        if not isinstance(m, dict):
            raise Unrenderable("a message is not an object")
        out = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif (
                    isinstance(part, dict)
                    and part.get("type", "text") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    texts.append(part["text"])
                else:
                    raise Unrenderable("a message has non-text content parts")
            out["content"] = (
                [{"type": "text", "text": t} for t in texts] if self.openai_format else "\n".join(texts)
            )
        elif isinstance(content, str) and self.openai_format:
            out["content"] = [{"type": "text", "text": content}]
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            out["tool_calls"] = [_parsed_call(c) for c in calls]
        return out


def _parsed_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if not args:
        fn["arguments"] = {}
    elif isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError as exc:
            raise Unrenderable("tool call arguments are not JSON (vLLM rejects them too)") from exc
    return {**call, "function": fn}
