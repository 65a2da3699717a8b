"""Token-exact request hashing: our tokenizer + chat template against HF ``transformers`` (the
renderer vLLM calls), and the prefix tokenization cache against tokenizing whole texts."""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any

import pytest
from tokenizers import Tokenizer

from picker.core.tokenize import load
from picker.core.tokenize.apis import Unrenderable
from picker.core.tokenize.chat import ChatTemplate
from replica.tinymodel import _corpus
from tests.support.tokenizer import STRING_TEMPLATE, tokenizer_dir

pytestmark = pytest.mark.precise

# A Llama-3-like template: tools as JSON, content parts iterated ("openai" format), a system default.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}:"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% elif m['content'] %}{% for part in m['content'] %} {{ part['text'] }}{% endfor %}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %} call {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tokenizer_dir(tmp_path_factory.mktemp("tok"), TEMPLATE, add_bos=True)


MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You route prompt blocks to the replica with the cache."},
    {"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
    },
    {"role": "tool", "content": "ok ünïcode ✓", "tool_call_id": "1"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def hf_reference(tok_dir: pathlib.Path, template: str, doc: dict[str, Any]) -> list[int]:
    """What vLLM computes: HF apply_chat_template (its renderer) with vLLM's message shapes."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    msgs = json.loads(json.dumps(doc["messages"]))
    openai = "for part in m['content']" in template
    for m in msgs:
        if m.get("content") is None:  # vLLM: no parts
            m["content"] = [] if openai else ""
        if isinstance(m.get("content"), list):
            texts = [p["text"] for p in m["content"]]
            m["content"] = [{"type": "text", "text": t} for t in texts] if openai else "\n".join(texts)
        elif isinstance(m.get("content"), str) and openai:
            m["content"] = [{"type": "text", "text": m["content"]}]
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    tools = [  # vLLM's ChatCompletionToolsParam.model_dump()
        {
            "type": "function",
            "function": {k: t["function"].get(k) for k in ("name", "description", "parameters")},
        }
        for t in doc.get("tools") or []
    ] or None
    text = hf.apply_chat_template(
        msgs, tools=tools, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert isinstance(ids, list)
    return ids


def test_chat_matches_hf_apply_chat_template(tok_dir: pathlib.Path) -> None:
    ours = load(str(tok_dir))
    doc = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    assert ours.chat is not None and ours.chat.openai_format
    got = ours.encode(doc, "/v1/chat/completions")
    assert got == hf_reference(tok_dir, TEMPLATE, doc)
    assert got is not None and got[0] == 0, "the template's own bos_token, no second one"


def test_string_format_template_joins_parts(tok_dir: pathlib.Path) -> None:
    chat = ChatTemplate(STRING_TEMPLATE, {"bos_token": "<s>"})
    assert not chat.openai_format
    doc = {"model": "m", "messages": MESSAGES[:2]}
    text = chat.render(doc)
    assert "first part\nsecond" in text
    ours = load(str(tok_dir))
    ours.chat = chat
    assert ours.encode(doc, "/v1/chat/completions") == hf_reference(tok_dir, STRING_TEMPLATE, doc)


def test_completions_add_the_post_processor_specials(tok_dir: pathlib.Path) -> None:
    ours = load(str(tok_dir))
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    text = "the cache12 router7 prefix3"
    assert ours.encode({"prompt": text}, "/v1/completions") == raw.encode(text).ids
    assert (
        ours.encode({"prompt": text, "add_special_tokens": False}, "/v1/completions")
        == raw.encode(text, add_special_tokens=False).ids
    )
    assert ours.encode({"prompt": [1, 2]}, "/v1/completions") is None, "ids need no tokenizer"


def test_unrenderable_requests_fall_back(tok_dir: pathlib.Path) -> None:
    ours = load(str(tok_dir))
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
    assert ours.encode({"messages": [image]}, "/v1/chat/completions") is None
    boom = ChatTemplate("{{ raise_exception('no') }}", {})
    with pytest.raises(Unrenderable):
        boom.render({"messages": []})
    with pytest.raises(Unrenderable):
        ChatTemplate(TEMPLATE, {}).render({"messages": [], "chat_template_kwargs": [1]})


def test_prefix_cache_is_exact(tok_dir: pathlib.Path) -> None:
    """Texts sharing long prefixes (and diverging anywhere: mid-word, in runs of spaces, in
    multi-byte characters) tokenize through the cache exactly as whole."""
    ours = load(str(tok_dir))
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    rng = random.Random(7)
    base = " ".join(_corpus(300, seed=3))
    assert ours.cache is not None
    for i in range(30):
        cut = rng.randrange(2500, len(base))
        tail = rng.choice(["  spaced  out ", "ünï ✓ code", "x", " the cache", "\n\nnew para", "12345"])
        text = base[:cut] + tail + " ".join(_corpus(3, seed=i))
        assert list(ours.encode({"prompt": text}, "/v1/completions") or ()) == raw.encode(text).ids, i
    assert ours.cache.hits >= 25, "the shared prefix was reused"


def test_try_encode_never_waits_for_another_encode(tok_dir: pathlib.Path) -> None:
    """The event loop's call: refused while a thread holds the tokenizer, else the same ids."""
    ours = load(str(tok_dir))
    doc = {"prompt": "the cache holds the prefix"}
    with ours._lock:
        assert ours.try_encode(doc, "/v1/completions") == (False, None)
    assert ours.try_encode(doc, "/v1/completions") == (True, ours.encode(doc, "/v1/completions"))


@pytest.mark.parametrize(("inline_bytes", "where"), [(0, "thread"), (4096, "loop")])
async def test_ext_proc_tokenizes_short_bodies_on_the_loop(
    tok_dir: pathlib.Path, inline_bytes: int, where: str
) -> None:
    """Through the ext_proc service: a chat body is tokenized (on the event loop when shorter
    than ``tokenize_inline_bytes``, else in a worker thread) and routed on its KV-block keys; the
    pick leaves a speculative entry keyed by exactly those tokens."""
    import asyncio

    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from picker.core.config import PrefixConfig, RouterConfig
    from picker.core.endpoints.pool import Pool
    from picker.core.endpoints.types import Endpoint
    from picker.core.prefix.precise import State, Sync, request_keys
    from picker.core.router import Router
    from tests.support import picking

    pool = Pool()
    pool.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)])
    prefix = PrefixConfig(
        mode="precise", block_size=16, tokenizer=str(tok_dir), tokenize_inline_bytes=inline_bytes
    )
    cfg = RouterConfig(prefix=prefix)
    router = Router(cfg, pool)
    for s in pool:
        router.syncs[s.key] = Sync(State.SYNCED, expected=0)
    doc = {"model": "m", "messages": MESSAGES[:2]}
    hs = [
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
    ]
    msgs = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(doc).encode(), end_of_stream=True)),
    ]

    async def stream() -> Any:
        for m in msgs:
            yield m

    import threading

    calls: list[tuple[str, str]] = []
    svc = picking.service(router)
    local = svc.director.tokenization.local
    assert local is not None, "a local tokenizer is configured"
    encode, encode_now = local.encode, local.try_encode

    def spy(*a: Any) -> Any:
        calls.append(("thread", threading.current_thread().name))
        return encode(*a)

    def spy_now(*a: Any) -> Any:
        calls.append(("loop", threading.current_thread().name))
        return encode_now(*a)

    local.encode = spy  # type: ignore[method-assign]
    local.try_encode = spy_now  # type: ignore[method-assign]
    out = await svc.answers(stream())
    # the first call tokenizes, where the body's size says
    assert out and calls and calls[0][0] == where, calls
    assert (calls[0][1] == "MainThread") == (where == "loop"), calls
    chosen = next(
        h.header.raw_value.decode()
        for r in out
        if r.HasField("request_headers")
        for h in r.request_headers.response.header_mutation.set_headers
        if h.header.key == "x-gateway-destination-endpoint"
    )
    ids = load(str(tok_dir)).encode(doc, "/v1/chat/completions")
    assert ids is not None
    keys = request_keys(ids, 16)
    assert keys and router.precise is not None
    assert router.precise.match_many([chosen], keys, 0.0)[chosen] == len(keys), (
        "speculative entry = our tokens"
    )
    await asyncio.sleep(0)
