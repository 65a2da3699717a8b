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
histogram deltas) and the CPU seconds of the router's and each replica's process groups.

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
import dataclasses
import json
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlaunch import Procs, free_port, http
from replica.vllm.tiny import ENV, build_tiny, command, cpu_binding

from . import loadgen, stats
from .engine_view import Hist, group_cpu, histograms
from .fleet import Fleet, FleetConfig
from .routers import PEERS, router
from .workloads import Workload, multi_turn, no_sharing, shared_prefix

MODEL = "tiny"
KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
"""The chart's ``vllm.kvEventsConfig``; ``endpoint`` is added per replica."""
ROUTERS = ("cost", "cost-approximate", "least-loaded", "vllm-router", "sglang-router")
APPROXIMATE = "-approximate"
VARIANT = "+"
"""``cost+scrape-interval=1.0``: the router ``cost`` with ``--scrape-interval 1.0`` added (one
flag at a time, side by side with the others)."""
WORKLOADS = ("shared-prefix", "multi-turn", "no-sharing")


@dataclass
class VllmFleet(Fleet):
    """Two (``cfg.replicas``) real vLLM-CPU servers of the tiny model."""

    model_dir: pathlib.Path = pathlib.Path()
    events_port: int = 0
    """Replica ``r`` publishes its KV events on this port + ``r``."""

    def start(self) -> None:
        assert self.cfg.replicas <= 2, "free_port() promises only port + 1 free: 2 replicas' event ports"
        os.environ.update(ENV)  # inherited by the children
        self.ports = [free_port() for _ in range(self.cfg.replicas)]
        self.events_port = free_port()
        for i, port in enumerate(self.ports):
            events = {**KV_EVENTS, "endpoint": f"tcp://*:{self.events_port + i}"}
            args = command(
                self.model_dir, port, "--served-model-name", MODEL, "--kv-events-config", json.dumps(events)
            )
            self.children.start(f"vllm-{i}", args, cpu_binding(i))
        deadline = time.monotonic() + 600
        for url in self.urls:
            while True:
                self.children.check()
                try:
                    if http("GET", url + "/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM at {url} did not become healthy")
                time.sleep(1)


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


def workloads(seed: int) -> list[Workload]:
    sp = shared_prefix(
        groups=8, prompts_per_group=8, system_prompt_len=240, question_len=24, output_len=16, seed=seed
    )
    mt = multi_turn(sessions=8, turns=4, system_len=64, user_len=24, answer_len=16, seed=seed)
    ns = no_sharing(64, 260, 16, seed=seed)
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


def measure(
    name: str,
    urls: list[str],
    fleet: Fleet,
    w: Workload,
    cfg: loadgen.LoadConfig,
    repeat: int,
    trace: pathlib.Path | None = None,
    groups: dict[str, list[int]] | None = None,
) -> Run:
    """One router on one workload; each request's outcome (TTFT, cached tokens) goes to ``trace``
    as JSON lines when given. ``groups``: process groups whose CPU time to read around it."""
    fleet.reset()
    before = fleet.counters()
    h0 = [histograms(u) for u in fleet.urls]
    c0 = _cpu(groups or {})
    outcomes, wall = asyncio.run(loadgen.run(urls, w, dataclasses.replace(cfg, label=f"{w.name}/{name}")))
    c1 = _cpu(groups or {})
    h1 = [histograms(u) for u in fleet.urls]
    after = fleet.counters()
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
    )


def warm_up(fleet: Fleet, rate: float) -> None:
    """Every workload once, straight to the replicas in turn, then caches reset: a fresh
    vLLM-CPU replica's first long prompts can stall it for about 10 s (seen twice here, on the
    first workload after start), and that would land on whichever router goes first."""
    for w in workloads(seed=1000):
        cfg = loadgen.LoadConfig(mode="poisson", rate=rate, model=MODEL, seed=1000, progress=False)
        asyncio.run(loadgen.run(fleet.urls, w, dataclasses.replace(cfg, label=f"warm-up/{w.name}")))
    fleet.reset()


def run_all(
    fleet: VllmFleet,
    routers: Sequence[str],
    repeats: int,
    rate: float,
    run_dir: pathlib.Path,
    only: Sequence[str] = WORKLOADS,
) -> list[Run]:
    runs: list[Run] = []
    warm_up(fleet, rate)
    for rep in range(repeats):
        ws = [w for w in workloads(seed=0) if w.name in only]
        # Each repeat starts with the next router: a router always run first (or last) would
        # carry whatever the position costs (the machine's other load drifting over a repeat).
        k = rep % len(routers)
        for name in [*routers[k:], *routers[:k]]:
            policy, args = picker_variant(name, fleet)
            routed: list[Procs] = []
            with router(
                name, fleet, run_dir / f"r{rep}", picker_args=args, policy=policy, started=routed.append
            ) as urls:
                groups = {f"vllm-{i}": [p.pid] for i, (_, p) in enumerate(fleet.children.procs)}
                groups["router"] = [p.pid for c in routed for _, p in c.procs]
                for w in ws:
                    cfg = loadgen.LoadConfig(mode="poisson", rate=rate, model=MODEL, seed=rep, progress=False)
                    trace = run_dir / f"r{rep}" / name / f"{w.name}.jsonl"
                    r = measure(name, urls, fleet, w, cfg, rep, trace, groups)
                    runs.append(r)
                    print(
                        f"[real] rep {rep} {w.name:<14} {name:<14} hit {r.hit_rate:.3f}  TTFT p50 {r.ttft_p50:.3f} "
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
    return runs


def _cell(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}–{format(max(xs), fmt)}]"


def table(runs: list[Run]) -> str:
    lines = []
    for w in dict.fromkeys(r.workload for r in runs):
        lines += [
            f"\n### {w}\n",
            "| router | hit rate (vLLM counters) | TTFT p50 s | TTFT p90 s | replica split (median) | errors |",
            "|---|---|---|---|---|---|",
        ]
        for name in dict.fromkeys(r.router for r in runs):
            rs = [r for r in runs if r.workload == w and r.router == name]
            split = " / ".join(
                str(int(statistics.median(s))) for s in zip(*(r.split for r in rs), strict=True)
            )
            lines.append(
                f"| {name} | {_cell([r.hit_rate for r in rs], '.3f')} | {_cell([r.ttft_p50 for r in rs], '.3f')} "
                f"| {_cell([r.ttft_p90 for r in rs], '.3f')} | {split} | {sum(r.errors for r in rs)} |"
            )
    return "\n".join(lines) + "\n"


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
    a = p.parse_args(argv)
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpick-real-"))
    model_dir = build_tiny(pathlib.Path(a.model_dir) if a.model_dir else run_dir)
    children = Procs(run_dir)
    fleet = VllmFleet(FleetConfig(replicas=2, model=MODEL), children, model_dir=model_dir)
    t0 = time.monotonic()
    try:
        fleet.start()
        runs = run_all(fleet, a.routers.split(","), a.repeats, a.rate, run_dir, a.workloads.split(","))
    finally:
        children.stop()
    text = table(runs)
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
