"""Local processes for ``make run``, the benchmarks and the tests: one launcher (:class:`Stack`:
the picker behind a real Envoy), one set of children (:class:`Procs`), one ``free_port`` and
``wait_port``. Also the fakes that stand in where the real part cannot run here: model servers
that answer instantly (:mod:`kvlaunch.upstream`) and a Kubernetes API server
(:mod:`kvlaunch.fakekube`)."""

from .procs import ENVOY, PY, ROOT, Procs, Stopper, free_port, http, post_json, wait_healthy, wait_port
from .stack import Stack, stack

__all__ = [
    "ENVOY",
    "PY",
    "ROOT",
    "Procs",
    "Stack",
    "Stopper",
    "free_port",
    "http",
    "post_json",
    "stack",
    "wait_healthy",
    "wait_port",
]
