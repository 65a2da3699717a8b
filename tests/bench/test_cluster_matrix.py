"""``bench.cluster_matrix`` runs each job as ``bench.cluster`` would alone, keeps to its budget,
and accounts for every job: done (with its JSON), failed, killed or not started."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from bench import cluster_matrix

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_jobs_match_a_plain_run_and_every_job_is_accounted_for(tmp_path: pathlib.Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.write_text(
        "# a comment, then a trace made once and used by name\n"
        "@trace hs shared-prefix --system 512 --question 64 --rate 40 --groups 4 --prompts 10\n"
        "hs . --trace {trace:hs} --replicas 2 --policy cost --seed 3   # trailing comment\n"
        "bad . --replicas 2 --policy no-such-policy --limit 5\n"
        "long . --replicas 8 --policy cost --prefix-mode precise\n"
        "late . --replicas 2 --policy cost --limit 5\n"
    )
    out = tmp_path / "out"
    cluster_matrix.main(["--jobs", str(jobs), "--out", str(out), "--procs", "2", "--budget", "10"])
    got = {j["name"]: j for j in json.loads((out / "matrix.json").read_text())}
    assert got["hs"]["status"] == "done" and got["hs"]["rc"] == 0 and got["hs"]["cpu_s"] > 0
    assert got["bad"]["status"] == "done" and got["bad"]["rc"] != 0
    assert got["long"]["status"] == "killed", "the whole trace at 8 replicas outlasts a 10 s budget"
    assert got["late"]["status"] in ("done", "not started")
    # the same run alone gives the same figures (cluster mode is deterministic per seed)
    alone = tmp_path / "alone.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.cluster",
            "--trace",
            str(out / "traces" / "hs"),
            "--replicas",
            "2",
            "--policy",
            "cost",
            "--seed",
            "3",
            "--json",
            str(alone),
        ],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    mine, theirs = got["hs"]["results"][0], json.loads(alone.read_text())[0]
    for key in ("hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "lru_hit_rate", "computed_tokens_per_s"):
        assert mine[key] == theirs[key], key
    table = (out / "matrix.md").read_text()
    assert "| hs | done | cost |" in table and "| long | killed |" in table


def test_the_hardware_tables_jobs_run_its_cells(tmp_path: pathlib.Path) -> None:
    """``bench.hardware --jobs`` names every cost cell once per seed and tree, with the fleet's own
    profiles, time scale and row limit; ``{root}`` resolves to the checkout; and a job runs what
    ``bench.hardware.run`` simulates for that cell (the overloaded fleet, cut to 30 rows here)."""
    from bench import hardware
    from bench import mooncake_trace as trace
    from bench.cluster import simulate
    from replica.sim.costmodel import profile

    fleets = [*hardware.FLEETS, hardware.OVERLOADED]
    trace_arg = "{root}/bench/data/mooncake_synthetic_trace.jsonl"
    lines = hardware.jobs(fleets, ["new=.", "base"], 2, ["approximate", "precise"], trace_arg)
    assert len(lines) == len({ln.split()[0] for ln in lines}) == len(fleets) * 2 * 2 * 2
    over = [ln for ln in lines if ln.startswith("overloaded-approximate-s0-new ")]
    assert len(over) == 1 and " --limit 1500 " in over[0] and over[0].split()[1] == "."
    assert any(" --profile h100-llama-3.1-8b,a100-llama-3.1-8b --time-scale 1.4 " in ln for ln in lines)
    jobs = tmp_path / "jobs"
    jobs.write_text(over[0] + " --limit 30\n")  # the last --limit wins
    out = tmp_path / "out"
    cluster_matrix.main(["--jobs", str(jobs), "--out", str(out), "--procs", "1", "--budget", "120"])
    (got,) = json.loads((out / "matrix.json").read_text())
    assert got["status"] == "done" and got["rc"] == 0, got
    rows = trace.read(trace.DEFAULT_TRACE)[:30]
    f = hardware.OVERLOADED
    want = simulate(
        rows, 8, "cost", [profile(p) for p in f.profiles], f.time_scale,
        prefix_mode="approximate", event_delay_s=hardware.EVENT_DELAY_S,
    )  # fmt: skip
    mine = got["results"][0]
    for key in ("hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "requests"):
        assert mine[key] == getattr(want, key), key
