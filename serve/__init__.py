"""The gRPC service (`paged_jax.v1.GenerationService`): `paged-jax serve` (`python -m serve serve`).

config (limits) -> convert (validation, messages) -> engine_loop (the engine's thread) -> servicer
(handlers) -> server (grpc.aio, health, reflection, auth/TLS, drain); metrics, client, cli, codegen.
"""
