"""The engine: `LLMEngine` (one replica's add_request / step / abort loop), the `Engine` protocol every
engine implements, data-parallel replicas, the output processor, the host side of the lookahead, and the
loading and CLI flags that build an engine."""
