"""Command-line flags for the engine options, shared by `paged-jax generate` and `paged-jax serve`; the chat
template and generation-defaults flags also by `paged-jax info` (and their logic by `LLM`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import jax

from paged_jax.config import KV_DTYPE_CHOICES, WEIGHT_QUANTIZATIONS
from paged_jax.config.engine import EngineConfig
from paged_jax.config.generation_defaults import load_generation_defaults
from paged_jax.engine.data_parallel import make_engine
from paged_jax.engine.load import load_model
from paged_jax.tokenization.chat_template import load_chat_template
from paged_jax.worker.executables import enable_persistent_cache
from pallas_kernels.common import BACKENDS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default="tiny",
        help="HF directory, GGUF file, named model (smollm2-135m-instruct), orbax checkpoint from "
        "`paged-jax convert`, or config name (random weights)",
    )
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="override the model dtype")
    g.add_argument(
        "--quantization",
        choices=WEIGHT_QUANTIZATIONS,
        default=None,
        help="quantize the weights at load: int8 / fp8, per-output-channel scales (paged_jax.model.quant)",
    )
    g.add_argument("--seed", type=int, default=0, help="random weights and unseeded requests")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from the memory budget)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.9)
    g.add_argument(
        "--cpu-kv-cache-gib",
        type=float,
        default=None,
        help="KV budget on CPU (default: 4 GiB, capped at half the available memory and at "
        "max-num-seqs x max-model-len tokens)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--chunk-size", type=int, default=None, help="max prompt tokens of one sequence per step")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--attention-backend", choices=BACKENDS, default="auto")
    g.add_argument("--no-warmup", action="store_true", help="compile step shapes lazily instead of at start-up")
    g.add_argument(
        "--kv-dtype",
        choices=KV_DTYPE_CHOICES,
        default=None,
        help="KV page dtype (default: model); int8 / fp8_e4m3 store quantized pages with per-token scales",
    )
    g.add_argument("--watermark", type=float, default=0.01, help="fraction of pages admission keeps free")
    g.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="wait for each step's tokens before scheduling the next (no one-step lookahead)",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s fields: e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
        "(paged_jax.spec.SpeculativeConfig; README: speculative decoding)",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="chips per engine replica")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas on disjoint groups of this host's chips",
    )
    add_lora_args(parser)
    add_model_text_args(parser)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters (paged_jax.lora), vLLM's flags."""
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters beside the base model")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters (PEFT directories) served as their own model names; implies --enable-lora",
    )
    g.add_argument("--max-loras", type=int, default=1, help="adapters resident on the device at once")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    g.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept loaded on the host (default: max-loras)"
    )
    g.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )


def add_model_text_args(parser: argparse.ArgumentParser) -> None:
    """`--chat-template` and `--generation-config`: what the model's files say about text, overridable."""
    g = parser.add_argument_group("chat template and generation defaults")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="jinja2 chat template to use instead of the model's (chat_template.jinja / tokenizer_config)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|none|DIR",
        help="sampling defaults for fields a request leaves unset: auto = the model's "
        "generation_config.json, none = off, or a directory holding one",
    )


def apply_model_text_args(args: argparse.Namespace, tokenizer, ec: EngineConfig | None = None) -> dict:
    """Install `--chat-template` on the tokenizer; return the generation defaults (also set on `ec`)."""
    if args.chat_template is not None:
        tokenizer.chat_template = load_chat_template(None, args.chat_template)
    defaults = load_generation_defaults(args.model, args.generation_config)
    if ec is not None:
        ec.sampling_defaults = dict(defaults)
    return defaults


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        page_size=args.page_size,
        num_pages=args.num_pages,
        cpu_kv_cache_bytes=None if args.cpu_kv_cache_gib is None else int(args.cpu_kv_cache_gib * 2**30),
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        chunk_size=args.chunk_size,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        seed=args.seed,
        warmup=not args.no_warmup,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        kv_dtype=args.kv_dtype,
        watermark=args.watermark,
        async_scheduling=not args.no_async_scheduling,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        speculative_config=args.speculative_config,
    )


def _json_object(text: str) -> dict:
    """A JSON object from the command line (argparse reports the error as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def build_engine(args: argparse.Namespace, warmup: bool | None = None):
    """Load the model named by `--model` and start an engine with the flags' options.

    `warmup=False`: the caller warms up itself (`engine.warmup(plan)`) with the shapes its run needs."""
    # Reuse compiled step shapes across runs (warm-up is most of a short job's start-up on CPU).
    enable_persistent_cache(os.environ.get("PAGED_JAX_COMPILE_CACHE", os.path.expanduser("~/.cache/paged-jax/xla")))
    ec = engine_config_from_args(args)
    if warmup is not None:
        ec.warmup = warmup
    # With several chips per process, load into host memory and let each engine place its shards
    # (the whole model need not fit one chip).
    on_host = ec.tensor_parallel_size * ec.data_parallel_size > 1 and jax.default_backend() != "cpu"
    with jax.default_device(jax.local_devices(backend="cpu")[0]) if on_host else contextlib.nullcontext():
        config, params, tokenizer = load_model(
            args.model, dtype=args.dtype, seed=args.seed, quantization=args.quantization
        )
    apply_model_text_args(args, tokenizer, ec)
    return make_engine(config, params, tokenizer, ec)
