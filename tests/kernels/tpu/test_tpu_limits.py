"""The TPU kernel's VMEM and SMEM guards (pallas_kernels.tpu.limits): capacities per generation, the clamped
scoped-VMEM limit, and the block table's SMEM check, which the kernel applies at trace time."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.common import kv_pages_shape
from pallas_kernels.tpu import limits as tpu_limits
from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu

MIB = 2**20


def test_capacities_by_generation():
    assert tpu_limits.vmem_capacity("v5e") == tpu_limits.vmem_capacity("v6e") == 128 * MIB
    assert tpu_limits.vmem_capacity("7x") == 64 * MIB
    # Unknown or no TPU: the smallest current VMEM, so a plan made without the chip fits every chip.
    assert tpu_limits.vmem_capacity(None) == tpu_limits.vmem_capacity("v9z") == 64 * MIB
    assert tpu_limits.smem_capacity("v6e") == MIB


def test_vmem_limit_is_clamped_to_the_chip():
    assert tpu_limits.vmem_limit(4 * MIB, "v6e") == 32 * MIB  # never below XLA's default
    assert tpu_limits.vmem_limit(36 * MIB, "v6e") == 72 * MIB
    assert tpu_limits.vmem_limit(36 * MIB, "7x") == 50 * MIB  # 72 MiB would exceed v7x's 64 MiB
    assert tpu_limits.vmem_limit(60 * MIB, "v5e") == 100 * MIB
    with pytest.raises(ValueError, match="needs 60.0 MiB of VMEM, over the 50 MiB"):
        tpu_limits.vmem_limit(60 * MIB, "7x")


def test_smem_check_names_the_fields():
    tpu_limits.check_smem(64, 3900, 64, "v6e")  # 977 KiB: fits (1,001 KiB compiled for v6e)
    with pytest.raises(ValueError, match="64 sequences x 4096 pages.*max_num_seqs or max_model_len"):
        tpu_limits.check_smem(64, 4096, 64, "v6e")  # 1,025 KiB: failed to compile for v6e


def test_kernel_rejects_a_block_table_over_smem_at_trace_time():
    """64 sequences x 128k tokens in 16-token pages: a 2 MiB block table, refused before Mosaic sees it."""
    max_seqs, max_blocks = 64, 131072 // 16
    args = (
        jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct(kv_pages_shape(1025, 8, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((max_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((max_seqs, max_blocks), jnp.int32),
        jax.ShapeDtypeStruct((max_seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    with pytest.raises(ValueError, match="block table .*SMEM"):
        jax.eval_shape(lambda *a: ragged_paged_attention_tpu(*a, sm_scale=0.1, interpret=True, generation="v6e"), *args)


def _sweep():
    """scripts/checks/check_tpu_compile.py as a module (importing it needs jax only, not libtpu)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[3] / "scripts" / "checks" / "check_tpu_compile.py"
    spec = importlib.util.spec_from_file_location("check_tpu_compile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_second_generation_sweep_takes_every_axis_value_of_the_full_one():
    sweep = _sweep()
    full, second = sweep.CASES, sweep.SECOND_GENERATION_CASES
    assert len(second) < len(full) and set(second) <= set(full)

    def bucket(c):
        return "decode" if c.num_tokens == c.max_seqs else "prefill" if c.max_seqs <= 8 else "mixed"

    axes = {field: (lambda c, f=field: getattr(c, f)) for field in sweep.KernelCase._fields}
    axes |= {"window": lambda c: c.window is not None, "soft_cap": lambda c: c.soft_cap is not None}
    del axes["num_tokens"], axes["max_seqs"]
    axes["bucket"] = bucket
    for name, value in axes.items():
        assert {value(c) for c in second} == {value(c) for c in full}, name
