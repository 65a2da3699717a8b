"""Request parsing: every OpenAI body shape gives the routing text and hash seed we expect, and
every bad input raises BadRequest with a message that names the problem."""

from __future__ import annotations

import orjson
import pytest

from picker.core.errors import BadRequest
from picker.core.prefix.hashing import HashConfig, block_hashes, seed_for
from picker.core.request import MAX_NESTING, SEP, InferenceRequest, ParseOptions, parse, parse_and_rewrite


def _parse(doc: object, path: str = "/v1/completions", **kw: object) -> InferenceRequest:
    headers = kw.pop("headers", {})
    assert isinstance(headers, dict)
    req, _ = parse(orjson.dumps(doc), path, headers, **kw)  # type: ignore[arg-type]
    return req


def _hashes(req: InferenceRequest) -> list[int]:
    return block_hashes(req.routing_text, seed_for(req.model, req.lora, req.cache_salt), HashConfig())


def test_completions_string_prompt() -> None:
    req = _parse({"model": "m", "prompt": "hello world", "max_tokens": 7, "stream": True})
    assert (req.model, req.routing_text, req.max_tokens, req.stream) == ("m", "hello world", 7, True)
    assert req.prompt_token_ids is None


def test_completions_token_list_prompt() -> None:
    req = _parse({"model": "m", "prompt": [1, 22, 333]})
    assert req.routing_text == "1 22 333"
    assert req.prompt_token_ids == (1, 22, 333)


def test_completions_batch_routes_on_first_prompt() -> None:
    assert _parse({"model": "m", "prompt": ["first", "second"]}).routing_text == "first"
    assert _parse({"model": "m", "prompt": [[5, 6], [7]]}).prompt_token_ids == (5, 6)


def test_chat_content_parts_and_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    doc = {
        "model": "m",
        "tools": tools,
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
        ],
    }
    text = _parse(doc, "/v1/chat/completions").routing_text
    parts = text.split(SEP)
    assert parts[0] == orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode(), "tools come first"
    assert parts[1:4] == ["system\nbe brief", "user\npart one two", "assistant\n"]
    assert parts[4] == '[{"id":"c1"}]'


def test_chat_tools_key_order_does_not_matter() -> None:
    a = {"model": "m", "tools": [{"x": 1, "y": 2}], "messages": [{"role": "user", "content": "q"}]}
    b = {"model": "m", "tools": [{"y": 2, "x": 1}], "messages": [{"role": "user", "content": "q"}]}
    assert _parse(a).routing_text == _parse(b).routing_text


def test_chat_image_part_feeds_the_text() -> None:
    def doc(url: str) -> dict[str, object]:
        part = {"type": "image_url", "image_url": {"url": url}}
        return {"model": "m", "messages": [{"role": "user", "content": [part]}]}

    assert _parse(doc("http://a/1.png")).routing_text != _parse(doc("http://a/2.png")).routing_text


def test_responses_input_and_instructions() -> None:
    req = _parse(
        {"model": "m", "instructions": "sys", "input": "hi", "max_output_tokens": 9}, "/v1/responses"
    )
    assert req.routing_text == f"system\nsys{SEP}user\nhi"
    assert req.max_tokens == 9
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}, "raw"]
    assert _parse({"model": "m", "input": items}, "/v1/responses").routing_text == f"user\na{SEP}raw"


def test_responses_instructions_alone_are_a_prefix_of_the_conversation() -> None:
    alone = _parse({"model": "m", "instructions": "sys"}, "/v1/responses").routing_text
    full = _parse({"model": "m", "instructions": "sys", "input": "hi"}, "/v1/responses").routing_text
    assert full.startswith(alone.rstrip("\n"))


