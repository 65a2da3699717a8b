"""``python -m bench._keepalive_vllm ARGS``: vLLM's OpenAI API server (``vllm.entrypoints.openai.api_server``'s
entry point, the same arguments), its uvicorn keep-alive timer logged to the file named by
``KVPICK_KEEPALIVE_LOG`` (:func:`bench.keepalive.instrument`; nothing else changes). For
``bench.keepalive --server vllm``."""

from __future__ import annotations

import os

from bench.keepalive import LOG_ENV, instrument

if __name__ == "__main__":
    instrument(os.environ[LOG_ENV])
    from vllm.entrypoints.launchers.api_server.entry import main

    main()  # type: ignore[no-untyped-call]
