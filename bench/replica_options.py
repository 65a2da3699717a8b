"""``python -m bench.replica_options``: what each replica scheduler option buys in cluster mode
under contention, as a Markdown table of medians and [min, max] over ``--seeds`` seeds.

Every run is ``python -m bench.cluster`` (discrete-event, deterministic for a given
``--seed``) on the same trace, replicas and policy; only the engines' scheduler options change.
The seed only changes the picker's tie-breaking, yet under heavy queueing it moves every figure
as much as an option does, so one seed proves nothing: compare medians and spreads.

    python -m bench.replica_options --trace bench/data/mooncake_synthetic_trace.jsonl \\
        --time-scale 0.3 --seeds 0 1 2
    python -m bench.replica_options --summarize '/tmp/rep/m2-*_s[0-9].json'   # runs saved by --json
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
from collections.abc import Mapping, Sequence

from bench import mooncake_trace as trace
from bench.cluster import simulate
from replica.sim.costmodel import profile
from replica.sim.scheduler import SchedulerConfig

OPTIONS: dict[str, dict[str, object]] = {
    "none": {},
    "aware": {"cache_aware": True},
    "charge": {"charge_cached_tokens": True},
    "cap": {"long_prefill_token_threshold": 2048},
}
"""name -> SchedulerConfig fields. ``charge`` is the ablation (cached tokens charged to the
budget, not vLLM's rule); ``cap`` is vLLM's ``--long-prefill-token-threshold 2048``."""

FIGURES = ("hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "prompt_tokens_per_s", "errors")


def table(runs: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    """Markdown: one row per option, ``median [min, max]`` of each figure over its runs."""
    head = "| option | runs | hit rate | TTFT p50 s | p90 s | p99 s | prompt tok/s | errors |"
    lines = [head, "|" + "---|" * 8]
    for name, results in runs.items():
        cells = []
        for key in FIGURES:
            vals = [float(r[key]) for r in results]
            fmt = "{:.0f}" if key in ("prompt_tokens_per_s", "errors") else "{:.3f}"
            med = fmt.format(statistics.median(vals))
            cells.append(f"{med} [{fmt.format(min(vals))}, {fmt.format(max(vals))}]")
        lines.append(f"| {name} | {len(results)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(pattern: str) -> dict[str, list[dict[str, float]]]:
    """Group ``--json`` files named ``<prefix>-<option>_s<seed>.json`` by option."""
    runs: dict[str, list[dict[str, float]]] = {}
    for path in sorted(glob.glob(pattern)):
        m = re.search(r"-([A-Za-z0-9_]+?)_s\d+\.json$", path)
        assert m is not None, f"{path}: expected <prefix>-<option>_s<seed>.json"
        with open(path, encoding="utf-8") as fh:
            runs.setdefault(m.group(1), []).extend(json.load(fh))
    order = list(OPTIONS)
    return dict(
        sorted(runs.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0]))
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_options", description=__doc__)
    p.add_argument("--trace", default=str(trace.DEFAULT_TRACE), help="Mooncake-format trace (JSONL)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--policy", default="cost")
    p.add_argument("--profile", default="h100-llama-3.1-8b")
    p.add_argument("--time-scale", type=float, default=0.3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", nargs="*", choices=sorted(OPTIONS))
    p.add_argument("--summarize", metavar="GLOB", help="tabulate saved cluster --json runs instead")
    a = p.parse_args(argv)
    if a.summarize:
        print(table(summarize(a.summarize)))
        return 0
    rows = trace.read(a.trace)
    runs: dict[str, list[dict[str, float]]] = {}
    for name in a.only or OPTIONS:
        cfg = SchedulerConfig(**OPTIONS[name])  # type: ignore[arg-type]
        for seed in a.seeds:
            r = simulate(rows, a.replicas, a.policy, profile(a.profile), a.time_scale, cfg, seed)
            runs.setdefault(name, []).append(dict(r.__dict__))
            print(
                json.dumps({"option": name, "seed": seed, **{k: r.__dict__[k] for k in FIGURES}}), flush=True
            )
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
