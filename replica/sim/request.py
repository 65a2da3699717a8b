"""One request's sequence, with vLLM V1's token accounting.

``tokens`` is the prompt followed by the tokens generated so far, so ``num_tokens`` grows by one
per sampled token. A step computes ``tokens[num_computed : num_computed + n]``; when
``num_computed`` reaches ``num_tokens`` the step samples the next token. Prefill, decode and
recompute after preemption (``num_computed`` back to 0, prompt *and* outputs recomputed) are the
same rule. ``hashes`` covers every full block of ``tokens``, extended as outputs fill blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from . import tokenizer
from .blocks import Block, chain_hashes

_ids = itertools.count()


@dataclass(eq=False, slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    block_size: int
    lora: str = ""
    salt: str = ""
    arrival: float = 0.0
    request_id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(init=False)
    hashes: list[int] = field(init=False)
    blocks: list[Block] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0
    """Leading entries of ``blocks`` registered in the prefix cache."""
    num_cached_tokens: int = -1
    """Prefix-cache hit at first admission, in tokens (``usage.prompt_tokens_details``); -1 before."""
    free_until: int = 0
    """Tokens below this were hits: scheduling them again (``charge_cached_tokens``) costs no
    compute. 0 unless that ablation is on."""
    num_preemptions: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    """When the last token was sampled."""
    prev_token_at: float | None = None
    """When the token before it was sampled: ``last_token_at - prev_token_at`` is the latest
    inter-token latency."""
    aborted: bool = False
    ttft_observed: bool = False
    """The HTTP server has observed its time to first token (``replica.sim.server``)."""
    kv_loaded: bool = False
    """P/D: the prompt's KV arrived from a prefill replica; admission computes only the last
    token (a decode step), as vLLM's decode side with a KV connector. Cleared by a preemption:
    the KV is then recomputed here."""

    def __post_init__(self) -> None:
        assert self.prompt and self.max_tokens > 0, "a request needs a prompt and max_tokens >= 1"
        self.tokens = list(self.prompt)
        self.hashes = chain_hashes(self.tokens, self.block_size, self.lora, self.salt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.num_output >= self.max_tokens

    @property
    def in_prefill(self) -> bool:
        """Computing tokens it has not sampled (prompt, or recompute after preemption)."""
        return self.num_computed < self.num_tokens - 1

    def sample(self) -> None:
        """Append the next filler token, and the hash of a block it completes."""
        self.tokens.append(tokenizer.output_token(self.num_output))
        bs, k = self.block_size, len(self.hashes)
        if len(self.tokens) // bs > k:
            parent = self.hashes[-1] if k else None
            self.hashes += chain_hashes(self.tokens, bs, self.lora, self.salt, k, parent)
