"""The decode-side P/D sidecar (``python -m replica.pd_sidecar``): :mod:`replica.pd_sidecar.server`."""
