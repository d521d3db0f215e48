"""The CPU decode step reads every layer weight in place: no copy of a weight-sized buffer per step.

A scanned decoder on XLA:CPU copies each layer's weight slices out of the stacked arrays before its dots (every
step, `paged_jax.model.scan.use_scan`), so "auto" runs the layers unrolled on CPU. These tests compile the
runner's own decode step and read its HLO (`paged_jax.worker.hlo_audit.weight_copies`): deterministic, no timing.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax.engine.aot import step_job
from paged_jax.model.cpu_weights import CPU_WEIGHTS
from paged_jax.model.scan import LAYERS
from paged_jax.worker.hlo_audit import weight_copies, with_matrix_forms
from paged_jax.worker.runner import ModelRunner


def _runner(config, params, scan_layers: str) -> ModelRunner:
    return ModelRunner(
        config,
        params,
        num_pages=64,
        page_size=16,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        scan_layers=scan_layers,
    )


def _layer_shapes(runner: ModelRunner) -> list[tuple[tuple[int, ...], np.dtype]]:
    """One layer's weights (`(shape, dtype)` per leaf) and their matrix forms; stacked leaves without the layer axis."""
    tree = runner.params["params"]
    leaves = jax.tree.leaves(tree[LAYERS] if runner.scan else tree["layers_0"])
    leaves += jax.tree.leaves(runner.params.get(CPU_WEIGHTS, {}).get("layers_0", {}))  # packed for the CPU GEMM
    return with_matrix_forms([(tuple(x.shape[1:] if runner.scan else x.shape), np.dtype(x.dtype)) for x in leaves])


def _decode_weight_copies(runner: ModelRunner):
    hlo = step_job(runner, "decode").lower().compile().as_text()
    return hlo, weight_copies(hlo, _layer_shapes(runner), runner.config.num_layers)


def test_auto_cpu_decode_step_copies_no_weight(tiny_config, tiny_params):
    """The default CPU engine's decode step: layers unrolled, every dot reading its parameter where it lies."""
    runner = _runner(tiny_config, tiny_params, "auto")
    assert not runner.scan
    hlo, copies = _decode_weight_copies(runner)
    assert " while(" not in hlo
    assert copies.hbm_bytes == 0, copies.lines


def test_scanned_cpu_decode_step_copies_every_layer_weight(tiny_config, tiny_params):
    """Why "auto" does not scan on CPU: the scanned step copies each layer's four projection weights (all of the
    tiny model's are at least 256 KiB) out of the stacked arrays, on every trip of the layer loop; the check above
    sees it (this is the copy that made the scanned CPU step slower)."""
    runner = _runner(tiny_config, tiny_params, "on")
    assert runner.scan
    hlo, copies = _decode_weight_copies(runner)
    assert " while(" in hlo
    c = tiny_config
    g = c.num_heads // c.num_kv_heads
    per_layer = c.hidden_size * (c.num_kv_heads * (g + 2) * c.head_dim + c.num_heads * c.head_dim)
    per_layer += 3 * c.hidden_size * c.intermediate_size  # gate_up [H, 2, I] and down [I, H]
    assert copies.hbm_bytes == per_layer * 4 * c.num_layers, copies.lines


@pytest.mark.parametrize("shape, forms", [((4, 2, 3), [(4, 6), (8, 3)]), ((5, 7), [])])
def test_matrix_forms(shape, forms):
    got = with_matrix_forms([(shape, np.float32)])
    assert got == [(shape, np.float32)] + [(f, np.float32) for f in forms]
