"""Which cases the device check runs, in which group and part: full size on a GPU, toy sizes on the CPU backend.

Part 1 holds what decides whether the kernels are right (page-id probes, random inputs against the dense
reference, full-size stacked-cache addressing), ordered by how much each group decides; part 2 the timings,
the large random cases, head_dim 64/256 and the block-config sweep. The case builders are in :mod:`device_cases`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from device_cases import (
    SWEEP_CONFIGS,
    Case,
    Group,
    RandomSpec,
    bandwidth_run,
    env_run,
    probe_case,
    random_case,
    shape_name,
    sweep_best,
    sweep_run,
    timing_case,
)
from device_probe import ProbeShape

# -- the case lists ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """A named batch of sequences in its bucket (the engine's buckets: tokens >= 16, sequences >= 8)."""

    label: str
    seqs: tuple[tuple[int, int], ...]
    num_tokens: int
    max_seqs: int


def _mixed(rng_seed: int, chunks: int, chunk: int, chunk_kv: int, decodes: int, max_kv: int, tokens: int) -> Batch:
    rng = np.random.default_rng(rng_seed)
    seqs = [(chunk, chunk_kv)] * chunks + [(1, int(k)) for k in rng.integers(1, max_kv + 1, decodes)]
    return Batch(f"mixed{tokens}", tuple(seqs), tokens, max(8, 1 << (len(seqs) - 1).bit_length()))


GPU_BATCHES = {
    "decode": Batch("decode-b64x4k", ((1, 4096),) * 64, 64, 64),
    "deep": Batch("decode-b1x32k", ((1, 32768),), 16, 8),  # one sequence: the deepest split-KV
    "prefill": Batch("prefill-8x512@4k", ((512, 4096),) * 8, 4096, 8),
    "mixed": _mixed(0, 2, 512, 2048, 60, 4096, 2048),
}
CPU_BATCHES = {
    "decode": Batch("decode-b4x200", ((1, 200),) * 4, 8, 8),
    "deep": Batch("decode-b1x1000", ((1, 1000),), 16, 8),
    "prefill": Batch("prefill-2x32@96", ((32, 96),) * 2, 64, 8),
    "mixed": Batch("mixed48", ((24, 80), (1, 50), (1, 17), (8, 8)), 48, 8),
}
# (q heads, kv heads) per head_dim: Llama-3.1-8B (128), Llama-3.2-1B (64), a Gemma-like 256.
HEADS = {64: (32, 8), 128: (32, 8), 256: (16, 4)}
Q_DTYPE = {"bfloat16": "bfloat16", "float32": "float32", "int8": "bfloat16", "float8_e4m3fn": "bfloat16"}


def _shape(batch: Batch, head_dim: int, kv_dtype: str, q_dtype: str | None = None, heads=None, **cache) -> ProbeShape:
    qh, kvh = heads or HEADS[head_dim]
    return ProbeShape(
        seqs=batch.seqs,
        num_tokens=batch.num_tokens,
        max_seqs=batch.max_seqs,
        num_q_heads=qh,
        num_kv_heads=kvh,
        head_dim=head_dim,
        page_size=16,
        kv_dtype=kv_dtype,
        q_dtype=q_dtype or Q_DTYPE[kv_dtype],
        **cache,
    )


def _probe_named(group: str, batch: Batch, shape: ProbeShape, backend: str) -> Case:
    case = probe_case(shape, backend)
    return dataclasses.replace(case, name=f"{group}/{batch.label}-{case.name}")


def _stacked(kv_dtype: str, layers: int, over_log2: int) -> dict:
    """A cache of ``layers`` layers (8 KV heads, 16-token pages, head_dim 128) just over 2^over_log2 elements."""
    per_page = 8 * 16 * 2 * 128
    return {"num_layers": layers, "pages_per_layer": 2**over_log2 // (layers * per_page) + 8}


RANDOM_SPECS = [  # the mixed random batches of the kernel tests, at the shapes where the kernels differ
    RandomSpec(0, "float32", None, 8, 2, 128, 16, 64, 8, 80),
    RandomSpec(1, "bfloat16", None, 32, 8, 128, 16, 64, 16, 200),
    RandomSpec(2, "bfloat16", None, 8, 1, 64, 8, 32, 8, 60),
    RandomSpec(3, "float32", None, 8, 8, 256, 32, 32, 8, 100, sliding_window=20),
    RandomSpec(4, "bfloat16", None, 16, 2, 64, 64, 64, 8, 150, soft_cap=30.0),
    RandomSpec(5, "bfloat16", None, 4, 4, 128, 128, 32, 8, 300, sliding_window=64, soft_cap=20.0),
    RandomSpec(6, "bfloat16", None, 14, 2, 64, 16, 16, 8, 3000),  # GQA 7, long: adaptive splits
    RandomSpec(7, "bfloat16", None, 32, 8, 128, 64, 8, 8, 5000, sliding_window=1000, soft_cap=30.0),
    RandomSpec(8, "bfloat16", "int8", 32, 8, 128, 16, 64, 16, 400),
    RandomSpec(9, "bfloat16", "float8_e4m3fn", 9, 3, 64, 16, 64, 8, 300),
    RandomSpec(10, "float32", "int8", 32, 8, 128, 16, 64, 16, 400),  # f32 queries over int8 pages
]
LARGE_RANDOM_SPECS = [
    RandomSpec(11, "bfloat16", None, 32, 8, 128, 16, 64, 64, 0, decode_seqs=(64, 4096)),
    RandomSpec(12, "float32", None, 32, 8, 128, 16, 64, 64, 0, decode_seqs=(64, 4096)),
    RandomSpec(13, "bfloat16", None, 32, 8, 128, 16, 16, 8, 0, decode_seqs=(1, 32768)),
]


def gpu_groups() -> list[Group]:
    """The H200 run: part 1 in about 8 minutes, part 2 after it."""
    b, pk = GPU_BATCHES, "pallas-gpu"
    groups = [Group("env", 1, 90, (Case("env/devices", env_run, {}),))]
    groups.append(Group("bandwidth", 1, 60, (Case("bandwidth/copy-2GiB", bandwidth_run(1 << 29), {"bytes": 2**32}),)))
    for kv in ("bfloat16", "int8", "float32", "float8_e4m3fn"):
        cases = [_probe_named("probe", b[k], _shape(b[k], 128, kv), pk) for k in ("decode", "deep", "prefill", "mixed")]
        cases += [_probe_named("probe", b[k], _shape(b[k], 128, kv), "xla") for k in ("decode", "mixed")]
        if kv == "int8":
            cases.append(_probe_named("probe", b["mixed"], _shape(b["mixed"], 128, kv, "float32"), pk))
        groups.append(Group(f"probe-{kv}", 1, 150, tuple(cases)))
    groups.insert(3, Group("exact", 1, 150, tuple(random_case(s, pk) for s in RANDOM_SPECS)))
    groups.insert(6, Group("exact-xla", 1, 150, tuple(random_case(s, "xla") for s in RANDOM_SPECS)))
    addr = (
        Batch("decode-b8x4k", ((1, 4096),) * 8, 8, 8),
        b["deep"],
        Batch("prefill-2x512@2k", ((512, 2048),) * 2, 1024, 8),
    )
    for kv in ("int8", "bfloat16", "float8_e4m3fn"):
        cases = []
        for layers, log2 in ((2, 31), (4, 32)):
            for batch in addr:
                shape = _shape(batch, 128, kv, **_stacked(kv, layers, log2))
                name = f"addressing/over-2^{log2}-{layers}layers-{batch.label}-{shape_name(shape)}-{pk}"
                cases.append(dataclasses.replace(probe_case(shape, pk), name=name))
        groups.insert(4 if kv == "int8" else len(groups), Group(f"addressing-{kv}", 1, 150, tuple(cases)))
    groups += _gpu_part2()
    return groups


def _gpu_part2() -> list[Group]:
    b, pk = GPU_BATCHES, "pallas-gpu"
    timing = [
        timing_case(f"timing/{b['decode'].label}-d128-{kv}", _shape(b["decode"], 128, kv), pk, 50)
        for kv in ("bfloat16", "int8", "float8_e4m3fn", "float32")
    ]
    timing += [
        timing_case(
            "timing/decode-b8x16k-d128-bfloat16",
            _shape(Batch("b8x16k", ((1, 16384),) * 8, 8, 8), 128, "bfloat16"),
            pk,
            50,
        ),
        timing_case(f"timing/{b['deep'].label}-d128-bfloat16", _shape(b["deep"], 128, "bfloat16"), pk, 50),
        timing_case(f"timing/{b['decode'].label}-d64-bfloat16", _shape(b["decode"], 64, "bfloat16"), pk, 50),
        timing_case(f"timing/{b['prefill'].label}-d128-bfloat16", _shape(b["prefill"], 128, "bfloat16"), pk, 20),
        timing_case(f"timing/{b['decode'].label}-d128-bfloat16-xla", _shape(b["decode"], 128, "bfloat16"), "xla", 20),
    ]
    groups = [Group("timing", 2, 240, tuple(timing))]
    groups.append(Group("exact-large", 2, 150, tuple(random_case(s, pk) for s in LARGE_RANDOM_SPECS)))
    for d in (64, 256):
        cases = [
            _probe_named("probe", b[k], _shape(b[k], d, kv), pk)
            for kv in ("bfloat16", "float32", "int8")
            for k in ("decode", "prefill")
        ]
        groups.append(Group(f"probe-d{d}", 2, 180, tuple(cases)))
    shape = _shape(b["decode"], 128, "bfloat16")
    sweep = [
        Case(
            f"sweep/decode-k{k}-w{w}-s{st}",
            sweep_run(shape, k, w, st),
            {"kv_keys": k, "num_warps": w, "num_stages": st},
        )
        for k, w, st in SWEEP_CONFIGS
    ]
    sweep.append(Case("sweep/best", sweep_best, {"writes": "sweep_best.txt"}))
    groups.append(Group("sweep", 2, 240, tuple(sweep)))
    return groups


def cpu_groups() -> list[Group]:
    """The same code at toy sizes on the CPU backend (XLA path; one case of the GPU kernel in the interpreter)."""
    b = CPU_BATCHES
    heads = (4, 2)
    probe = [
        _probe_named("probe", b["decode"], _shape(b["decode"], 128, "bfloat16", heads=heads), "xla"),
        _probe_named("probe", b["deep"], _shape(b["deep"], 64, "float32", heads=heads), "xla"),
        _probe_named("probe", b["prefill"], _shape(b["prefill"], 128, "int8", heads=heads), "xla"),
        _probe_named("probe", b["mixed"], _shape(b["mixed"], 256, "float8_e4m3fn", heads=heads), "xla"),
        _probe_named("probe", b["mixed"], _shape(b["mixed"], 64, "bfloat16", heads=heads), "pallas-gpu-interpret"),
    ]
    stacked = _shape(b["decode"], 128, "int8", heads=heads, num_layers=3, pages_per_layer=64)
    addr = dataclasses.replace(
        probe_case(stacked, "xla"), name=f"addressing/3layers-top-pages-{shape_name(stacked)}-xla"
    )
    timing = timing_case(
        "timing/decode-b4x200-d128-bfloat16-xla", _shape(b["decode"], 128, "bfloat16", heads=heads), "xla", 5
    )
    return [
        Group("env", 1, 60, (Case("env/devices", env_run, {}),)),
        Group("bandwidth", 1, 60, (Case("bandwidth/copy-8MiB", bandwidth_run(1 << 21), {"bytes": 2**24}),)),
        Group("probe", 1, 120, tuple(probe)),
        Group("exact", 1, 60, (random_case(RANDOM_SPECS[2], "xla"),)),
        Group("addressing", 1, 60, (addr,)),
        Group("timing", 2, 60, (timing,)),
    ]


# What the device check leaves out, and why (summary.json's ``not_covered``).
NOT_COVERED = {
    "engine end to end": "imports flax, tqdm, jinja2, tokenizers, safetensors: not on the bare device image",
    "fused model step vs paged_jax.model.reference": "the model is a flax module: not on the bare device image",
    "cuDNN dot_product_attention baseline": "not built yet",
}


def groups_for(platform: str) -> list[Group]:
    return gpu_groups() if platform == "gpu" else cpu_groups()
