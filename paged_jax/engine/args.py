"""Command-line flags for the engine options, shared by `paged-jax generate` and `paged-jax serve`; the chat
template and generation-defaults flags also by `paged-jax info` (and their logic by `LLM`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from paged_jax.config import KV_DTYPE_CHOICES, WEIGHT_QUANTIZATIONS
from paged_jax.config.engine import REASONING_PARSERS, SCAN_CHOICES, TOOL_CALL_PARSERS, EngineConfig
from paged_jax.config.generation_defaults import load_generation_defaults
from paged_jax.config.pooling import read_pooler
from paged_jax.engine.compile_cache import use_compile_cache
from paged_jax.engine.data_parallel import make_engine
from paged_jax.engine.load import load_model
from paged_jax.errors import UsageError
from paged_jax.model.loader.named import NAMED_MODELS
from paged_jax.model.loader.resolve import ModelSource, resolve_model
from paged_jax.pooling_params import POOLING_TYPES
from paged_jax.tokenization.chat_template import load_chat_template
from pallas_kernels.common import BACKENDS

log = logging.getLogger(__name__)
MODEL_HELP = (
    "a Hugging Face directory, GGUF file, Hugging Face id in the local hub cache (ORG/NAME), named model "
    "(smollm2-135m-instruct), orbax checkpoint from `paged-jax convert`, or a config name such as tiny "
    "(random weights)"
)


def setup_logging() -> None:
    """The commands' log: INFO of our own, JAX's platform probe ("Unable to initialize backend 'tpu'" on a
    machine without one) only when it is a warning."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=None, help=f"the model (required): {MODEL_HELP}")
    g.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="override the model dtype (default: its own)"
    )
    g.add_argument(
        "--quantization",
        choices=WEIGHT_QUANTIZATIONS,
        default=None,
        help="quantize the weights at load: int8 / fp8, per-output-channel scales (paged_jax.model.quant)",
    )
    for flag in ENGINE_FLAGS:
        flag.add_to(g)
    add_lora_args(parser)
    add_model_text_args(parser)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters (paged_jax.lora), vLLM's flags."""
    g = parser.add_argument_group("LoRA adapters")
    LORA_FLAGS[0].add_to(g)
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters (PEFT directories) served as their own model names; implies --enable-lora",
    )
    for flag in LORA_FLAGS[1:]:
        flag.add_to(g)
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


def check_model_text_args(args: argparse.Namespace) -> None:
    """UsageError naming the flag when `--chat-template` is not a readable template or `--generation-config` is
    neither auto, none nor a directory: checked before the model loads, not after."""
    if args.chat_template is not None:
        try:
            load_chat_template(None, args.chat_template)
        except (ValueError, OSError) as e:
            why = str(e) if isinstance(e, ValueError) else f"{args.chat_template}: {e.strerror}"
            why = why.removeprefix("chat_template: ").removeprefix("--chat-template ")
            raise UsageError(f"--chat-template: {why}") from None
    setting = args.generation_config
    if setting not in ("auto", "none") and not Path(setting).is_dir():
        raise UsageError(f"--generation-config: {setting} is not a directory (give auto, none or a directory)")


def apply_model_text_args(args: argparse.Namespace, tokenizer, ec: EngineConfig | None = None) -> dict:
    """`apply_model_text` with the flags of `add_model_text_args`."""
    return apply_model_text(args.model, tokenizer, args.chat_template, args.generation_config, ec)


