"""``python -m bench.flow``: the flow-control studies of bench/results/2026-11-27-flow-control.md,
in cluster mode (simulated time, deterministic per seed), 8 × H100 Llama-3.1-8B by default.

    python -m bench.flow capacity                  # the fleet's capacity in req/s (cost, saturated)
    python -m bench.flow overload --capacity-rps C # 0.8 … 2 × C and a burst, four policies
    python -m bench.flow tenants  --capacity-rps C # a 10× tenant at 1.5 × C
    python -m bench.flow priority --capacity-rps C # a critical band while sheddable floods at 3 × C
    python -m bench.flow pickers  --capacity-rps C # 1, 2, 4 pickers' admissions at 1 and 1.5 × C

**Capacity**: the trace sent at five times its own rate (time scale 0.2) under ``cost`` without
flow control; the replicas then never idle, and requests finished per simulated second, over the
run, is the rate the fleet sustains on this trace's mix. **Load L** sends the trace at
``L × capacity``: time scale ``trace rate / (L × capacity)``.

**Goodput**: requests served with TTFT within the SLO, per second of the arrival window (the
same denominator for every policy, so goodputs compare as counts do).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from picker.core.config import RouterConfig
from picker.core.flowcontrol import FlowControlConfig
from replica.sim.costmodel import profile
from replica.sim.scheduler import SchedulerConfig

from . import ceilings
from . import mooncake_trace as trace
from .cluster import Cluster, Tag, drift_text

SLOS = (1.0, 2.0, 10.0)
"""TTFT objectives for goodput, seconds: the H100 8B SLO (2 s), half and five times it."""


def trace_rate(rows: Sequence[trace.Row]) -> float:
    span = rows[-1].arrival_s - rows[0].arrival_s
    return len(rows) / span if span > 0 else float("inf")


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def run(
    rows: Sequence[trace.Row],
    policy: str,
    fc: bool,
    time_scale: float = 1.0,
    seed: int = 0,
    tags: Callable[[trace.Row], Tag] | None = None,
    cfg: RouterConfig | None = None,
    fc_cfg: FlowControlConfig | None = None,
    n: int = 8,
    prof: str = "h100-llama-3.1-8b",
    pickers: int = 1,
    share: frozenset[str] = frozenset(),
    peer_delay_s: float = 0.01,
    prefix_mode: str = "approximate",
) -> tuple[Cluster, dict[str, Any]]:
    cfg = cfg or RouterConfig()
    cfg = dataclasses.replace(cfg, prefix=dataclasses.replace(cfg.prefix, mode=prefix_mode))
    fcc = dataclasses.replace(fc_cfg or cfg.flow_control, enabled=fc)
    t0 = time.perf_counter()
    c = Cluster(
        n,
        policy,
        profile(prof),
        sched=SchedulerConfig(),
        seed=seed,
        router_cfg=cfg,
        flow_control=fcc,
        tags=tags,
        pickers=pickers,
        share=share,
        peer_delay_s=peer_delay_s,
    )
    c.run(list(rows), time_scale)
    window = (rows[-1].arrival_s - rows[0].arrival_s) * time_scale
    out = summary(c, c.records, window, time.perf_counter() - t0)
    tokens = {r.index: r.input_length for r in rows}
    total = sum(tokens.values())
    served = sum(tokens[r.row] for r in c.records if r.ttft is not None)
    good = sum(tokens[r.row] for r in c.records if r.ttft is not None and r.ttft <= 2.0)
    out["served_token_share"] = served / total if total else 0.0
    out["token_goodput_2s"] = good / window if window > 0 else 0.0
    # token_goodput_2s: prompt tokens of the requests served within 2 s, per second of the window
    return c, out


def summary(c: Cluster, records: Sequence[Any], window: float, wall: float = 0.0) -> dict[str, Any]:
    served = [r.ttft for r in records if r.ttft is not None]
    shed: dict[str, int] = {}
    for r in records:
        if r.outcome not in ("served", "error", ""):
            shed[r.outcome] = shed.get(r.outcome, 0) + 1
    waits = [w for fc in c.flows.values() for ws in fc.queue.waits.values() for w in ws]
    out: dict[str, Any] = {
        "requests": len(records),
        "served": len(served),
        "shed": sum(shed.values()),
        "shed_by": shed,
        "ttft_p50": pct(served, 0.5),
        "ttft_p90": pct(served, 0.9),
        "ttft_p99": pct(served, 0.99),
        "queue_wait_p90": pct(waits, 0.9),
        "hit_rate": c.hit_rate(),
        "lru_hit_rate": ceilings.lru_hit_rate(c.sent, c.block_size, c.capacity_blocks),
        "sim_s": c.now,
        "window_s": window,
        "wall_s": wall,
    }
    for slo in SLOS:
        out[f"goodput_{slo:g}s"] = sum(1 for t in served if t <= slo) / window if window > 0 else 0.0
    out["hit_over_lru"] = out["hit_rate"] / out["lru_hit_rate"] if out["lru_hit_rate"] else 0.0
    return out


def by(records: Sequence[Any], key: Callable[[Any], str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    return out


def burst_rows(
    rows: Sequence[trace.Row],
    rate: float,
    cap: float,
    high: float = 2.0,
    low: float = 0.5,
    burst_s: float = 60.0,
) -> list[trace.Row]:
    """The trace's rows re-timed: ``high × cap`` for ``burst_s`` seconds, then ``low × cap``."""
    s_hi, s_lo = rate / (high * cap), rate / (low * cap)
    out, t0 = [], rows[0].arrival_s
    cut = t0 + burst_s / s_hi  # the original time the burst ends at
    for r in rows:
        t = (r.arrival_s - t0) * s_hi if r.arrival_s <= cut else burst_s + (r.arrival_s - cut) * s_lo
        out.append(dataclasses.replace(r, arrival_s=t))
    return out


