"""KV-event encoding of LoRA and salted blocks, and the metrics page, without processes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from replica.sim.costmodel import profile
from replica.sim.engine import EngineConfig, EngineCore
from replica.sim.kv_events import encode_event
from replica.sim.metrics import Metrics
from replica.sim.request import Request

BS = 4


def drive(core: EngineCore) -> None:
    t = 0.0
    while (step := core.begin(t)) is not None:
        t += step.duration
        core.end(step, t)


def test_stored_events_carry_lora_and_salt_as_vllm_does() -> None:
    seen: list[dict[str, object]] = []
    core = EngineCore(
        profile("cpu-test"),
        EngineConfig(block_size=BS, num_gpu_blocks=32),
        lambda evs: seen.extend(encode_event(e, BS, {"sql": 7}) for e in evs),
    )
    core.sched.add(Request(list(range(9)), 1, BS, lora="sql", salt="s1"))
    core.sched.add(Request(list(range(9)), 1, BS, lora="sql", salt="s2"))
    drive(core)
    stored = [e for e in seen if e["type"] == "BlockStored"]
    assert len(stored) == 2, "a different salt makes a different first block: nothing is shared"
    assert stored[0]["extra_keys"] == [["sql", "s1"], ["sql"]], "the salt goes on block 0 only"
    assert stored[0]["lora_name"] == "sql" and stored[0]["lora_id"] == 7
    assert stored[0]["block_hashes"] != stored[1]["block_hashes"]


def test_metrics_page_has_vllm_names_and_labels() -> None:
    core = EngineCore(profile("cpu-test"), EngineConfig(block_size=BS, num_gpu_blocks=64))
    m = Metrics(core, "base", loras=("sql",), max_loras=2)
    for salt in ("", ""):
        core.sched.add(Request(list(range(12)), 2, BS, lora="sql", salt=salt))
        drive(core)
    core.sched.add(Request(list(range(100, 112)), 2, BS, lora="sql"))
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    one = {s.name: s for f in fams.values() for s in f.samples}
    assert (
        one["vllm:prefix_cache_queries_total"].value == 24 and one["vllm:prefix_cache_hits_total"].value == 8
    )
    assert one["vllm:num_requests_waiting"].labels == {"model_name": "base", "engine": "0"}
    assert one["vllm:num_requests_waiting"].value == 1
    cfg = one["vllm:cache_config_info"].labels
    assert (cfg["block_size"], cfg["num_gpu_blocks"], cfg["engine"]) == ("4", "64", "0")
    lora = one["vllm:lora_requests_info"].labels
    assert lora == {"max_lora": "2", "waiting_lora_adapters": "sql", "running_lora_adapters": ""}
    assert "vllm:time_to_first_token_seconds" in fams
