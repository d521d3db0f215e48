"""The compiled-step KV copy scanner (paged_jax.worker.hlo_audit) on saved HLO text.

tests/data/hlo/tpu_v6e_qwen2.5-0.5b_2049_pages.hlo.gz: every instruction of the compiled v6e decode step of
Qwen2.5-0.5B (24 layers, 2,049 pages) whose text names a layer's page array ``bf16[2049,2,16,128]``. At that
small cache XLA placed each layer's pages in VMEM and copied them back (one copy-done per layer), beside the
allowed producers: the donated parameters, the in-place scatter fusions, bitcasts and the attention custom
calls.

tpu_v6e_qwen2.5-0.5b_int8_scales_64_columns.hlo.gz: the instructions naming a layer's scale array
``f32[287554,64]`` of the same step with int8 pages at full size, before scale rows were lane-dense: XLA kept
the 64-column array column-major and relayouted it (``copy``) for the attention kernel in every layer.
tpu_v6e_tiny_int8_16385_pages_scales_staged.hlo.gz: tiny (2 layers, unrolled) with int8 pages at 16,385 pages
and lane-dense ``f32[16385,128]`` scales, the scale scatter run in VMEM: layer 0's array prefetched whole
(``copy-done`` into memory space 1), layer 1's in slices (reassembled by a ``ConcatBitcast`` custom call), both
written back (``copy-done``)."""

import gzip
import pathlib

import jax.numpy as jnp

from paged_jax.worker.hlo_audit import WeightCopies, cache_copies, hlo_shape, kv_copies, weight_copies

DATA = pathlib.Path(__file__).parents[1] / "data" / "hlo"
KV = (2049, 2, 16, 128)


def _hlo() -> str:
    return gzip.decompress((DATA / "tpu_v6e_qwen2.5-0.5b_2049_pages.hlo.gz").read_bytes()).decode()


def test_finds_the_copy_of_every_layer():
    """Each layer's pages sliced into VMEM (reassembled by ConcatBitcast) and copied back (copy-done)."""
    bad = kv_copies(_hlo(), KV, jnp.bfloat16)
    assert len(bad) == 48
    assert sum(" copy-done(" in line for line in bad) == 24 and sum("ConcatBitcast" in line for line in bad) == 24


def test_in_place_producers_are_not_copies():
    hlo = _hlo()
    allowed = [
        line
        for line in hlo.splitlines()
        if any(op in line.split("=", 1)[1][:120] for op in (" parameter(", " bitcast(", " custom-call("))
        and "ConcatBitcast" not in line
        or "scatter_fusion" in line.split("=", 1)[0]
    ]
    assert len(allowed) > 24
    assert kv_copies("\n".join(allowed), KV, jnp.bfloat16) == []


def _data(name: str) -> str:
    return gzip.decompress((DATA / name).read_bytes()).decode()


def test_finds_the_relayout_of_narrow_scale_rows():
    """The 64-column scale array of every layer relayouted (copy from column- to row-major) for the kernel."""
    hlo = _data("tpu_v6e_qwen2.5-0.5b_int8_scales_64_columns.hlo.gz")
    bad = kv_copies(hlo, (287554, 64), jnp.float32)
    assert len(bad) == 24 and all(" copy(%scatter_fusion" in line for line in bad)
    pages = ((287554, 2, 16, 128), jnp.int8)  # no page array line in the saved text
    assert cache_copies(hlo, [pages, ((287554, 64), jnp.float32)]) == bad
    assert cache_copies(hlo, [pages]) == []


def test_finds_scale_arrays_staged_in_vmem():
    """Scale arrays prefetched into VMEM for the scatter (whole: copy-done; in slices: ConcatBitcast) and
    written back: four copies for two layers; the in-place producers (parameters, scatter fusions) are not."""
    hlo = _data("tpu_v6e_tiny_int8_16385_pages_scales_staged.hlo.gz")
    bad = kv_copies(hlo, (16385, 128), jnp.float32)
    names = [line.split(" ", 1)[0] for line in bad]
    assert names == ["%copy-done.3", "%copy-done.4", "%custom-call.76", "%copy-done.2"]


def test_other_shapes_and_dtypes_are_ignored():
    hlo = _hlo()
    assert kv_copies(hlo, (2048, 2, 16, 128), jnp.bfloat16) == []
    assert kv_copies(hlo, KV, jnp.int8) == []
    assert hlo_shape(KV, jnp.float8_e4m3fn) == "f8e4m3fn[2049,2,16,128]"


def test_a_transpose_or_plain_copy_is_found():
    lines = [
        "%t = bf16[2049,2,16,128]{2,3,1,0} transpose(bf16[2049,2,16,128]{3,2,1,0} %p), dimensions={0,1,3,2}",
        "%c = bf16[2049,2,16,128]{3,2,1,0} copy(bf16[2049,2,16,128]{3,2,1,0} %p)",
        "%ok = bf16[2049,2,16,128]{3,2,1,0} parameter(3)",
    ]
    assert [b.split(" ", 1)[0] for b in kv_copies("\n".join(lines), KV, jnp.bfloat16)] == ["%t", "%c"]


