"""The `paged-jax` console script: one argparse subcommand per entry of `COMMANDS`.

It lives in `serve`, the application layer, because it imports both: `paged_jax` (generate, convert, info)
and `serve` (serve, client). `serve` depends on `paged_jax`, never the reverse, so there is no cycle (the
design card fixes the top-level packages, so no third package). `python -m serve` runs it without installing.

To add a subcommand, write `add_args(parser)` and `run(args) -> int` (in this file or its own
module) and register them: `COMMANDS["name"] = Command(help, add_args, run)`.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from paged_jax.config import DTYPES, WEIGHT_QUANTIZATIONS


@dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_convert_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="Hugging Face model directory (config.json + *.safetensors)")
    source.add_argument(
        "--gguf",
        help="GGUF file (llama.cpp format; quantized tensors are dequantized), or the "
        "name of a model shipped as one (e.g. smollm2-135m-instruct)",
    )
    parser.add_argument("--out", required=True, help="orbax checkpoint directory to write")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="parameter dtype (default: the config's)")
    parser.add_argument(
        "--quantization",
        choices=WEIGHT_QUANTIZATIONS,
        default=None,
        help="store quantized weights (per-output-channel scales; the checkpoint loads quantized)",
    )
    parser.add_argument(
        "--float-lm-head",
        action="store_true",
        help="with --quantization: keep the LM head in the model dtype (embeddings always are)",
    )


def run_convert(args: argparse.Namespace) -> int:
    """Import an HF directory or a GGUF file and write it as an orbax checkpoint (plus its config JSON;
    for a GGUF also its tokenizer as `tokenizer.json` + `tokenizer_config.json`)."""
    from paged_jax.engine.load import load_model
    from paged_jax.model.init import count_params, param_bytes
    from paged_jax.model.loader.checkpoint import save_checkpoint
    from paged_jax.model.loader.weights import resolve_model_path
    from paged_jax.model.quant import quantize_params

    start = time.perf_counter()
    config, params, _ = load_model(args.hf or args.gguf, dtype=args.dtype)
    params = quantize_params(params, args.quantization, lm_head=not args.float_lm_head)
    save_checkpoint(args.out, config, params)
    if args.gguf:
        from paged_jax.model.loader.gguf_file import GGUFFile
        from paged_jax.tokenization.gguf import tokenizer_from_gguf

        gguf = GGUFFile(resolve_model_path(args.gguf))
        if gguf.get("tokenizer.ggml.model", None) is not None:
            tokenizer_from_gguf(gguf).save(args.out)
    print(
        f"wrote {args.out}: {count_params(params):,} parameters, {param_bytes(params):,} bytes "
        f"({config.dtype}{', weights ' + args.quantization if args.quantization else ''}) in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0


def _add_info_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="config name (e.g. tiny, llama-3.2-1b), config JSON, HF directory, GGUF file, named "
        "model (smollm2-135m-instruct) or orbax checkpoint",
    )
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="parameter dtype (default: the config's)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random weights (config names only)")
    parser.add_argument(
        "--no-weights",
        action="store_true",
        help="config names, JSON or HF directories: count parameters from the abstract shape tree "
        "without allocating them (for shapes larger than this machine, e.g. mixtral-8x7b)",
    )
    from paged_jax.engine.args import add_model_text_args

    add_model_text_args(parser)


def text_info_lines(tokenizer, defaults: dict) -> list[str]:
    """What `info` prints about text: the tokenizer, its special tokens, the EOS set, chat template, defaults."""
    describe = getattr(tokenizer, "describe", None)
    lines = [f"tokenizer: {describe() if describe else type(tokenizer).__name__} (vocab {tokenizer.vocab_size})"]
    special = tokenizer.special
    roles = []
    for role in ("bos", "eos", "pad", "unk"):
        text, tid = getattr(special, f"{role}_token"), getattr(special, f"{role}_token_id")
        if text is not None or tid is not None:
            shown = f"{text!r} " if text is not None else ""
            roles.append(f"{role}={shown}{tid} ({special.sources.get(role, '?')})")
    lines.append("special tokens: " + (", ".join(roles) or "none"))
    lines.append(f"eos set (ends generation): {list(tokenizer.eos_token_ids)}")
    template = tokenizer.chat_template
    lines.append(
        f"chat template: {template.source} ({', '.join(sorted(template.templates))})"
        if template
        else "chat template: none (give one with --chat-template FILE)"
    )
    lines.append("generation defaults: " + (", ".join(f"{k}={v}" for k, v in defaults.items()) or "none"))
    return lines


def _abstract_model(model: str, dtype: str | None):
    """(config, parameter tree of ShapeDtypeStructs, tokenizer) without allocating any weights."""
    from pathlib import Path

    from paged_jax.config import load_model_config
    from paged_jax.model.init import param_shapes
    from paged_jax.tokenization.tokenizer import load_tokenizer

    config = load_model_config(model)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    return config, param_shapes(config), load_tokenizer(model if Path(model).is_dir() else None, config)


def run_info(args: argparse.Namespace) -> int:
    """Load the model (random weights for a config name) and print its shape, size and memory."""
    import jax

    from paged_jax.engine.args import apply_model_text_args
    from paged_jax.engine.load import load_model
    from paged_jax.model.init import count_params, param_bytes
    from paged_jax.model.quant import kv_bytes_per_token

    start = time.perf_counter()
    if args.no_weights:
        config, params, tokenizer = _abstract_model(args.model, args.dtype)
    else:
        config, params, tokenizer = load_model(args.model, dtype=args.dtype, seed=args.seed)
    defaults = apply_model_text_args(args, tokenizer)
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - start
    n, nbytes = count_params(params), param_bytes(params)
    print(f"model: {config.name} ({config.dtype}{', shapes only' if args.no_weights else ''})")
    print(f"family: {config.family_summary()}")
    print(
        f"layers={config.num_layers} hidden={config.hidden_size} heads={config.num_heads} "
        f"kv_heads={config.num_kv_heads} head_dim={config.head_dim} intermediate={config.intermediate_size} "
        f"vocab={config.vocab_size} tied={config.tie_word_embeddings}"
    )
    print(f"parameters: {n:,}")
    print(f"memory: {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB)")
    kv = kv_bytes_per_token(config, config.dtype)  # unquantized pages in the model's dtype
    print(f"kv cache: {kv:,} bytes per token")
    print("\n".join(text_info_lines(tokenizer, defaults)))
    print(f"loaded in {elapsed:.1f} s on {jax.devices()[0].platform}")
    return 0


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    from paged_jax.offline import batch

    batch.add_args(parser)


def run_generate(args: argparse.Namespace) -> int:
    from paged_jax.engine.args import MODEL_HELP
    from paged_jax.errors import UsageError
    from paged_jax.offline import batch

    if args.model is None:  # never a silent random model: its throughput and text would mislead
        raise UsageError(f"--model is required: {MODEL_HELP}")

    return batch.run(args)


def _add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    from . import batch_file

    batch_file.add_args(parser)


def run_batch_file(args: argparse.Namespace) -> int:
    from . import batch_file

    return batch_file.run(args)


def _serve_cli():
    from . import cli  # imported on use: `generate` and `info` need neither grpc nor the server

    return cli


COMMANDS: dict[str, Command] = {
    "generate": Command(
        "batch generation: JSONL prompts in, JSONL results out (resumable)", _add_generate_args, run_generate
    ),
    "run-batch": Command(
        "answer an OpenAI batch file (chat, completions, embeddings lines) with this model: JSONL in, OpenAI's "
        "output format out (resumable)",
        _add_run_batch_args,
        run_batch_file,
    ),
    "convert": Command(
        "convert a Hugging Face directory or a GGUF file to an orbax checkpoint", _add_convert_args, run_convert
    ),
    "info": Command(
        "load a model and print its size, memory, tokenizer, special tokens, chat template and generation defaults",
        _add_info_args,
        run_info,
    ),
    "serve": Command(
        "serve a model: the OpenAI-compatible HTTP API on --port and gRPC on --grpc-port",
        lambda p: _serve_cli().add_serve_args(p),
        lambda a: _serve_cli().run_serve(a),
    ),
    "client": Command(
        "stream a completion from a running server to the terminal",
        lambda p: _serve_cli().add_client_args(p),
        lambda a: _serve_cli().run_client(a),
    ),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, unless the help states it in words or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with errors on one line, `paged-jax serve: error: <why>` and exit status 2, without the usage
    block (`--help` shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The `paged-jax` parser, one subparser per command (its errors are reported under its own name)."""
    parser = Parser(prog="paged-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help, formatter_class=HelpFormatter)
        command.add_args(p)
        p.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its line")
    return parser


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subparser of command `name` in `parser` (from `build_parser`)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Parse `argv`; an unknown flag is reported by its subcommand with the closest known spellings."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = command_parser(parser, args.command)
    if extra:
        known = [o for a in command._actions for o in a.option_strings]
        close = [m for x in extra if x.startswith("-") for m in difflib.get_close_matches(x.split("=")[0], known, 1)]
        hint = f" (did you mean {' / '.join(close)}?)" if close else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args, command


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the input's fault (a flag, a model file, a config field); their messages name the field."""
    from paged_jax.config import ConfigError
    from paged_jax.config.model_files import ModelFileError
    from paged_jax.errors import UsageError
    from paged_jax.model.loader.gguf_bounds import GGUFError
    from paged_jax.model.loader.hf import WeightsError
    from paged_jax.tokenization.chat_template import ChatTemplateError

    return (UsageError, ConfigError, WeightsError, GGUFError, ModelFileError, ChatTemplateError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a flag, model or config error is one clean line on stderr
    (`paged-jax serve: error: <field>: <why>`) and exit status 2, not a traceback (`--debug` shows it)."""
    args, parser = parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ValueError as e:
        if args.debug or not isinstance(e, _user_errors()):
            raise
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
