"""The plain-XLA backend: paged attention as gathers and dense math (quantized pages on CPU, machines without a
compiler)."""
