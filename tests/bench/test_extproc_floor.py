"""Dry run of ``bench.extproc_floor``: a real Envoy in front of the minimal ext_proc servers, tiny N.
Checks that every request is routed (200s) and that the table comes out; no timing assertions."""

from __future__ import annotations

import pytest

from bench.extproc_floor import main


@pytest.mark.envoy
@pytest.mark.timeout(60)
def test_dry_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    names = ("aio-tls", "sync-plain", "sync-tls-handoff", "aio-tls-oghttp2-frame16m")
    argv = ["--variants", ",".join(names), "--sizes", "1k", "--requests", "3", "--repeats", "1"]
    assert main([*argv, "--warmup", "1", "--idle", "0.1", "--tail", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "| variant | 1k net CPU ms/req | 1k gross | 1k Envoy's | idle cores | 200s | what |" in out
    for name in names:
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert "| 3/3 |" in row, row  # every request answered 200 through Envoy and the server
