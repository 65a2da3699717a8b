"""Reliability runs: fuzzing, forged headers, faults under load and a soak, through a real Envoy and
the picker (``python -m bench.reliability``; the short variants run in tests/reliability)."""
