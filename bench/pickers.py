"""1, 2 and 3 picker replicas behind one real Envoy (the shipped config, an ext_proc cluster of N),
in precise mode, sharing picks and in-flight load over the peer channel, in front of simulated
replicas that publish KV events (each on its own loopback address, one port, as pods).

    python -m bench.pickers --pickers 1,2,3,3:1 --repeats 3        # the scaling table
    python -m bench.pickers --workload mooncake --repeats 3        # the same on the Mooncake trace
    python -m bench.pickers --failover --repeats 3                 # SIGKILL 1 of 3 under load

Scaling: a shared-prefix workload (text prompts; the pickers have no tokenizer, so each new
prompt's ids come from a replica's vLLM-style ``/tokenize``) at a fixed Poisson rate. A case is
``N`` pickers, or ``N:K``: N pickers of which Envoy routes to K (the others subscribe and share but
decide nothing: the duplicated work and the machine's contention with one picker's routing). Per
case: the pickers' CPU per request (utime + stime from ``/proc`` of every picker process tree, summed;
net of each picker's idle rate, the mean of the rates measured just before and just after the run),
the hit rate (the replicas' ``cached_tokens`` / ``prompt_tokens``), TTFT p50 / p90 and the achieved
throughput. The cases are interleaved within each repeat (1, 2, 3, 1, 2, 3, ...), fresh pickers and
emptied replica caches for each, so machine noise falls on all of them alike.

Failover: 3 pickers, ``--clients`` closed-loop clients; one picker is SIGKILLed after
``--kill-after`` seconds. Reported: requests in flight at the kill and how many failed (at most those
whose ext_proc stream was on the killed picker), requests sent after it and how many failed (the
target is 0), and the hit rate of the requests sent in the second after the kill against the rest.

Results: ``bench/results/pickers.md`` (and ``.json``), medians over the repeats with [min-max].
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import aiohttp

from kvlaunch import ENVOY, PY, ROOT, Procs, free_port, http, wait_port
from kvlaunch.stack import supports
from picker.serving.tls import local_pki

from . import mooncake_trace
from .datapath import cpu_seconds
from .loadgen import LoadConfig, run
from .stats import summarize
from .workloads import mooncake, shared_prefix

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
RESULTS = ROOT / "bench" / "results"


@dataclass
class Fleet:
    """Simulated replicas on 127.0.0.(i+1), all on one HTTP port and one KV-event port."""

    port: int
    events: int
    hosts: list[str]

    @property
    def endpoints(self) -> str:
        return ",".join(f"{h}:{self.port}" for h in self.hosts)

    def served(self) -> list[float]:
        """Requests each replica has finished (its ``vllm:request_success`` counters, summed)."""
        out = []
        for h in self.hosts:
            status, body, _ = http("GET", f"http://{h}:{self.port}/metrics")
            assert status == 200, f"{h}: /metrics answered {status}"
            out.append(sum(
                float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                if line.startswith("vllm:request_success_total")
            ))  # fmt: skip
        return out

    def reset(self) -> None:
        for h in self.hosts:
            deadline = time.monotonic() + 30
            while http("POST", f"http://{h}:{self.port}/reset_prefix_cache")[0] != 200:
                assert time.monotonic() < deadline, f"{h} kept refusing to reset its cache"
                time.sleep(0.2)


def start_fleet(procs: Procs, n: int, kv_blocks: int) -> Fleet:
    fleet = Fleet(free_port(), free_port(), [f"127.0.0.{i + 1}" for i in range(n)])
    for h in fleet.hosts:
        args = [
            "--host",
            h,
            "--port",
            str(fleet.port),
            "--model",
            MODEL,
            "--kv-events-port",
            str(fleet.events),
        ]
        args += ["--kv-blocks", str(kv_blocks)] if kv_blocks else []
        proc = procs.start(f"sim-{h}", [PY, "-m", "replica.sim", *args])
        wait_port(fleet.port, host=h, proc=proc, timeout=60)
    return fleet


@dataclass
class Pickers:
    pids: list[int]
    grpc: list[int]
    url: str

    def cpu(self) -> float:
        return sum(self.per_picker_cpu())

    def per_picker_cpu(self) -> list[float]:
        return [cpu_seconds(p) for p in self.pids]


def start_pickers(procs: Procs, n: int, fleet: Fleet, tag: str, routed: int = 0, source: str = "") -> Pickers:
    """``n`` pickers sharing picks and load; Envoy's ext_proc cluster lists the first ``routed``
    (default all): the others subscribe, listen to their peers, scrape and are idle otherwise.
    ``source``: another source tree's picker (``PYTHONSAFEPATH`` keeps this checkout, the working
    directory, off the path, so ``PYTHONPATH`` decides which ``picker`` is imported)."""
    routed = routed or n
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": source} if source else None
    peers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
    grpc = [free_port() for _ in range(n)]
    pids = []
    tree = pathlib.Path(source) if source else ROOT
    pki = (
        local_pki(procs.run_dir / f"pki-{tag}")
        if supports(tree / "picker" / "__main__.py", "--client-ca-path")
        else None
    )
    mtls = ["--cert-path", str(pki.picker), "--client-ca-path", str(pki.ca)] if pki else []
    for i in range(n):
        args = [
            "--endpoints",
            fleet.endpoints,
            "--prefix-mode",
            "precise",
            "--kv-events-port",
            str(fleet.events),
        ]
        args += ["--host", "127.0.0.1", "--grpc-port", str(grpc[i]), "--grpc-health-port", str(free_port())]
        args += ["--metrics-port", str(free_port()), "--log-level", "warning", "--drain-timeout", "1"]
        args += ["--peer-bind", peers[i], "--peers", ",".join(p for j, p in enumerate(peers) if j != i)]
        args += mtls
        proc = procs.start(f"picker-{tag}-{i}", [PY, "-m", "picker", *args], env=env)
        wait_port(grpc[i], proc=proc, timeout=60)
        pids.append(proc.pid)
    listen = free_port()
    render = [PY, str(ROOT / "deploy/envoy/render.py"), "--listen-port", str(listen)]
    render += [
        "--admin-port",
        str(free_port()),
        "--picker",
        ",".join(f"127.0.0.1:{g}" for g in grpc[:routed]),
        *(["--client-cert-dir", str(pki.gateway)] if pki else []),
    ]
    cfg = procs.run_dir / f"envoy-{tag}.yaml"
    cfg.write_text(subprocess.run(render, check=True, capture_output=True, text=True).stdout)
    base_id = str(os.getpid() % 1000 + 7000 + len(procs.procs))
    proc = procs.start(f"envoy-{tag}", [ENVOY, "-c", str(cfg), "--base-id", base_id, "-l", "warning"])
    wait_port(listen, proc=proc, timeout=60)
    url = f"http://127.0.0.1:{listen}"
    body = json.dumps({"model": MODEL, "prompt": "warm up", "max_tokens": 1}).encode()
    deadline = time.monotonic() + 60
    while http("POST", url + "/v1/completions", body, {"content-type": "application/json"})[0] != 200:
        assert time.monotonic() < deadline, procs.log(f"envoy-{tag}")[-2000:]
        time.sleep(0.2)
    return Pickers(pids, grpc, url)


@contextmanager
def pickers_running(
    procs: Procs, n: int, fleet: Fleet, tag: str, routed: int = 0, source: str = ""
) -> Iterator[Pickers]:
    first = len(procs.procs)
    try:
        yield start_pickers(procs, n, fleet, tag, routed, source)
    finally:
        for name, _ in procs.procs[first:]:
            procs.stop(name, timeout=5)
        del procs.procs[first:]


def parse_case(spec: str) -> tuple[int, int, str]:
    """``"3"``: 3 pickers, all behind Envoy; ``"3:1"``: 3 pickers running, Envoy routes to 1;
    ``"3@old"``: the pickers of the source tree ``--source old=DIR`` names."""
    spec, _, source = spec.partition("@")
    n, _, routed = spec.partition(":")
    out = (int(n), int(routed or n), source)
    assert 1 <= out[1] <= out[0], f"case {spec!r}: Envoy can route to 1..{out[0]} of the pickers"
    return out


@dataclass
class Case:
    pickers: int
    routed: int
    """Pickers in Envoy's ext_proc cluster (the rest only consume events and peer messages)."""
    repeat: int
    requests: int
    errors: int
    source: str
    """The ``--source`` name of the pickers' tree ("" for this checkout)."""
    cpu_ms_per_request: float
    """All the pickers' CPU during the run, per request."""
    net_cpu_ms_per_request: float
    """The same less their idle rate (scrapes, health checks, peer reports) times the run's wall;
    the idle rate is the mean of the ones measured just before and just after the run."""
    idle_cpu_ms_per_s: float
    """Idle rate before the run."""
    idle_after_cpu_ms_per_s: float
    picker_share_max: float
    """The busiest picker's share of the pickers' CPU net of idle during the run, times the
    number routed (1.0: Envoy spread the requests evenly)."""
    replica_share_max: float
    """The busiest replica's share of the requests, times the number of replicas."""
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    throughput_rps: float


