"""paged-jax: a JAX/XLA inference runtime for Llama-style models with PagedAttention."""

from paged_jax.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in jax and the model; import it on first use so `import paged_jax` stays light.
    if name == "LLM":
        from paged_jax.offline.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
