"""The H200 compile report read from saved compiler output (tests/data/h200_compile: the PTX, ``ptxas -v`` report
and XLA launch lines of the decode and prefill attention kernels, compiled for sm_90a by
scripts/checks/check_gpu_compile.py), so the parsing that make gpu-check relies on is checked without the CUDA
wheels."""

import gzip
import pathlib

from pallas_kernels.analysis.gpu_aot import _entry_body, clean_loop, kernel_reports, loop_bodies

DATA = pathlib.Path(__file__).parents[2] / "data" / "h200_compile"


def _read(name: str) -> str:
    path = DATA / name
    return gzip.decompress(path.read_bytes()).decode() if name.endswith(".gz") else path.read_text()


def test_decode_kernel_report():
    (r,) = kernel_reports([_read("decode.ptx.gz")], [_read("decode.ptxas.log")], [_read("decode.thunk_sequence.txt")])
    assert r.name == "ragged_paged_attention_gpu_all"
    assert (r.registers, r.spill_bytes, r.shared_memory) == (160, 0, 88064)
    assert (r.grid, r.threads) == ((1, 64, 8), 128)
    assert r.async_copies and not r.tma and r.mma == "mma.sync"  # 16-row decode tiles: below wgmma's 64 rows
    assert r.clean_kv_loop


def test_prefill_kernel_report_without_launch_lines():
    (r,) = kernel_reports([_read("prefill.ptx.gz")], [_read("prefill.ptxas.log")], [])
    assert r.name == "ragged_paged_attention_gpu_prefill"
    assert (r.registers, r.spill_bytes) == (190, 0)
    assert r.shared_memory == -1 and r.grid == (0, 0, 0)  # unknown without XLA's thunk sequence
    assert r.async_copies and r.mma == "wgmma" and r.clean_kv_loop


def test_loop_scanner_tells_the_masked_loop_from_the_interior_one():
    """The prefill kernel has two pipelined MMA loops: the interior blocks (no mask: K and V go from cp.async to
    wgmma) and the boundary blocks (V zeroed by a 16-bit select). Only the first is clean; a kernel with only
    the second (V masked on every step, as before) is reported as not clean."""
    body = _entry_body(_read("prefill.ptx.gz"), "ragged_paged_attention_gpu_prefill")
    mma_loops = [b for b in loop_bodies(body) if "wgmma.mma_async" in b and "cp.async.wait_group" in b]
    assert len(mma_loops) == 2
    masked = [b for b in mma_loops if "selp.b16" in b]
    assert len(masked) == 1
    assert clean_loop(body)
    only_masked = "$L__BB9_1:\n" + masked[0].replace("$L__BB", "$X__BB") + "\n\tbra.uni \t$L__BB9_1;"
    assert not clean_loop(only_masked)
