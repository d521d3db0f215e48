"""Prompt lookup (vLLM's "ngram" method): the tokens that followed the latest earlier occurrence of the sequence's
own suffix.

For n from `max_n` down to `min_n`, the last n tokens are looked up among the n-grams that ended earlier in the
sequence (prompt and output); the first hit proposes up to k of the tokens that followed it. The lookup is an
index per sequence, n-gram -> the last position it ended at, extended by the tokens added since the previous step,
so a step costs O(new tokens x (max_n - min_n + 1)) dict operations per sequence whatever its length (a scan of
the whole sequence, even vectorised, grows with it); `scripts/bench/bench_spec.py` times it at batch 64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_jax.spec_decode.proposer import DraftRequest


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-grams (as tuples) -> the index of the last token of their latest occurrence, for every
    n-gram ending before `num_indexed - 1` (the suffix itself is never its own match)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # tokens seen; n-grams ending at positions < num_indexed - 1 are in `ends`


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"ngram proposer: need 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}")
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self.propose_one(r.seq.seq_id, r.seq.all_token_ids, r.max_drafts) for r in requests]

    def propose_one(self, key: str, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) tokens to follow `tokens` (the sequence `key`'s, only ever extended)."""
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = NgramIndex()
        self._extend(index, tokens)
        size = len(tokens)
        ends = index.ends
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = ends.get(tuple(tokens[size - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + min(self.k, max_drafts)]
        return []

    def _extend(self, index: NgramIndex, tokens: list[int]) -> None:
        """Index the n-grams ending at positions [num_indexed - 1, len(tokens) - 1): all but the suffix."""
        ends, lo, hi = index.ends, self.min_n, self.max_n
        for end in range(max(0, index.num_indexed - 1), len(tokens) - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                ends[tuple(tokens[end - n + 1 : end + 1])] = end
        index.num_indexed = len(tokens)

    def release(self, seq_id: str) -> None:
        self.indexes.pop(seq_id, None)
