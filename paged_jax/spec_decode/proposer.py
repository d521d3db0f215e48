"""What a proposer is: it guesses up to k next tokens for each speculating sequence, before the step that
verifies them.

Proposers see the sequences' tokens only after the previous step's samples reached the host (the engine runs a
speculating batch without the one-step lookahead, `paged_jax.spec_decode.decoder`). Two kinds exist: `ngram` (host
lookup over the sequence's own tokens) and `draft_model` (a smaller model over its own KV pages).

The seam for EAGLE-style heads: such a proposer needs the target's hidden states at the positions each sequence
accepted (the forward step has them, `hidden[logits_indices]` in `paged_jax.runner.step_functions`, before the
LM head). It would return them from the verify step beside the logits and take them in `propose` through
`DraftRequest`; nothing here fakes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from paged_jax.sched.sequence import TokenSequence


@dataclass(slots=True)
class DraftRequest:
    """Propose at most `max_drafts` (>= 1) tokens to follow `seq`'s tokens (all known on the host)."""

    seq: TokenSequence
    max_drafts: int


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Draft tokens for each request, in order (possibly none: nothing worth proposing)."""
        ...

    def release(self, seq_id: str) -> None:
        """Forget a sequence that finished or was aborted (its index, its draft KV pages)."""
        ...
