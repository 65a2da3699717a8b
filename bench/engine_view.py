"""vLLM's own per-request view and the processes' CPU time, read around one measured window.

- :func:`histograms`: per replica, the bucket counts, sum and count of vLLM's per-request
  histograms (queue time, engine TTFT, prefill time), from its ``/metrics``; the difference of
  two reads is the window's requests as the engine saw them.
- :func:`group_cpu`: the user+system CPU seconds of every live process in a process group
  (``/proc/PID/stat``), so a router's or a replica's children count with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import http

ENGINE_HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
"""Short name -> vLLM histogram (per-request seconds)."""
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Hist:
    """One histogram's samples summed over label sets: cumulative bucket counts by upper bound."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0
    count: float = 0.0

    def minus(self, before: Hist) -> Hist:
        return Hist(
            {le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.total - before.total,
            self.count - before.count,
        )

    def quantile(self, q: float) -> float:
        """Upper bound of the first bucket holding the ``q`` quantile (Prometheus-style, no
        interpolation: an over-estimate by at most one bucket); 0 with no samples."""
        if self.count <= 0:
            return 0.0
        for le in sorted(self.buckets):
            if self.buckets[le] >= q * self.count:
                return le
        return float("inf")

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


PICKER_HISTOGRAMS = {"pick": "inference_extension_scheduler_e2e_duration_seconds"}
"""The picker's own time per pick (parse, hash, score, pick; not the tokenization before it)."""


def histograms(url: str, names: dict[str, str] | None = None) -> dict[str, Hist]:
    """The ``/metrics`` at ``url``: its histograms ``names`` (short name -> metric; default
    :data:`ENGINE_HISTOGRAMS`)."""
    names = ENGINE_HISTOGRAMS if names is None else names
    _, text, _ = http("GET", url + "/metrics")
    wanted = {v: k for k, v in names.items()}
    out = {k: Hist() for k in names}
    for fam in text_string_to_metric_families(text.decode()):
        key = wanted.get(fam.name)
        if key is None:
            continue
        h = out[key]
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                h.total += s.value
            elif s.name.endswith("_count"):
                h.count += s.value
    return out


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes in process group ``pgid``."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # state ppid pgrp ...
            ticks += int(fields[11]) + int(fields[12])  # utime stime
    return ticks / _TICK
