"""``python -m bench.progressive``: the picker's CPU per request on long prompts, tokenization
included, in process (``Director.prepare`` + ``pick`` + ``finish`` on the real router, precise
index and tokenizer; ``--endpoints`` endpoints, every one precise), for four workloads:

- ``cold``: chat requests, each a different ~``--tokens``-token document (no shared prefix);
- ``conversation``: one ~``--tokens``-token conversation, each request adding a ~500-token turn;
- ``document``: one ~``--tokens``-token document, each request a different short question;
- ``siblings``: a burst of 16 concurrent requests sharing a cold ~``--tokens``-token document
  (reports on how many endpoints they land).

After each pick the chosen endpoint is told it holds the whole prompt, as its vLLM's KV events
(``BlockStored``) would say after the prefill (a long-lived entry in the precise index; the ids
for it are computed outside the measured window). CPU is the process's run time, all its threads
(``time.process_time()``: a running thread's ``/proc`` schedstat lags by up to a slice, see
:func:`cpu_s`), over each workload's requests, divided by their number; peak
memory is the process's ``VmHWM`` from ``/proc/self/status`` (the whole-prompt tokenizations that
stand in for the events count in it, alike for both sides). The estimate error is
that of the prompt length a progressive tokenization reports against the whole prompt's tokens.

``--compare ROOT`` runs each workload with the code under ROOT too (e.g. a checkout of main: the
whole-prompt tokenization), in interleaved subprocesses, ``--repeats`` times each, and prints a
side-by-side table of medians with their spread.

The tokenizer is a byte-level BPE trained here (the test model's kind, vocabulary 2048); a real
model's tokenizer (128k vocabulary) costs more per token, which favours tokenizing less.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

WORDS = ["the", "cache", "prefix", "token", "router", "replica", "model", "request", "system", "prompt"]
CHAT = "/v1/chat/completions"
BS = 16
WORKLOADS = ("cold", "conversation", "document", "siblings")


def corpus(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of word salad for the tokenizer trained here."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(tokens // 2))


def tokenizer_dir(root: pathlib.Path) -> pathlib.Path:
    """The bench's tokenizer under ``root/bpe``, trained on this module's word salad (kept)."""
    out = root / "bpe"
    if (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    return write_bpe(out, [corpus(200, s) for s in range(3000)])


def write_bpe(out: pathlib.Path, texts: list[str]) -> pathlib.Path:
    """A byte-level BPE of 2,048 ids trained on ``texts`` (the test model's kind: ``<s>``/``</s>``
    specials, a one-line-per-message chat template), written as a model directory ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (out / "chat_template.jinja").write_text(
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return out


def cpu_s(pid: int | str = "self", children: bool = False) -> float:
    """CPU seconds of process ``pid``'s live threads (this process by default), from
    ``/proc/PID/task/*/schedstat`` (nanoseconds; ``/proc/PID/stat`` counts 10 ms ticks).
    ``children``: plus those of its live child processes, and theirs (the picker's body-parse
    worker, :mod:`picker.serving.offload`, is one).

    This process's own: ``time.process_time()`` (``CLOCK_PROCESS_CPUTIME_ID``, the same kernel
    accounting, every thread). A thread's ``schedstat`` leaves out the run time of the slice it is
    in, so the thread reading it, still running, reads a figure up to a slice old: 3 ms of busy
    loop read as 0.03-4.0 ms (the run before a measured window, here the stand-in for the KV
    events, leaked into it; bench/results/2026-11-28-parity.md)."""
    if pid == "self":
        own = time.process_time()
        return own + sum(cpu_s(c, children=True) for c in _children(pid)) if children else own
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    seconds = total / 1e9
    if children:
        seconds += sum(cpu_s(child, children=True) for child in _children(pid))
    return seconds


def _children(pid: int | str) -> list[int]:
    """The live processes whose parent is ``pid``."""
    parent = os.getpid() if pid == "self" else int(pid)
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == parent:
                out.append(int(entry))
    return out


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def build(tok: pathlib.Path, endpoints: int) -> Any:
    """A director over ``endpoints`` precise endpoints (fields this code's PrefixConfig lacks are
    left out, so that an older checkout runs too)."""
    from picker.core.config import PrefixConfig, RouterConfig
    from picker.core.endpoints.pool import Pool
    from picker.core.endpoints.types import Endpoint
    from picker.core.prefix.precise import State, Sync
    from picker.core.router import Router
    from picker.serving.director import Director
    from picker.serving.tokenization import Tokenization

    names = {f.name for f in dataclasses.fields(PrefixConfig)}
    want: dict[str, Any] = {
        "mode": "precise",
        "block_size": BS,
        "tokenizer": str(tok),
        "tokenize_inline_bytes": 0,
    }
    prefix = PrefixConfig(**{k: v for k, v in want.items() if k in names})
    pool = Pool()
    pool.set_endpoints([Endpoint(f"10.0.{i // 250}.{i % 250 + 1}", 8000) for i in range(endpoints)])
    router = Router(RouterConfig(policy="cost", prefix=prefix), pool)
    for s in pool:
        router.syncs[s.key] = Sync(State.SYNCED, expected=0)
    return Director(router, Tokenization.from_config(router, prefix), None, None)


def body_of(doc: dict[str, Any]) -> bytes:
    """The request body as the client sends it (made outside the measured window: the
    client's work, not the picker's)."""
    return json.dumps({"model": "m", **doc}).encode()


async def one(d: Any, body: bytes, rid: str) -> tuple[str, Any]:
    parsed = await d.prepare([body], len(body), {":path": CHAT, "x-request-id": rid})
    pick, _ = d.pick(parsed)
    d.finish(pick, "ok")
    return pick.chosen[0], parsed[0]


def held(d: Any, key: str, doc: dict[str, Any]) -> int:
    """The engine's events: ``key`` holds the whole prompt (outside the measured window)."""
    from picker.core.prefix.precise import request_keys

    local = d.tokenization.local
    text = local.chat.render({"model": "m", **doc})
    ids = local.tok.encode(text, add_special_tokens=False).ids
    d.router.precise.speculate(key, request_keys(ids, BS), d.router.clock() + 3600)
    return len(ids)


def workload_docs(name: str, tokens: int, requests: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(warm-up requests, measured requests) of workload ``name`` (``cold``, ``conversation`` or
    ``document``), as chat documents. The warm-up sends the shared part twice (a progressive
    tokenization reads a cold prompt's ids once it is held); the conversation's turns carry the
    earlier turns' answers."""
    rng = random.Random(1)
    history: list[dict[str, str]] = [{"role": "system", "content": corpus(tokens, 7)}]
    warm = [{"messages": list(history)}] * 2 if name in ("conversation", "document") else []
    docs: list[dict[str, Any]] = []
    for i in range(requests):
        if name == "cold":
            doc = {"messages": [{"role": "user", "content": corpus(tokens, 1000 + i)}]}
        elif name == "conversation":
            history.append({"role": "user", "content": corpus(500, 2000 + i)})
            doc = {"messages": list(history)}
            history.append({"role": "assistant", "content": f"answer {rng.randrange(1000)}"})
        else:
            doc = {
                "messages": [*history, {"role": "user", "content": f"Question {i}: {corpus(40, 3000 + i)}?"}]
            }
        docs.append(doc)
    return warm, docs


async def workload(
    name: str, tok: pathlib.Path, endpoints: int, tokens: int, requests: int
) -> dict[str, Any]:
    d = build(tok, endpoints)
    cpu = 0.0
    errors: list[float] = []
    landed: Counter[str] = Counter()
    ids_held: list[int] = []
    if name == "siblings":
        shared = corpus(tokens, 99)
        docs = [
            {
                "messages": [
                    {"role": "system", "content": shared},
                    {"role": "user", "content": f"question {i}?"},
                ]
            }
            for i in range(16)
        ]
        bodies = [body_of(doc) for doc in docs]
        c0 = cpu_s()
        picks = await asyncio.gather(*(one(d, body, f"s{i}") for i, body in enumerate(bodies)))
        cpu = cpu_s() - c0
        landed.update(k for k, _ in picks)
        ids_held = [len(r.prompt_token_ids) for _, r in picks]
        return {
            "cpu_ms": cpu * 1000 / 16,
            "landed": len(landed),
            "peak_mib": peak_mib(),
            "ids": max(ids_held),
        }
    warm, docs = workload_docs(name, tokens, requests)
    for w, doc in enumerate(warm):  # steady state: the shared part held, its ids cached
        key, _ = await one(d, body_of(doc), f"warm{w}")
        held(d, key, doc)
    for i, doc in enumerate(docs):
        body = body_of(doc)
        c0 = cpu_s()
        key, req = await one(d, body, f"r{i}")
        cpu += cpu_s() - c0
        whole = held(d, key, doc)
        est = getattr(req, "prompt_token_estimate", 0)
        if est:
            errors.append((est - whole) / whole)
        ids_held.append(len(req.prompt_token_ids))
    return {
        "cpu_ms": cpu * 1000 / requests,
        "peak_mib": peak_mib(),
        "ids": max(ids_held),
        "estimate_error": max((abs(e) for e in errors), default=None),
        "estimate_bias": statistics.mean(errors) if errors else None,
    }


def run_child(root: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    script = str(pathlib.Path(__file__).resolve())
    run = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    cmd = [  # run from ROOT, so that its picker package is the one imported
        sys.executable,
        "-c",
        run,
        script,
        "--child",
        name,
        "--tokens",
        str(args.tokens if name != "big" else args.big_tokens),
        "--endpoints",
        str(args.endpoints if name != "big" else 96),
        "--requests",
        str(args.requests),
        "--tmp",
        args.tmp,
    ]
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=root)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.progressive", description=__doc__)
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--big-tokens", type=int, default=240_000, help="the 240k case (96 endpoints)")
    p.add_argument("--endpoints", type=int, default=100)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workloads", default=",".join((*WORKLOADS, "big")))
    p.add_argument("--compare", default="", help="another checkout's root, run side by side")
    p.add_argument("--tmp", default=str(pathlib.Path(tempfile.gettempdir()) / "kvpick-bench-progressive"))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tok = tokenizer_dir(pathlib.Path(args.tmp))
    if args.child:
        name = "document" if args.child == "big" else args.child
        res = asyncio.run(workload(name, tok, args.endpoints, args.tokens, args.requests))
        print(json.dumps(res))
        return 0
    here = str(pathlib.Path(__file__).resolve().parents[1])
    roots = {"this": here, **({"compare": args.compare} if args.compare else {})}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        for name in args.workloads.split(","):
            for label, root in roots.items():  # interleaved: this, compare, this, compare, ...
                results.setdefault((name, label), []).append(run_child(root, name, args))
                print(
                    f"repeat {rep + 1} {name} {label}: {results[name, label][-1]}",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"\n{args.tokens}-token prompts ({args.big_tokens} for big), {args.endpoints} endpoints (96 for big), "
        f"{args.requests} requests per run, {args.repeats} interleaved repeats; CPU ms per request, median [min-max]\n"
    )
    print(
        "| workload | " + " | ".join(f"{label} CPU ms | {label} peak MiB" for label in roots) + " | notes |"
    )
    print("|---|" + "---|---|" * len(roots) + "---|")
    for name in args.workloads.split(","):
        cells = []
        notes = []
        for label in roots:
            rs = results[name, label]
            cpu = [r["cpu_ms"] for r in rs]
            peak = [r["peak_mib"] for r in rs]
            cells.append(
                f"{statistics.median(cpu):.1f} [{min(cpu):.1f}-{max(cpu):.1f}] | {statistics.median(peak):.0f}"
            )
            if "landed" in rs[0]:
                notes.append(f"{label}: landed on {sorted({r['landed'] for r in rs})} endpoints")
            err = [r["estimate_error"] for r in rs if r.get("estimate_error") is not None]
            if err:
                notes.append(f"{label}: estimate error ≤ {max(err) * 100:.1f}%")
            notes.append(f"{label}: ≤ {max(r['ids'] for r in rs)} ids held")
        print(f"| {name} | " + " | ".join(cells) + " | " + "; ".join(notes) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
