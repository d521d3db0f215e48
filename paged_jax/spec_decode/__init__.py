"""Speculative decoding: proposers guess the next tokens of a sequence, one step of the target scores them all.

- `SpeculativeConfig` (in `paged_jax.config.speculative`: `LLM(..., speculative_config={...})`,
  `--speculative-config JSON`), parsed once into `EngineConfig`.
- `proposer`: the interface every proposer implements; `ngram`: prompt lookup on the host; `draft_model`: a smaller
  model with its own runner and KV pages.
- `verify`: which rows a verify step keeps, on the device.
- `decoder`: the engine's side: who speculates, the drafts each step, settling the KV after it, the metrics.

How a step verifies: a speculating sequence schedules its last token plus k drafts (the scheduler reserves their KV
slots inside the token budget, `paged_jax.sched.scheduler`); the forward step scores all 1 + k positions; the sampler
draws one token per position from the target's distribution, exactly as it would without speculation; a position's
token is kept while every earlier draft equals the token drawn before it (`verify.mask_rejected`). For greedy rows
that is the longest prefix equal to the target's argmax plus the target's next token. For sampled rows the drafts
here are point masses (q = 1 on the draft), and then "draw y from p, accept the draft x iff y == x" is the
standard rejection rule: x is kept with probability p(x) = min(1, p(x) / q(x)), and on rejection y is distributed
as normalize(max(0, p - q)) = p without x. So the output distribution is the target's, and with the same seed the
tokens are those of a run without speculation.
"""

from paged_jax.config.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from paged_jax.spec_decode.stats import SpecStats

__all__ = ["MAX_SPECULATIVE_TOKENS", "SpecStats", "SpeculativeConfig"]