def scaling_case(procs: Procs, fleet: Fleet, spec: str, repeat: int, a: argparse.Namespace) -> Case:
    n, routed, source = parse_case(spec)
    if a.workload == "mooncake":
        w = mooncake(a.trace, a.limit, a.max_input_tokens)
        load = LoadConfig(mode="trace", time_scale=a.time_scale, model=MODEL, progress=False)
    else:
        w = shared_prefix(
            a.groups, a.per_group, a.prefix_tokens, a.question_tokens, a.output_tokens, seed=repeat
        )
        load = LoadConfig(mode="poisson", rate=a.rate, model=MODEL, seed=repeat, progress=False)
    tag = spec.replace("@", "-").replace(":", "of")
    with pickers_running(procs, n, fleet, f"{tag}-{repeat}", routed, a.sources.get(source, "")) as pk:
        fleet.reset()
        time.sleep(1.0)
        idle = _idle_rates(pk, a.idle_s)
        cpu0, served0 = pk.per_picker_cpu(), fleet.served()
        outcomes, wall = asyncio.run(run([pk.url], w, load))
        cpus = [c - c0 for c, c0 in zip(pk.per_picker_cpu(), cpu0, strict=True)]
        served = [x - x0 for x, x0 in zip(fleet.served(), served0, strict=True)]
        after = _idle_rates(pk, a.idle_s)
    s = summarize(outcomes, wall)
    per = 1000 / max(1, s.requests)
    idle_rate = [(b + c) / 2 for b, c in zip(idle, after, strict=True)]
    net = [max(0.0, c - r * wall) for c, r in zip(cpus, idle_rate, strict=True)]
    case = Case(
        n, routed, repeat, s.requests, s.errors, source, per * sum(cpus), per * sum(net), 1000 * sum(idle),
        1000 * sum(after), max(net[:routed]) / max(1e-9, sum(net[:routed])) * routed,
        max(served) / max(1e-9, sum(served)) * len(served), s.hit_rate, s.ttft_p50, s.ttft_p90,
        s.throughput_rps,
    )  # fmt: skip
    print(json.dumps(asdict(case)), flush=True)
    return case


