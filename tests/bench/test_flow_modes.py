"""``bench.flow --prefix-mode precise`` runs the studies with the picker's precise index, fed by
the engines' KV events as shipped; the default stays approximate."""

from __future__ import annotations

from bench import flow
from bench import mooncake_trace as trace


def test_the_prefix_mode_reaches_the_cluster() -> None:
    rows = trace.read(str(trace.DEFAULT_TRACE), 150)
    ts = flow.trace_rate(rows) / (1.5 * 10.964912280701864)
    c_pre, s_pre = flow.run(rows, "cost", True, ts, 0, flow.slo_tag, flow.SHEDDABLE, prefix_mode="precise")
    c_app, s_app = flow.run(rows, "cost", True, ts, 0, flow.slo_tag, flow.SHEDDABLE)
    assert c_pre.precise and not c_app.precise
    assert s_pre["requests"] == s_app["requests"] == len(rows)
    assert s_pre["hit_rate"] > 0 and s_pre["served"] + s_pre["shed"] == len(rows)
