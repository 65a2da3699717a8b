"""The ext_proc hold: flow control (:mod:`picker.core.flowcontrol`) on the picker's event loop.

While the pool is saturated a request's ext_proc stream is held unanswered once its body is
whole: the exchange awaits :meth:`FlowGate.admit`. When capacity frees, the gate dispatches
the queue in flow-control order, each request routed then by the normal policy
(:meth:`Director.pick`, late binding) and bound to an endpoint with room: the policy's choice
over every endpoint (asked without committing) must have room, else the request waits for it;
the held exchange answers Envoy with that pick. The fast path (nothing queued) routes as usual,
within the endpoints with room where a lower band must leave some (:meth:`pass_through`).

- **Envoy's message timeout.** A held stream first sends a ``ProcessingResponse`` carrying only
  ``override_message_timeout`` (the longest a request can wait here: the queue's TTL, or the
  empty pool's, plus :data:`TIMEOUT_MARGIN_S`), which Envoy honours up to the filter's
  ``max_message_timeout`` (the shipped configs set it: deploy/envoy/render.py). Envoy takes one
  override per message it is waiting on.
- **A client that goes away while queued.** Envoy resets the ext_proc stream; gRPC cancels the
  handler, and :meth:`admit` takes the request out of the queue at once (``cancelled``). It was
  never routed, so nothing was counted in flight.
- **Draining.** :meth:`drain` dispatches every queued request (or answers 503 where no endpoint
  is left) before the gRPC server stops taking streams' answers.
- **When the queue moves**: every finished request (:meth:`poke`, from the director), every
  ``tick_s`` (a scrape may have freed room), and at the earliest TTL or predicted prefill end
  (:meth:`FlowController.next_wake`).

Writer of the queue: this gate, on the event loop (the director's finish only pokes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2

from picker.core.endpoints.types import EndpointState
from picker.core.errors import NoEndpoints, Overloaded, PickerError
from picker.core.flowcontrol import (
    DEFAULT_FLOW,
    FlowControlConfig,
    FlowController,
    Item,
    Outcome,
    queue_s,
    typical_s,
)
from picker.core.request import InferenceRequest, Parsed
from picker.serving.director import Director, Pick

TIMEOUT_MARGIN_S = 5.0
"""Added to the longest queue wait in the message-timeout override: the pick after a wait and
the answer's trip to Envoy."""

Picked = tuple[Pick, bytes | None]


@dataclass(eq=False, slots=True)
class Held:
    """A held exchange: what its dispatch needs, and the future it waits on."""

    parsed: Parsed
    subset: Collection[str] | None
    future: asyncio.Future[Picked] = field(repr=False)


def error_for(outcome: Outcome, retry_after_s: int, band: int) -> PickerError:
    """The client's answer for a flow-control outcome with a status (429 or 503)."""
    if outcome.status == 503:
        return NoEndpoints("no ready endpoint came while the request waited (flow control)")
    why = {
        Outcome.REJECTED_FULL: f"the queue of priority {band} is full",
        Outcome.SHED_SLO: "the request's TTFT objective cannot be met; it is sheddable",
        Outcome.EVICTED_TTL: "the request waited its queue TTL; it is sheddable",
    }[outcome]
    err = Overloaded(f"{why} (flow control)")
    err.retry_after_s = retry_after_s
    return err


