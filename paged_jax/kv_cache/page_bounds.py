"""Page geometry the host side needs without JAX: the page sizes the attention kernels accept, and the
ceiling division that turns a token count into a page count.

The kernels (`pallas_kernels.common`) state the same bounds for their own validation; the KV cache keeps its
copy so that the host-side bookkeeping imports neither JAX nor the kernels (a test keeps the two equal).
"""

from __future__ import annotations

MIN_PAGE_SIZE, MAX_PAGE_SIZE = 8, 256  # token slots per page: a power of two in this range


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints: pages needed for `a` tokens at `b` slots per page."""
    return -(-a // b)
