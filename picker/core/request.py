"""OpenAI request body → :class:`InferenceRequest`. The JSON is parsed exactly once, here.

The routing text is what the prefix hasher sees. It is built so that two requests that share a
prompt prefix (same system prompt, same chat history, same document) share a text prefix:
- ``/v1/completions``: the prompt string; a token-id list is rendered as space-separated ids.
- ``/v1/chat/completions``: tools first (they precede messages in chat templates), then each
  message as ``role\\n content`` with text content parts concatenated.
- ``/v1/responses``: instructions, then input (a string or a list of message items).
- ``/v1/messages`` (Anthropic): the top-level ``system`` (a string or text blocks) as a first
  message, then the messages as chat; ``tool_use`` blocks as their name and input, ``tool_result``
  blocks as their content.

Honest sizes:
- The routing text stops at ``max_text_chars`` (what the hasher will read: ``max_blocks ×
  block_size``); the length of the rest is still counted (``prompt_chars``) for the estimates.
- A media part (image, audio, video, file; a URL or base64 data) enters the text as a short
  marker holding a digest of its content, never as its base64 text, and costs a configured
  number of tokens (``media_tokens``) instead of one per four base64 characters.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from picker.core.errors import BadRequest

MAX_NESTING = 64
REWRITE_HEADERS = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")
"""Set by a gateway, never trusted from a client: read only with ``trust_gateway_headers``.
llm-d-router's current name first, then its deprecated alias (``pkg/epp/metadata/consts.go``):
the first one present wins, as there."""
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
SLO_TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
"""llm-d's TTFT objective, milliseconds: flow control orders a flow by it (earliest deadline
first) and sheds a sheddable request it predicts will miss it (:mod:`picker.core.flowcontrol`).
The TPOT headers (``x-llm-d-slo-tpot-ms`` / ``x-slo-tpot-ms``) steer nothing here."""


def slo_ms(headers: Mapping[str, str], names: Sequence[str]) -> float:
    """A positive finite number of milliseconds from the first of ``names`` present, else 0
    (an unparsable value is ignored: the objective is advice, not a contract to reject on)."""
    raw = header_of(headers, names)
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        return 0.0
    return value if 0.0 < value < float("inf") else 0.0


def header_of(headers: Mapping[str, str], names: Sequence[str]) -> str:
    """The value of the first of ``names`` present with a value (llm-d's current name before its
    deprecated alias), or "" when none is."""
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return ""


SEP = "\x1e"  # record separator between messages: never produced by a normal prompt
MEDIA_MARK = "\x1d"  # group separator: starts a media part's digest marker in the routing text
MEDIA_KINDS = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "file": "file",
    "input_file": "file",
}
"""Content-part ``type`` → media kind (the key into ``media_tokens``)."""
DEFAULT_MEDIA_TOKENS: Mapping[str, int] = {"image": 1024, "audio": 512, "video": 4096, "file": 1024}


@dataclass(frozen=True, slots=True)
class ParseOptions:
    """What parsing needs from the config (picklable: parsing may run in a worker process)."""

    lora_adapters: frozenset[str] = frozenset()
    trust_rewrite: bool = False
    """Honour ``x-llm-d-model-name-rewrite`` / ``x-gateway-model-name-rewrite`` (config
    ``trust_gateway_headers``)."""
    max_text_chars: int = 1 << 60
    """Routing text kept; the hasher reads at most ``max_blocks × block_size`` bytes of it, and
    a character is at least one byte."""
    media_tokens: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_MEDIA_TOKENS))
    keep_doc: bool = False
    """Hand the decoded body back (precise mode tokenizes it); off, none crosses processes."""


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
    slo_ttft_ms: float = 0.0
    """The TTFT objective (``x-llm-d-slo-ttft-ms`` / ``x-slo-ttft-ms``), 0: none."""
    max_tokens: int = 0
    prompt_token_ids: Sequence[int] | None = None
    """The prompt's token ids: the client's (a token-id prompt, cut with the routing text) or the
    picker's tokenizer's (precise mode). Never mutated once set."""
    prompt_chars: int = -1
    """Length of the whole routing text before the cut; -1: ``len(routing_text)``."""
    prompt_token_count: int = 0
    """Ids the client sent (all of them), when it sent ids."""
    prompt_token_estimate: int = 0
    """The whole prompt's tokens, estimated, when ``prompt_token_ids`` holds only its first ones
    (a progressive tokenization stopped where no endpoint holds the next block); 0 otherwise."""
    prompt_keys: list[int] | None = None
    """The KV-block keys of ``prompt_token_ids`` at ``prompt_keys_block_size`` tokens per block,
    with this request's LoRA adapter and salt (``request_keys(prompt_token_ids, ...)``), when
    tokenization computed them with the ids (a held prefix's from its cache); None otherwise.
    Never mutated (shared with the tokenization cache)."""
    prompt_keys_block_size: int = 0
    media_tokens: int = 0
    """Configured token cost of the request's media parts."""


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's ``x-request-id``, or a fresh one when it sent none (or an empty one)."""
    return headers.get("x-request-id") or uuid.uuid4().hex


def parse(
    body: bytes,
    path: str,
    headers: Mapping[str, str],
    lora_adapters: frozenset[str] = frozenset(),
    trust_rewrite: bool = False,
    opts: ParseOptions | None = None,
) -> tuple[InferenceRequest, dict[str, Any]]:
    """Parse ``body`` once. Returns the request and the decoded JSON object (for rewrites).
    ``x-llm-d-model-name-rewrite`` (or its alias ``x-gateway-model-name-rewrite``) names the
    model only when ``trust_rewrite`` is set.
    ``opts``, when given, replaces ``lora_adapters`` and ``trust_rewrite``.

    Raises :class:`BadRequest` for invalid UTF-8, invalid JSON, nesting deeper than
    ``MAX_NESTING``, a non-object body, or a missing ``model``.
    """
    opts = opts or ParseOptions(lora_adapters, trust_rewrite)
    try:
        doc = orjson.loads(body)  # rejects invalid UTF-8 too
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    _check_depth(doc)
    model = (header_of(headers, REWRITE_HEADERS) if opts.trust_rewrite else None) or doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("request body has no 'model'")
    salt = doc.get("cache_salt", "")
    max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens", doc.get("max_output_tokens", 0)))
    text = Text(opts.max_text_chars, opts.media_tokens)
    token_ids, n_ids = routing_text_into(text, doc, path)
    req = InferenceRequest(
        model=model,
        routing_text=text.value(),
        request_id=request_id_of(headers),
        stream=bool(doc.get("stream", False)),
        cache_salt=salt if isinstance(salt, str) else "",
        lora=model if model in opts.lora_adapters else "",
        session_id=headers.get("x-session-id", ""),
        objective=header_of(headers, OBJECTIVE_HEADERS),
        fairness_id=header_of(headers, FAIRNESS_HEADERS),
        slo_ttft_ms=slo_ms(headers, SLO_TTFT_HEADERS),
        max_tokens=max_tokens if isinstance(max_tokens, int) else 0,
        prompt_token_ids=token_ids,
        prompt_chars=text.total,
        prompt_token_count=n_ids,
        media_tokens=text.media_tokens,
    )
    return req, doc


Parsed = tuple[InferenceRequest, bytes | None, dict[str, Any] | None]
"""A request, its rewritten body (None: unchanged) and its decoded body (None unless kept)."""


def parse_and_rewrite(body: bytes, path: str, headers: Mapping[str, str], opts: ParseOptions) -> Parsed:
    """:func:`parse`, the body with its ``model`` rewritten when a trusted
    rewrite header (either spelling) changes it (None when unchanged), and the decoded body when
    ``opts.keep_doc``. Module-level and picklable both ways, so it can run in a worker process."""
    req, doc = parse(body, path, headers, opts=opts)
    kept = doc if opts.keep_doc else None
    rewrite = header_of(headers, REWRITE_HEADERS) if opts.trust_rewrite else None
    if rewrite and doc.get("model") != rewrite:
        doc["model"] = rewrite
        return req, orjson.dumps(doc), kept
    return req, None, kept


def _check_depth(doc: Any) -> None:
    """Iterative depth check (orjson accepts up to 1024 levels; we route nothing that deep).
    Only containers are pushed (one plain loop per container, no generator: it runs per request)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise BadRequest(f"request body is nested deeper than {MAX_NESTING} levels")
        for v in node.values() if type(node) is dict else node:
            if type(v) is dict or type(v) is list:
                stack.append((v, depth + 1))


class Text:
    """The routing text under construction: keeps at most ``cap`` characters, counts them all.

    ``total`` is the length the whole text would have; ``media_tokens`` the summed cost of the
    media parts seen. Once full, :meth:`add` only counts (no slicing, no copies)."""

    __slots__ = ("cap", "media_cost", "media_tokens", "parts", "size", "total")

    def __init__(self, cap: int = 1 << 60, media_cost: Mapping[str, int] = DEFAULT_MEDIA_TOKENS) -> None:
        self.cap, self.media_cost = cap, media_cost
        self.parts: list[str] = []
        self.size = self.total = self.media_tokens = 0

    @property
    def full(self) -> bool:
        return self.size >= self.cap

    def add(self, s: str) -> None:
        self.total += len(s)
        room = self.cap - self.size
        if room > 0:
            piece = s if len(s) <= room else s[:room]
            self.parts.append(piece)
            self.size += len(piece)

    def media(self, kind: str, part: dict[str, Any], ptype: str) -> None:
        """A media part: a digest marker in the text, its configured cost in tokens."""
        self.media_tokens += self.media_cost.get(kind, 0)
        self.add(f"{MEDIA_MARK}{kind}:{_digest(part.get(ptype, part))}")

    def value(self) -> str:
        return "".join(self.parts)


def _digest(payload: Any) -> str:
    """A content digest of a media payload: its string leaves (the URL, or the base64 data)
    hashed in place, without re-serialising megabytes of base64."""
    h = xxhash.xxh3_128()
    stack = [payload]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            h.update(node.encode())
            h.update(b"\x00")
        elif isinstance(node, dict):
            for k in sorted(node, reverse=True):
                stack.append(node[k])
                stack.append(k)
        elif isinstance(node, list):
            stack.extend(reversed(node))
        else:
            h.update(orjson.dumps(node))
    return h.hexdigest()


def routing_text(doc: dict[str, Any], path: str) -> tuple[str, tuple[int, ...] | None]:
    """The text the prefix hasher sees, and the prompt token ids when the client sent ids."""
    text = Text()
    ids, _ = routing_text_into(text, doc, path)
    return text.value(), ids


def routing_text_into(text: Text, doc: dict[str, Any], path: str) -> tuple[tuple[int, ...] | None, int]:
    """Build the routing text into ``text``. Returns the ids rendered (cut with the text) and
    the number of ids sent, when the client sent ids."""
    if "messages" in doc:
        _chat_text(text, doc, path.split("?", 1)[0].rstrip("/").endswith("/v1/messages"))
        return None, 0
    if "prompt" in doc:
        return _prompt_text(text, doc["prompt"])
    if "input" in doc or "instructions" in doc or path.startswith("/v1/responses"):
        _responses_text(text, doc)
    return None, 0


def _prompt_text(text: Text, prompt: Any) -> tuple[tuple[int, ...] | None, int]:
    if isinstance(prompt, str):
        text.add(prompt)
        return None, 0
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return _ids_text(text, prompt), len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        # A batch: route on the first prompt (all go to one endpoint anyway).
        return _prompt_text(text, prompt[0])
    if isinstance(prompt, list) and not prompt:
        return None, 0
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those")


def _ids_text(text: Text, ids: list[int]) -> tuple[int, ...]:
    """Space-separated ids, rendered only as far as the cut (each id is at least 2 characters
    with its separator, so ``cap // 2 + 1`` ids always fill it)."""
    kept = ids[: text.cap // 2 + 1]
    rendered = " ".join(map(str, kept))
    text.add(rendered)
    if len(kept) < len(ids):  # count the rest without rendering it (about 2 chars per digit + 1)
        text.total += sum(len(str(t)) + 1 for t in ids[len(kept) :])
    return tuple(kept)


def _content_text(text: Text, content: Any) -> None:
    if content is None:
        return
    if isinstance(content, str):
        text.add(content)
        return
    if not isinstance(content, list):
        raise BadRequest("message 'content' must be a string, a list of parts, or null")
    for part in content:
        if isinstance(part, str):
            text.add(part)
        elif isinstance(part, dict):
            ptype = part.get("type")
            kind = MEDIA_KINDS.get(ptype) if isinstance(ptype, str) else None
            value = part.get("text", part.get("input_text", ""))
            if isinstance(value, str) and value:
                text.add(value)
            elif kind is not None and isinstance(ptype, str):
                text.media(kind, part, ptype)
            elif ptype == "tool_use":  # Anthropic
                text.add(
                    f"{part.get('name', '')}{orjson.dumps(part.get('input'), option=orjson.OPT_SORT_KEYS).decode()}"
                )
            elif ptype == "tool_result":
                _content_text(text, part.get("content"))


def _chat_text(text: Text, doc: dict[str, Any], anthropic: bool = False) -> None:
    messages = doc["messages"]
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list")
    first = True
    tools = doc.get("tools")
    if tools:
        text.add(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
        first = False
    system = doc.get("system") if anthropic else None
    if system:
        if not first:
            text.add(SEP)
        first = False
        text.add("system\n")
        _content_text(text, system)
    for msg in messages:
        if not isinstance(msg, dict):
            raise BadRequest("each message must be an object")
        if not first:
            text.add(SEP)
        first = False
        role = msg.get("role", "")
        text.add(f"{role}\n")
        _content_text(text, msg.get("content"))
        if msg.get("tool_calls") and not text.full:
            text.add(SEP)
            text.add(orjson.dumps(msg["tool_calls"]).decode())


def _responses_text(text: Text, doc: dict[str, Any]) -> None:
    first = True

    def record() -> None:
        nonlocal first
        if not first:
            text.add(SEP)
        first = False

    instructions = doc.get("instructions")
    if isinstance(instructions, str) and instructions:
        record()
        text.add(f"system\n{instructions}")
    item = doc.get("input", "")
    if isinstance(item, str):
        record()
        text.add(f"user\n{item}")
    elif isinstance(item, list):
        for msg in item:
            if isinstance(msg, dict):
                record()
                role = msg.get("role", "")
                text.add(f"{role}\n")
                _content_text(text, msg.get("content"))
            elif isinstance(msg, str):
                record()
                text.add(msg)
    else:
        raise BadRequest("'input' must be a string or a list of items")
