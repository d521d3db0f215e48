"""What does a runner compile? One `Job` per executable (its key, how to lower it, its shape in words), built from
the runner's `RunnerKey` and its argument specs.

Jobs are lowered only when compiled (argument specs are built then), so building one is cheap: the runner builds
the job of every step it runs, and warm-up (`paged_jax.worker.warmup`) and the ahead-of-time checks
(`paged_jax.engine.aot`) build the same jobs for the shapes a run can reach. The executable store
(`paged_jax.worker.executable_store`) keys its entries by a job key's repr, so every part of a key is a plain
value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels
from paged_jax.config import LINEAR_ATTENTION_TYPES, ModelConfig
from paged_jax.lora import weights as lora_weights
from paged_jax.lora.delta import LoraBatch
from paged_jax.structured.bitmask import mask_words
from paged_jax.worker import xla_flags
from paged_jax.worker.executables import CompilerOptions
from paged_jax.worker.linear_state import linear_backend, state_meta_specs
from paged_jax.worker.paged_attention import PagedMeta
from paged_jax.worker.pending import merge_pending, merge_pending_history
from paged_jax.worker.pooling import pool_rows
from paged_jax.worker.sampler import SamplingMeta, empty_meta
from paged_jax.worker.spec_verify import VerifyRows
from paged_jax.worker.step_functions import LoraShape, StepKey, sample_rows
from paged_jax.worker.step_inputs import SamplerFlags
from pallas_kernels.cpu import paged as cpu_paged


class Job(NamedTuple):
    """One executable to compile: its cache key, how to lower it (argument specs built only then), and its
    shape in words for the log."""

    key: Hashable
    lower: Callable[[], jax.stages.Lowered]
    describe: str
    options: CompilerOptions = ()  # XLA compiler options (`paged_jax.worker.xla_flags`); part of `key` too


def resolved_backend(backend: str, platform: str) -> str:
    """The attention backend `backend` means on `platform`, naming the CPU kernel's library when it is that
    (building and registering it: a stored executable calling it loads only once it is registered)."""
    try:
        resolved = pallas_kernels.resolve_backend(backend, platform)
    except ValueError:
        return backend  # the step's own trace raises the error that names it
    if resolved == "cpu":
        kernel = cpu_paged.kernel()
        return f"cpu:{kernel.library.name}" if kernel is not None else "cpu:unavailable"
    return resolved


def fingerprint(tree) -> str:
    """Shapes, dtypes and shardings of a pytree's leaves: part of an executable's key."""
    leaves = [(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in jax.tree.leaves(tree)]
    return hashlib.sha1(repr((jax.tree.structure(tree), leaves)).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class RunnerKey:
    """What makes two runners' executables interchangeable, as plain values: the `StepKey` the step functions
    are built from (`paged_jax.worker.step_functions`), the attention backend this platform resolves it to (with
    the CPU kernel's library: its ISA path and sources), the block-table width, the width of the sampler's padded
    ids and of the lookahead's merge input (the largest sequence bucket), and the parameters' and pages' avals."""

    step: StepKey
    resolved_backend: str
    max_blocks: int
    max_seq_bucket: int
    params: str  # fingerprint
    kv_pages: str  # fingerprint


@dataclass(frozen=True, slots=True)
class CompileJobs:
    """The jobs of one runner. `params`, `kv_specs` and `lora_specs` are what lowering sees (a background compile
    never touches pages a running step donated); `rep` places the replicated operands (None: the default
    device)."""

    key: RunnerKey
    config: ModelConfig
    params: Any
    kv_specs: Any
    lora_specs: lora_weights.LoraWeights | None
    rep: jax.sharding.Sharding | None
    forward_fn: Any  # jitted `step_functions` forward
    forward_onednn_fn: Any  # the same with oneDNN dots, or None
    prompt_logprobs_fn: Any
    copy_fn: Any
    lora_write_fn: Any  # None without LoRA
    lora: LoraShape | None
    scanned_gpu: bool  # a scanned GPU step with float weights: cuBLAS dots (`xla_flags.forward_compiler_options`)
    num_speculative_tokens: int
    history_len: int

    @property
    def max_seq_bucket(self) -> int:
        return self.key.max_seq_bucket

    def spec(self, *shape: int, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.rep)

    def forward(self, t: int, s: int) -> Job:
        """The forward step of `t` tokens and `s` sequences (with oneDNN dots from ONEDNN_MIN_TOKENS tokens on,
        when the runner uses them: `paged_jax.worker.xla_flags`)."""
        onednn = self.forward_onednn_fn is not None and t >= xla_flags.ONEDNN_MIN_TOKENS
        forward = self.forward_onednn_fn if onednn else self.forward_fn

        def lower() -> jax.stages.Lowered:
            i32 = self.spec
            grouped = self.key.step.grouped
            g = () if grouped is None else (grouped.num_groups,)  # one block table and slot mapping per group
            linear = self.config.model_type in LINEAR_ATTENTION_TYPES
            state = state_meta_specs(t, s, self.spec, linear_backend(self.key.resolved_backend)) if linear else None
            meta = PagedMeta(i32(*g, t), i32(s), i32(*g, s, self.key.max_blocks), i32(s + 1), i32(1), state)  # type: ignore[arg-type]  # abstract leaves stand in for arrays
            assert self.lora is None or self.lora_specs is not None
            lora = None if self.lora_specs is None else LoraBatch(self.lora_specs, i32(t))  # type: ignore[arg-type]  # abstract leaves stand in for arrays
            return forward.lower(self.params, self.kv_specs, i32(t), i32(t), meta, i32(s), lora)

        options = xla_flags.forward_compiler_options(onednn, self.scanned_gpu)
        return Job(("forward", self.key, t, s, options), lower, f"forward tokens={t} seqs={s}", options)

    def sample(self, s: int, suppress_width: int, history_len: int, flags: SamplerFlags, logit_bias_width: int) -> Job:
        """Sampling of `s` rows with the given static flags (do_sample, do_filter, do_penalty, want_logprobs)
        and bias columns. The argument specs are built only when the executable is compiled (this runs every
        step)."""
        verify = self.num_speculative_tokens > 0
        width = self.max_seq_bucket

        def lower() -> jax.stages.Lowered:
            shapes = {k: v.shape for k, v in empty_meta(s, suppress_width, history_len, logit_bias_width).items()}
            dtypes = {k: v.dtype for k, v in empty_meta(1).items()}
            meta = SamplingMeta(**{k: self.spec(*shapes[k], dtype=dtypes[k]) for k in shapes})  # type: ignore[arg-type]  # abstract leaves stand in for arrays
            logits = self.spec(s, self.config.vocab_size, dtype=jnp.float32)
            bitmask = self.spec(s, mask_words(self.config.vocab_size))
            rows = VerifyRows(self.spec(s), self.spec(s)) if verify else None  # type: ignore[arg-type]  # abstract leaves stand in for arrays
            return sample_rows.lower(logits, meta, bitmask, rows, width=width, **SamplerFlags(*flags)._asdict())

        return Job(
            ("sample", self.key, s, suppress_width, history_len, flags, width, verify, logit_bias_width),
            lower,
            f"sample rows={s} suppress={suppress_width} history={history_len} logit_bias={logit_bias_width} "
            + (" ".join(n for n, on in SamplerFlags(*flags)._asdict().items() if on) or "greedy"),
        )

    def prompt_logprobs(self, t: int) -> Job:
        """Prompt logprobs of up to `t` rows of a `t`-token step (`paged_jax.worker.prompt_logprobs`)."""

        def lower() -> jax.stages.Lowered:
            hidden = self.spec(t, self.config.hidden_size, dtype=jnp.dtype(self.config.dtype))
            i32 = self.spec
            return self.prompt_logprobs_fn.lower(self.params, hidden, i32(t), i32(t), i32(1))

        return Job(("prompt_logprobs", self.key, t), lower, f"prompt logprobs tokens={t}")

    def pool(self, t: int, s: int) -> Job:
        """Pooling of up to `t` marked rows of a `t`-token step into `s` segments (`paged_jax.worker.pooling`)."""

        def lower() -> jax.stages.Lowered:
            hidden = self.spec(t, self.config.hidden_size, dtype=jnp.dtype(self.config.dtype))
            return pool_rows.lower(hidden, self.spec(t), self.spec(t), num_segments=s)

        return Job(("pool", self.key, t, s), lower, f"pool tokens={t} seqs={s}")

    def merge(self, t: int) -> Job:
        """The lookahead's merge of the previous step's ids (always `max_seq_bucket` rows) into `t` tokens."""
        i32, width = self.spec, self.max_seq_bucket
        return Job(
            ("merge", self.key, t, width),
            lambda: merge_pending.lower(i32(t), i32(t), i32(width)),
            f"merge tokens={t}",
        )

    def history(self, s: int) -> Job:
        """The lookahead's merge of the previous step's ids into `s` rows of penalty history."""
        i32, width = self.spec, self.max_seq_bucket
        return Job(
            ("history", self.key, s, width),
            lambda: merge_pending_history.lower(i32(s, self.history_len), i32(s), i32(s), i32(width)),
            f"history rows={s} length={self.history_len}",
        )

    def lora_write(self) -> Job:
        """Writing one adapter into one LoRA slot (the slot a traced scalar: one executable for all)."""
        assert self.lora is not None, "a LoRA job of a runner without LoRA"
        lora = self.lora

        def lower() -> jax.stages.Lowered:
            one = lora_weights.abstract_slot(self.config, lora.max_rank, self.key.step.scan)
            arrays = jax.tree.map(lambda x: self.spec(*x.shape, dtype=x.dtype), one)
            scaling = self.spec(dtype=jnp.float32)
            return self.lora_write_fn.lower(self.lora_specs, self.spec(), arrays, scaling)

        return Job(("lora_write", self.key), lower, "lora slot write")

    def copy(self, n: int) -> Job:
        """Copy-on-write of `n` pages on every layer."""
        return Job(
            ("copy", self.key, n),
            lambda: self.copy_fn.lower(self.kv_specs, self.spec(n), self.spec(n)),
            f"copy pages={n}",
        )
