"""`paged-jax serve` / `generate` mistakes: each is one line, `paged-jax <command>: error: <flag>: <why>`, exit
status 2, no traceback, before the model loads. Also the port flags (`--port` is HTTP as in vLLM, `--grpc-port`
gRPC, the old spellings where they are not ambiguous) and `serve --help`."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax.engine.args import MODEL_HELP
from paged_jax.errors import UsageError
from serve.main import COMMANDS, build_parser, command_parser, main
from serve.ports import Ports, resolve_ports

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `paged-jax ARGV` in this process: (exit status, stderr). Loading a model fails the test: every error
    here must come before it."""

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was found")

    monkeypatch.setattr("paged_jax.engine.args.load_model", no_load)
    for name in ("PAGED_JAX_API_KEY", "PAGED_JAX_AUTH_TOKEN", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)

    def run(*argv: str) -> tuple[int, str]:
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out = capsys.readouterr()
        assert out.out == ""
        return code, out.err

    return run


@pytest.fixture
def busy_port():
    """A port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_model_is_required(cli):
    assert cli("serve") == (2, f"paged-jax serve: error: MODEL is required (paged-jax serve MODEL): {MODEL_HELP}\n")
    assert cli("generate", "--input", "in.jsonl", "--output", "out.jsonl") == (
        2,
        f"paged-jax generate: error: --model is required: {MODEL_HELP}\n",
    )
    assert cli("serve", "tiny", "--model", "smollm2-135m-instruct") == (
        2,
        "paged-jax serve: error: --model: 'smollm2-135m-instruct' and the positional MODEL 'tiny' differ; give one\n",
    )


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs: must be >= 1"),
        (
            ["--max-lora-rank", "1000000"],
            "--max-lora-rank: 1000000 is more than 512, the most this engine takes (every adapter slot is padded",
        ),
        (["--max-loras", "100000"], "--max-loras: 100000 is more than 256, the most this engine takes (adapters"),
        (["--max-cpu-loras", "100000"], "--max-cpu-loras: 100000 is more than 4096, the most this engine takes"),
        (["--max-num-seqs", "1000000"], "--max-num-seqs: 1000000 is more than 16384, the most this engine takes"),
        (["--max-num-batched-tokens", "10000000"], "--max-num-batched-tokens: 10000000 is more than 1048576, "),
        (["--max-model-len", "10000000"], "--max-model-len: 10000000 is more than 1048576, the most this engine"),
        (["--chunk-size", "0"], "--chunk-size: must be >= 1 (or None for the token budget)"),
        (["--page-size", "1000000"], "--page-size: 1000000 is more than 1024, the most this engine takes"),
        (["--num-pages", "1"], "--num-pages: must be in [2, 134217727] (page 0 is the null page, and every slot"),
        (["--num-pages", "1000000000"], "--num-pages: must be in [2, 134217727]"),
        (["--watermark", "1"], "--watermark: must be in [0, 1) (the share of pages admission keeps free), got 1.0"),
        (["--max-message-bytes", "3000000000"], "--max-message-bytes: must be at most 1073741824 (1 GiB)"),
        (["--gpu-memory-utilization", "1.5"], "--kv-cache-memory-fraction: must be in (0, 1]"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "--speculative-config: num_speculative_tokens: must be an int in [1, 16], got 0",
        ),
        (["--speculative-config", "[1]"], "argument --speculative-config: expected a JSON object, got list"),
        (["--max-queued-requests", "0"], "--max-queued-requests: must be >= 1 (0 would refuse every request)"),
        (["--front-nice", "20"], "--front-nice: must be in [0, 19] (a niceness added to the fronts' threads)"),
        (["--default-max-tokens", "0"], "--default-max-tokens: must be in [1, max_tokens (4096)]"),
        (["--kv-cache-dtype", "fp9"], "argument --kv-dtype/--kv-cache-dtype: must be one of auto, float32, bfloat16, "),
        (
            ["--served-model-name", "a", "a"],
            "--served-model-name: names must be non-empty and distinct, got ['a', 'a']",
        ),
        (["--api-key", " "], "--api-key: is empty; leave it out to serve without auth"),
        (["--auth-token-file", "/no/such/token"], "--auth-token-file: /no/such/token: No such file or directory"),
        (
            ["--serverd-model-name", "x"],
            "unrecognized arguments: --serverd-model-name x (did you mean --served-model-name?)",
        ),
        (["--port", "50051"], "--port: 50051 is also the gRPC port; --port is the HTTP (OpenAI) port, gRPC listens "),
        (["--port", "1", "--http-port", "2", "--grpc-port", "3"], "--http-port: the old spelling of --port; give one"),
        (["--no-http", "--no-grpc"], "--no-http, --no-grpc: nothing left to serve"),
        (["--port", "70000"], "--port: must be in [0, 65536), got 70000"),
        (["zzzz-model"], "model: unknown model 'zzzz-model'; real models: "),
        (["/no/such/model/dir"], "model: /no/such/model/dir: no such file or directory"),
        (["--chat-template", "/no/such.jinja"], "--chat-template: /no/such.jinja is not a file"),
        (["--generation-config", "/no/such/dir"], "--generation-config: /no/such/dir is not a directory"),
    ],
)
def test_a_bad_flag_is_one_line_before_loading(cli, argv, line):
    model = [] if argv[0].startswith(("/", "zzzz")) else ["tiny"]
    code, err = cli("serve", *model, *argv)
    assert code == 2
    assert err.startswith(f"paged-jax serve: error: {line}"), err
    assert err.count("\n") == 1


def test_a_port_in_use_is_named_before_loading(cli, busy_port):
    code, err = cli("serve", "tiny", "--port", str(busy_port))
    assert (code, err) == (
        2,
        f"paged-jax serve: error: --port: 127.0.0.1:{busy_port} is in use (another server?); pick another port, "
        "or 0 for a free one\n",
    )
    code, err = cli("serve", "tiny", "--port", "0", "--grpc-port", str(busy_port))
    assert code == 2 and err.startswith(f"paged-jax serve: error: --grpc-port: 127.0.0.1:{busy_port} is in use")


def test_the_real_process_prints_the_line_and_no_traceback(busy_port):
    """The same through `python -m serve` (what the console script runs): stderr is exactly the line."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for argv, line in [
        (["--port", str(busy_port)], f"--port: 127.0.0.1:{busy_port} is in use (another server?); pick another"),
        (["--speculative-config", '{"methd": "ngram"}'], "--speculative-config: methd: unknown field (known: "),
    ]:
        run = subprocess.run(
            [sys.executable, "-m", "serve", "serve", "tiny", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and run.stdout == ""
        assert run.stderr.startswith(f"paged-jax serve: error: {line}") and run.stderr.count("\n") == 1, run.stderr


def test_debug_shows_the_traceback(cli):
    with pytest.raises(UsageError, match="^--max-num-seqs: must be >= 1$"):
        main(["serve", "tiny", "--max-num-seqs", "0", "--debug"])


def ports(*argv: str) -> Ports:
    args = command_parser(build_parser(), "serve").parse_args(["tiny", *argv])
    return resolve_ports(args)


def test_port_is_http_and_grpc_port_is_grpc():
    assert ports() == Ports(http=8000, grpc=50051)
    assert ports("--port", "9000") == Ports(http=9000, grpc=50051)
    assert ports("--grpc-port", "7000", "--no-http") == Ports(http=None, grpc=7000)
    assert ports("--no-grpc") == Ports(http=8000, grpc=None)
    assert ports("--port", "0", "--grpc-port", "0") == Ports(http=0, grpc=0)  # two free ports


def test_old_spellings_keep_working_where_they_are_not_ambiguous():
    assert ports("--http-port", "9000") == Ports(http=9000, grpc=50051)
    old = ports("--port", "50052", "--http-port", "8001")  # the old pair: --port was gRPC's
    assert (old.http, old.grpc) == (8001, 50052)
    assert old.note == "--port 50052 --http-port 8001: read as before (gRPC on 50052, HTTP on 8001); write " + (
        "--grpc-port 50052 --port 8001"
    )


def test_help_shows_every_flag_with_help_and_its_default(capsys):
    for command in COMMANDS:
        actions = command_parser(build_parser(), command)._actions
        assert [a.option_strings or a.dest for a in actions if not a.help] == [], command
    parser = command_parser(build_parser(), "serve")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in (
        "--port PORT the OpenAI-compatible HTTP API, as vLLM's --port (default: 8000; 0 picks a free port)",
        "--grpc-port GRPC_PORT the gRPC API (default: 50051;",
        "--max-num-seqs MAX_NUM_SEQS sequences in one step (the decode batch) (default: 64)",
        "--page-size PAGE_SIZE, --block-size PAGE_SIZE",
        "--enable-prefix-caching, --no-enable-prefix-caching",
        "--host HOST bind address of every port (0.0.0.0: all interfaces) (default: 127.0.0.1)",
        "--seed SEED random weights and unseeded requests (default: 0)",
    ):
        assert shown in text


def test_vllm_spellings_set_our_fields():
    from paged_jax.engine.args import engine_config_from_args

    args = command_parser(build_parser(), "serve").parse_args(
        ["tiny", "--block-size", "32", "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8"]
    )
    ec = engine_config_from_args(args)
    assert (ec.page_size, ec.kv_cache_memory_fraction, ec.kv_dtype) == (32, 0.5, "fp8_e4m3")
    parse = command_parser(build_parser(), "serve").parse_args
    for argv, on in ([], True), (["--no-enable-prefix-caching"], False), (["--no-prefix-caching"], False):
        assert engine_config_from_args(parse(["tiny", *argv])).enable_prefix_caching is on
    assert engine_config_from_args(parse(["tiny", "--kv-cache-dtype", "auto"])).kv_dtype is None


def test_api_key_sources(monkeypatch, tmp_path):
    from serve.cli import api_key

    parse = command_parser(build_parser(), "serve").parse_args
    for name in ("PAGED_JAX_API_KEY", "PAGED_JAX_AUTH_TOKEN", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert api_key(parse(["tiny"])) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_key(parse(["tiny"])) == "from-vllm"
    monkeypatch.setenv("PAGED_JAX_API_KEY", "ours")
    assert api_key(parse(["tiny"])) == "ours"
    assert api_key(parse(["tiny", "--api-key", "flag"])) == "flag"
    (tmp_path / "t").write_text("filed\n")
    assert api_key(parse(["tiny", "--auth-token-file", str(tmp_path / "t")])) == "filed"
    with pytest.raises(UsageError, match="^--api-key, --auth-token-file: give one of them$"):
        api_key(parse(["tiny", "--api-key", "a", "--auth-token-file", str(tmp_path / "t")]))
    assert isinstance(parse(["tiny"]), argparse.Namespace)
