"""``python -m bench.datapath``: the data path's cost — router CPU per request, req/s, p50/p99.

    flock /tmp/kvpick-heavy.lock python -m bench.datapath              # 3 repeats, writes the table
    python -m bench.datapath --repeats 1 --duration 3 --cases 8k-c64   # a quick look

One fast fixed-response upstream (``kvlaunch.upstream --fixed``, two ports) serves every router:

- ``kvpick``: Envoy with the shipped default config (``deploy/envoy/render.py`` defaults: TLS
  ext_proc, ORIGINAL_DST) and our picker (``python -m picker``, default policy); extra variants
  with other render flags via ``--variant NAME='--flag value ...'``;
- ``vllm-router`` and ``sglang-router`` (``--policy cache_aware``), the peers;
- ``direct``: wrk straight to one upstream port (the ceiling).

Each case drives each router with ``wrk`` (Debian package; POSTs one fixed OpenAI chat body from
a Lua script) and reads the router process's CPU time (utime + stime, ``/proc/PID/stat``) before
and after: CPU ms per request is the robust figure on a shared machine, req/s and latency are not.
Runs are interleaved (repeat 1 of every router, then repeat 2, ...) so that the routers of one
case see the same machine. Writes ``datapath.json`` and ``datapath.md`` under ``--out``.

Where there is no ``wrk``, ``--loadgen python`` drives the same requests with ``bench.httpload``.
``--pickers NAME=N`` runs the kvpick router NAME as N separate picker processes sharing their
picks (Envoy's ext_proc cluster lists all N). ``bench.device`` runs the same machinery on a big
machine with the cores split between the load generator, the upstreams, Envoy and the pickers
(:class:`Layout`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shlex
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field

from kvlaunch import PY, ROOT, Procs, Stack, free_port, http, wait_port

from . import httpload
from .routers import PEERS, start_peer

JSON = {"content-type": "application/json"}
"""vllm-router answers 415 without it (wrk's script sends it too)."""
STREAM_EVENTS = 256
"""Events per streamed response (``kvlaunch.upstream``'s default ``--chunks``)."""
_TICK = os.sysconf("SC_CLK_TCK")
WRK_MISSING = (
    "bench.datapath needs wrk (an HTTP load generator, Debian package 'wrk'):\n"
    "    apt-get update && apt-get install -y wrk"
)
LUA = r"""
local body_file = nil
function init(args)
  local f = assert(io.open(args[1], "rb"))
  wrk.body = f:read("*a")
  f:close()
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"errors":%d,"status_errors":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class Case:
    name: str
    body_bytes: int
    connections: int
    stream: bool = False
    pace_ms: int = 0
    """Each connection waits this long before each request (wrk's ``delay()``): plain requests
    at about the rate a streamed case reaches, to tell a stream's own cost from its lower rate."""

    def lua(self) -> str:
        return LUA + (f"function delay()\n  return {self.pace_ms}\nend\n" if self.pace_ms else "")


CASES = {
    c.name: c
    for c in (
        Case("8k-c64", 8 * 1024, 64),
        Case("220k-c150", 220 * 1024, 150),
        Case("8k-c64-sse256", 8 * 1024, 64, stream=True),
        Case("8k-c8", 8 * 1024, 8),
        Case("8k-c1", 8 * 1024, 1),
        Case("220k-c8", 220 * 1024, 8),
        Case("8k-c8-sse256", 8 * 1024, 8, stream=True),
        Case("8k-c64-paced180", 8 * 1024, 64, pace_ms=180),
    )
}


DEFAULT_CASES = ("8k-c64", "220k-c150", "8k-c64-sse256", "8k-c8")
"""The issue's cases; the c8 variants of the others are for profiling at light load, and
``8k-c64-paced180`` sends plain requests at about ``8k-c64-sse256``'s rate (each of its streams
lasts about 180 ms here), and ``8k-c1`` (one request at a time) shows the latency a request adds
with no queue in front."""


@dataclass
class Run:
    case: str
    router: str
    repeat: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_ms_per_req: float
    """The router process's CPU (the picker's for kvpick), ms per completed request."""
    envoy_cpu_ms_per_req: float = 0.0
    net_cpu_ms_per_req: float = 0.0
    """``cpu_ms_per_req`` less what the router burns idle over the run's wall time (the picker
    scrapes and health-checks its endpoints every 0.2 s): the cost the requests added."""


def make_body(size: int, stream: bool, seed: int = 0) -> bytes:
    """An OpenAI chat body of about ``size`` bytes (one user message of random words)."""
    rng = random.Random(seed)
    words: list[str] = []
    n = 0
    while n < size - 120:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        words.append(w)
        n += len(w) + 1
    head = '{"stream":true,' if stream else "{"
    doc = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": " ".join(words)}]}
    return (head + json.dumps(doc)[1:]).encode()


def _stat(pid: int) -> list[bytes]:
    """``/proc/PID/stat`` after the command name (field 3 onwards)."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return fh.read().rsplit(b")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants (all threads; the picker's body-parsing
    worker processes included), seconds."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError, IndexError):
                children.setdefault(int(_stat(int(entry))[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with suppress(OSError):
            st = _stat(p)
            total += int(st[11]) + int(st[12])
        todo.extend(children.get(p, ()))
    return total / _TICK


@dataclass
class Target:
    url: str
    pids: tuple[int, ...]
    """The router processes whose CPU is charged, each with its descendants (none for direct)."""
    envoy_pid: int | None = None

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids)


@dataclass(frozen=True)
class Layout:
    """Which CPUs each part of a run may use (``os.sched_setaffinity``, inherited by a child from
    the thread that starts it). Empty: unpinned."""

    loadgen: tuple[int, ...] = ()
    upstream: tuple[int, ...] = ()
    envoy: tuple[int, ...] = ()
    picker: tuple[int, ...] = ()
    upstream_processes: int = 1
    """Fixed-response upstream processes, one port each (1: one process serving two ports)."""
    note: str = ""

    @property
    def routers(self) -> tuple[int, ...]:
        """A peer router's CPUs: Envoy's and the picker's together."""
        return tuple(sorted({*self.envoy, *self.picker}))

    @property
    def envoy_concurrency(self) -> int:
        return len(self.envoy) or 2


def split_cores(cpus: Collection[int]) -> Layout:
    """The CPUs of a big machine split for a data-path run: about 3/16 for the load generator,
    1/8 for the upstreams, 3/16 for Envoy and the rest (half) for the picker (16 cores: 3, 2, 3,
    8); a peer router gets Envoy's and the picker's. Under 8 CPUs only the load generator is
    pinned (to the last CPU) and everything else shares the machine."""
    c = sorted(cpus)
    n = len(c)
    if n < 8:
        note = f"{n} CPUs: load generator on CPU {c[-1]}, everything else unpinned (shared)"
        return Layout(loadgen=(c[-1],), note=note)
    lg, up, env = max(1, round(n * 3 / 16)), max(1, n // 8), max(1, round(n * 3 / 16))
    parts = (c[:lg], c[lg : lg + up], c[lg + up : lg + up + env], c[lg + up + env :])
    names = ("load generator", "upstreams", "Envoy", "picker(s)")
    note = f"{n} CPUs: " + "; ".join(f"{k} {_span(v)}" for k, v in zip(names, parts, strict=True))
    note += "; a peer router gets Envoy's and the picker's CPUs together"
    lg_, up_, env_, pick_ = (tuple(x) for x in parts)
    return Layout(lg_, up_, env_, pick_, upstream_processes=up, note=note)


def _span(cpus: list[int]) -> str:
    return f"CPU {cpus[0]}" if len(cpus) == 1 else f"CPUs {cpus[0]}-{cpus[-1]} ({len(cpus)})"


@contextmanager
def pinned(cpus: Collection[int]) -> Iterator[None]:
    """This thread (and so every child it starts) on ``cpus`` (no change when empty)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _kvpick(
    name: str, variant: Variant, ports: list[int], procs: Procs, layout: Layout, pickers: int = 1
) -> Target:
    """Our picker behind Envoy (the shared launcher), its processes logged under ``name/``; from
    another source tree where the variant names one (``PYTHONSAFEPATH`` keeps this checkout, the
    working directory, off the path, so ``PYTHONPATH`` decides which ``picker`` is imported).
    ``pickers`` > 1: that many separate picker processes sharing their picks over the peer
    channel, all in Envoy's ext_proc cluster."""
    render_args, picker_args, source = variant
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": source} if source else None
    d = procs.run_dir / name
    d.mkdir(exist_ok=True)
    peers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(pickers)] if pickers > 1 else []
    stacks = [
        Stack(
            Procs(d / f"picker-{i}" if pickers > 1 else d),
            ports,
            envoy_concurrency=layout.envoy_concurrency,
            pki_dir=d / "pki",  # one CA: Envoy presents one certificate to every picker
        )
        for i in range(pickers)
    ]
    pids: list[int] = []
    try:
        for i, st in enumerate(stacks):
            st.procs.run_dir.mkdir(exist_ok=True)
            share = (
                ["--peer-bind", peers[i], "--peers", ",".join(peers[:i] + peers[i + 1 :])] if peers else []
            )
            with pinned(layout.picker):
                pids.append(
                    st.start_picker("--log-level", "warning", *share, *picker_args, debug=False, env=env).pid
                )
        cluster = ["--picker", ",".join(f"127.0.0.1:{st.grpc_port}" for st in stacks)] if peers else []
        with pinned(layout.envoy):
            envoy = stacks[0].start_envoy(*render_args, *cluster)
    finally:
        for i, st in enumerate(stacks):  # stopped, and logs read, with the rest
            tag = f"{name}/picker-{i}/" if peers else f"{name}/"
            procs.procs += [(f"{tag}{n}", p) for n, p in st.procs.procs]
    return Target(stacks[0].url, tuple(pids), envoy.pid)


def _wait_routable(t: Target, children: Procs, timeout: float = 60.0) -> None:
    body = make_body(200, False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children.check()
        with suppress(OSError):
            if http("POST", t.url + "/v1/chat/completions", body, JSON)[0] == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{t.url} never answered 200")


def check_answer(name: str, t: Target, case: Case) -> None:
    """One request of ``case`` through ``t`` gets what the upstream sends: the whole SSE stream
    (every event, then [DONE]) for a streaming case, the JSON completion otherwise."""
    body = make_body(case.body_bytes, case.stream)
    status, got, _ = http("POST", t.url + "/v1/chat/completions", body, JSON)
    assert status == 200, f"{name}: {status} {got[:200]!r}"
    if case.stream:
        events = got.count(b"data: ")
        assert events == STREAM_EVENTS + 1 and got.endswith(b"data: [DONE]\n\n"), (
            f"{name}: {events} SSE events, not {STREAM_EVENTS} and [DONE]: {got[:200]!r}"
        )
    else:
        assert got.startswith(b'{"id":"cmpl-bench"'), f"{name}: {got[:200]!r}"


@contextmanager
def stack(
    routers: list[str],
    variants: dict[str, Variant],
    run_dir: pathlib.Path,
    layout: Layout | None = None,
    pickers: dict[str, int] | None = None,
) -> Iterator[dict[str, Target]]:
    """Every router in ``routers`` in front of the same fixed upstreams, started, answering; all
    stopped after. ``pickers``: kvpick routers run as that many separate picker processes."""
    layout = layout or Layout()
    children = Procs(run_dir)
    try:
        n = layout.upstream_processes
        ports = [free_port() for _ in range(max(2, n))]
        ups = [f"127.0.0.1:{p}" for p in ports]
        groups = [ports] if n == 1 else [[p] for p in ports]
        with pinned(layout.upstream):
            for i, group in enumerate(groups):
                args = [PY, "-m", "kvlaunch.upstream", "--fixed", "--ports", ",".join(map(str, group))]
                children.start("upstream" if n == 1 else f"upstream-{i}", args)
        for p in ports:
            wait_port(p, procs=children)
        targets: dict[str, Target] = {}
        for name in routers:
            if name == "direct":
                targets[name] = Target(f"http://{ups[0]}", ())
            elif name in PEERS:
                with pinned(layout.routers):
                    url, proc = start_peer(name, [f"http://{u}" for u in ups], children)
                targets[name] = Target(url, (proc.pid,))
            else:
                variant = variants.get(name, ([], [], ""))
                count = (pickers or {}).get(name, 1)
                targets[name] = _kvpick(name, variant, ports, children, layout, count)
        for t in targets.values():
            _wait_routable(t, children)
        yield targets
    finally:
        children.stop()


@dataclass(frozen=True)
class Loadgen:
    """What drives a run: ``wrk`` or ``python`` (:mod:`bench.httpload`), on ``cpus`` (all when empty)."""

    kind: str = "wrk"
    cpus: tuple[int, ...] = field(default=())

    def drive(
        self, url: str, case: Case, body_file: pathlib.Path, lua: pathlib.Path, duration: float
    ) -> dict[str, int]:
        if self.kind == "python":
            assert not case.pace_ms, "bench.httpload does not pace requests: use wrk"
            body = body_file.read_bytes()
            procs = len(self.cpus) or 2
            return httpload.run(
                url + "/v1/chat/completions", body, case.connections, duration, self.cpus, procs
            )
        with pinned(self.cpus):
            return wrk(url, case, body_file, lua, duration, threads=max(2, len(self.cpus)))


def wrk(
    url: str, case: Case, body_file: pathlib.Path, lua: pathlib.Path, duration: float, threads: int = 2
) -> dict[str, int]:
    threads = min(threads, case.connections)
    cmd = ["wrk", f"-t{threads}", f"-c{case.connections}", f"-d{round(duration)}s", "--timeout", "10s"]
    cmd += ["-s", str(lua), url + "/v1/chat/completions", "--", str(body_file)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("WRKJSON ")), None)
    assert line is not None, f"wrk printed no summary:\n{out}"
    result: dict[str, int] = json.loads(line[len("WRKJSON ") :])
    return result


def idle_rates(targets: dict[str, Target], seconds: float) -> dict[str, float]:
    """Each router's CPU seconds per second with no traffic, sampled together over ``seconds``."""
    before = {k: t.cpu() for k, t in targets.items() if t.pids}
    start = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return {k: (targets[k].cpu() - v) / elapsed for k, v in before.items()}


def measure(
    case: Case,
    router: str,
    t: Target,
    repeat: int,
    files: tuple[pathlib.Path, pathlib.Path],
    duration: float,
    idle: float,
    loadgen: Loadgen | None = None,
) -> Run:
    body_file, lua = files
    cpu0 = t.cpu()
    env0 = cpu_seconds(t.envoy_pid) if t.envoy_pid else 0.0
    start = time.monotonic()
    r = (loadgen or Loadgen()).drive(t.url, case, body_file, lua, duration)
    wall = time.monotonic() - start
    cpu = t.cpu() - cpu0
    env = (cpu_seconds(t.envoy_pid) - env0) if t.envoy_pid else 0.0
    n = max(1, r["requests"])
    return Run(
        case.name,
        router,
        repeat,
        r["requests"],
        r["requests"] / (r["duration_us"] / 1e6),
        r["p50_us"] / 1e3,
        r["p99_us"] / 1e3,
        r["errors"] + r["status_errors"],
        cpu * 1e3 / n,
        env * 1e3 / n,
        max(0.0, cpu - idle * wall) * 1e3 / n,
    )


def _fmt(values: list[float], digits: int) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def table(runs: list[Run], cases: list[str], routers: list[str]) -> str:
    lines = [
        "| case | router | req/s | p50 ms | p99 ms | router CPU ms/req | same, idle subtracted "
        "| Envoy CPU ms/req | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        for r in routers:
            rs = [x for x in runs if x.case == c and x.router == r]
            if not rs:
                continue
            cpu = _fmt([x.cpu_ms_per_req for x in rs], 3) if r != "direct" else "–"
            net = _fmt([x.net_cpu_ms_per_req for x in rs], 3) if r != "direct" else "–"
            env = _fmt([x.envoy_cpu_ms_per_req for x in rs], 3) if rs[0].envoy_cpu_ms_per_req else "–"
            lines.append(
                f"| {c} | {r} | {_fmt([x.rps for x in rs], 0)} | {_fmt([x.p50_ms for x in rs], 2)} | "
                f"{_fmt([x.p99_ms for x in rs], 2)} | {cpu} | {net} | {env} | {sum(x.errors for x in rs)} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.datapath",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--routers", default="direct,kvpick,vllm-router,sglang-router")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=RENDER_FLAGS[|PICKER_FLAGS[|PICKER_SOURCE]]",
        help="an extra kvpick router NAME with these render.py (and picker) flags, e.g. "
        "plain='--plaintext | --secure-serving false' (then list NAME in --routers); PICKER_SOURCE, "
        "a directory holding another revision's picker/ (`git archive REV | tar -x -C DIR`), runs "
        "that picker instead of this checkout's, side by side",
    )
    p.add_argument(
        "--pickers",
        action="append",
        default=[],
        metavar="NAME=N",
        help="run the kvpick router NAME as N separate picker processes sharing their picks",
    )
    p.add_argument(
        "--loadgen",
        choices=("wrk", "python"),
        default="wrk",
        help="wrk (the Debian package), or bench.httpload where there is none",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--idle", type=float, default=5.0, help="seconds of no traffic to measure idle CPU")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    p.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of wrk per router and case, not counted"
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--run-dir", default=str(ROOT / ".run" / "datapath"))
    return p.parse_args(argv)


Variant = tuple[list[str], list[str], str]
"""render.py flags, picker flags, and the picker's source tree ("" for this checkout)."""


def _variant(flags: str) -> Variant:
    render, _, rest = flags.partition("|")
    picker, _, source = rest.partition("|")
    source = source.strip()
    assert not source or (pathlib.Path(source) / "picker" / "__main__.py").is_file(), (
        f"{source!r} holds no picker/ (make it with `git archive REV | tar -x -C DIR`)"
    )
    return shlex.split(render), shlex.split(picker), source


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.loadgen == "wrk" and shutil.which("wrk") is None:
        print(WRK_MISSING, file=sys.stderr)
        return 2
    cases = [CASES[c] for c in a.cases.split(",")]
    routers = a.routers.split(",")
    variants = {k: _variant(v) for k, _, v in (x.partition("=") for x in a.variant)}
    pickers = {k: int(v) for k, _, v in (x.partition("=") for x in a.pickers)}
    loadgen = Loadgen(a.loadgen)
    run_dir = pathlib.Path(a.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp, stack(routers, variants, run_dir, pickers=pickers) as targets:
        time.sleep(3.0)  # let start-up work (worker spawns, first scrapes) finish
        idle = idle_rates(targets, a.idle)
        for case in cases:
            body_file = pathlib.Path(tmp) / f"{case.name}.json"
            body_file.write_bytes(make_body(case.body_bytes, case.stream))
            lua = pathlib.Path(tmp) / f"{case.name}.lua"
            lua.write_text(case.lua())
            for name, t in targets.items():
                check_answer(name, t, case)
                loadgen.drive(t.url, case, body_file, lua, a.warmup)
            for rep in range(a.repeats):
                for name, t in targets.items():
                    run = measure(
                        case, name, t, rep, (body_file, lua), a.duration, idle.get(name, 0.0), loadgen
                    )
                    runs.append(run)
                    print(
                        f"{case.name:14} {name:14} #{rep}: {run.rps:8.0f} req/s  p50 {run.p50_ms:7.2f} ms  "
                        f"p99 {run.p99_ms:7.2f} ms  cpu {run.cpu_ms_per_req:6.3f} ms/req  errors {run.errors}",
                        flush=True,
                    )
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "datapath.json").write_text(
        json.dumps({"idle_cpu_s_per_s": idle, "runs": [asdict(r) for r in runs]}, indent=1)
    )
    cmd = "python -m bench.datapath " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])
    )
    md = table(runs, [c.name for c in cases], routers)
    md += "\n\nIdle CPU (no traffic, ms per s): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in idle.items())
    (out / "datapath.md").write_text(
        f"# Data path: router CPU per request\n\n`{cmd}` — {a.repeats} repeats of {a.duration:.0f} s each, "
        f"medians (min–max).\n\n{md}\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
