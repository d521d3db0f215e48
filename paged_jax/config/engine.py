"""The engine's options (`EngineConfig`): names and defaults follow vLLM where one exists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from paged_jax.config import KV_DTYPE_CHOICES
from paged_jax.config.pooling import PoolerConfig
from paged_jax.config.speculative import SpeculativeConfig
from paged_jax.pooling_params import POOLING_TYPES
from paged_jax.sampling_params import MAX_LOGIT_BIAS
from pallas_kernels.common import BACKENDS

SCAN_CHOICES = ("auto", "on", "off")  # scan_layers (paged_jax.model.scan)
# Reply parsers (paged_jax.tokenization.reasoning, .tool_calls): "auto" reads the chat template's family.
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "qwen3_coder", "llama3", "mistral", "deepseek_v3")
MAX_SLOT_ID = 2**31 - 1  # pages x page_size: every KV slot id is an int32
# The largest value of each size field, and what a larger one would make: past these a typo allocates absurd
# memory (or compiles absurd shapes) instead of failing with one line naming the flag.
UPPER_BOUNDS: dict[str, tuple[int, str]] = {
    "page_size": (1024, "token slots per KV page"),
    "max_num_seqs": (16384, "sequences per step: every sampling array has a row per sequence"),
    "max_num_batched_tokens": (2**20, "tokens per step: the forward step's activations are that long"),
    "max_model_len": (2**20, "tokens per sequence: the penalties' history row is that long"),
    "chunk_size": (2**20, "prompt tokens of one sequence per step"),
    "max_n": (16384, "samples per request"),
    "max_logit_bias": (4096, "logit-bias columns every step carries per row"),
    "max_loras": (256, "adapters resident on the device: one device slot each, allocated at start-up"),
    "max_lora_rank": (512, "every adapter slot is padded to this rank"),
    "max_cpu_loras": (4096, "adapters kept loaded in host memory"),
}


@dataclass(slots=True)
class EngineConfig:
    """Engine options; names and defaults follow vLLM where one exists."""

    page_size: int = 16  # token slots per KV page
    num_pages: int | None = None  # explicit KV pages (page 0 is the null page); overrides the budgets below
    kv_cache_memory_fraction: float = 0.9  # of free accelerator memory, for KV pages
    cpu_kv_cache_bytes: int | None = None  # KV budget on CPU; None: 4 GiB, capped (see paged_jax.worker.kv_budget)
    # Host memory for evicted prefix blocks (paged_jax.kv_cache.host_tier), GiB; 0: off; None: off on CPU, on TPU/GPU
    # a share of the host memory available at start-up (paged_jax.worker.kv_transfer.host_tier_pages).
    kv_host_cache_gib: float | None = None
    # A directory of prefix blocks that survives restarts (paged_jax.kv_cache.disk_tier); None: off. Bounded by
    # kv_disk_cache_gib, least recently used files deleted first.
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_gib: float = 16.0
    # A preempted request with a host tier (paged_jax.kv_cache.swap): "auto" swaps its pages out when the cost model
    # says copying them is cheaper than recomputing its context, "swap" / "recompute" force one (benchmarks).
    kv_preemption_mode: str = "auto"
    # Host -> device page copies per step (prefix-hit restores and swap-ins), so a burst cannot stall decodes.
    kv_restore_pages_per_step: int = 128
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # token budget per step
    max_model_len: int | None = None  # prompt + output tokens; default min(model max, 8192)
    chunk_size: int | None = None  # max prompt tokens of one sequence per step (None: the token budget)
    enable_prefix_caching: bool = True
    # Linear-attention hybrids (paged_jax.kv_cache.state_snapshots): rows of recurrent-state snapshots kept for the
    # prefix cache (None: max_num_seqs), and the spacing in tokens of the snapshot points inside long prompts
    # (rounded down to whole pages); each row costs one state slot's memory, taken from the KV budget.
    state_snapshots: int | None = None
    state_snapshot_interval: int = 512
    attention_backend: str = "auto"  # one of pallas_kernels.common.BACKENDS (auto | xla | pallas | ...)
    # The decoder's layers as scanned steps (paged_jax.model.scan; every model scans): "on" scans, "auto" scans on
    # TPU and GPU and loops on CPU (XLA:CPU copies a scanned layer's weights every step), "off" is a Python loop.
    scan_layers: str = "auto"
    # KV cache groups (paged_jax.kv_cache.groups): on a model with sliding-window layers, their block tables keep
    # only the pages their window still reads, beside the full-attention layers' (scanned decoder only). False:
    # every layer keeps full-length pages (one group).
    hybrid_kv: bool = True
    kv_dtype: str | None = None  # default: the model dtype; int8 / fp8_e4m3: quantized pages (paged_jax.model.quant)
    seed: int = 0  # seeds requests that do not set their own
    max_n: int = 64  # samples per request (also capped by max_num_seqs: a request's samples run together)
    warmup: bool = True  # compile every step shape at start-up (or call `warmup(plan)` later with False)
    # A directory of serialized step executables (paged_jax.worker.executable_store): a warm start loads them
    # without tracing or compiling. None: off. The CLI sets $PAGED_JAX_COMPILE_CACHE/executables.
    executable_store: str | None = None
    watermark: float = 0.01  # fraction of pages admission keeps free while requests run
    async_scheduling: bool = True  # schedule step n+1 while the device runs step n (see LLMEngine.step)
    # No step compiles: a request whose step shapes are not compiled yet waits while a compile thread builds them,
    # the others run on in compiled shapes (paged_jax.engine.compile_gate). The server turns it on.
    background_compiles: bool = False
    # Benchmark baseline: reserve max_model_len slots per request (no sharing), like a contiguous KV cache.
    reserve_full_length: bool = False
    max_logit_bias: int = MAX_LOGIT_BIAS  # most `logit_bias` entries per request (the sampler's fixed bias width)
    tensor_parallel_size: int = 1  # chips per engine (weights by heads/columns/vocab, KV pages by KV heads)
    data_parallel_size: int = 1  # engine replicas on disjoint device groups (`engine.data_parallel.make_engine`)
    # LoRA (paged_jax.lora), vLLM's names: adapters batched with the base model and with each other.
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident on the device at once (one slot each; slot 0 is "none")
    max_lora_rank: int = 16  # the largest adapter rank; every slot is padded to it
    max_cpu_loras: int | None = None  # adapters kept loaded on the host for reuse (None: max_loras)
    # SamplingParams fields a request gets when it leaves them unset (the model's generation_config.json;
    # see paged_jax.config.generation_defaults). Applied by LLM, batch and gRPC where "unset" is known.
    sampling_defaults: dict = field(default_factory=dict)
    # Structured outputs (paged_jax.structured): bounds on one request's constraint, against hostile schemas.
    structured_max_grammar_bytes: int = 64 * 1024  # size of the schema / regex / grammar / choices text
    structured_compile_timeout_s: float = 5.0  # wall time to compile one grammar; slower ones are refused
    # Host time one constrained row may take in a step (its mask fill, its grammar advance): a row past it ends with
    # finish_reason "error", the others go on. None: no budget (one parallel fill of every row).
    structured_fill_budget_s: float | None = 0.5
    reasoning_parser: str = "auto"  # one of REASONING_PARSERS: a thinking model's reply split into thought + answer
    tool_call_parser: str = "auto"  # one of TOOL_CALL_PARSERS: how the OpenAI front reads (and forces) tool calls
    # Speculative decoding (paged_jax.config.speculative.SpeculativeConfig; vLLM's names); None: off. A mapping or
    # its JSON text, e.g. {"method": "ngram", "num_speculative_tokens": 3}, is parsed here, once, into the record
    # (ValueError naming `speculative_config.<field>`).
    speculative_config: SpeculativeConfig | Mapping | str | None = None
    # Embeddings (paged_jax.config.pooling): "last" | "mean" serves them with that pooling whatever the model's files
    # say (None: the model's own pooling module, if any). `pooler` is the result, set from the model's files with
    # this override when the model loads (`paged_jax.engine.args.apply_model_text`); None: generative only.
    pooling: str | None = None
    pooler: PoolerConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative config (None: off)."""
        assert self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig)
        return self.speculative_config

    def model_len(self, max_position_embeddings: int) -> int:
        """Prompt + output tokens per sequence: `max_model_len`, default min(the model's maximum, 8192)."""
        return self.max_model_len or min(max_position_embeddings, 8192)

    def validate(self) -> None:
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend: must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.scan_layers not in SCAN_CHOICES:
            raise ValueError(f"scan_layers: must be one of {SCAN_CHOICES}, got {self.scan_layers!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_n",
            "max_logit_bias",
            "tensor_parallel_size",
            "data_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        for name, (bound, what) in UPPER_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value > bound:
                raise ValueError(f"{name}: {value} is more than {bound}, the most this engine takes ({what})")
        if self.state_snapshots is not None and self.state_snapshots < 1:
            raise ValueError("state_snapshots: must be >= 1 (or None for max_num_seqs)")
        if self.state_snapshot_interval < 1:
            raise ValueError("state_snapshot_interval: must be >= 1 token")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError("chunk_size: must be >= 1 (or None for the token budget)")
        if self.num_pages is not None and not 2 <= self.num_pages <= MAX_SLOT_ID // self.page_size:
            raise ValueError(
                f"num_pages: must be in [2, {MAX_SLOT_ID // self.page_size}] (page 0 is the null page, and every "
                f"slot id, pages x page_size, is an int32)"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(
                f"watermark: must be in [0, 1) (the share of pages admission keeps free), got {self.watermark}"
            )
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction: must be in (0, 1]")
        if self.kv_host_cache_gib is not None and not self.kv_host_cache_gib >= 0:
            raise ValueError(f"kv_host_cache_gib: must be >= 0 (0: off), got {self.kv_host_cache_gib!r}")
        if self.kv_preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                f"kv_preemption_mode: must be one of auto, swap, recompute, got {self.kv_preemption_mode!r}"
            )
        if not isinstance(self.kv_restore_pages_per_step, int) or self.kv_restore_pages_per_step < 1:
            raise ValueError(f"kv_restore_pages_per_step: must be an int >= 1, got {self.kv_restore_pages_per_step!r}")
        if not self.kv_disk_cache_gib > 0:
            raise ValueError(f"kv_disk_cache_gib: must be > 0, got {self.kv_disk_cache_gib!r}")
        if self.cpu_kv_cache_bytes is not None and self.cpu_kv_cache_bytes <= 0:
            raise ValueError("cpu_kv_cache_bytes: must be positive (or None for the default)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}")
        if self.structured_max_grammar_bytes < 1 or not self.structured_compile_timeout_s > 0:
            raise ValueError("structured_max_grammar_bytes, structured_compile_timeout_s: must be positive")
        budget = self.structured_fill_budget_s
        if budget is not None and not 0 < budget <= 3600:
            raise ValueError(f"structured_fill_budget_s: must be in (0, 3600] seconds, got {budget}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling: must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"kv_dtype: must be one of {KV_DTYPE_CHOICES}, got {self.kv_dtype!r}")
