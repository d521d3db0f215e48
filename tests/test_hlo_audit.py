"""The compiled-step KV copy scanner (paged_jax.worker.hlo_audit) on saved HLO text.

tests/data/hlo/tpu_v6e_qwen2.5-0.5b_2049_pages.hlo.gz: every instruction of the compiled v6e decode step of
Qwen2.5-0.5B (24 layers, 2,049 pages) whose text names a layer's page array ``bf16[2049,2,16,128]``. At that
small cache XLA placed each layer's pages in VMEM and copied them back (one copy-done per layer), beside the
allowed producers: the donated parameters, the in-place scatter fusions, bitcasts and the attention custom
calls."""

import gzip
import pathlib

import jax.numpy as jnp

from paged_jax.worker.hlo_audit import hlo_shape, kv_copies

DATA = pathlib.Path(__file__).parent / "data" / "hlo"
KV = (2049, 2, 16, 128)


def _hlo() -> str:
    return gzip.decompress((DATA / "tpu_v6e_qwen2.5-0.5b_2049_pages.hlo.gz").read_bytes()).decode()


def test_finds_the_copy_of_every_layer():
    bad = kv_copies(_hlo(), KV, jnp.bfloat16)
    assert len(bad) == 24 and all(" copy-done(" in line for line in bad)


def test_in_place_producers_are_not_copies():
    hlo = _hlo()
    allowed = [
        line
        for line in hlo.splitlines()
        if any(op in line.split("=", 1)[1][:120] for op in (" parameter(", " bitcast(", " custom-call("))
        or "scatter_fusion" in line.split("=", 1)[0]
    ]
    assert len(allowed) > 24
    assert kv_copies("\n".join(allowed), KV, jnp.bfloat16) == []


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
