"""Benchmark outputs under ``bench/results/``: JSON, a markdown table, PNG plots (matplotlib, Agg).

The JSON is ``{"workloads": {NAME: {"ideal_hit_rate": x, "lru_hit_rate": y, ..., "routers":
{ROUTER: {"hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "throughput_rps", "errors", ...}}}}}``;
latencies are in seconds of wall time on this machine.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

from .runner import RouterRun


@dataclass
class WorkloadResult:
    name: str
    ideal_hit_rate: float
    lru_hit_rate: float | None
    requests: int
    load: dict[str, Any]
    runs: list[RouterRun] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        routers = {}
        for r in self.runs:
            d = {k: round(v, 5) if isinstance(v, float) else v for k, v in r.summary.as_dict().items()}
            d["server_hit_rate"] = round(r.server_hit_rate, 5)
            routers[r.router] = d
        return {
            "ideal_hit_rate": round(self.ideal_hit_rate, 5),
            "lru_hit_rate": None if self.lru_hit_rate is None else round(self.lru_hit_rate, 5),
            "requests": self.requests,
            "load": self.load,
            "routers": routers,
        }


def write_json(path: pathlib.Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")


PATH_LABELS = {"cost": "envoy + picker (cost)"}
"""How the overhead table names a path: our router is Envoy plus the picker, not the policy alone."""


def markdown(results: list[WorkloadResult], overhead: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# kvpick benchmark — suite `{meta['suite']}`", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "suite"]
    for w in results:
        lru = "n/a" if w.lru_hit_rate is None else f"{w.lru_hit_rate:.3f}"
        lines += ["", f"## {w.name}", ""]
        lines.append(
            f"{w.requests} requests, {w.load.get('describe', '')}; ideal hit rate {w.ideal_hit_rate:.3f}, "
            f"single-LRU ceiling {lru}"
        )
        lines += [
            "",
            "| router | hit rate | of ideal | replica counters | TTFT p50 (s) | p90 | p99 | ITL p50 (ms) | req/s | errors |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in w.runs:
            s = r.summary
            frac = s.hit_rate / w.ideal_hit_rate if w.ideal_hit_rate else 0.0
            lines.append(
                f"| {r.router} | {s.hit_rate:.3f} | {frac:.0%} | {r.server_hit_rate:.3f} | {s.ttft_p50:.3f} | "
                f"{s.ttft_p90:.3f} | {s.ttft_p99:.3f} | {s.itl_p50 * 1e3:.1f} | {s.throughput_rps:.2f} | {s.errors} |"
            )
    if overhead:
        lines += [
            "",
            "## Router overhead",
            "",
            "TTFT at the client; added = path minus direct (client round-robin).",
            "",
        ]
        lines += ["| load | path | TTFT p50 (ms) | p99 | added p50 (ms) | added p99 | errors |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for table in overhead:
            for name, d in table["paths"].items():
                lines.append(
                    f"| {table['describe']} | {PATH_LABELS.get(name, name)} | {d['ttft_p50'] * 1e3:.2f} | {d['ttft_p99'] * 1e3:.2f} | "
                    f"{d['added_p50'] * 1e3:.2f} | {d['added_p99'] * 1e3:.2f} | {d['errors']} |"
                )
    return "\n".join(lines) + "\n"


def plots(results: list[WorkloadResult], out: pathlib.Path) -> list[pathlib.Path]:
    paths = [_ttft_cdf(results, out / "ttft_cdf.png"), _bars(results, out / "hit_rate.png", "hit_rate")]
    paths.append(_bars(results, out / "throughput.png", "throughput_rps"))
    return paths


def _ttft_cdf(results: list[WorkloadResult], path: pathlib.Path) -> pathlib.Path:
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
    for ax, w in zip(axes[0], results, strict=True):
        for r in w.runs:
            n = len(r.ttfts)
            if n:
                ax.plot(r.ttfts, [(i + 1) / n for i in range(n)], label=r.router)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on short log ranges
        ax.set_title(w.name, fontsize=10)
        ax.set_xlabel("TTFT (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _bars(results: list[WorkloadResult], path: pathlib.Path, metric: str) -> pathlib.Path:
    routers = list(dict.fromkeys(r.router for w in results for r in w.runs))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(results)), 3.8))
    width = 0.8 / max(1, len(routers))
    for j, name in enumerate(routers):
        xs, ys = [], []
        for i, w in enumerate(results):
            for r in w.runs:
                if r.router == name:
                    xs.append(i + j * width)
                    ys.append(float(getattr(r.summary, metric)))
        ax.bar(xs, ys, width, label=name)
    if metric == "hit_rate":
        for i, w in enumerate(results):
            ax.hlines(w.ideal_hit_rate, i - width / 2, i + 0.8 - width / 2, colors="k", linestyles="--")
        ax.set_ylabel("hit rate (dashed: ideal)")
    else:
        ax.set_ylabel("completed requests/s")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], [w.name for w in results], fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