def _idle_rates(pk: Pickers, seconds: float) -> list[float]:
    """Each picker's CPU seconds per second while no request is sent."""
    c0, t0 = pk.per_picker_cpu(), time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    return [(c - b) / dt for c, b in zip(pk.per_picker_cpu(), c0, strict=True)]


@dataclass
class Failover:
    repeat: int
    before: int
    before_failed: int
    in_flight: int
    in_flight_failed: int
    after: int
    after_failed: int
    hit_first_second: float
    hit_rest: float


async def _closed_loop(url: str, prompts: list[str], clients: int, stop: asyncio.Event) -> list[tuple[float, float, int, int, int]]:  # fmt: skip
    """(sent, done, status, prompt tokens, cached tokens) for every request, until ``stop``."""
    out: list[tuple[float, float, int, int, int]] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client(c: int) -> None:
            i = c
            while not stop.is_set():
                body = {"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": 2}
                t0 = time.monotonic()
                status, prompt, cached = 0, 0, 0
                try:
                    async with session.post(url + "/v1/completions", json=body) as r:
                        status = r.status
                        doc = await r.json(content_type=None) if status == 200 else {}
                        usage = doc.get("usage") or {}
                        prompt = int(usage.get("prompt_tokens") or 0)
                        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    status = -1
                out.append((t0, time.monotonic(), status, prompt, cached))
                i += clients

        await asyncio.gather(*(client(c) for c in range(clients)))
    return out