# Lines of the compiled v6e decode step of Llama-3.1-8B in bfloat16, scanned (32 layers): the layer body's
# dynamic-slices of the stacked qkv_proj (staged in VMEM) and gate_up_proj (written to HBM, T(2,128) tiles),
# the fused computation inside the gate_up one, the entry computation's header and the scan's while loop.
WEIGHTS = [((4096, 8, 6, 128), jnp.bfloat16), ((4096, 2, 14336), jnp.bfloat16), ((14336, 4096), jnp.bfloat16)]


def _weights_hlo() -> str:
    return gzip.decompress((DATA / "tpu_v6e_llama-3.1-8b_scanned_decode_weights.hlo.gz").read_bytes()).decode()


def test_weight_slice_copies_count_per_layer_and_memory_space():
    w = weight_copies(_weights_hlo(), WEIGHTS, 32)
    assert w.hbm_bytes == 32 * 4096 * 2 * 14336 * 2  # 224 MiB of gate_up per layer: 7 GiB per step
    assert w.vmem_bytes == 32 * 4096 * 8 * 6 * 128 * 2
    assert len(w.lines) == 2 and "constant_dynamic-slice_fusion.5.remat" in w.lines[1]


def test_weight_copies_ignore_fusion_insides_and_other_shapes():
    hlo = _weights_hlo()
    assert weight_copies(hlo, WEIGHTS[2:], 32) == WeightCopies(0, 0, [])
    # The dynamic-slice root inside %fused_computation.125 alone (no entry, no while body): not a copy.
    inside = hlo.split("\n}\n")[0]
    assert weight_copies(inside, WEIGHTS, 32).lines == []


# Shapes of Gemma 3 4B's layer (qkv_proj, gate_up_proj) and lines in the form of its compiled steps: XLA:GPU's
# multi-output fusion slicing two layers of a scan step (a while body of 5 trips), and XLA:TPU's relayout of
# the whole stacked qkv_proj in the entry computation.
GEMMA = [((2560, 4, 4, 256), jnp.bfloat16), ((2560, 2, 10240), jnp.bfloat16)]
_GEMMA_HLO = """\
%body (p: (s32[])) -> (s32[]) {
  %f = (bf16[1,2560,4,4,256]{4,3,2,1,0}, bf16[1,2560,4,4,256]{4,3,2,1,0}, s32[]) fusion(%a, %b), kind=kLoop
  %g = bf16[1,2560,4,4,256]{4,3,2,1,0} get-tuple-element(%f), index=0
  %t = (bf16[1,2560,4,4,256]{4,3,2,1,0}, s32[]) tuple(%g, %i)
}

ENTRY %main (p0: bf16[34,2560,4,4,256]) -> bf16[64,2560] {
  %p0 = bf16[34,2560,4,4,256]{4,3,2,1,0:T(4,128)(2,1)} parameter(0)
  %copy.234 = bf16[34,2560,4,4,256]{4,1,3,2,0:T(8,128)(2,1)} copy(%p0)
  %w = (s32[], bf16[34,2560,4,4,256]{4,3,2,1,0}) while(%i), body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""


def test_multi_output_fusion_slices_and_stacked_relayouts_are_found():
    w = weight_copies(_GEMMA_HLO, GEMMA, 34)
    qkv = 2560 * 4 * 4 * 256 * 2
    assert w.hbm_bytes == 2 * 5 * qkv + 34 * qkv  # two layers per trip, 5 trips; the whole stacked array once
    assert [line.split(" ", 1)[0] for line in w.lines] == ["%f", "%copy.234"]
    assert weight_copies(_GEMMA_HLO, GEMMA[1:], 34) == WeightCopies(0, 0, [])


# tiny's down_proj [I=512, H=256] float32 and the compiled v6e 512-token prefill step's relayout of its hidden
# states [T=512, H=256] (an activation of the same shape), beside a scan slice of the stacked weight copied out.
TINY_DOWN = [((512, 256), jnp.float32)]
_TINY_HLO = """\
%body (p: (s32[])) -> (s32[]) {
  %copy-done.2 = f32[512,256]{0,1:T(8,128)} copy-done(%copy-start.2), backend_config={"dma_priority":1}
  %dynamic-slice_fusion.1 = f32[1,512,256]{2,1,0:T(8,128)} fusion(%gte.3, %i), kind=kLoop
}

ENTRY %main (p0: f32[2,512,256]) -> f32[512,256] {
  %w = (s32[], f32[2,512,256]{2,1,0}) while(%i), body=%body, backend_config={"known_trip_count":{"n":"2"}}
}
"""


def test_a_weight_shaped_like_the_steps_activations_is_matched_only_stacked():
    one = 512 * 256 * 4
    assert weight_copies(_TINY_HLO, TINY_DOWN, 2).hbm_bytes == 2 * 2 * one  # both lines, two trips each
    w = weight_copies(_TINY_HLO, TINY_DOWN, 2, tokens=512)  # [512, 256] is also the hidden states' shape
    assert w.hbm_bytes == 2 * one and [line.split(" ", 1)[0] for line in w.lines] == ["%dynamic-slice_fusion.1"]
    assert weight_copies(_TINY_HLO, TINY_DOWN, 2, tokens=64).hbm_bytes == 2 * 2 * one  # another step: both