class FlowGate:
    def __init__(
        self,
        director: Director,
        cfg: FlowControlConfig,
        tick_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.director, self.cfg, self.tick_s, self.clock = director, cfg, tick_s, clock
        self.router = director.router
        self.fc: FlowController[Held] = FlowController(
            cfg, self._endpoints, self._dispatch, self._reject, self._local, self._choose
        )
        self.hold_timeout_s = max(cfg.ttl_s, cfg.empty_pool_ttl_s) + TIMEOUT_MARGIN_S
        """The message-timeout override a held stream sends Envoy, seconds."""
        self.hold_answer = pb.ProcessingResponse(
            override_message_timeout=duration_pb2.Duration(seconds=math.ceil(self.hold_timeout_s))
        )
        """A held stream's only answer before its pick (built once, never modified)."""
        self._poke: asyncio.Event | None = None
        self.held = 0
        """Exchanges awaiting their dispatch now (gauge ``flow_control_queue_size`` counts the
        queue itself)."""
        telemetry = director.telemetry
        self._waits = telemetry.flow_waits if telemetry is not None else None
        if telemetry is not None:
            telemetry.flow = self

    # -- the controller's callbacks ---------------------------------------------------------------
    def _endpoints(self) -> list[EndpointState]:
        c = self.router.pool.routable()
        self.router.accounting.expire(c)
        return c

    def _local(self, item: Item[Held], e: EndpointState) -> int:
        return self.router.cached_blocks(e.key, item.hashes)

    def _choose(self, item: Item[Held]) -> str | None:
        """The normal policy's endpoint for a queued request, committing nothing (the pump binds
        it there only if that endpoint has room; None: it cannot be routed, its dispatch says why)."""
        held = item.payload
        try:
            return self.router.route(held.parsed[0], subset=held.subset, commit=False).primary.key
        except PickerError:
            return None

    def _observe(self, item: Item[Held]) -> None:
        if self._waits is not None and item.outcome is not None:
            self._waits.labels(str(item.band), item.outcome.label).observe(self.clock() - item.arrived)

    def _dispatch(self, item: Item[Held]) -> None:
        held = item.payload
        self._observe(item)
        if held.future.done():  # its client went away in this very turn of the loop
            return
        subset = held.subset
        if item.room is not None:  # bound to the endpoints with room (within the gateway's subset)
            subset = item.room if subset is None else (item.room & frozenset(subset)) or subset
        try:
            held.future.set_result(self.director.pick(held.parsed, subset))
        except PickerError as err:
            held.future.set_exception(err)

    def _reject(self, item: Item[Held]) -> None:
        assert item.outcome is not None, "a rejection without an outcome"
        self._observe(item)
        if not item.payload.future.done():
            err = error_for(item.outcome, self.fc.retry_after(item.band), item.band)
            item.payload.future.set_exception(err)

    # -- the exchange's side ----------------------------------------------------------------------
    def pass_through(
        self, req: InferenceRequest, subset: frozenset[str] | None = None
    ) -> Literal[False] | frozenset[str] | None:
        """The fast path. False: :meth:`admit` the request. Otherwise nothing is queued, the pool
        has room for its band and it has no TTFT objective to judge: the caller routes it now
        (counted ``dispatched``, not observed in the wait histogram) within the subset returned,
        the endpoints with room (None: the gateway's ``subset``, or anywhere, every endpoint
        having room)."""
        if req.slo_ttft_ms > 0:
            return False
        endpoints = self.router.pool.routable()
        if subset is not None:
            endpoints = [e for e in endpoints if e.key in subset]
        room = self.fc.pass_through(self.router.objectives.priority(req.objective), endpoints)
        if room is False:
            return False
        return subset if room is True else room

    async def admit(
        self,
        parsed: Parsed,
        subset: Collection[str] | None,
        size: int,
        write: Callable[[pb.ProcessingResponse], Awaitable[None]],
    ) -> Picked:
        """Queue the request and wait for its dispatch: the pick (routed and started), or the
        :class:`PickerError` it is answered with. If it has to wait, :attr:`hold_answer` is
        written first (Envoy's message timeout, extended). Cancelled (the client went away):
        the request leaves the queue, and a pick made in the same turn is finished at once."""
        req = parsed[0]
        now = self.clock()
        priority, tokens, hashes, best = self.router.admission(req)
        fut: asyncio.Future[Picked] = asyncio.get_running_loop().create_future()
        item = self.fc.item(
            Held(parsed, subset, fut),
            priority,
            req.fairness_id,
            tokens,
            size,
            now,
            req.slo_ttft_ms / 1000.0,
            hashes,
        )
        adm = self.fc.offer(item, now, best)
        if adm.outcome is not None and adm.outcome.status:
            self._observe(item)
            raise error_for(adm.outcome, adm.retry_after_s, priority)
        if not fut.done():
            self.held += 1
            try:
                await write(self.hold_answer)
                self.poke()
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                if self.fc.cancel(item, self.clock()):
                    self._observe(item)
                elif fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.director.finish(fut.result()[0], "aborted")  # routed, never answered
                fut.cancel()
                raise
            finally:
                self.held -= 1
        return fut.result()

    # -- the loop -----------------------------------------------------------------------------------
    def poke(self) -> None:
        """Capacity may have freed (a request finished): pump soon."""
        if self._poke is not None and len(self.fc.queue):
            self._poke.set()

    async def run(self) -> None:
        """Pump on pokes, every ``tick_s``, and at :meth:`FlowController.next_wake`."""
        self._poke = asyncio.Event()
        while True:
            wake = self.fc.next_wake()
            delay = self.tick_s if wake is None else min(self.tick_s, max(0.0, wake - self.clock()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), delay)
            self._poke.clear()
            self.fc.pump(self.clock())

    def drain(self) -> int:
        """Stopping: every queued request is dispatched, or answered 503 with no endpoint left."""
        return self.fc.drain(self.clock())

    def explain(self, req: InferenceRequest) -> dict[str, object]:
        """What flow control would do with ``req`` now (nothing is queued): its band and flow,
        whether the pool has room, the wait predicted ahead of it, and the queue by band."""
        priority = self.router.objectives.priority(req.objective)
        endpoints = self._endpoints()
        q = self.fc.queue
        return {
            "priority": priority,
            "flow": req.fairness_id or DEFAULT_FLOW,
            "slo_ttft_ms": req.slo_ttft_ms,
            "saturation": round(self.saturation(), 4),
            "room": {e.key: round(typical_s(e) - queue_s(e), 6) for e in endpoints},
            "predicted_wait_s": round(self.fc.predicted_wait_s(priority, endpoints), 6) if len(q) else 0.0,
            "queued": {
                str(b): {"requests": q.band_depth(b)[0], "bytes": q.band_depth(b)[1]} for b in q.bands()
            },
            "outcomes": {f"{b}:{label}": n for (b, label), n in sorted(q.counts.items())},
        }

    def depths(self) -> dict[int, tuple[int, int]]:
        """Band → (requests, bytes) queued (for the telemetry)."""
        q = self.fc.queue
        return {b: q.band_depth(b) for b in q.bands()}

    def counts(self) -> dict[tuple[int, str], int]:
        return self.fc.queue.counts

    def saturation(self) -> float:
        """``min over endpoints of queue_s / typical_s``: 1 or more is saturated (the set point,
        as llm-d's ``flow_control_pool_saturation``); 1 with no endpoint."""
        endpoints = self._endpoints()
        return min((queue_s(e) / typical_s(e) for e in endpoints), default=1.0)