def failover_case(procs: Procs, fleet: Fleet, repeat: int, a: argparse.Namespace) -> Failover:
    w = shared_prefix(a.groups, a.per_group, a.prefix_tokens, a.question_tokens, 2, seed=repeat)
    prompts = [r.prompt for r in w.requests]
    with pickers_running(procs, 3, fleet, f"kill-{repeat}") as pk:
        fleet.reset()
        time.sleep(1.0)

        async def scenario() -> tuple[list[tuple[float, float, int, int, int]], float]:
            stop = asyncio.Event()
            task = asyncio.create_task(_closed_loop(pk.url, prompts, a.clients, stop))
            await asyncio.sleep(a.kill_after)
            os.kill(pk.pids[1], signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.sleep(a.run_after)
            stop.set()
            return await task, killed

        rows, kill = asyncio.run(scenario())
    before = [r for r in rows if r[1] < kill]
    flight = [r for r in rows if r[0] <= kill <= r[1]]
    after = [r for r in rows if r[0] > kill]

    def hit(rs: list[tuple[float, float, int, int, int]]) -> float:
        ok = [r for r in rs if r[2] == 200]
        return sum(r[4] for r in ok) / max(1, sum(r[3] for r in ok))

    f = Failover(
        repeat, len(before), sum(r[2] != 200 for r in before), len(flight), sum(r[2] != 200 for r in flight),
        len(after), sum(r[2] != 200 for r in after), hit([r for r in after if r[0] <= kill + 1.0]),
        hit([r for r in after if r[0] > kill + 1.0]),
    )  # fmt: skip
    print(json.dumps(asdict(f)), flush=True)
    return f


def _med(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}-{format(max(xs), fmt)}]"


