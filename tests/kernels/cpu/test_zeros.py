"""The lazily mapped CPU zeros (pallas_kernels.cpu.zeros) behind the CPU KV cache: exact zeros over reused,
poisoned memory at every size and alignment, XLA's own buffer (a donating step updates it in place), and no
full-size fill at allocation (counted in resident memory, not timed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config import ModelConfig
from paged_jax.worker.kv_allocation import allocate_kv
from pallas_kernels.cpu import paged as cpu_paged
from pallas_kernels.cpu import zeros as cpu_zeros

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="the CPU kernel needs a C++ compiler (g++)")

MIB = 1 << 20


def _resident_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize(
    "shape, dtype",
    [((3,), jnp.float32), ((1000, 37), jnp.float32), ((257, 3, 16, 128), jnp.bfloat16), ((64, 2, 8, 128), jnp.float32)],
)
def test_zeros_are_exact_over_reused_poisoned_memory(shape, dtype):
    for _ in range(3):  # freed NaN buffers of the same size are what the allocator hands out next
        poison = jnp.full(shape, jnp.nan, dtype)
        poison.block_until_ready()
        del poison
        z = cpu_zeros.zeros(shape, dtype)
        assert z is not None and z.shape == shape and z.dtype == dtype
        assert not np.asarray(z).view(np.uint8).any()  # every byte 0: no NaN, no -0.0


def test_a_donating_step_updates_the_zeros_in_place_and_reads_zeros_elsewhere():
    shape = (512, 2, 8, 128)
    z = cpu_zeros.zeros(shape, jnp.float32)
    before = z.unsafe_buffer_pointer()
    step = jax.jit(lambda kv, i: kv.at[i].set(1.0), donate_argnums=0)
    kv = step(z, 5)
    assert kv.unsafe_buffer_pointer() == before  # XLA's own buffer: donated, not copied
    expected = np.zeros(shape, np.float32)
    expected[5] = 1.0
    np.testing.assert_array_equal(np.asarray(kv), expected)


def test_the_cpu_kv_cache_is_allocated_without_a_full_size_fill():
    config = ModelConfig(num_layers=1, num_kv_heads=4, hidden_size=512, num_heads=8, intermediate_size=64)
    pages = 2048  # 2048 pages x 4 heads x 16 slots x 128 floats = 64 MiB
    base = _resident_mib()
    caches = [allocate_kv(config, pages, 16, jnp.float32, None, "cpu") for _ in range(8)]  # 512 MiB in all
    grown = _resident_mib() - base
    assert caches[0].shape == (pages, 4, 16, 128)
    assert grown < 64, f"{grown:.0f} MiB resident after allocating 512 MiB of pages"
    written = caches[0].at[7].set(2.0)  # a page written is backed, the rest still reads zeros
    assert float(written[7].sum()) == 2.0 * 4 * 16 * 128 and float(jnp.abs(written).sum()) == 2.0 * 4 * 16 * 128
