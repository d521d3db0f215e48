"""The engine's command-line flags come from `EngineConfig`'s fields: one place states each default."""

from __future__ import annotations

import argparse
import dataclasses

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.args import ENGINE_FLAGS, add_engine_args, engine_config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_no_flags_is_the_default_engine_config():
    assert engine_config_from_args(parse()) == EngineConfig()


def test_every_flag_sets_its_field():
    args = parse(
        "--page-size", "32", "--num-pages", "99", "--cpu-kv-cache-gib", "0.5", "--max-num-seqs", "3",
        "--no-prefix-caching", "--no-warmup", "--no-async-scheduling", "--kv-dtype", "int8", "-tp", "2",
        "-dp", "3", "--watermark", "0.2", "--seed", "7", "--speculative-config", '{"method": "ngram"}',
    )  # fmt: skip
    ec = engine_config_from_args(args)
    assert (ec.page_size, ec.num_pages, ec.cpu_kv_cache_bytes, ec.max_num_seqs) == (32, 99, 2**29, 3)
    assert (ec.enable_prefix_caching, ec.warmup, ec.async_scheduling) == (False, False, False)
    assert (ec.kv_dtype, ec.tensor_parallel_size, ec.data_parallel_size, ec.watermark, ec.seed) == (
        "int8",
        2,
        3,
        0.2,
        7,
    )
    assert ec.speculative_config.method == "ngram"  # parsed once, into the typed record
    assert args.no_warmup  # the batch job reads this switch by its flag's name


def test_flags_name_real_fields_once():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    named = [flag.field for flag in ENGINE_FLAGS]
    assert set(named) <= fields and len(named) == len(set(named))