def scaling_table(cases: list[Case], specs: list[str]) -> str:
    lines = [
        "| pickers (routed) | picker CPU ms/request | vs first | net of idle | net vs first | idle CPU ms/s, before / after | "
        "busiest picker | busiest replica | hit rate | TTFT p50 s | TTFT p90 s | req/s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = [[c for c in cases if (c.pickers, c.routed, c.source) == parse_case(spec)] for spec in specs]
    firsts: dict[str, tuple[float, float]] = {}  # per source tree: its first case's medians
    for cs in groups:
        firsts.setdefault(
            cs[0].source,
            (
                statistics.median(c.cpu_ms_per_request for c in cs),
                statistics.median(c.net_cpu_ms_per_request for c in cs),
            ),
        )
    for cs in groups:
        net, gross = [c.net_cpu_ms_per_request for c in cs], [c.cpu_ms_per_request for c in cs]
        gross_base, base = firsts[cs[0].source]
        name = f"{cs[0].pickers}" + (f" ({cs[0].routed})" if cs[0].routed != cs[0].pickers else "")
        name += f" @{cs[0].source}" if cs[0].source else ""
        lines.append(
            f"| {name} | {_med(gross, '.3f')} | {statistics.median(gross) / gross_base:.2f}x | {_med(net, '.3f')} | "
            f"{statistics.median(net) / base:.2f}x | {_med([c.idle_cpu_ms_per_s for c in cs], '.0f')} / "
            f"{_med([c.idle_after_cpu_ms_per_s for c in cs], '.0f')} | "
            f"{_med([c.picker_share_max for c in cs], '.2f')} | {_med([c.replica_share_max for c in cs], '.2f')} | "
            f"{_med([c.hit_rate for c in cs], '.3f')} | {_med([c.ttft_p50 for c in cs], '.3f')} | "
            f"{_med([c.ttft_p90 for c in cs], '.3f')} | {_med([c.throughput_rps for c in cs], '.1f')} | "
            f"{sum(c.errors for c in cs)} |"
        )
    return "\n".join(lines)


def failover_table(rows: list[Failover]) -> str:
    lines = [
        "| repeat | done before the kill (failed) | in flight at the kill (failed) | sent after (failed) | "
        "hit rate, 1st s after / later |",
        "|---|---|---|---|---|",
    ]
    for f in rows:
        lines.append(
            f"| {f.repeat} | {f.before} ({f.before_failed}) | {f.in_flight} ({f.in_flight_failed}) | "
            f"{f.after} ({f.after_failed}) | {f.hit_first_second:.3f} / {f.hit_rest:.3f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--pickers",
        default="1,2,3",
        help="cases to compare: N pickers, or N:K for N pickers of which Envoy routes to K (the others "
        "only consume events and peer messages: their CPU, not their routing)",
    )
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another source tree's pickers, for the cases N@NAME (side by side with this checkout's)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=0, help="KV blocks per replica (0: the profile's)")
    p.add_argument("--workload", choices=["shared-prefix", "mooncake"], default="shared-prefix")
    p.add_argument("--trace", default=str(mooncake_trace.DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=300, help="mooncake: the trace's first N rows")
    p.add_argument("--max-input-tokens", type=int, default=4096, help="mooncake: rows cut to this")
    p.add_argument("--time-scale", type=float, default=0.2, help="mooncake: arrival times multiplied by this")
    p.add_argument("--rate", type=float, default=30.0, help="requests per second (scaling)")
    p.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle CPU measured before each case")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--failover", action="store_true", help="measure SIGKILL of 1 of 3 pickers instead")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--kill-after", type=float, default=2.0)
    p.add_argument("--run-after", type=float, default=3.0)
    p.add_argument(
        "-o", "--output", default="", help="results file stem (default bench/results/pickers[-failover])"
    )
    a = p.parse_args(argv)
    a.sources = dict(x.partition("=")[::2] for x in a.source)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    stem = pathlib.Path(a.output) if a.output else RESULTS / ("pickers-failover" if a.failover else "pickers")
    with tempfile.TemporaryDirectory(prefix="kvpick-pickers-") as tmp:
        procs = Procs(pathlib.Path(tmp))
        try:
            fleet = start_fleet(procs, a.replicas, a.kv_blocks)
            if a.failover:
                fo = [failover_case(procs, fleet, r, a) for r in range(a.repeats)]
                text, data = failover_table(fo), [asdict(f) for f in fo]
            else:
                specs = a.pickers.split(",")
                cases = [scaling_case(procs, fleet, spec, r, a) for r in range(a.repeats) for spec in specs]
                text, data = scaling_table(cases, specs), [asdict(c) for c in cases]
        finally:
            procs.stop()
    print(text)
    command = "python -m bench.pickers " + " ".join(sys.argv[1:] if argv is None else argv)
    head = f"Command: `{command}` ({a.repeats} repeats, median [min-max]; {a.replicas} simulated replicas)."
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(a), "rows": data}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(f"{head}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
