"""The protocol-free core of the hot path: request → prefix match → scheduling → accounting.

The ext_proc server and the simulator's cluster mode both drive a :class:`Router`:

    decision = router.route(req)          # may raise PickerError subclasses
    ticket = router.start(decision)       # request sent: index records the pick, in-flight += 1
    router.recredit(ticket, served_key)   # Envoy served a fallback: move the ticket there
    router.first_token(ticket)            # first response byte (if Envoy sends bodies): prefill done
    router.on_scrape(state)               # after each scrape: KV capacity, load model, queue check
    router.finish(ticket)                 # end, error, reset or disconnect; idempotent

Invariant: every ``start`` is matched by exactly one effective ``finish`` (later calls are
no-ops), so in-flight counters return to zero when traffic stops.

Pure decision logic: no sockets, threads or network libraries are imported here (a test holds
it). What feeds it from outside (``picker.feeds``) writes its state only through its methods:
:meth:`on_scrape` / :meth:`on_unreachable` (the scraper), :meth:`record_remote_pick` (the peer
channel), and the precise index and :attr:`syncs` (the KV-event subscribers). Tokenization is the
serving layer's (:mod:`picker.serving.tokenization`); the router reads a request's token ids.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from picker.core.accounting import Accounting, Ticket
from picker.core.calibration import Calibrator
from picker.core.config import RouterConfig, build_profile
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import EndpointState
from picker.core.errors import NoEndpoints
from picker.core.objectives import Objectives
from picker.core.prefix.hashing import seed_for
from picker.core.prefix.index import PrefixIndex
from picker.core.prefix.memo import HashMemo
from picker.core.prefix.precise import PreciseIndex, State, Sync, request_keys
from picker.core.request import InferenceRequest, ParseOptions
from picker.core.scheduling.cost import CostScorer
from picker.core.scheduling.pd import PDHandler, PDResult, split_roles
from picker.core.scheduling.profile import PluginTimer, Profile, Result
from picker.core.scheduling.registry import make_decider
from picker.core.scheduling.types import Cycle


@dataclass(slots=True)
class Decision:
    cycle: Cycle
    result: Result
    hashes: list[int]
    keys: list[int] | None = None
    """The prompt's precise (token-block) keys when precise matching applied, else None."""
    pd: PDResult | None = None
    """The prefill half of a P/D pick (``pd.enabled``), else None."""

    @property
    def prefill(self) -> EndpointState | None:
        """The prefill endpoint when the request is disaggregated, else None."""
        return self.pd.prefill if self.pd is not None else None

    @property
    def primary(self) -> EndpointState:
        return self.result.chosen[0]

    @property
    def chosen(self) -> list[EndpointState]:
        return self.result.chosen