POLICIES: tuple[tuple[str, bool], ...] = (
    ("cost", True),
    ("cost", False),
    ("round-robin", False),
    ("least-loaded", False),
)


KEPT_FED = FlowControlConfig(ttl_s=1e9, empty_pool_ttl_s=1e9, max_requests=1 << 30, max_bytes=1 << 60)
"""Flow control that never sheds nor lets go early: the queue holds what the fleet cannot take."""


def cmd_capacity(rows: Sequence[trace.Row], a: argparse.Namespace) -> dict[str, Any]:
    """Two measures, both at ten times the trace's own rate (time scale 0.1), requests finished
    per simulated second over the run: ``cost`` with flow control that never sheds (the fleet
    kept fed, replica queues kept short: the capacity the loads are relative to), and ``cost``
    without (what it sustains once its replicas' queues grow without bound)."""
    out: dict[str, Any] = {"trace_rps": trace_rate(rows)}
    for name, fc in (("fed", True), ("cost_off", False)):
        c, s = run(rows, "cost", fc, 0.1, a.seed, fc_cfg=KEPT_FED, prefix_mode=a.prefix_mode)
        cap = c.done / c.now
        print(
            f"{name}: {cap:.2f} req/s ({cap / trace_rate(rows):.2f} x the trace's rate); hit {s['hit_rate']:.3f}"
        )
        out[name] = {"rps": cap, **s}
    out["capacity_rps"] = out["fed"]["rps"]
    return out


SHEDDABLE = RouterConfig(objectives={"sheddable": -1})


def slo_tag(r: trace.Row) -> Tag:
    """Every overload request: sheddable (priority -1), with the 2 s TTFT objective."""
    return Tag(objective="sheddable", slo_ttft_ms=2000.0)


