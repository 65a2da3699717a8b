"""bench.real runs ``ROUTER@NAME`` from another source tree (``--source NAME=DIR``): that tree's
picker and its Envoy config, through the real launcher, in front of real HTTP upstreams."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from bench.fleet import Fleet, FleetConfig
from bench.real import WORKLOADS, split_source, workloads
from bench.routers import router
from kvlaunch import PY, Procs, Stack, free_port, post_json, wait_port
from kvlaunch.procs import ROOT


def test_router_names_pick_their_source_tree() -> None:
    sources = {"base": "/tmp/base"}
    assert split_source("cost", sources) == ("cost", "")
    assert split_source("cost@base", sources) == ("cost", "/tmp/base")
    assert split_source("cost+scrape-interval=1.0@base", sources) == ("cost+scrape-interval=1.0", "/tmp/base")
    with pytest.raises(ValueError, match="no --source old"):
        split_source("cost@old", sources)
    with pytest.raises(ValueError, match="peer"):
        split_source("sglang-router@base", sources)


def _tree(dest: pathlib.Path) -> pathlib.Path:
    """This checkout's committed tree, as ``git archive`` writes it (what --source is given)."""
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


@pytest.mark.envoy
@pytest.mark.timeout(120)
def test_a_router_from_another_tree_serves_and_is_that_trees(tmp_path: pathlib.Path) -> None:
    tree = _tree(tmp_path / "base")
    (tmp_path / "run").mkdir()
    procs = Procs(tmp_path / "run")
    fleet = Fleet(FleetConfig(replicas=2, model="m"), procs, [free_port(), free_port()])
    try:
        up = procs.start(
            "upstreams", [PY, "-m", "kvlaunch.upstream", "--ports", ",".join(map(str, fleet.ports))]
        )
        for port in fleet.ports:
            wait_port(port, procs=procs, proc=up)
        with router("cost", fleet, tmp_path / "run", source=str(tree)) as urls:
            status, doc = post_json(
                urls[0] + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1}
            )
            assert status == 200 and doc["served_by"] in fleet.ports
        # That tree's own code runs: its picker, and its render.py for Envoy's config.
        (tree / "picker" / "__main__.py").write_text("raise SystemExit(3)\n")
        with (
            pytest.raises(RuntimeError, match="picker exited with 3"),
            router("cost", fleet, tmp_path / "broken", source=str(tree)),
        ):
            pass
        (tree / "deploy" / "envoy" / "render.py").unlink()
        with pytest.raises(RuntimeError, match="rendering the Envoy config failed"):
            Stack(procs, fleet.ports, root=tree).render_envoy()
    finally:
        procs.stop()


def test_scale_multiplies_the_workloads_and_1_keeps_them() -> None:
    """``--scale``: more groups, sessions and prompts at the same shape; scale 1 is the tables'."""
    one = {w.name: w for w in workloads(seed=0)}
    two = {w.name: w for w in workloads(seed=0, scale=2)}
    assert [len(one[n].requests) for n in WORKLOADS] == [64, 32, 64]
    assert [len(two[n].requests) for n in WORKLOADS] == [128, 64, 128]
    assert len({r.group for r in two["shared-prefix"].requests}) == 16, "16 groups of 8"
