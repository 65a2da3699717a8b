"""Where each request's time to first token goes, per request, joined on its ``x-request-id``
(``bench.real --split``; issue 12).

Four records of one request, all on this host's wall clock (``time.time()``):

- the client's (:class:`bench.loadgen.Outcome`): when it was sent, its TTFT;
- Envoy's access log (``deploy/envoy/render.py --access-log``, kvpick only): when the first byte
  arrived, when the request went to the model server, the ext_proc filter's own timings of the
  picker's two calls (request headers, request body);
- vLLM's own ``llm_request`` span, exported over OTLP (``--otlp-traces-endpoint``) to
  :class:`bench.otlp.TraceSink`: its arrival (the frontend's ``arrival_time``, after its HTTP handling and
  tokenization), and its own TTFT, queue and prefill time;
- nothing from the peers' routers: they are the time between the client and vLLM.

:func:`segments` cuts each request's client TTFT into consecutive pieces that add up to it:

- ``to_envoy``: client send → Envoy's first byte (kvpick);
- ``envoy_picker``: Envoy's first byte → request sent to the model server (Envoy, ext_proc, the
  picker), of which ``ext_proc_calls``: the ext_proc calls' round trips as Envoy timed them;
- ``router``: client send → request sent by the router (sglang-router: the send time is not
  logged, so this is 0 and its time is inside ``api_server``);
- ``api_server``: request sent to the model server → vLLM's arrival (its HTTP handling,
  validation, tokenization);
- ``engine``: vLLM's own TTFT (arrival → first token in its frontend);
- ``back``: vLLM's first token → the client's (detokenizing, SSE, the proxy's way back, the
  client's event loop).

:func:`schedstat` reads the run-queue wait (``/proc/PID/task/TID/schedstat``, the time a thread
was runnable but not running) of every process in the given process groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .loadgen import Outcome

if TYPE_CHECKING:
    from .otlp import TraceSink

ENV = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
"""vLLM's span exporter batches for 5 s by default; 200 ms gets a window's spans sooner."""


@dataclass
class Span:
    """vLLM's own timings of one request (its ``llm_request`` span)."""

    arrival: float
    """vLLM's ``arrival_time`` (Unix seconds)."""
    ttft: float = 0.0
    queue: float = 0.0
    prefill: float = 0.0
    process: int = 0
    """The pid of the vLLM process that sent the span (its resource's ``vllm.process_id``: the API
    server's), which says which replica served the request; 0 when unknown."""


@contextlib.contextmanager
def trace_sink() -> Iterator[TraceSink]:
    """A started :class:`bench.otlp.TraceSink` (imported here: it needs ``opentelemetry-proto``,
    which comes with vLLM), stopped after."""
    from .otlp import TraceSink

    sink = TraceSink()
    sink.start()
    try:
        yield sink
    finally:
        sink.stop()