def cmd_overload(rows: Sequence[trace.Row], a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every request names a sheddable objective and carries the 2 s TTFT objective
    (``x-llm-d-slo-ttft-ms: 2000``), the same for every policy: ``cost`` without flow control
    sheds through its ``not-saturated`` filter (every endpoint at 64 waiting), round-robin and
    least-loaded never shed."""
    rate, cap = trace_rate(rows), a.capacity_rps
    out = []
    loads: list[tuple[str, Sequence[trace.Row], float]] = [
        (f"{x:g}", rows, rate / (x * cap)) for x in a.loads
    ]
    if a.burst:
        loads.append(("burst", burst_rows(rows, rate, cap), 1.0))
    for label, rs, ts in loads:
        for pol, fc in POLICIES:
            _, s = run(
                rs, pol, fc, ts, a.seed, None if a.plain else slo_tag, SHEDDABLE, prefix_mode=a.prefix_mode
            )
            s.update(load=label, policy=pol, flow_control=fc, time_scale=ts)
            out.append(s)
            line(s)
    return out


def line(s: dict[str, Any]) -> None:
    print(
        f"{s['load']:>6} {s['policy'] + (' +FC' if s['flow_control'] else ''):<16}"
        f" good1 {s['goodput_1s']:6.2f} good2 {s['goodput_2s']:6.2f} good10 {s['goodput_10s']:6.2f}"
        f" p50 {s['ttft_p50']:7.2f} p90 {s['ttft_p90']:7.2f} p99 {s['ttft_p99']:7.2f}"
        f" hit {s['hit_rate']:.3f} /LRU {s['hit_over_lru']:.2f} shed {s['shed']:5d}"
        f" wait90 {s['queue_wait_p90']:6.2f} wall {s['wall_s']:5.0f}",
        flush=True,
    )


def jain(xs: Sequence[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 0.0


def cmd_tenants(rows: Sequence[trace.Row], a: argparse.Namespace) -> list[dict[str, Any]]:
    """At 1.5 × capacity, tenant ``noisy`` sends 10 requests for each of ``quiet``'s (drawn per
    row with seed ``a.seed``), both in one sheddable band (no TTFT objective: the excess is shed
    at the queue TTL). Compared: flow control with fair flows (the fairness id), flow control
    with one flow (no fairness id), no flow control; and the reference, the whole trace at 0.8 ×
    capacity with flow control."""
    rate, cap = trace_rate(rows), a.capacity_rps
    rng = random.Random(a.seed)
    tenant = {r.index: ("quiet" if rng.random() < 1 / 11 else "noisy") for r in rows}
    fair: Callable[[trace.Row], Tag] = lambda r: Tag("sheddable", tenant[r.index])  # noqa: E731
    one: Callable[[trace.Row], Tag] = lambda r: Tag("sheddable")  # noqa: E731
    out = []
    _, ref = run(rows, "cost", True, rate / (0.8 * cap), a.seed, fair, SHEDDABLE, prefix_mode=a.prefix_mode)
    ref.update(case="whole trace at 0.8 × capacity, FC")
    out.append(ref)
    print(f"reference p90 at 0.8: {ref['ttft_p90']:.3f}", flush=True)
    cases = [("FC, fair flows", True, fair), ("FC, one flow", True, one), ("no FC", False, fair)]
    for name, fc, tags in cases:
        c, s = run(rows, "cost", fc, rate / (1.5 * cap), a.seed, tags, SHEDDABLE, prefix_mode=a.prefix_mode)
        window = s["window_s"]
        per = {}
        for t, recs in by(c.records, lambda r: tenant[r.row]).items():
            ts = summary(c, recs, window)
            per[t] = {
                "requests": len(recs),
                "ttft_p90": ts["ttft_p90"],
                "goodput_2s": ts["goodput_2s"],
                "share_within_2s": ts["goodput_2s"] * window / len(recs),
                "shed": ts["shed"],
            }
        s.update(
            case=name,
            tenants=per,
            jain_goodput=jain([p["goodput_2s"] for p in per.values()]),
            jain_share=jain([p["share_within_2s"] for p in per.values()]),
        )
        out.append(s)
        print(
            f"{name:<16} quiet p90 {per['quiet']['ttft_p90']:.3f} noisy p90 {per['noisy']['ttft_p90']:.3f}"
            f" jain(goodput) {s['jain_goodput']:.3f} jain(share) {s['jain_share']:.3f}"
            f" hit {s['hit_rate']:.3f} shed {s['shed']}",
            flush=True,
        )
    return out


def cmd_priority(rows: Sequence[trace.Row], a: argparse.Namespace) -> list[dict[str, Any]]:
    """One request in ten (every tenth row) names objective ``critical`` (priority 10); the rest
    name ``batch`` (priority -1, sheddable), the whole sent at 3 × capacity. The critical band's
    TTFT p90 is compared with its own, alone, at the same times."""
    rate, cap = trace_rate(rows), a.capacity_rps
    cfg = RouterConfig(objectives={"critical": 10, "batch": -1})

    def crit(r: trace.Row) -> bool:
        return r.index % 10 == 0

    tags: Callable[[trace.Row], Tag] = lambda r: Tag(objective="critical" if crit(r) else "batch")  # noqa: E731
    ts = rate / (3.0 * cap)
    out = []
    alone_rows = [r for r in rows if crit(r)]
    _, alone = run(alone_rows, "cost", True, ts, a.seed, tags, cfg, prefix_mode=a.prefix_mode)
    alone.update(case="critical alone")
    out.append(alone)
    print(f"critical alone: p90 {alone['ttft_p90']:.3f}", flush=True)
    for fc in (True, False):
        c, s = run(rows, "cost", fc, ts, a.seed, tags, cfg, prefix_mode=a.prefix_mode)
        per = {}
        for band, recs in by(c.records, lambda r: r.tag.objective).items():
            bs = summary(c, recs, s["window_s"])
            per[band] = {
                k: bs[k]
                for k in ("requests", "served", "ttft_p50", "ttft_p90", "ttft_p99", "shed", "shed_by")
            }
        s.update(case=f"flood at 3x, FC {'on' if fc else 'off'}", bands=per)
        out.append(s)
        print(
            f"FC {fc}: critical p90 {per['critical']['ttft_p90']:.3f} (x{per['critical']['ttft_p90'] / alone['ttft_p90']:.2f})"
            f" batch p90 {per['batch']['ttft_p90']:.3f} shed {per['batch']['shed_by']}",
            flush=True,
        )
    return out


def cmd_pickers(rows: Sequence[trace.Row], a: argparse.Namespace) -> list[dict[str, Any]]:
    """The overload suite's requests (sheddable, 2 s TTFT objective) under ``cost`` with flow
    control, split round-robin over 1, 2 and 4 pickers, each with its own queue, seeing its peers
    through ``--shares`` (``peers``: the modelled peer channel, ``--peer-delay-s`` late;
    ``inflight``: one pool, every peer's work seen at once; ``none``: scrapes only). Drift
    (bench.cluster's ``Result``): ``over_admitted`` of ``admitted`` dispatches; per picker the
    fraction of scrape instants it judged the pool saturated; the fraction at which they
    disagreed; the most picks one picker made that one peer had not yet heard of."""
    rate, cap = trace_rate(rows), a.capacity_rps
    out = []
    for x in a.loads:
        ts = rate / (x * cap)
        for n in a.pickers:
            for sh in a.shares if n > 1 else ["-"]:
                share = frozenset() if sh in ("-", "none") else frozenset(sh.split("+"))
                c, s = run(
                    rows,
                    "cost",
                    True,
                    ts,
                    a.seed,
                    slo_tag,
                    SHEDDABLE,
                    None,
                    8,
                    "h100-llama-3.1-8b",
                    n,
                    share,
                    a.peer_delay_s,
                    a.prefix_mode,
                )
                sat = [k / c.samples for k in c.sat_counts] if c.samples else []
                s.update(
                    load=f"{x:g}",
                    policy="cost",
                    flow_control=True,
                    time_scale=ts,
                    pickers=n,
                    share=sh,
                    peer_delay_s=a.peer_delay_s,
                    admitted=c.admitted,
                    over_admitted=c.over_admitted,
                    saturated=sat,
                    disagree=c.disagreements / c.samples if c.samples else 0.0,
                    unheard_max=c.unheard_max,
                )
                out.append(s)
                print(
                    f"{s['load']:>5} pickers {n} {sh:<9} good2 {s['goodput_2s']:6.2f}"
                    f" p90 {s['ttft_p90']:6.2f} shed {s['shed']:4d} hit {s['hit_rate']:.3f}"
                    f" {drift_text(c.over_admitted, c.admitted, sat, s['disagree'], c.unheard_max)}"
                    f" wall {s['wall_s']:4.0f}",
                    flush=True,
                )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.flow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("study", choices=["capacity", "overload", "tenants", "priority", "pickers"])
    p.add_argument("--pickers", default="1,2,4", help="pickers: picker counts")
    p.add_argument("--shares", default="peers", help="pickers: peers, inflight, none (comma-separated)")
    p.add_argument("--peer-delay-s", type=float, default=0.01, help="pickers: peer channel delay, seconds")
    p.add_argument("--trace", default=str(trace.DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None, help="the first N rows")
    p.add_argument("--capacity-rps", type=float, default=0.0)
    p.add_argument("--loads", default="0.5,0.8,1,1.25,1.5,2")
    p.add_argument("--no-burst", dest="burst", action="store_false")
    p.add_argument(
        "--plain",
        action="store_true",
        help="overload: requests carry no objective and no TTFT objective (nothing sheddable)",
    )
    p.add_argument("--policies", default="", help="subset of: cost+fc,cost,round-robin,least-loaded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-mode",
        default="approximate",
        choices=("approximate", "precise"),
        help="the picker's prefix index (precise: fed by the engines' KV events, as shipped)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.loads = [float(x) for x in a.loads.split(",") if x]
    a.pickers = [int(x) for x in a.pickers.split(",") if x]
    a.shares = [x for x in a.shares.split(",") if x]
    if a.policies:
        want = set(a.policies.split(","))
        global POLICIES
        POLICIES = tuple(x for x in POLICIES if (x[0] + ("+fc" if x[1] else "")) in want)
    rows = trace.read(a.trace, a.limit)
    if a.study != "capacity" and a.capacity_rps <= 0:
        p.error("--capacity-rps is required (python -m bench.flow capacity)")
    study = {
        "capacity": cmd_capacity,
        "overload": cmd_overload,
        "tenants": cmd_tenants,
        "priority": cmd_priority,
        "pickers": cmd_pickers,
    }[a.study]
    result = study(rows, a)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
