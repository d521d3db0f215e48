"""XLA:CPU settings: which flags a process ran with (logged so that a benchmark says what it measured).

No flag is set by default. Measured on the 2-core AVX-512 BF16 + AMX machine (November 2026, load average
11-14 from other jobs), the runner's forward step plus greedy sampling at batch 32 on the peers' 56M Llama,
median CPU ms of 10 steps, two interleaved rounds (float32 / bfloat16):

    (none)                                        102.8, 108.7 / 53.1, 55.0
    --xla_cpu_prefer_vector_width=512              98.6,  98.8 / 51.4, 55.2   (about 5% in float32: noise-sized)
    --xla_cpu_experimental_xnn_fusion_type=dot     98.4, 109.4 / 52.2, 56.5   (no change)
    --xla_cpu_use_onednn=true                      98.7, 121.3 / 92.4, 108.7  (bfloat16 1.7-2x slower)

A 32 x 512 x 32,000 matmul (the LM head) in isolation showed the same picture; bfloat16 dots are already
fast without oneDNN (AMX), and a decode step is bound by reading weights and KV from memory, which no flag
changes. `--xla_cpu_enable_fast_math` was not tried on the step: it licenses reassociation and approximate
exp/log, and float32 greedy tokens must stay identical to transformers'.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def log_settings() -> str:
    """The XLA flags in effect (from `XLA_FLAGS`), printed and logged."""
    line = f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    log.info(line)
    print(line)
    return line
