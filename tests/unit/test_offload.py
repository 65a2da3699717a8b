"""Large bodies parse in a real worker process and give what inline parsing gives."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from picker.core.errors import BadRequest
from picker.core.request import ParseOptions, parse_and_rewrite
from picker.serving.offload import BodyParser


def test_worker_parse_equals_inline_and_errors_cross_back() -> None:
    opts = ParseOptions(trust_rewrite=True, max_text_chars=4096)
    headers = {"x-request-id": "r1", "x-gateway-model-name-rewrite": "other"}
    body = orjson.dumps({"model": "m", "prompt": "p " * 200_000})

    async def run() -> None:
        parser = BodyParser(threshold=1024)
        try:
            parser.start()
            assert parser.offloads(len(body)) and not parser.offloads(10)
            got = await parser.parse([body[:1000], body[1000:]], "/v1/completions", headers, opts)
            assert got == parse_and_rewrite(body, "/v1/completions", headers, opts)
            assert got[1] is not None and orjson.loads(got[1])["model"] == "other" and got[2] is None
            with pytest.raises(BadRequest, match="not valid JSON"):
                await parser.parse([b"{nope" * 1000], "/v1/completions", {}, opts)
        finally:
            parser.close()

    asyncio.run(run())


def test_threshold_zero_never_offloads() -> None:
    assert not BodyParser(threshold=0).offloads(1 << 30)
