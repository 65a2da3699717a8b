"""Options of the prefix-aware scheduler, from ``KVPICK_*`` environment variables or from
``--additional-config '{"kvpick": {...}}'`` (the latter wins). Every option off means vLLM's
own behaviour, unchanged."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

_TRUE = {"1", "true", "yes", "on"}


@dataclasses.dataclass(frozen=True)
class PrefixAwareOptions:
    """``cache_aware_admission``: the waiting queue serves the longest cached prefix first, but a
    request that has waited ``aging_s`` seconds goes first in FCFS order."""

    cache_aware_admission: bool = False
    aging_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.aging_s >= 0:
            raise ValueError(f"aging_s must be >= 0, got {self.aging_s}")

    @property
    def any_on(self) -> bool:
        return self.cache_aware_admission


def _flag(value: object) -> bool:
    return value is True or str(value).strip().lower() in _TRUE


def load_options(
    env: Mapping[str, str] | None = None, additional: Mapping[str, object] | None = None
) -> PrefixAwareOptions:
    """Read ``KVPICK_CACHE_AWARE_ADMISSION`` and ``KVPICK_AGING_S``, then the ``kvpick`` entry of vLLM's additional config. A bad setting
    raises ``ValueError`` (a configuration error, not a broken invariant: ``python -O`` must not
    skip it); ``python -m replica.vllm`` turns it into a one-line message and exit status 2."""
    env = os.environ if env is None else env
    raw: dict[str, object] = {
        "cache_aware_admission": env.get("KVPICK_CACHE_AWARE_ADMISSION", ""),
        "aging_s": env.get("KVPICK_AGING_S", "2.0"),
    }
    extra = (additional or {}).get("kvpick", {})
    if isinstance(extra, Mapping):
        unknown = set(extra) - set(raw)
        if unknown:
            raise ValueError(f"unknown kvpick options in --additional-config: {sorted(unknown)}")
        raw.update(extra)
    return PrefixAwareOptions(
        cache_aware_admission=_flag(raw["cache_aware_admission"]),
        aging_s=float(str(raw["aging_s"])),
    )
