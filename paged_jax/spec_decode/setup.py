"""Building an engine's speculative decoder from its `speculative_config`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_jax.config import LINEAR_ATTENTION_TYPES, ConfigError
from paged_jax.config.speculative import SpeculativeConfig
from paged_jax.spec_decode.decoder import SpecDecoder
from paged_jax.spec_decode.ngram import NgramProposer
from paged_jax.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from paged_jax.config import ModelConfig
    from paged_jax.config.engine import EngineConfig


def make_spec_decoder(
    spec: SpeculativeConfig, target: ModelConfig, ec: EngineConfig, max_model_len: int, num_pages: int
) -> SpecDecoder:
    """The decoder with its proposer; a draft model is loaded and checked against the target here (its KV pool
    has `num_pages`, the target's, unless the config says `draft_num_pages`)."""
    proposer: Proposer
    if spec.method == "draft_model" and target.model_type in LINEAR_ATTENTION_TYPES:
        name = target.model_type
        raise ConfigError(f'speculative_config.method: "draft_model" is not supported for {name!r}; use "ngram"')
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)
    else:
        from paged_jax.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer.load(spec, target, ec, max_model_len, num_pages)
    return SpecDecoder(spec, proposer, max_model_len)
