"""kvpick's own gRPC APIs. ``python -m proto`` compiles ``proto/kvpick/**/*.proto`` into ``picker/_proto``."""
