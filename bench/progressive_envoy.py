"""``python -m bench.progressive_envoy``: issue 24's run through Envoy. The picker's CPU per
request on long chat prompts, in precise mode, behind a real Envoy, in front of ``--endpoints``
fake model servers served by one process (``kvlaunch.upstream --fixed``), for
:mod:`bench.progressive`'s workloads (same tokenizer, same bodies):

- ``cold``: each request a different ~``--tokens``-token document;
- ``conversation``: one ~``--tokens``-token conversation, each request adding a ~500-token turn;
- ``document``: one ~``--tokens``-token document, each request a different short question.

Requests go through Envoy at a steady rate (one every ``--interval`` seconds, open loop). The
fake servers publish no KV events: every endpoint stays WAITING, which precise mode routes from
the picker's own speculative entries (``prefix.speculative_ttl_s`` is set to 600 s, so that the
shared part stays held over the run). The shared part of ``conversation`` and ``document`` is
sent twice before the measured requests (not measured).

CPU is the picker process's threads' run time from ``/proc/<pid>/task/*/schedstat``, its child
processes' included (the body-parse worker that bodies of ``parse_offload_bytes`` or more go to), over the
window from the first request sent to ``--tail`` seconds after the last answer (the work a pick
leaves to the parse worker, such as a cold prompt's rest, counts), divided by the requests
answered 200. The picker scrapes every endpoint's ``/metrics`` meanwhile (``scrape.interval_s``
``--scrape-interval``, 1 s by default: 100 scrapes/s); its idle CPU rate, measured over ``--idle``
seconds before each window, is reported beside, and the net figure subtracts it over the window.
A longer scrape interval makes that idle rate, and the noise its subtraction adds, smaller. The endpoint that
served each request comes from Envoy's access log (``x-request-id`` kept): a conversation's
turns and a document's questions should all land on one endpoint.

``--compare ROOT`` runs the picker of another tree (e.g. ``git archive`` of main) with the same
Envoy, upstreams and bodies, its picker started with ``PYTHONPATH=ROOT``; ``--repeats`` times,
interleaved (this, compare, this, ...), a fresh picker per workload and run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import aiohttp

from bench.progressive import BS, CHAT, body_of, cpu_s, tokenizer_dir, workload_docs
from kvlaunch.procs import Procs, free_port
from kvlaunch.stack import Stack

WORKLOADS = ("cold", "conversation", "document")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def picker_config(path: pathlib.Path, tok: pathlib.Path, kv_port: int, scrape_s: float = 1.0) -> pathlib.Path:
    """The picker's YAML: precise mode with the bench's tokenizer, long speculative entries, a
    scrape every ``scrape_s`` seconds (fields the older tree knows too)."""
    doc = {
        "policy": "cost",
        "scrape": {"interval_s": scrape_s, "timeout_s": 1.0, "stale_after_s": 5.0 * scrape_s},
        "prefix": {
            "mode": "precise",
            "block_size": BS,
            "tokenizer": str(tok),
            "speculative_ttl_s": 600.0,
            "kv_events_port": kv_port,
        },
    }
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


async def send(
    http: aiohttp.ClientSession, url: str, bodies: list[bytes], ids: list[str], interval: float
) -> list[int]:
    """Post ``bodies`` one every ``interval`` seconds (open loop); their statuses."""

    async def post(i: int) -> int:
        await asyncio.sleep(i * interval)
        headers = {"content-type": "application/json", "x-request-id": ids[i]}
        try:
            async with http.post(url, data=bodies[i], headers=headers) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    return await asyncio.gather(*(post(i) for i in range(len(bodies))))


def routed(log: pathlib.Path, ids: list[str]) -> list[str]:
    """The upstream that served each of ``ids``, from Envoy's JSON access log ("" where none)."""
    seen: dict[str, str] = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        seen[rec.get("id", "")] = rec.get("upstream") or ""
    return [seen.get(i, "") for i in ids]


def stop_picker(st: Stack) -> None:
    """Stop the picker and forget it (:meth:`Procs.check` would take its exit for a crash)."""
    st.procs.stop("picker")
    st.procs.procs = [(n, p) for n, p in st.procs.procs if n != "picker"]


