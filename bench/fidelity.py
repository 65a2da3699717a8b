"""``python -m bench.fidelity``: the simulator's ``cpu-test`` cost model against real vLLM-CPU.

Cluster mode and ``replica.sim`` run a cost model; the studies made with it transfer to real
engines only as far as the model's *shape* holds: how prefill time grows with the prompt, and a
decode step against a prefill. This bench starts real vLLM-CPU with the tiny model on disk and
reads the engine's own histograms (``vllm:request_prefill_time_seconds``,
``vllm:inter_token_latency_seconds``): the mean prefill time of three cold prompts of 512, 1,024
and 1,536 tokens, and the mean inter-token latency of one request decoding alone. It fits one
speed factor for this machine (the geometric mean of measured / predicted) and reports each
time's error against the profile scaled by it.

Wall clock on a shared machine only ever slows the engine, and unevenly, so each time is taken as
its fastest over ``--rounds`` rounds. The verdict: every error within ``TOLERANCE`` and the factor
within ``SCALE_BOUNDS``. It was a test in ``make test`` until a loaded CI machine put the decode
time 36% off the fitted shape (fastest of 5 rounds) where quiet runs are within 6%: a speed
measurement, so a bench (the team's rule), with the exit status giving the verdict.

    python -m bench.fidelity [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from kvlaunch import PY, Procs, free_port, http, post_json, wait_healthy
from picker.core.endpoints.types import EndpointMetrics
from picker.feeds.scrape import parse_metrics
from replica.sim.costmodel import profile
from replica.vllm.tiny import ENV, build_tiny, command

LENGTHS = (512, 1024, 1536)
"""Prompt lengths (tokens) whose cold prefill is timed; ids stay under the tiny vocabulary."""

TOLERANCE = 0.25
"""Largest error of any time against the profile once scaled by the machine's speed factor."""

SCALE_BOUNDS = (0.5, 2.5)
"""How far this machine's speed may stray from the one the profile was fitted on: a guard against
measuring the wrong thing, not a speed verdict (the shape within ``TOLERANCE`` is the verdict).
Seen here: idle, a 512-token prefill took 12.7 ms one hour and 10.8 ms the next (the machines are
shared VMs); on 2026-11-27 a quiet machine gave a factor of 1.62, and with other tests beside it
1.71 and 1.74, the shape within 6% each time."""


def predicted() -> dict[str, float]:
    """The ``cpu-test`` profile's times (seconds): one cold prefill per length, one decode step of
    a request alone at 100 tokens of context."""
    p = profile("cpu-test")
    out = {f"prefill_{n}": p.step_time([(n, 0)]) for n in LENGTHS}
    out["itl"] = p.step_time([(1, 100)])
    return out


def engine_times(url: str, model: str, round_: int = 0) -> dict[str, float]:
    """From the server's own ``/metrics``: the mean prefill time (s) of three cold prompts of each
    length in ``LENGTHS``, and the mean inter-token latency (s) of one request decoding alone.
    ``round_`` varies the prompts so that every round's are cold too."""

    def metrics() -> EndpointMetrics:
        return parse_metrics(http("GET", url + "/metrics")[1].decode())

    out: dict[str, float] = {}
    for n in LENGTHS:
        before = metrics()
        for k in range(3):
            prompt = [(n * 11 + (k + 3 * round_) * 7 + i * 13) % 1900 + 50 for i in range(n)]
            status, body = post_json(
                url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2}
            )
            if status != 200:
                raise RuntimeError(f"vLLM answered {status}: {body}")
            if body["usage"]["prompt_tokens_details"]["cached_tokens"] != 0:
                raise RuntimeError(f"a prompt meant cold was cached: {body['usage']}")
        time.sleep(0.3)  # vLLM observes the histograms as the outputs are processed
        after = metrics()
        out[f"prefill_{n}"] = (after.prefill_seconds_sum - before.prefill_seconds_sum) / (
            after.prefill_count - before.prefill_count
        )
    before = metrics()
    prompt = [(i * 17 + 3) % 1900 + 50 for i in range(64)]
    body_in = {"model": model, "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
    status, body = post_json(url + "/v1/completions", body_in)
    if status != 200:
        raise RuntimeError(f"vLLM answered {status}: {body}")
    time.sleep(0.3)
    after = metrics()
    out["itl"] = (after.itl_seconds_sum - before.itl_seconds_sum) / (after.itl_count - before.itl_count)
    return out


def fit(predicted: dict[str, float], measured: dict[str, float]) -> tuple[float, dict[str, float]]:
    """The machine's speed factor (geometric mean of measured / predicted) and each quantity's
    error against the profile scaled by it (0.1 = 10% slower than the scaled profile)."""
    ratios = {k: measured[k] / predicted[k] for k in predicted}
    scale = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    return scale, {k: r / scale - 1 for k, r in ratios.items()}


def judge(scale: float, errors: dict[str, float]) -> bool:
    """The verdict: the shape within ``TOLERANCE`` and the factor within ``SCALE_BOUNDS``."""
    return max(abs(v) for v in errors.values()) <= TOLERANCE and SCALE_BOUNDS[0] <= scale <= SCALE_BOUNDS[1]


@dataclass
class Result:
    """One run's figures (seconds): the profile's, each round's, the fastest of each, the speed
    factor and the errors after it, and the verdict."""

    predicted: dict[str, float]
    rounds: list[dict[str, float]]
    fastest: dict[str, float]
    factor: float
    errors: dict[str, float]
    passed: bool


def run(rounds: int) -> Result:
    """Start vLLM-CPU with the tiny model in a temporary directory, measure ``rounds`` rounds
    (stopping early once the verdict passes), and return the figures."""
    with tempfile.TemporaryDirectory(prefix="kvpick-fidelity-") as tmp:
        root = pathlib.Path(tmp)
        model = build_tiny(root)
        procs = Procs(root)
        port = free_port()
        proc = procs.start("vllm", command(model, port, python=PY), env=ENV)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, 300, procs=procs, proc=proc)
            want = predicted()
            best: dict[str, float] = {}
            measured: list[dict[str, float]] = []
            for r in range(rounds):
                m = engine_times(url, str(model), r)
                measured.append(m)
                best = {k: min(v, best.get(k, v)) for k, v in m.items()}
                scale, errors = fit(want, best)
                if judge(scale, errors):
                    break
        finally:
            procs.stop()
    return Result(want, measured, best, scale, errors, judge(scale, errors))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds at most; each time is its fastest")
    ap.add_argument("--json", type=pathlib.Path, help="write the figures here too")
    args = ap.parse_args(argv)
    out = run(args.rounds)
    print(f"cpu-test profile against vLLM-CPU, fastest of {len(out.rounds)} round(s)")
    print(f"{'time':<14}{'profile ms':>12}{'vLLM ms':>10}{'error':>9}")
    for k, want in out.predicted.items():
        print(f"{k:<14}{want * 1e3:>12.2f}{out.fastest[k] * 1e3:>10.2f}{out.errors[k]:>+9.1%}")
    print(f"speed factor {out.factor:.2f} (bounds {SCALE_BOUNDS}); shape tolerance {TOLERANCE:.0%}")
    print("PASS" if out.passed else "FAIL")
    if args.json:
        args.json.write_text(json.dumps(asdict(out), indent=1))
    return 0 if out.passed else 1


if __name__ == "__main__":
    sys.exit(main())