class Router:
    def __init__(
        self,
        cfg: RouterConfig,
        pool: Pool,
        clock: Callable[[], float] = time.monotonic,
        plugin_timer: PluginTimer | None = None,
        catch_up: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.clock = clock
        self.index = PrefixIndex(cfg.index.capacity_blocks, cfg.index.segments)
        self.objectives = Objectives(cfg.objectives, cfg.default_priority)
        """Objective priorities: config, and InferenceObjective objects where discovery feeds them."""
        self._hash_memo = HashMemo(cfg.hashing)
        self.profiles: dict[str, Profile] = {n: build_profile(n, s) for n, s in cfg.profiles.items()}
        for p in self.profiles.values():
            p.timer = plugin_timer
        self.profile = self.profiles[cfg.policy]
        self.precise_profiles: dict[str, Profile] = {}
        """Each profile as it runs a precise cycle: its default-penalty ``cost`` scorers charge
        ``prefix.precise_miss_penalty`` per miss (``PrefixConfig``); empty in approximate mode."""
        if cfg.prefix.mode != "approximate":
            self.precise_profiles = {
                n: _with_miss_penalty(p, cfg.prefix.precise_miss_penalty) for n, p in self.profiles.items()
            }
        self._block_tokens = cfg.hashing.block_size / cfg.index.chars_per_token
        self.pd: PDHandler | None = None
        """The ``pd`` profile handler (``pd.enabled``): decode pick, prefill pick, decider."""
        if cfg.pd.enabled:
            self.pd = PDHandler(make_decider(cfg.pd.decider, cfg.pd.decider_params), cfg.pd.link)
        self.accounting = Accounting(clock)
        self.parse_options = ParseOptions(
            lora_adapters=cfg.lora_adapters,
            trust_rewrite=cfg.trust_gateway_headers,
            max_text_chars=cfg.hashing.block_size * cfg.hashing.max_blocks,
            media_tokens=dict(cfg.media_tokens),
        )
        """How request bodies are parsed for this router (its config's view of parsing)."""
        self.calibrator = Calibrator(cfg.calibration)
        for state in pool:
            state.model = cfg.calibration.default_model()
        pool.on_add(lambda s: setattr(s, "model", cfg.calibration.default_model()))
        pcfg = cfg.prefix
        self.precise: PreciseIndex | None = None
        """Fed by the KV-event subscribers (or cluster mode); None in approximate mode."""
        self.syncs: dict[str, Sync] = {}
        """Endpoint key → its event stream's state. Writer: whoever feeds ``precise``."""
        self._pick_listeners: list[Callable[[str, list[int] | None, list[int]], None]] = []
        """Told of every pick (endpoint, KV-block keys, text-block hashes), after its accounting:
        the peer channel (:meth:`add_pick_listener`). Writer: :meth:`add_pick_listener`."""
        self.catch_up = catch_up
        """Called first in every :meth:`route` (:meth:`picker.feeds.drain.Inbox.catch_up`): the KV
        events and peer messages (picks, loads, scrape outcomes) that reached the picker before a
        pick are applied before its candidates are chosen and scored. None: nothing to catch up."""
        if pcfg.mode != "approximate":
            self.precise = PreciseIndex(pcfg.max_blocks_per_endpoint, pcfg.speculative_ttl_s)
            pool.on_remove(lambda s: self._forget_precise(s.key))
        if pcfg.tokenizes:
            self.parse_options = dataclasses.replace(self.parse_options, keep_doc=True)
        pool.on_remove(lambda s: self.index.remove(s.key))
        pool.on_remove(self.calibrator.forget)

    def _forget_precise(self, key: str) -> None:
        assert self.precise is not None, "precise state without a precise index"
        self.precise.remove(key)
        self.syncs.pop(key, None)

    def is_precise(self, key: str) -> bool:
        """Whether ``key``'s prefix matches come from its KV events (else from our own record)."""
        sync = self.syncs.get(key)
        if self.precise is None or sync is None:
            return False
        if sync.state is State.SYNCED:
            return True
        return sync.state is State.WAITING and self.cfg.prefix.mode == "precise"

    def precise_block_size(self) -> int:
        """Tokens per KV block for request keys: configured, else learned from the events or the
        scraped cache config (0: none yet)."""
        if self.cfg.prefix.block_size:
            return self.cfg.prefix.block_size
        if self.precise is None:
            return 0
        if self.precise.block_size:
            return self.precise.block_size
        # no event yet: the scraped vllm:cache_config_info
        return next((s.metrics.block_size for s in self.pool if s.metrics.block_size), 0)

    def cycle(
        self, req: InferenceRequest, candidates: list[EndpointState]
    ) -> tuple[Cycle, list[int], list[int] | None]:
        """The cycle's inputs, the routing text's block hashes (approximate index) and, when
        precise matching applies, the prompt's KV-block keys."""
        priority = self.objectives.priority(req.objective)
        tokens, bs = req.prompt_token_ids, self.precise_block_size()
        exact: list[str] = []
        if tokens is not None and bs and self.precise is not None:  # is_precise, inline (per endpoint)
            syncs, synced = self.syncs, State.SYNCED
            waiting = State.WAITING if self.cfg.prefix.mode == "precise" else None
            exact = [
                e.key
                for e in candidates
                if (sync := syncs.get(e.key)) is not None and (sync.state is synced or sync.state is waiting)
            ]
        if exact:
            return self._precise_cycle(req, candidates, exact, priority)
        text = req.routing_text.encode()
        hashes = self._hash_memo.hashes(text, seed_for(req.model, req.lora, req.cache_salt))
        beyond = max(0, req.prompt_chars - len(req.routing_text))  # text past the cut, 1 byte/char
        block_tokens = self._block_tokens
        if tokens is not None:
            prompt_tokens = max(len(tokens), req.prompt_token_count, req.prompt_token_estimate)
            bs = self.cfg.hashing.block_size
            if hashes and len(text) + beyond <= bs * len(hashes):  # every id's text was hashed
                block_tokens = prompt_tokens / len(hashes)
            elif text:  # ids per byte of the text they stand for, times the bytes in a block
                covered = len(text) if req.prompt_token_count else len(text) + beyond
                block_tokens = len(tokens) * bs / covered
        else:
            prompt_tokens = max(1, int((len(text) + beyond) / self.cfg.index.chars_per_token))
        prompt_tokens += req.media_tokens
        matches = self.index.match_many([e.key for e in candidates], hashes)
        cyc = Cycle(req, prompt_tokens, block_tokens, len(hashes), matches, self.clock(), priority)
        return cyc, hashes, None

    def _precise_cycle(
        self, req: InferenceRequest, candidates: list[EndpointState], exact: list[str], priority: int
    ) -> tuple[Cycle, list[int], list[int] | None]:
        """The cycle counts KV blocks of the engine's block size. Endpoints not routed precisely
        (none, usually: then the routing text is not even hashed) get their approximate
        text-block matches converted to whole KV blocks."""
        assert self.precise is not None and req.prompt_token_ids is not None, "precise cycle without tokens"
        tokens, bs = req.prompt_token_ids, self.precise_block_size()
        keys = self.keys_of(req, bs)
        now = self.clock()
        matches = self.precise.match_many(exact, keys, now)
        rest = [e.key for e in candidates if e.key not in matches] if len(exact) < len(candidates) else []
        hashes: list[int] = []
        if rest:
            seed = seed_for(req.model, req.lora, req.cache_salt)
            hashes = self._hash_memo.hashes(req.routing_text.encode(), seed)
            whole = max(len(tokens), req.prompt_token_estimate)
            block_tokens = whole / len(hashes) if hashes else self._block_tokens
            for k, m in self.index.match_many(rest, hashes).items():
                matches[k] = int(m * block_tokens / bs)
        prompt = max(len(tokens), req.prompt_token_estimate)  # ids cut short: the rest estimated
        cyc = Cycle(req, prompt, float(bs), len(keys), matches, now, priority)
        return cyc, hashes, keys

    @staticmethod
    def keys_of(req: InferenceRequest, bs: int) -> list[int]:
        """``req``'s KV-block keys at ``bs`` tokens per block: those tokenization computed with its
        ids (:attr:`InferenceRequest.prompt_keys`) when at that block size, else computed here."""
        assert req.prompt_token_ids is not None, "keys without token ids"
        if req.prompt_keys is not None and req.prompt_keys_block_size == bs:
            return req.prompt_keys
        return request_keys(req.prompt_token_ids, bs, req.lora, req.cache_salt)

    def route(
        self,
        req: InferenceRequest,
        policy: str | None = None,
        commit: bool = True,
        subset: Collection[str] | None = None,
        prune: bool = True,
    ) -> Decision:
        """Pick for ``req``. ``subset`` (the gateway's subset hint, endpoint keys) limits the
        candidates; an empty subset, or one with no routable endpoint, raises :class:`NoEndpoints`.
        ``prune=False`` scores every candidate (explain); the pick is the same either way
        (:meth:`Profile.run`)."""
        if self.catch_up is not None:
            self.catch_up()
        candidates = self.pool.routable()
        prefills: list[EndpointState] = []
        if self.pd is not None:  # the subset hint limits the destination (decode) pods only
            candidates, prefills = split_roles(candidates)
        if subset is not None:
            candidates = [e for e in candidates if e.key in subset]
            if not candidates:
                raise NoEndpoints("no ready endpoint in the gateway's subset")
        if not candidates:
            raise NoEndpoints("no ready endpoint in the pool")
        self.accounting.expire(candidates)
        if prefills:
            self.accounting.expire(prefills)
        cyc, hashes, keys = self.cycle(req, candidates + prefills if prefills else candidates)
        profile = self.profiles[policy] if policy else self.profile
        if keys is not None:
            profile = self.precise_profiles.get(profile.name, profile)
        k = 1 + self.cfg.fallbacks
        if self.pd is None:
            return Decision(cyc, profile.run(cyc, candidates, k, commit, prune), hashes, keys)
        pcfg = self.cfg.pd
        decode = self._profile(pcfg.decode_policy, keys) if pcfg.decode_policy and not policy else profile
        prefill = self._profile(pcfg.prefill_policy, keys) if pcfg.prefill_policy else profile
        result, pd = self.pd.run(cyc, decode, prefill, candidates, prefills, k, commit, prune)
        return Decision(cyc, result, hashes, keys, pd)

    def _profile(self, name: str, keys: list[int] | None) -> Profile:
        profile = self.profiles[name]
        return self.precise_profiles.get(name, profile) if keys is not None else profile

    def admission(self, req: InferenceRequest) -> tuple[int, int, list[int], float | None]:
        """What flow control needs to queue ``req`` (:mod:`picker.core.flowcontrol`): its
        priority, estimated prompt tokens, routing-text block hashes (locality look-ups), and,
        when it carries a TTFT objective, the best endpoint's TTFT estimate now (else None).
        Nothing is committed; with no routable endpoint the tokens are the text's estimate."""
        priority = self.objectives.priority(req.objective)
        candidates = self.pool.routable()
        if not candidates:
            text = req.routing_text.encode()
            hashes = self._hash_memo.hashes(text, seed_for(req.model, req.lora, req.cache_salt))
            tokens = max(1, int(max(len(text), req.prompt_chars) / self.cfg.index.chars_per_token))
            return priority, tokens, hashes, None
        self.accounting.expire(candidates)
        cyc, hashes, _ = self.cycle(req, candidates)
        best = None
        if req.slo_ttft_ms > 0:
            cost = self.profile.scorer("cost") or CostScorer()
            assert isinstance(cost, CostScorer)
            best = min(cost.estimates(cyc, candidates).values())
        return priority, cyc.prompt_tokens, hashes, best

    def cached_blocks(self, key: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the approximate index says ``key`` holds."""
        return self.index.match(key, hashes) if hashes else 0

    def any_ready(self, subset: Collection[str] | None = None) -> EndpointState:
        """A bodiless request's endpoint (GET /v1/models): the routable one with the fewest
        in-flight requests, with no scheduling, index or accounting work. Never shed."""
        best: EndpointState | None = None
        for e in self.pool.routable():
            if (subset is None or e.key in subset) and (
                best is None or e.load.in_flight_requests < best.load.in_flight_requests
            ):
                best = e
        if best is None:
            raise NoEndpoints("no ready endpoint in the pool" + (" subset" if subset is not None else ""))
        return best

    def start(self, decision: Decision) -> Ticket:
        """The request was sent to the primary: the index records it, accounting charges it."""
        state = decision.primary
        cyc = decision.cycle
        self.index.record(state.key, decision.hashes)
        if decision.keys and self.precise is not None:
            self.precise.speculate(state.key, decision.keys, self.clock())
        uncached = cyc.prompt_tokens - cyc.cached_tokens(state.key)
        prefill = decision.prefill
        ticket = self.accounting.start(
            state,
            cyc.prompt_tokens,
            0 if prefill is not None else uncached,  # disaggregated: its KV arrives over the link
            cyc.matches.get(state.key, 0),
            cyc,
            decision.hashes,
        )
        if prefill is not None:  # the prefill leg (picker.core.accounting: both pods)
            self.index.record(prefill.key, decision.hashes)
            if decision.keys and self.precise is not None:
                self.precise.speculate(prefill.key, decision.keys, self.clock())
            p_uncached = cyc.prompt_tokens - cyc.cached_tokens(prefill.key)
            ticket.leg = self.accounting.start(prefill, cyc.prompt_tokens, p_uncached, leg=True)
        for listener in self._pick_listeners:  # after accounting: the peers hear our load with it in
            listener(state.key, decision.keys, decision.hashes)
            if prefill is not None:
                listener(prefill.key, decision.keys, decision.hashes)
        return ticket

    def add_pick_listener(self, listener: Callable[[str, list[int] | None, list[int]], None]) -> None:
        """Tell ``listener`` of every later pick (endpoint key, KV-block keys or None, text-block
        hashes). The peer channel registers here: it needs the router and the router must reach
        it, so one side of that cycle is a registration, as :meth:`Pool.on_add` is."""
        self._pick_listeners.append(listener)

    def record_remote_pick(self, key: str, keys: Sequence[int], hashes: Sequence[int]) -> None:
        """A peer picker sent a request to ``key``: its KV-block ``keys`` are speculated in the
        precise index (when there is one) and its text-block ``hashes`` recorded in the
        approximate index, as our own picks are. Writer: the peer channel."""
        if keys and self.precise is not None:
            self.precise.speculate(key, keys, self.clock())
        if hashes:
            self.index.record(key, hashes)

    def confirmed_depth(self, key: str, keys: Sequence[int]) -> int:
        """How many of ``keys``' leading blocks ``key``'s own KV events confirm (0 without a
        precise index): what a peer need not be told of a pick there."""
        return self.precise.confirmed_depth(key, keys) if keys and self.precise is not None else 0

    def recredit(self, ticket: Ticket, key: str) -> bool:
        """Move ``ticket`` to endpoint ``key``, the one that served it (Envoy fell back): its
        in-flight counts, pending prefill and prefix-index entry go there.

        The blocks the primary was credited with beyond what it already held are taken back
        from its LRU. Returns False, changing nothing, when the ticket is done, already on
        ``key``, or ``key`` is not in the pool."""
        if ticket.done or key == ticket.state.key:
            return False
        new = self.pool.get(key)
        if new is None:
            return False
        self.index.discard(ticket.state.key, ticket.hashes[ticket.matched_blocks :])
        cyc = ticket.cycle
        matched = cyc.matches.get(key, self.index.match(key, ticket.hashes)) if cyc else 0
        cached = min(ticket.prompt_tokens, int(matched * cyc.block_tokens)) if cyc else 0
        self.accounting.move(ticket, new, ticket.prompt_tokens - cached, matched)
        self.index.record(key, ticket.hashes)
        req = cyc.request if cyc else None
        bs = self.precise_block_size()
        if self.precise is not None and req is not None and req.prompt_token_ids is not None and bs:
            self.precise.speculate(key, self.keys_of(req, bs), self.clock())
        return True

    def first_token(self, ticket: Ticket) -> None:
        """See :meth:`picker.core.accounting.Accounting.first_token`."""
        self.accounting.first_token(ticket)

    def finish(self, ticket: Ticket) -> None:
        self.accounting.finish(ticket)

    def on_scrape(self, state: EndpointState) -> None:
        """``state.metrics`` was just replaced by a successful scrape."""
        self.refresh_capacity(state)
        self.calibrator.observe(state)
        self.accounting.reconcile(state)

    def on_unreachable(self, state: EndpointState) -> None:
        """``state`` stopped answering its scrapes: it may come back restarted, with an empty
        cache, so our own record of what it holds (the approximate index) is dropped. Its precise
        entries are the KV-event subscribers' to drop (:meth:`Subscribers.suspect`)."""
        self.index.remove(state.key)
        self.refresh_capacity(state)

    def refresh_capacity(self, state: EndpointState) -> None:
        """Size the endpoint's LRU from its ``vllm:cache_config_info`` (KV blocks × block tokens),
        clamped to [``segments``, ``max_derived_capacity_blocks``].

        The segmented LRU (:mod:`picker.core.prefix.index`) is guaranteed to retain only the last
        ``(segments - 1) / segments`` of its capacity (it drops its oldest segment whole), so it
        is sized at the engine's KV in hash blocks times ``segments / (segments - 1)``: it then
        always remembers at least as many blocks as the engine can hold, and at most
        ``segments / (segments - 1)`` times as many (figures: bench/results/2026-11-28-scaling.md)."""
        m, icfg = state.metrics, self.cfg.index
        if not (icfg.derive_capacity and m.block_size and m.num_gpu_blocks):
            return
        tokens = m.block_size * m.num_gpu_blocks
        kept = (icfg.segments - 1) / icfg.segments  # the part of its capacity the LRU always keeps
        blocks = math.ceil(tokens * icfg.chars_per_token / self.cfg.hashing.block_size / kept)
        self.index.set_capacity(state.key, min(max(blocks, icfg.segments), icfg.max_derived_capacity_blocks))

    def explain(self, req: InferenceRequest, policy: str | None = None) -> dict[str, object]:
        """Per-endpoint scores and TTFT estimates for ``req``, without sending it anywhere."""
        decision = self.route(req, policy, commit=False, prune=False)
        cyc = decision.cycle
        cost = self.profile.scorer("cost") or CostScorer()
        assert isinstance(cost, CostScorer)
        candidates = self.pool.routable()
        out: dict[str, object] = {
            "policy": policy or self.profile.name,
            "prompt_tokens_est": cyc.prompt_tokens,
            "blocks": cyc.n_blocks,
            "chosen": [e.key for e in decision.chosen],
            "endpoints": {
                e.key: {
                    "matched_blocks": cyc.matches.get(e.key, 0),
                    "prefix_source": "precise"
                    if decision.keys is not None and self.is_precise(e.key)
                    else "approximate",
                    "cached_tokens_est": cyc.cached_tokens(e.key),
                    "ttft_estimate_s": round(cost.estimate(cyc, e), 6),
                    "model": {
                        "prefill_tokens_per_s": round(e.model.prefill_rate, 1),
                        "prefill_source": e.model.prefill_source,
                        "step_base_s": round(e.model.step_base_s, 6),
                        "step_per_seq_s": round(e.model.step_per_seq_s, 7),
                        "step_source": e.model.step_source,
                        "uncached_tokens_per_request": round(e.model.uncached_per_request, 1),
                    },
                    "score": decision.result.scores.get(e.key),
                    "scores": {n: s.get(e.key) for n, s in decision.result.per_scorer.items()},
                    "health": e.health.value,
                    "in_flight_requests": e.load.in_flight_requests,
                    "waiting": e.metrics.waiting,
                    "kv_usage": e.metrics.kv_usage,
                }
                for e in candidates
            },
        }
        if decision.pd is not None:
            v = decision.pd.verdict
            out["pd"] = {
                "prefill": decision.prefill.key if decision.prefill is not None else None,
                "decider": v.reason if v else None,
                "local_ttft_s": round(v.local_s, 6) if v else None,
                "remote_ttft_s": round(v.remote_s, 6) if v else None,
            }
        return out


def _with_miss_penalty(profile: Profile, penalty: float) -> Profile:
    """``profile`` with its ``cost`` scorers that are at the default miss penalty charging
    ``penalty`` instead (new scorer objects; filters and picker shared); itself if none is."""
    default = CostScorer().miss_penalty
    if not any(isinstance(s, CostScorer) and s.miss_penalty == default for _, s, _ in profile.scorers):
        return profile
    scorers = [
        (n, dataclasses.replace(s, miss_penalty=penalty), w)
        if isinstance(s, CostScorer) and s.miss_penalty == default
        else (n, s, w)
        for n, s, w in profile.scorers
    ]
    return Profile(profile.name, profile.filters, scorers, profile.picker, profile.timer)