def access_log(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Envoy's access log (``render.py --access-log``) by request id; absent file: empty."""
    out: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        doc = json.loads(line)
        out[str(doc["id"])] = doc
    return out


def _us(doc: dict[str, Any], key: str) -> float:
    v = doc.get(key)
    return float(v) / 1e6 if v not in (None, "", "-") else 0.0


def _ext_proc_calls(envoy: dict[str, Any]) -> float:
    """The wall time of a request's ext_proc calls, as Envoy timed them: the headers' call and
    the body's, one after the other (BUFFERED: one body call); where Envoy sent the body without
    waiting for the headers' answer (streamed bodies: several body calls, or a size twin's route
    in the log's ``route``) the body's calls run inside the headers' call, which the
    picker answers once the body is in: that call alone. (Envoy drops the content-length of a
    streamed body, so after the pick such a request matches the ``:streamed`` twin.)"""
    header = _us(envoy, "ext_proc_request_header_latency_us")
    twin = str(envoy.get("route", "")).endswith(":streamed")
    calls = envoy.get("ext_proc_request_body_call_count")
    if twin or (calls not in (None, "", "-") and int(calls) >= 2):
        return header
    return header + _us(envoy, "ext_proc_request_body_total_latency_us")


def segments(o: Outcome, span: Span | None, envoy: dict[str, Any] | None) -> dict[str, float] | None:
    """``o``'s client TTFT cut into the module doc's pieces (seconds); None without vLLM's span."""
    if not o.ok or span is None:
        return None
    first = o.sent_wall + o.ttft
    engine_first = span.arrival + span.ttft
    seg = {"client_ttft": o.ttft, "engine": span.ttft, "queue": span.queue, "back": first - engine_first}
    if envoy is not None:
        start = float(envoy["start"])
        upstream = start + _us(envoy, "upstream_tx_us")
        seg["to_envoy"] = start - o.sent_wall
        seg["envoy_picker"] = upstream - start
        seg["ext_proc_calls"] = _ext_proc_calls(envoy)
        seg["api_server"] = span.arrival - upstream
    else:
        seg["to_envoy"] = seg["envoy_picker"] = seg["ext_proc_calls"] = 0.0
        seg["api_server"] = span.arrival - o.sent_wall
    seg["before_engine"] = span.arrival - o.sent_wall
    return seg


PIECES = (
    "client_ttft",
    "before_engine",
    "to_envoy",
    "envoy_picker",
    "ext_proc_calls",
    "api_server",
    "engine",
    "queue",
    "back",
)
""":func:`segments`' keys, in table order."""


def summarize(segs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median of each piece over the window's requests, and their count (``n``)."""
    out = {k: statistics.median(s[k] for s in segs) for k in PIECES} if segs else {}
    return {**out, "n": float(len(segs))}


@dataclass
class SchedStat:
    """Summed over a set of processes' threads: nanoseconds on a CPU and waiting to run."""

    run_ns: int = 0
    wait_ns: int = 0
    by_comm: dict[str, int] = field(default_factory=dict)
    """Run-queue wait (ns) by process name (``/proc/PID/comm``)."""

    def minus(self, before: SchedStat) -> SchedStat:
        comms = {k: v - before.by_comm.get(k, 0) for k, v in self.by_comm.items()}
        return SchedStat(self.run_ns - before.run_ns, self.wait_ns - before.wait_ns, comms)


def _pgrp(pid: str) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        stat = f.read()
    return int(stat[stat.rfind(")") + 2 :].split()[2])


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if _pgrp(entry.name) == pgid:
                    pids.append(int(entry.name))
    return pids


def schedstat(pgids: Iterable[int]) -> SchedStat:
    """Run and run-queue-wait time of every thread of the processes in ``pgids`` (threads and
    processes that exited are not counted: read it around a window in which they live)."""
    out = SchedStat()
    for pgid in pgids:
        for pid in group_pids(pgid):
            with contextlib.suppress(OSError):
                comm = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
                for task in os.scandir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError, ValueError):
                        run, wait, _ = pathlib.Path(task.path, "schedstat").read_text().split()
                        out.run_ns += int(run)
                        out.wait_ns += int(wait)
                        out.by_comm[comm] = out.by_comm.get(comm, 0) + int(wait)
    return out


def renice_engines(pgid: int, nice: int) -> int:
    """Set every thread of every process in vLLM's process group ``pgid`` except the group leader
    (the API server: it stays at the routers' priority, as part of the request path) to ``nice``:
    the engine core and its OpenMP threads. Returns how many threads were set. Run again before
    each window: threads started meanwhile inherit their creator's value anyway."""
    n = 0
    for pid in group_pids(pgid):
        if pid == pgid:
            continue
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
                n += 1
    return n


def load_run(run_dir: pathlib.Path) -> dict[tuple[str, str], list[list[dict[str, float]]]]:
    """``bench.real --split``'s per-request files under ``run_dir``: (workload file stem, router)
    -> per repeat, its requests' rows."""
    out: dict[tuple[str, str], list[list[dict[str, float]]]] = {}
    for f in sorted(run_dir.glob("r*/*/*.split.jsonl")):
        rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
        out.setdefault((f.name.removesuffix(".split.jsonl"), f.parent.name), []).append(rows)
    return out


def report(run_dir: pathlib.Path, base: str) -> str:
    """Per workload and router, over every repeat's requests: the mean of each piece (means add
    up to the mean TTFT), the mean of each piece over the slowest 10% of requests, and the median
    over requests of the difference from router ``base`` on the same request (same repeat, same
    index: the same prompt sent at the same offset)."""
    runs = load_run(run_dir)
    cols = [k for k in PIECES if k != "queue"]
    lines = [
        "| workload | router | n | what | " + " | ".join(cols) + " |",
        "|---|---|---|---|" + "---|" * len(cols),
    ]
    for (wl, router), reps in sorted(runs.items()):
        rows = [r for rep in reps for r in rep]
        slow = sorted(rows, key=lambda r: r["client_ttft"])[int(0.9 * len(rows)) :]
        stats = {"mean": rows, "slowest 10%": slow}
        for what, rs in stats.items():
            cells = [f"{statistics.fmean(r[k] for r in rs) * 1e3:.1f}" for k in cols]
            lines.append(f"| {wl} | {router} | {len(rs)} | {what} | " + " | ".join(cells) + " |")
        other = runs.get((wl, base))
        if other is None or router == base:
            continue
        diffs: dict[str, list[float]] = {k: [] for k in cols}
        for mine, theirs in zip(reps, other, strict=False):
            by_index = {r["index"]: r for r in theirs}
            for r in mine:
                b = by_index.get(r["index"])
                if b is not None:
                    for k in cols:
                        diffs[k].append(r[k] - b[k])
        if diffs[cols[0]]:
            cells = [f"{statistics.median(diffs[k]) * 1e3:+.1f}" for k in cols]
            n = len(diffs[cols[0]])
            lines.append(
                f"| {wl} | {router} | {n} | median paired diff vs {base} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.split", description=report.__doc__)
    p.add_argument("run_dir", help="a bench.real --split run directory (its logs line names it)")
    p.add_argument("--base", default="sglang-router", help="the router to pair requests with")
    a = p.parse_args(argv)
    print(report(pathlib.Path(a.run_dir), a.base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
