"""Fuzz the request path: generated request bodies and header sets through a real Envoy + picker.

Cases come from hypothesis strategies (OpenAI-shaped bodies with every field also drawn as arbitrary
JSON, then mutated: truncated, invalid UTF-8 spliced in, nested deeply, huge numbers, random bytes)
and from a fixed edge corpus (oversize bodies, nesting at and past the picker's limit, empty and
non-JSON bodies). Each case is sent concurrently with many others; every answer must be a 2xx that
an upstream produced or a 4xx carrying the JSON error body. Anything else is a failure, kept with
the case that caused it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import aiohttp
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

MAX_BODY = 8 * 1024 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def describe(self) -> str:
        return f"{self.method} {self.path} {self.headers} {self.body[:160]!r} ({len(self.body)} B)"


@dataclass
class Tally:
    """Outcomes of a fuzz run: counts per class and the first few failures."""

    sent: int = 0
    classes: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, case: Case, status: int, body: bytes, upstreams: set[int]) -> None:
        self.sent += 1
        cls = classify(status, body, upstreams)
        self.classes[cls] += 1
        if cls.startswith("FAIL") and len(self.failures) < 20:
            self.failures.append(f"{cls} {status} {body[:200]!r} <- {case.describe()}")

    @property
    def failed(self) -> int:
        return sum(n for c, n in self.classes.items() if c.startswith("FAIL"))


def classify(status: int, body: bytes, upstreams: set[int]) -> str:
    """``ok_2xx`` (an upstream's answer), ``reject_<status>`` (the JSON error body), else FAIL_*."""
    if 200 <= status < 300:
        text = body.decode("utf-8", "replace")
        if '"served_by"' in text and any(
            f'"served_by": {p}' in text or f'"served_by":{p}' in text for p in upstreams
        ):
            return "ok_2xx"
        return "FAIL_2xx_not_from_upstream"
    if 400 <= status < 500:
        try:
            doc = json.loads(body)
        except ValueError:
            return f"FAIL_{status}_not_json"
        err = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return f"reject_{status}"
        return f"FAIL_{status}_no_error_object"
    return f"FAIL_{status}"


# -- strategies -------------------------------------------------------------------------------------
_TEXT = st.text(max_size=60)
_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | _TEXT
JSON = st.recursive(
    _LEAF,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=10,
)
_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "video_url", "x"])},
    optional={
        "text": _TEXT | JSON,
        "image_url": st.fixed_dictionaries(
            {
                "url": st.sampled_from(["data:image/png;base64," + "iVBORw0KGgo" * 50, "http://h/i.png", ""])
                | JSON
            }
        )
        | JSON,
    },
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | JSON},
    optional={"content": st.text(max_size=400) | st.lists(_PART, max_size=3) | JSON, "name": _TEXT},
)
OPENAI = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "m", "m", "", "m-lora"]) | JSON},
    optional={
        "prompt": st.text(max_size=2000)
        | st.lists(st.text(max_size=80), max_size=4)
        | st.lists(st.integers(-1, 2**40), max_size=16)
        | JSON,
        "messages": st.lists(_MESSAGE, max_size=4) | JSON,
        "stream": st.booleans() | JSON,
        "max_tokens": st.integers() | st.floats() | JSON,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}) | JSON,
        "cache_salt": _TEXT | JSON,
        "n": st.integers(-3, 3),
        "temperature": st.floats(),
        "user": _TEXT,
        "lora_request": JSON,
    },
)
_HEADER_VALUE = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80
) | st.sampled_from(["127.0.0.1:1", "127.0.0.1:8001,127.0.0.1:8002", "[::1]:80", "", "evil", "-1", "999999"])
HEADERS = st.dictionaries(
    st.sampled_from(
        [
            "x-gateway-destination-endpoint",
            "x-gateway-destination-endpoint-subset",
            "x-gateway-destination-endpoint-served",
            "x-gateway-model-name-rewrite",
            "x-gateway-inference-objective",
            "x-gateway-inference-fairness-id",
            "x-session-id",
            "x-request-id",
            "x-envoy-max-retries",
            "x-envoy-retry-on",
            "x-envoy-upstream-rq-timeout-ms",
            "x-envoy-original-dst-host",
            "content-type",
        ]
    ),
    _HEADER_VALUE,
    max_size=4,
)


