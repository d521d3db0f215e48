"""The OpenAI-compatible HTTP front (`paged-jax serve --http-port N`), on the gRPC server's engine loop.

protocol (JSON bodies as GenerateRequest) -> front (handlers: the shared validation, admission queue and
metrics) -> responses (OpenAI objects and stream chunks) and errors (OpenAI's error shape) -> app (routes)
-> server (uvicorn in the serving process's event loop).
"""