def test_headers_model_rewrite_and_ids() -> None:
    headers = {
        "x-gateway-model-name-rewrite": "other",
        "x-request-id": "rid",
        "x-session-id": "s1",
        "x-gateway-inference-objective": "obj",
        "x-gateway-inference-fairness-id": "tenant",
    }
    req = _parse({"model": "m", "prompt": "p"}, headers=headers)
    assert (req.model, req.request_id, req.session_id) == ("m", "rid", "s1"), "rewrite untrusted"
    assert (req.objective, req.fairness_id) == ("obj", "tenant")
    trusted, _ = parse(b'{"model": "m", "prompt": "p"}', "/v1/completions", headers, trust_rewrite=True)
    assert trusted.model == "other"


@pytest.mark.parametrize("new_too", [False, True])
def test_llm_d_header_names_and_their_aliases(new_too: bool) -> None:
    """llm-d-router's current names (x-llm-d-*) are read as their x-gateway-* aliases are; when a
    request carries both spellings, the current name wins (pkg/epp/metadata/consts.go)."""
    new = {
        "x-llm-d-model-name-rewrite": "new-model",
        "x-llm-d-inference-objective": "new-obj",
        "x-llm-d-inference-fairness-id": "new-tenant",
    }
    old = {
        "x-gateway-model-name-rewrite": "old-model",
        "x-gateway-inference-objective": "old-obj",
        "x-gateway-inference-fairness-id": "old-tenant",
    }
    headers = {**old, **new} if new_too else new
    body = b'{"model": "m", "prompt": "p"}'
    req, _ = parse(body, "/v1/completions", headers, trust_rewrite=True)
    assert (req.model, req.objective, req.fairness_id) == ("new-model", "new-obj", "new-tenant")
    _, rewritten, _ = parse_and_rewrite(body, "/v1/completions", headers, ParseOptions(trust_rewrite=True))
    assert rewritten is not None and orjson.loads(rewritten)["model"] == "new-model"
    untrusted, _ = parse(body, "/v1/completions", headers)
    assert untrusted.model == "m", "the rewrite is read only from a trusted gateway"
    alone, _ = parse(body, "/v1/completions", old, trust_rewrite=True)
    assert (alone.model, alone.objective, alone.fairness_id) == ("old-model", "old-obj", "old-tenant")


def test_request_id_generated_when_absent() -> None:
    a, b = _parse({"model": "m", "prompt": "p"}), _parse({"model": "m", "prompt": "p"})
    assert a.request_id and b.request_id and a.request_id != b.request_id


def test_cache_salt_changes_every_hash() -> None:
    plain = _parse({"model": "m", "prompt": "x" * 1000})
    salted = _parse({"model": "m", "prompt": "x" * 1000, "cache_salt": "tenant-a"})
    other = _parse({"model": "m", "prompt": "x" * 1000, "cache_salt": "tenant-b"})
    assert plain.routing_text == salted.routing_text
    assert salted.cache_salt == "tenant-a"
    h0, h1, h2 = _hashes(plain), _hashes(salted), _hashes(other)
    assert not set(h0) & set(h1) and not set(h1) & set(h2), "salts must not share any block"


def test_lora_adapter_changes_every_hash() -> None:
    doc = {"model": "adapter-1", "prompt": "y" * 1000}
    lora = _parse(doc, lora_adapters=frozenset({"adapter-1"}))
    base = _parse(doc)
    assert (lora.lora, base.lora) == ("adapter-1", "")
    assert not set(_hashes(lora)) & set(_hashes(base))


def test_model_changes_every_hash() -> None:
    a, b = _parse({"model": "a", "prompt": "z" * 640}), _parse({"model": "b", "prompt": "z" * 640})
    assert not set(_hashes(a)) & set(_hashes(b))