def apply_model_text(
    model: str | Path | ModelSource,
    tokenizer,
    chat_template: str | None = None,
    generation_config: str = "auto",
    ec: EngineConfig | None = None,
) -> dict:
    """Install the `chat_template` file (when given) on the tokenizer; return `model`'s generation defaults
    (`generation_config`: "auto", "none" or a directory), also set on `ec` with the model's pooler (embeddings,
    `paged_jax.config.pooling`, with `ec.pooling` as its override)."""
    if chat_template is not None:
        tokenizer.chat_template = load_chat_template(None, chat_template)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    folder = source.path if source.path is not None and source.path.is_dir() else None
    defaults = load_generation_defaults(folder, generation_config)
    if ec is not None:
        ec.sampling_defaults = dict(defaults)
        ec.pooler = read_pooler(folder, ec.pooling)
    return defaults


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags of `add_engine_args` describe (`--lora-modules` implies `--enable-lora`),
    validated with its speculative config: UsageError naming the flag, before any model loads."""
    flags = (*ENGINE_FLAGS, *LORA_FLAGS)
    fields = {flag.field: flag.value(args) for flag in flags}
    fields["enable_lora"] = fields["enable_lora"] or bool(args.lora_modules)
    try:
        ec = EngineConfig(**fields)  # parses the speculative config
        ec.validate()
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        head = field.split(".", 1)[0]
        flag = next((f.flag for f in flags if f.field == head), None)
        sub = field[len(head) :].removeprefix(".")
        raise UsageError(f"{flag}: {sub + ': ' if sub else ''}{why}" if flag and why else str(e)) from None
    return ec


def _json_object(text: str) -> dict:
    """A JSON object from the command line (argparse reports the error as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class EngineFlag:
    """The command-line flag of one `EngineConfig` field: `--<field>` (or `name`), typed and defaulted by the
    field itself, so a default is stated once. `negate`: a `--no-...` switch for a field that defaults to
    True; `scale`: the flag's unit in the field's (GiB -> bytes); `parse`: a type the field's annotation
    does not give (JSON)."""

    field: str
    help: str
    name: str | None = None
    short: str | None = None
    choices: tuple[str, ...] | None = None
    negate: bool = False
    scale: int | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # other spellings (vLLM's name where ours differs)
    negated_alias: str | None = None  # with a `--x/--no-x` pair: an old `--no-...` spelling of `--no-x`

    @property
    def flag(self) -> str:
        return self.name or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def add_to(self, group) -> None:
        default = _FIELDS[self.field].default
        if self.negate:
            assert default is True, f"{self.field}: a --no- switch needs a field that defaults to True"
        if self.negated_alias is not None:  # --x / --no-x, and the old spelling of --no-x
            group.add_argument(self.flag, action=argparse.BooleanOptionalAction, default=default, help=self.help)
            no = "--no-" + self.flag.removeprefix("--")
            group.add_argument(self.negated_alias, dest=self.dest, action="store_false", help=f"the same as {no}")
            return
        if self.negate or default is False:  # a switch: --no-<x> turns a True field off, --<x> a False one on
            group.add_argument(self.flag, *self.aliases, action="store_true", help=self.help)
            return
        names = (self.flag, *self.aliases, *((self.short,) if self.short else ()))
        parse = self.parse or _scalar_type(self.field)
        if self.scale is not None:
            parse = float
        group.add_argument(
            *names,
            dest=self.dest,
            type=parse,
            default=default,
            choices=self.choices,
            metavar=self.metavar,
            help=self.help,
        )

    def value(self, args: argparse.Namespace) -> Any:
        value = getattr(args, self.dest)
        if self.negate:
            return not value
        if self.scale is not None and value is not None:
            return int(value * self.scale)
        return value


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_HINTS = typing.get_type_hints(EngineConfig)


def _scalar_type(name: str) -> type:
    """int / float / str of a field annotated `T` or `T | None`."""
    hint = _HINTS[name]
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    return kinds[0]


def _kv_dtype(text: str) -> str | None:
    """`--kv-dtype` / vLLM's `--kv-cache-dtype`: "auto" is the model's dtype, "fp8" is fp8_e4m3."""
    value = {"auto": None, "fp8": "fp8_e4m3"}.get(text, text)
    if value is not None and value not in KV_DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(f"must be one of auto, {', '.join(KV_DTYPE_CHOICES)}, fp8; got {text!r}")
    return value


LORA_FLAGS = (
    EngineFlag("enable_lora", "serve PEFT LoRA adapters beside the base model"),
    EngineFlag("max_loras", "adapters resident on the device at once"),
    EngineFlag("max_lora_rank", "the largest adapter rank"),
    EngineFlag("max_cpu_loras", "adapters kept loaded on the host (default: max-loras)"),
)
ENGINE_FLAGS = (
    EngineFlag("seed", "random weights and unseeded requests"),
    EngineFlag("page_size", "token slots per KV page (vLLM: --block-size)", aliases=("--block-size",)),
    EngineFlag("num_pages", "KV pages (default: from the memory budget)"),
    EngineFlag(
        "kv_cache_memory_fraction",
        "share of the accelerator memory left after the weights that KV pages take (vLLM's "
        "--gpu-memory-utilization, which counts the weights too, is accepted as this flag)",
        aliases=("--gpu-memory-utilization",),
    ),
    EngineFlag(
        "cpu_kv_cache_bytes",
        "KV budget on CPU (default: 4 GiB, capped at half the available memory and at "
        "max-num-seqs x max-model-len tokens)",
        name="--cpu-kv-cache-gib",
        scale=2**30,
    ),
    EngineFlag(
        "kv_host_cache_gib",
        "host memory for prefix blocks evicted from the KV pages, copied back instead of recomputed (0: off; "
        "default: off on CPU, 30%% of the available host memory on TPU/GPU)",
    ),
    EngineFlag(
        "kv_disk_cache_dir",
        "a directory of prefix blocks that survives restarts, written behind and checked on read (default: off)",
    ),
    EngineFlag("kv_disk_cache_gib", "the most the disk tier's directory holds (least recently used files go first)"),
    EngineFlag(
        "kv_preemption_mode",
        "a preempted request with a host tier: swap its pages to host memory when the cost model says copying is "
        "cheaper than recomputing (auto), always (swap) or never (recompute)",
        choices=("auto", "swap", "recompute"),
    ),
    EngineFlag(
        "kv_restore_pages_per_step",
        "host -> device KV page copies per step (prefix-hit restores and swap-ins), so decodes are not stalled",
    ),
    EngineFlag("max_num_seqs", "sequences in one step (the decode batch)"),
    EngineFlag(
        "structured_fill_budget_s",
        "host seconds one structured-output row may take in a step (its mask fill, its grammar advance); a row past "
        "it ends with finish_reason error, the others go on",
    ),
    EngineFlag("max_num_batched_tokens", "tokens in one step (decodes and prompt chunks together)"),
    EngineFlag("max_model_len", "prompt + output tokens per sequence (default: the model's maximum, at most 8192)"),
    EngineFlag("chunk_size", "max prompt tokens of one sequence per step (default: the step's token budget)"),
    EngineFlag(
        "enable_prefix_caching",
        "reuse the KV pages of prompt prefixes already computed",
        negated_alias="--no-prefix-caching",
    ),
    EngineFlag(
        "state_snapshots",
        "linear-attention hybrids (Qwen3.5): recurrent-state snapshots kept for the prefix cache, each the memory of "
        "one sequence's state (default: max_num_seqs)",
    ),
    EngineFlag(
        "state_snapshot_interval",
        "linear-attention hybrids: tokens between state snapshots inside a long prompt (whole pages; each prompt's "
        "last full block is always one)",
    ),
    EngineFlag("attention_backend", "the paged attention kernel (auto: the platform's fastest)", choices=BACKENDS),
    EngineFlag(
        "scan_layers",
        "the layers as scanned steps (on; auto on TPU and GPU, and on CPU for sliding-window models, whose KV "
        "cache groups need it) or unrolled (off; auto on CPU otherwise, where XLA copies a scanned layer's "
        "weights every step)",
        choices=SCAN_CHOICES,
    ),
    EngineFlag(
        "hybrid_kv",
        "full-length KV pages for sliding-window layers too (no KV cache groups)",
        name="--no-hybrid-kv",
        negate=True,
    ),
    EngineFlag("warmup", "compile step shapes lazily instead of at start-up", name="--no-warmup", negate=True),
    EngineFlag(
        "kv_dtype",
        "KV page dtype: auto (the model's), float32, bfloat16, or quantized pages with per-token scales: int8, "
        "fp8_e4m3 (fp8)",
        aliases=("--kv-cache-dtype",),
        parse=_kv_dtype,
        metavar="DTYPE",
    ),
    EngineFlag("watermark", "fraction of pages admission keeps free"),
    EngineFlag(
        "async_scheduling",
        "wait for each step's tokens before scheduling the next (no one-step lookahead)",
        name="--no-async-scheduling",
        negate=True,
    ),
    EngineFlag(
        "speculative_config",
        'speculative decoding, vLLM\'s fields: e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
        "(paged_jax.config.speculative.SpeculativeConfig; docs/user/speculative_decoding.md)",
        parse=_json_object,
        metavar="JSON",
    ),
    EngineFlag(
        "reasoning_parser",
        "how a thinking model's reply is split into reasoning_content and content: auto (from the chat "
        "template), none, or a family (docs/user/reasoning.md)",
        choices=REASONING_PARSERS,
    ),
    EngineFlag(
        "tool_call_parser",
        "how the OpenAI front reads and forces tool calls: auto (from the chat template; a template without a "
        "tools section gets the generic form), none, or a family (docs/user/tool_calls.md)",
        choices=TOOL_CALL_PARSERS,
    ),
    EngineFlag(
        "pooling",
        "serve embeddings (/v1/embeddings, LLM.embed) with this pooling of the final hidden states, whatever the "
        "model's files say (default: the model's sentence-transformers pooling, if any; docs/user/embeddings.md)",
        choices=POOLING_TYPES,
    ),
    EngineFlag("tensor_parallel_size", "chips per engine replica", short="-tp"),
    EngineFlag("data_parallel_size", "engine replicas on disjoint groups of this host's chips", short="-dp"),
)


def build_engine(
    args: argparse.Namespace,
    warmup: bool | None = None,
    background_compiles: bool = False,
    devices: Sequence[jax.Device] | None = None,
):
    """Load the model named by `--model` and start an engine with the flags' options.

    `warmup=False`: the caller warms up itself (`engine.warmup(plan)`) with the shapes its run needs.
    `background_compiles`: no step compiles (`EngineConfig.background_compiles`, the server's).
    `devices`: one replica over exactly these (multi-host serving: every process's, `serve.multihost`); the
    tensor-parallel size is their number.
    Random weights (a config name) are announced with a warning: their text is noise."""
    # Reuse compiled step shapes across runs (warm-up is most of a short job's start-up on CPU): the step
    # executables from the executable store (no lowering), anything else from JAX's persistent cache.
    if args.model is None:  # never a silent default: a random model's text and throughput would mislead
        raise UsageError(f"--model is required: {MODEL_HELP}")
    ec = engine_config_from_args(args)
    check_model_text_args(args)
    source = resolve_model(args.model)
    if source.random_weights:
        log.warning(
            "%s is an architecture config: random weights (seed %d), so its text is noise; for a real model "
            "pass a directory, a GGUF file, a Hugging Face id or %s",
            args.model,
            args.seed,
            ", ".join(NAMED_MODELS),
        )
    cache = use_compile_cache(ec)
    if warmup is not None:
        ec.warmup = warmup
    ec.background_compiles = background_compiles
    if devices is not None:
        if ec.tensor_parallel_size not in (1, len(devices)):
            raise UsageError(
                f"--tensor-parallel-size: {ec.tensor_parallel_size}, but the job has {len(devices)} devices "
                "(multi-host serving shards over all of them)"
            )
        ec.tensor_parallel_size = len(devices)
    # With several chips per process, load into host memory and let each engine place its shards
    # (the whole model need not fit one chip).
    on_host = ec.tensor_parallel_size * ec.data_parallel_size > 1 and jax.default_backend() != "cpu"
    with jax.default_device(jax.local_devices(backend="cpu")[0]) if on_host else contextlib.nullcontext():
        config, params, tokenizer = load_model(
            source,
            dtype=args.dtype,
            seed=args.seed,
            quantization=args.quantization,
            weights_cache=None if cache is None else cache / "weights",
        )
    apply_model_text(source, tokenizer, args.chat_template, args.generation_config, ec)
    return make_engine(config, params, tokenizer, ec, devices)
