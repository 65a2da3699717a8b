"""The protocol-free core: parse a request, keep the endpoints and their prefix index, score and pick.

Nothing here knows ext_proc, gRPC or HTTP serving; :mod:`picker.serving` wraps it.
"""
