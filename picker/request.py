"""OpenAI request body → :class:`InferenceRequest`. The JSON is parsed exactly once, here.

The routing text is what the prefix hasher sees. It is built so that two requests that share a
prompt prefix (same system prompt, same chat history, same document) share a text prefix:
- ``/v1/completions``: the prompt string; a token-id list is rendered as space-separated ids.
- ``/v1/chat/completions``: tools first (they precede messages in chat templates), then each
  message as ``role\\n content`` with text content parts concatenated.
- ``/v1/responses``: instructions, then input (a string or a list of message items).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from picker.errors import BadRequest

MAX_NESTING = 64
REWRITE_HEADER = "x-gateway-model-name-rewrite"
"""Set by a gateway, never trusted from a client: read only with ``trust_gateway_headers``."""
SEP = "\x1e"  # record separator between messages: never produced by a normal prompt


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What scheduling needs to know about one request. Immutable once parsed."""

    model: str
    routing_text: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    stream: bool = False
    cache_salt: str = ""
    lora: str = ""
    """Adapter name when ``model`` names a LoRA adapter rather than the base model."""
    session_id: str = ""
    objective: str = ""
    fairness_id: str = ""
    max_tokens: int = 0
    prompt_token_ids: Sequence[int] | None = None
    """The prompt's token ids: the client's (a token-id prompt) or the picker's tokenizer's
    (precise mode). Never mutated once set."""


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's ``x-request-id``, or a fresh one when it sent none (or an empty one)."""
    return headers.get("x-request-id") or uuid.uuid4().hex


def parse(
    body: bytes,
    path: str,
    headers: Mapping[str, str],
    lora_adapters: frozenset[str] = frozenset(),
    trust_rewrite: bool = False,
) -> tuple[InferenceRequest, dict[str, Any]]:
    """Parse ``body`` once. Returns the request and the decoded JSON object (for rewrites).
    ``x-gateway-model-name-rewrite`` names the model only when ``trust_rewrite`` is set.

    Raises :class:`BadRequest` for invalid UTF-8, invalid JSON, nesting deeper than
    ``MAX_NESTING``, a non-object body, or a missing ``model``.
    """
    try:
        doc = orjson.loads(body)  # rejects invalid UTF-8 too
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    _check_depth(doc)
    model = (headers.get(REWRITE_HEADER) if trust_rewrite else None) or doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("request body has no 'model'")
    salt = doc.get("cache_salt", "")
    max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens", doc.get("max_output_tokens", 0)))
    text, token_ids = routing_text(doc, path)
    req = InferenceRequest(
        model=model,
        routing_text=text,
        request_id=request_id_of(headers),
        stream=bool(doc.get("stream", False)),
        cache_salt=salt if isinstance(salt, str) else "",
        lora=model if model in lora_adapters else "",
        session_id=headers.get("x-session-id", ""),
        objective=headers.get("x-gateway-inference-objective", ""),
        fairness_id=headers.get("x-gateway-inference-fairness-id", ""),
        max_tokens=max_tokens if isinstance(max_tokens, int) else 0,
        prompt_token_ids=token_ids,
    )
    return req, doc


def _check_depth(doc: Any) -> None:
    """Iterative depth check (orjson accepts up to 1024 levels; we route nothing that deep)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise BadRequest(f"request body is nested deeper than {MAX_NESTING} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))


def routing_text(doc: dict[str, Any], path: str) -> tuple[str, tuple[int, ...] | None]:
    """The text the prefix hasher sees, and the prompt token ids when the client sent ids."""
    if "messages" in doc:
        return _chat_text(doc), None
    if "prompt" in doc:
        return _prompt_text(doc["prompt"])
    if "input" in doc or "instructions" in doc or path.startswith("/v1/responses"):
        return _responses_text(doc), None
    return "", None


def _prompt_text(prompt: Any) -> tuple[str, tuple[int, ...] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), tuple(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        # A batch: route on the first prompt (all go to one endpoint anyway).
        return _prompt_text(prompt[0])
    if isinstance(prompt, list) and not prompt:
        return "", None
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text", part.get("input_text", ""))
                if isinstance(text, str) and text:
                    parts.append(text)
                elif part.get("type") in ("image_url", "input_image", "input_audio", "file"):
                    parts.append(orjson.dumps(part).decode())  # media identity feeds the hash
        return "".join(parts)
    raise BadRequest("message 'content' must be a string, a list of parts, or null")


def _chat_text(doc: dict[str, Any]) -> str:
    messages = doc["messages"]
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list")
    out: list[str] = []
    tools = doc.get("tools")
    if tools:
        out.append(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    for msg in messages:
        if not isinstance(msg, dict):
            raise BadRequest("each message must be an object")
        out.append(f"{msg.get('role', '')}\n{_content_text(msg.get('content'))}")
        if msg.get("tool_calls"):
            out.append(orjson.dumps(msg["tool_calls"]).decode())
    return SEP.join(out)


def _responses_text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    instructions = doc.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append(f"system\n{instructions}")
    item = doc.get("input", "")
    if isinstance(item, str):
        out.append(f"user\n{item}")
    elif isinstance(item, list):
        for msg in item:
            if isinstance(msg, dict):
                out.append(f"{msg.get('role', '')}\n{_content_text(msg.get('content'))}")
            elif isinstance(msg, str):
                out.append(msg)
    else:
        raise BadRequest("'input' must be a string or a list of items")
    return SEP.join(out)