def run_one(
    st: Stack,
    cfg: pathlib.Path,
    tok: pathlib.Path,
    root: str,
    name: str,
    tag: str,
    warm: list[bytes],
    bodies: list[bytes],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """A fresh picker from ``root`` (this tree: ``""``), the warm-up, an idle window, then the
    measured requests of workload ``name``."""
    env = {"PYTHONPATH": root, "PYTHONSAFEPATH": "1"} if root else None
    proc = st.start_picker(
        "--config-file", str(cfg), "--prefix-mode", "precise", "--tokenizer", str(tok), env=env, debug=False
    )
    try:
        st.wait_routable({"model": "m", "messages": [{"role": "user", "content": "warm up"}]}, path=CHAT)
        url = st.url + CHAT

        async def go() -> tuple[list[int], float, float, float]:
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                for w, body in enumerate(warm):
                    await send(http, url, [body], [f"{tag}-warm{w}"], 0)
                await asyncio.sleep(0.5)  # the warm-up's work in the parse worker
                i0, t_idle = cpu_s(proc.pid, children=True), time.monotonic()
                await asyncio.sleep(args.idle)
                i1, t0 = cpu_s(proc.pid, children=True), time.monotonic()
                ids = [f"{tag}-{i}" for i in range(len(bodies))]
                statuses = await send(http, url, bodies, ids, args.interval)
                await asyncio.sleep(args.tail)
                c1, t1 = cpu_s(proc.pid, children=True), time.monotonic()
            return statuses, (i1 - i0) / (t0 - t_idle), c1 - i1, t1 - t0

        statuses, idle_rate, cpu, seconds = asyncio.run(go())
    finally:
        stop_picker(st)
    ok = sum(s == 200 for s in statuses)
    time.sleep(0.5)  # Envoy's access log is flushed every 250 ms
    where = routed(st.procs.run_dir / "access.log", [f"{tag}-{i}" for i in range(len(bodies))])
    per = cpu * 1000 / max(ok, 1)
    return {
        "cpu_ms": per,
        "net_ms": (cpu - idle_rate * seconds) * 1000 / max(ok, 1),
        "idle_cores": idle_rate,
        "ok": ok,
        "sent": len(bodies),
        "endpoints": len(Counter(w for w in where if w)),
        "top_share": max(Counter(where).values()) / len(where) if where else 0.0,
    }


def fmt(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.progressive_envoy", description=__doc__)
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--endpoints", type=int, default=100)
    p.add_argument("--requests", type=int, default=12, help="measured requests per workload and run")
    p.add_argument("--interval", type=float, default=0.4, help="seconds between requests")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of idle CPU measured before each window")
    p.add_argument("--tail", type=float, default=1.0, help="seconds after the last answer counted")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--scrape-interval", type=float, default=1.0, help="the picker's scrape.interval_s, seconds"
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--compare", default="", help="another tree's root, its picker run side by side")
    p.add_argument("--tmp", default=str(pathlib.Path(tempfile.gettempdir()) / "kvpick-bench-progressive"))
    args = p.parse_args(argv)
    tok = tokenizer_dir(pathlib.Path(args.tmp))
    names = args.workloads.split(",")
    payloads: dict[str, tuple[list[bytes], list[bytes]]] = {}
    for name in names:
        warm, docs = workload_docs(name, args.tokens, args.requests)
        payloads[name] = ([body_of(d) for d in warm], [body_of(d) for d in docs])
    roots = {"this": "", **({"compare": str(pathlib.Path(args.compare).resolve())} if args.compare else {})}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvpick-bench-penvoy-") as tmp:
        procs = Procs(pathlib.Path(tmp))
        st = Stack(procs, [free_port() for _ in range(args.endpoints)])
        cfg = picker_config(pathlib.Path(tmp) / "picker.yaml", tok, free_port(), args.scrape_interval)
        try:
            st.start_upstreams("--fixed")
            st.start_picker("--config-file", str(cfg), "--tokenizer", str(tok), debug=False)
            st.start_envoy(
                "--upstream",
                "pool",
                "--endpoints",
                ",".join(st.addresses),
                "--access-log",
                str(pathlib.Path(tmp) / "access.log"),
                "--preserve-request-id",
            )
            stop_picker(st)
            for rep in range(args.repeats):
                for name in names:
                    for label, root in roots.items():  # interleaved: this, compare, this, ...
                        first, bodies = payloads[name]
                        res = run_one(st, cfg, tok, root, name, f"{label}-{rep}-{name}", first, bodies, args)
                        results.setdefault((name, label), []).append(res)
                        print(f"repeat {rep + 1} {name} {label}: {res}", file=sys.stderr, flush=True)
        finally:
            procs.stop()
    print(
        f"\n{args.tokens}-token prompts, {args.endpoints} endpoints, {args.requests} chat requests per run "
        f"every {args.interval} s, {args.repeats} interleaved repeats, {time.monotonic() - t_start:.0f} s in all; "
        "picker CPU ms per request answered 200, median [min-max]\n"
    )
    head = " | ".join(f"{lb} CPU ms | {lb} net of idle | {lb} idle cores" for lb in roots)
    print(f"| workload | {head} | 200s | endpoints used per run |")
    print("|---|" + "---|---|---|" * len(roots) + "---|---|")
    for name in names:
        cells, oks, used = [], [], []
        for label in roots:
            rs = results[name, label]
            cells.append(
                f"{fmt([r['cpu_ms'] for r in rs])} | {fmt([r['net_ms'] for r in rs])} | "
                f"{fmt([r['idle_cores'] for r in rs], 2)}"
            )
            oks.append(f"{label} {sum(r['ok'] for r in rs)}/{sum(r['sent'] for r in rs)}")
            used.append(f"{label} {sorted({r['endpoints'] for r in rs})}")
        print(f"| {name} | " + " | ".join(cells) + f" | {'; '.join(oks)} | {'; '.join(used)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
