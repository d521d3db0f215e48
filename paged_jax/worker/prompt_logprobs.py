"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logits of the prompt positions that asked, gathered
chunk by chunk, and their logprobs.

The scheduler marks, per scheduled sequence, the prompt positions whose next-token logprob this step computes
(`ScheduledSeq.prompt_logprob_positions`: only the leader of a request that asked, only positions no earlier
step computed, so chunked prefill and recomputation after a preemption each give every position once). The
forward step returns its final hidden states [T, H]; `make_prompt_logprobs` applies the model's LM head to the
marked rows `ROW_BLOCK` at a time (a [ROW_BLOCK, V] buffer, never [T, V], let alone a whole prompt's) and, with
the sampler's own `token_logprobs`, computes each row's logprob of the next prompt token and its top
`MAX_LOGPROBS` alternatives under the raw model distribution. The row count is a loop bound known at run time,
so there is one executable per token bucket and a step costs in proportion to its marked rows; a step without
any runs none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.outputs import TokenLogprob
from paged_jax.sampling_params import MAX_LOGPROBS
from paged_jax.worker.sampler import token_logprobs
from pallas_kernels.common import cdiv

if TYPE_CHECKING:
    from paged_jax.sched.output import SchedulerOutput

ROW_BLOCK = 64  # marked rows per LM-head block


@dataclass(slots=True)
class PromptRows:
    """The step's marked positions as flat token rows, padded to the token bucket `T`."""

    rows: np.ndarray  # [T] i32 index of each marked position in the step's flat tokens (0 for padding)
    targets: np.ndarray  # [T] i32 the prompt token that follows it (whose logprob is asked)
    num_rows: np.ndarray  # [1] i32 marked rows


class PromptLogprobs(NamedTuple):
    """One step's prompt logprobs, row i for the i-th marked position in scheduling order."""

    logprob: Any  # [R] f32 logprob of the next prompt token
    top_ids: Any  # [R, K] i32 the K = MAX_LOGPROBS most likely tokens, most likely first
    top_logprobs: Any  # [R, K] f32

    def entry(self, row: int, token_id: int, k: int) -> TokenLogprob:
        """Row `row` as the output's record of prompt token `token_id`, with its `k` top alternatives."""
        top = [(int(i), float(v)) for i, v in zip(self.top_ids[row, :k], self.top_logprobs[row, :k], strict=True)]
        return TokenLogprob(token_id, float(self.logprob[row]), top)


def num_prompt_rows(sched: SchedulerOutput) -> int:
    return sum(len(item.prompt_logprob_positions) for item in sched.scheduled)


def build_prompt_rows(sched: SchedulerOutput, t: int) -> PromptRows | None:
    """The marked rows of `sched` for token bucket `t`; None when the step has none."""
    n = num_prompt_rows(sched)
    if not n:
        return None
    rows = np.zeros(t, np.int32)
    targets = np.zeros(t, np.int32)
    off = r = 0
    for item in sched.scheduled:
        positions = item.prompt_logprob_positions
        if positions:
            k = len(positions)
            first = off + positions.start - item.start  # flat index of the first marked position
            rows[r : r + k] = np.arange(first, first + k, dtype=np.int32)
            targets[r : r + k] = item.seq.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            r += k
        off += item.num_scheduled  # its new tokens and its drafts
    return PromptRows(rows, targets, np.array([n], np.int32))


def make_prompt_logprobs(model, jit_kwargs: dict | None = None):
    """The jitted prompt-logprob step of `model` (a `CausalLM` with `compute_logits`):

    run(params, hidden [T, H], rows [T] i32, targets [T] i32, num_rows [1] i32) -> PromptLogprobs of [T] rows
    (rows past `num_rows` are zeros). `jit_kwargs`: shardings on a mesh (`paged_jax.sharding.logits_shardings`).
    """

    def run(params, hidden: jax.Array, rows: jax.Array, targets: jax.Array, num_rows: jax.Array) -> PromptLogprobs:
        t = rows.shape[0]
        block = min(ROW_BLOCK, t)
        assert t % block == 0, (t, block)
        k = min(MAX_LOGPROBS, model.config.vocab_size)
        init = PromptLogprobs(jnp.zeros(t, jnp.float32), jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k), jnp.float32))

        def body(i: jax.Array, out: PromptLogprobs) -> PromptLogprobs:
            start = i * block
            r = jax.lax.dynamic_slice(rows, (start,), (block,))
            logits = model.apply(params, hidden[r], method="compute_logits")  # [block, V] f32
            got = token_logprobs(logits, jax.lax.dynamic_slice(targets, (start,), (block,)), k)
            put = jax.lax.dynamic_update_slice
            return PromptLogprobs(*(put(a, b, (start,) + (0,) * (a.ndim - 1)) for a, b in zip(out, got, strict=True)))

        return jax.lax.fori_loop(0, cdiv(num_rows[0], block), body, init)

    return jax.jit(run, **(jit_kwargs or {}))
