"""The TPU kernel's on-chip memory limits per generation: the scoped VMEM it asks for, and the SMEM its scalar
operands (the block table above all) take.

Capacities come from jax's own chip table (``pltpu.get_tpu_info_for_chip``, per TensorCore): VMEM 128 MiB on
v5e/v6e, 64 MiB on v5p and v7x; SMEM 1 MiB. An unknown generation (``None``: a compile on a machine with no
TPU, or a chip jax does not list) gets the smallest of the current ones, so a kernel planned without knowing
the chip fits every chip.

Why a guard: the scoped VMEM limit is a compiler parameter, and a request above the chip's VMEM fails in
Mosaic with an error that names neither the model nor the engine setting. The block table is scalar-prefetched
into SMEM whole (``max_seqs x max_blocks`` int32, ``max_blocks = max_model_len / page_size``), so a long
``max_model_len`` with many sequences overflows SMEM (256 sequences x 128k tokens / 16-token pages = 8 MiB).
Both are caught here, at trace time, with the fields to change.
"""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu

_MIB = 2**20
_FALLBACK = "7x"  # the smallest VMEM of the current generations (64 MiB per TensorCore)
_MIN_SCOPED_VMEM = 32 * _MIB  # XLA's default scoped VMEM on v5e/v6e: never ask for less
# Of the chip's VMEM, what the kernel may claim (the rest stays XLA's): 100 MiB of 128 MiB, 50 MiB of 64 MiB.
VMEM_LIMIT_FRACTION = 25 / 32
# SMEM the kernel's scalar operands must leave to Mosaic and XLA: compiled for v6e, a call whose operands took
# 1,001 KiB of the 1 MiB compiled and one of 1,025 KiB failed 4.6 KiB over capacity (about 6 KiB theirs).
SMEM_RESERVE = 16 * 1024


def _info(generation: str | None):
    try:
        chip = pltpu.ChipVersion(generation or _FALLBACK)
    except ValueError:
        chip = pltpu.ChipVersion(_FALLBACK)
    return pltpu.get_tpu_info_for_chip(chip, 1)


def vmem_capacity(generation: str | None) -> int:
    """Bytes of VMEM of one TensorCore of ``generation`` (``"v5e"``, ``"v6e"``, ``"7x"``, ...; None: unknown)."""
    return _info(generation).vmem_capacity_bytes


def smem_capacity(generation: str | None) -> int:
    """Bytes of SMEM of one TensorCore of ``generation``."""
    return _info(generation).smem_capacity_bytes


def vmem_limit(need: int, generation: str | None) -> int:
    """The scoped VMEM limit of one ``pallas_call`` that holds ``need`` bytes per grid step: twice that (room
    for Mosaic's own temporaries), at least XLA's default, at most :data:`VMEM_LIMIT_FRACTION` of the chip's
    VMEM. ValueError when ``need`` itself does not fit under that ceiling."""
    ceiling = int(vmem_capacity(generation) * VMEM_LIMIT_FRACTION)
    if need > ceiling:
        raise ValueError(
            f"TPU attention: one grid step needs {need / _MIB:.1f} MiB of VMEM, over the {ceiling / _MIB:.0f} MiB"
            f" the kernel may use on {generation or 'an unknown TPU'} (fewer KV heads per chip: a larger"
            " tensor_parallel_size, or a smaller page_size)"
        )
    return min(max(2 * need, _MIN_SCOPED_VMEM), ceiling)


def smem_bytes(max_seqs: int, max_blocks: int, num_items: int) -> int:
    """SMEM of one call's scalar operands: kv_lens, the block table, cu_q_lens, the three item arrays and the
    stats output (int32 each)."""
    return 4 * (max_seqs + max_seqs * max_blocks + max_seqs + 1 + 5 * num_items + 1)


def check_smem(max_seqs: int, max_blocks: int, num_items: int, generation: str | None) -> None:
    """ValueError naming the engine fields when the call's scalar operands (:func:`smem_bytes`, the block table
    of ``max_seqs x max_blocks`` above all) do not fit the chip's SMEM less :data:`SMEM_RESERVE`."""
    need, budget = smem_bytes(max_seqs, max_blocks, num_items), smem_capacity(generation) - SMEM_RESERVE
    if need > budget:
        raise ValueError(
            f"TPU attention: the block table ({max_seqs} sequences x {max_blocks} pages, int32) and the other"
            f" scalar operands need {need / 1024:.0f} KiB of SMEM, over the {budget / 1024:.0f} KiB budget of"
            f" {generation or 'an unknown TPU'}: lower max_num_seqs or max_model_len, or raise page_size"
            " (max_blocks = max_model_len / page_size)"
        )
