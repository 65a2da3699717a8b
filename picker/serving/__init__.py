"""The serving layer: Envoy ext_proc over gRPC, the metrics and debug HTTP servers, TLS, explain,
telemetry, the body-parse worker and the worker processes. It calls into :mod:`picker.core`.
"""