def _encode(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")


class Chooser(Protocol):
    """Where a mutation's choices come from: a hypothesis draw, or a seeded ``random.Random``."""

    def pick(self, options: Sequence[T]) -> T: ...
    def int_in(self, lo: int, hi: int) -> int: ...
    def blob(self, max_size: int) -> bytes: ...


@dataclass
class _Drawn:
    draw: Callable[[st.SearchStrategy[Any]], Any]

    def pick(self, options: Sequence[T]) -> T:
        return cast(T, self.draw(st.sampled_from(options)))

    def int_in(self, lo: int, hi: int) -> int:
        return int(self.draw(st.integers(lo, hi)))

    def blob(self, max_size: int) -> bytes:
        return bytes(self.draw(st.binary(max_size=max_size)))


@dataclass
class _Seeded:
    rnd: random.Random

    def pick(self, options: Sequence[T]) -> T:
        return options[self.rnd.randrange(len(options))]

    def int_in(self, lo: int, hi: int) -> int:
        return self.rnd.randint(lo, hi)

    def blob(self, max_size: int) -> bytes:
        return self.rnd.randbytes(self.rnd.randint(0, max_size))


MUTATIONS = ("none", "truncate", "utf8", "nest", "number", "bytes")


def mutate(body: bytes, c: Chooser, kinds: Sequence[str] = ("none", "none", "none", *MUTATIONS[1:])) -> bytes:
    """One mutation of a request body: truncated, invalid UTF-8 spliced in, deeply nested, a huge
    or non-finite number in a field, or random bytes."""
    kind = c.pick(kinds)
    at = c.int_in(0, len(body))
    if kind == "truncate":
        return body[:at]
    if kind == "utf8":
        return (
            body[:at]
            + c.pick([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"])
            + body[at:]
        )
    if kind == "nest":
        depth = c.pick([10, 63, 64, 65, 200, 5000])
        return b'{"model":"m","prompt":' + b"[" * depth + b'"x"' + b"]" * depth + b"}"
    if kind == "number":
        num = c.pick([b"1e400", b"-1e400", b"9" * 400, b"-0", b"1e-400", b"NaN", b"Infinity"])
        key = c.pick([b"max_tokens", b"n", b"temperature", b"prompt", b"model"])
        return b'{"model":"m","prompt":"x","' + key + b'":' + num + b"}"
    if kind == "bytes":
        return c.blob(300)
    return body


@st.composite
def cases(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Case:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models"]))
    headers = dict(draw(HEADERS))
    headers.setdefault("content-type", "application/json")
    if path == "/v1/models" and draw(st.booleans()):
        return Case("GET", path, headers, b"")
    body = _encode(draw(OPENAI) if draw(st.integers(0, 9)) else draw(JSON))  # 1 in 10: any JSON at all
    return Case("POST", path, headers, mutate(body, _Drawn(draw)))


def mutants(base: Sequence[Case], n: int, rng_seed: int) -> list[Case]:
    """``n`` cheap variants of drawn cases: one case's body, mutated again, with another's headers."""
    c = _Seeded(random.Random(rng_seed))
    posts = [b for b in base if b.method == "POST"]
    out = []
    for _ in range(n):
        body_of, headers_of = c.pick(posts), c.pick(base)
        out.append(Case("POST", body_of.path, headers_of.headers, mutate(body_of.body, c)))
    return out


def edge_cases(oversize: int = 1) -> list[Case]:
    """Fixed cases a random draw rarely reaches: limits, emptiness, sizes."""
    h = {"content-type": "application/json"}
    pad = b" " * (MAX_BODY + 1024)
    out = [
        Case("POST", "/v1/completions", h, b""),
        Case("POST", "/v1/completions", h, b"{}"),
        Case("POST", "/v1/completions", h, b"null"),
        Case("POST", "/v1/completions", h, b'{"model":"m","prompt":"' + b"a" * (4 * 1024 * 1024) + b'"}'),
        Case(
            "POST",
            "/v1/chat/completions",
            h,
            b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        ),
        Case("POST", "/v1/completions", h, b'{"model":"m","model":"n","prompt":"dup keys"}'),
        Case("POST", "/v1/completions", {"content-type": "text/plain"}, b"model=m&prompt=x"),
        Case(
            "POST", "/v1/completions", h, '{"model":"m","prompt":"\ud800"}'.encode("utf-8", "surrogatepass")
        ),
    ]
    out += [Case("POST", "/v1/completions", h, b'{"model":"m","prompt":"x"}' + pad) for _ in range(oversize)]
    return out


def generate(n: int, rng_seed: int, drawn_fraction: float = 0.25) -> list[Case]:
    """``n`` cases: a quarter drawn by hypothesis (about 10 ms each here), the rest their mutants."""
    base = draw_cases(max(1, int(n * drawn_fraction)), rng_seed)
    return base + mutants(base, n - len(base), rng_seed)


def draw_cases(n: int, rng_seed: int) -> list[Case]:
    """``n`` cases from the strategies, reproducible from ``rng_seed`` (hypothesis drives the draw)."""
    out: list[Case] = []
    batch = max(1, min(20, n))
    for round_ in range(1000):  # hypothesis may discard an overrun example: draw until there are n
        if len(out) >= n:
            break

        @seed(rng_seed + round_)
        @settings(
            max_examples=(n - len(out) + batch - 1) // batch,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.lists(cases(), min_size=batch, max_size=batch))
        def collect(drawn: list[Case]) -> None:
            out.extend(drawn)

        collect()
    rnd = random.Random(rng_seed)
    rnd.shuffle(out)
    return out[:n]


async def send_all(url: str, todo: Iterable[Case], upstreams: set[int], concurrency: int = 64) -> Tally:
    """Send every case with ``concurrency`` connections; tally the answers."""
    tally = Tally()
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for c in todo:
        queue.put_nowait(c)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout, skip_auto_headers=["Content-Type"]
    ) as session:

        async def worker() -> None:
            while not queue.empty():
                case = queue.get_nowait()
                try:
                    async with session.request(
                        case.method, url + case.path, data=case.body or None, headers=case.headers
                    ) as resp:
                        tally.add(case, resp.status, await resp.read(), upstreams)
                except (TimeoutError, aiohttp.ClientError) as err:
                    tally.add(case, 0, repr(err).encode(), upstreams)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally
