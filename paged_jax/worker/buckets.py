"""Which padded shapes can a step take? Token buckets, sequence buckets and copy buckets.

Each step's inputs are numpy arrays padded to a token bucket `T` (powers of two from 16) and a sequence bucket
`S`. The token-level work (embedding, projections, RoPE, the KV write, the MLP) depends on `T` alone; `S` sizes
the attention metadata, the LM head's rows and sampling, and only the last two cost anything when padded. So `S`
is derived from `T`, `S = bucket(min(T, max_num_seqs))` (a step never holds more sequences than tokens), raised
only when one step samples more rows than that (`n` > 1 samples of a short prompt): one executable per token
bucket, not one per (T, S) pair (docs/benchmarks/host.md).
"""

from __future__ import annotations

from dataclasses import dataclass


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from `lo` up to the first one >= `hi`."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True, slots=True)
class StepBuckets:
    """The buckets of one runner: `tokens` (T), `seqs` (S, up to the sample rows of a full verify step with
    speculation) and `copies` (copy-on-write instructions of one step: at most one per running sequence, so
    these are every copy shape a run can reach; more are chunked)."""

    tokens: list[int]
    seqs: list[int]
    copies: list[int]
    max_num_seqs: int
    num_speculative_tokens: int

    @classmethod
    def make(cls, max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int) -> StepBuckets:
        # verify rows (one per token) and, beside them, one row per child of a forking prompt
        max_rows = max_num_seqs * (1 + num_speculative_tokens)
        if num_speculative_tokens:
            max_rows = min(max_num_batched_tokens + max_num_seqs, max_rows)
        return cls(
            tokens=pow2_buckets(16, max_num_batched_tokens),
            seqs=pow2_buckets(8, max(max_num_seqs, max_rows)),
            copies=pow2_buckets(8, max_num_seqs),
            max_num_seqs=max_num_seqs,
            num_speculative_tokens=num_speculative_tokens,
        )

    def seq_bucket(self, t: int, rows: int = 0) -> int:
        """The sequence bucket of a step of token bucket `t` with `rows` sequences or sample rows:
        `bucket(min(t, max_num_seqs))`, or more when `rows` exceeds that."""
        return bucket_for(max(min(t, self.max_num_seqs), rows), self.seqs)

    def step_seq_buckets(self, t: int, forks: bool = False, fork_rows: int | None = None) -> list[int]:
        """The sequence buckets a step of token bucket `t` can use (warm-up compiles each): `seq_bucket(t)`, and
        with speculation those up to one holding the sample rows of a full verify step (each row is a token).

        `forks`: requests with n > 1 can run. A prompt's last chunk then samples one row per child sequence, so
        a step of few tokens can have up to `max_num_seqs` sample rows (4 prompts x n=16 in 32 tokens: 64), or
        up to `fork_rows` when the caller knows the requests (`paged_jax.worker.ready_shapes.StepNeeds`). With
        speculation too, the verify rows of the step's other sequences (one per token) come on top of the
        children's: up to `t` plus the children (a 14-token verify batch beside a 2-token prompt with n=4
        samples 18 rows in a 16-token step)."""
        lo = self.seq_bucket(t)
        k, m = self.num_speculative_tokens, self.max_num_seqs
        rows = min(t, m * (1 + k))
        if forks:
            children = m if fork_rows is None else min(fork_rows, m)
            rows = max(rows, children if k == 0 else min(t + children, m * (1 + k)))
        hi = self.seq_bucket(t, rows)
        return [s for s in self.seqs if lo <= s <= hi]