def test_shared_chat_history_is_a_shared_text_prefix() -> None:
    history = [
        {"role": "system", "content": "You are a helpful assistant. " * 20},
        {"role": "user", "content": "first question " * 10},
        {"role": "assistant", "content": [{"type": "text", "text": "first answer " * 10}]},
    ]
    short = _parse({"model": "m", "messages": history})
    longer = _parse({"model": "m", "messages": [*history, {"role": "user", "content": "follow-up"}]})
    assert longer.routing_text.startswith(short.routing_text)
    hs, hl = _hashes(short), _hashes(longer)
    full = len(short.routing_text.encode()) // HashConfig().block_size
    assert full > 5 and hs[:full] == hl[:full], "full blocks of the shared history share hashes"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "m", "prompt": "\xff\xfe"}', "not valid JSON"),
        (b'["model", "m"]', "must be a JSON object"),
        (b'"just a string"', "must be a JSON object"),
        (b'{"prompt": "p"}', "no 'model'"),
        (b'{"model": "", "prompt": "p"}', "no 'model'"),
        (b'{"model": 7, "prompt": "p"}', "no 'model'"),
        (b'{"model": "m", "x": ' + b"[" * MAX_NESTING + b"]" * MAX_NESTING + b"}", "nested deeper than 64"),
        (b"[" * 5000 + b"]" * 5000, "not valid JSON"),
        (b'{"model": "m", "prompt": {"a": 1}}', "'prompt' must be"),
        (b'{"model": "m", "messages": "hi"}', "'messages' must be a list"),
        (b'{"model": "m", "messages": ["hi"]}', "each message must be an object"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "'content' must be"),
        (b'{"model": "m", "input": 5}', "'input' must be"),
    ],
)
def test_bad_input_raises_bad_request(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        parse(body, "/v1/completions", {})
    assert info.value.status == 400


def test_nesting_at_the_limit_is_accepted() -> None:
    depth = MAX_NESTING - 1  # plus the top-level object
    body = b'{"model": "m", "x": ' + b"[" * depth + b"]" * depth + b"}"
    req, doc = parse(body, "/v1/completions", {})
    assert req.model == "m" and "x" in doc


def _image_doc(data: bytes, text: str = "what is this?") -> dict[str, object]:
    import base64

    url = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


def test_media_counts_its_configured_cost_and_hashes_by_content() -> None:
    from picker.core.request import MEDIA_MARK, ParseOptions

    big = bytes(range(256)) * 4096  # 1 MiB of image, 1.4 MB of base64
    opts = ParseOptions(media_tokens={"image": 700})
    a, _ = parse(orjson.dumps(_image_doc(big)), "/v1/chat/completions", {}, opts=opts)
    b, _ = parse(orjson.dumps(_image_doc(big, "and this?")), "/v1/chat/completions", {}, opts=opts)
    c, _ = parse(orjson.dumps(_image_doc(big[::-1])), "/v1/chat/completions", {}, opts=opts)
    assert a.media_tokens == 700 and len(a.routing_text) < 100, "the base64 is not routing text"
    assert MEDIA_MARK + "image:" in a.routing_text
    marker = a.routing_text.split(MEDIA_MARK)[1]
    assert marker in b.routing_text and marker not in c.routing_text, "digest of the content"
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    d = _parse({"model": "m", "messages": [{"role": "user", "content": [audio]}]})
    assert d.media_tokens == 512 and MEDIA_MARK + "audio:" in d.routing_text


def test_routing_text_stops_at_what_is_hashed_and_counts_the_rest() -> None:
    from picker.core.request import ParseOptions

    opts = ParseOptions(max_text_chars=1000)
    doc = {
        "model": "m",
        "messages": [{"role": "user", "content": "x" * 5000}, {"role": "user", "content": "y"}],
    }
    req, _ = parse(orjson.dumps(doc), "/v1/chat/completions", {}, opts=opts)
    assert len(req.routing_text) == 1000 and req.prompt_chars == len(_parse(doc).routing_text)
    ids = list(range(100, 10_100))
    req, _ = parse(orjson.dumps({"model": "m", "prompt": ids}), "/v1/completions", {}, opts=opts)
    assert req.prompt_token_count == 10_000 and req.prompt_token_ids is not None
    assert len(req.prompt_token_ids) < 600 and len(req.routing_text) >= 1000
    assert _parse({"model": "m", "prompt": ids}).routing_text.startswith(req.routing_text)
