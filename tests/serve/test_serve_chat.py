"""gRPC chat: messages rendered with the model's template, INVALID_ARGUMENT naming the field, generation defaults
for unset fields, and old clients (text, Tokenize's add_bos) unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from paged_jax.config import load_model_config
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.input_processor import InputProcessor
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.model.init import init_params
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.chat_template import apply_chat_template, template_from_text
from paged_jax.tokenization.tokenizer import ByteTokenizer, load_tokenizer
from serve import convert
from serve.client import Client, build_request, chat_input
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.metrics import Metrics
from serve.proto.paged_jax.v1 import generate_pb2 as pb
from serve.server import ServerThread

from support.serve_support import LIMITS, run_offline

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if tools %}[{{ tools | length }} tools]{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
DEFAULTS = {"temperature": 0.0, "max_tokens": 5}
GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "tokenizers" / "golden.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def setup():
    config = load_model_config("tiny")
    tokenizer = ByteTokenizer(chat_template=template_from_text(TEMPLATE, "test template"))
    engine = LLMEngine(
        config,
        init_params(config, seed=0),
        tokenizer,
        EngineConfig(
            num_pages=256,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            attention_backend="xla",
            warmup=False,
            sampling_defaults=dict(DEFAULTS),
        ),
    )
    _, ids = apply_chat_template(tokenizer, CHAT)
    reference = run_offline(engine, ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), "ref")
    metrics = Metrics()
    loop = EngineLoop(engine, on_step=metrics.on_step).start()
    server = ServerThread(loop, ServingConfig(port=0, limits=LIMITS), metrics).start()
    with Client(server.target) as client:
        yield client, tokenizer, ids, reference, server.target
    server.stop()
    loop.stop()


def test_chat_request_is_rendered_with_the_template(setup):
    client, tokenizer, ids, reference, _ = setup
    assert tokenizer.decode(ids) == "<system>Be brief.</system><user>Hello there</user><assistant>"
    reply = client.chat(CHAT, ignore_eos=True)  # temperature and max_tokens: the model's defaults
    assert reply.usage.prompt_tokens == len(ids) == len(reference.prompt_token_ids)
    assert list(reply.completions[0].token_ids) == reference.outputs[0].token_ids
    streamed = [r for r in client.generate_stream(build_request(chat_input(CHAT), ignore_eos=True, max_tokens=3))]
    assert sum(len(r.chunk.token_ids) for r in streamed if r.HasField("chunk")) == 3
    with_tools = client.chat(CHAT, tools=[{"name": "f"}, {"name": "g"}], add_generation_prompt=False, max_tokens=1)
    assert with_tools.usage.prompt_tokens == len(
        tokenizer.encode("<system>Be brief.</system><user>Hello there</user>[2 tools]", add_special_tokens=False)
    )


def test_unset_fields_take_the_generation_defaults(setup):
    client, *_ = setup
    info = client.model_info()
    assert {d.field: d.value for d in info.generation_defaults} == {"temperature": 0.0, "max_tokens": 5.0}
    assert info.chat_template_source == "test template"
    assert len(client.generate("Hi", ignore_eos=True).completions[0].token_ids) == 5
    assert len(client.generate("Hi", ignore_eos=True, max_tokens=2).completions[0].token_ids) == 2


@pytest.mark.parametrize(
    "chat,field",
    [
        (pb.ChatInput(), "chat.messages"),
        (chat_input([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]), r"chat.messages\[1\].role"),
        (chat_input([{"role": "", "content": "a"}]), r"chat.messages\[0\].role"),
        (pb.ChatInput(messages=[pb.ChatMessage(role="user", content="a")], tools_json="[oops"), "chat.tools_json"),
        (pb.ChatInput(messages=[pb.ChatMessage(role="user", content="a")], tools_json='{"a": 1}'), "chat.tools_json"),
        (
            pb.ChatInput(messages=[pb.ChatMessage(role="user", content="a")], chat_template_kwargs_json='{"tools": 1}'),
            "chat.chat_template_kwargs_json",
        ),
    ],
)
def test_invalid_chat_names_the_field(setup, chat, field):
    client, *_ = setup
    with pytest.raises(grpc.RpcError) as e:
        client.generate(build_request(chat))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().split(":")[0] == field.replace("\\", "")


def test_a_model_without_a_template_is_invalid_argument(setup):
    client, tokenizer, *_ = setup
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(grpc.RpcError) as e:
            client.chat(CHAT)
    finally:
        tokenizer.chat_template = template
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("chat.messages: the model has no chat template; give one with --chat-template")


def test_old_clients_keep_working(setup):
    client, tokenizer, *_ = setup
    assert client.generate("héllo", max_tokens=1).usage.prompt_tokens == len(tokenizer.encode("héllo")) == 7
    assert client.tokenize("a") == [1, 3 + 97]
    assert client.tokenize("a", add_special_tokens=False) == [3 + 97]
    old = pb.TokenizeRequest(text="a", add_bos=False)  # the field older clients send
    assert list(client.stub.Tokenize(old).token_ids) == [3 + 97]


def _inputs(tokenizer, defaults: dict | None = None) -> InputProcessor:
    limits = LIMITS.input_limits()
    return InputProcessor(
        tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=4096, max_n=8, defaults=defaults, limits=limits
    )


def test_parse_generate_with_a_real_vocabulary(real_tokenizer_dir):
    """Conversion alone (no server): Phi-3's own template gives transformers' ids; the decode fields pass through."""
    tokenizer = load_tokenizer(real_tokenizer_dir("phi-3"), load_model_config("tiny"))
    case = next(c for c in GOLDEN["tokenizers"]["phi-3"]["chat"] if c["template"] is None)
    req = build_request(
        chat_input(case["messages"], add_generation_prompt=case["add_generation_prompt"]),
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    parsed = convert.parse_generate(req, _inputs(tokenizer, {"top_p": 0.5}))
    assert parsed.prompt_token_ids == case["ids"]
    p = parsed.params
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.top_p) == (False, False, 0.5)
    text = convert.parse_generate(build_request("Hello world"), _inputs(tokenizer))
    assert text.prompt_token_ids == [1, 15043, 3186] and text.params.skip_special_tokens


def test_client_cli_chat(setup, capsys):
    from serve.main import main

    _, _, ids, _, target = setup
    assert (
        main(["client", "--target", target, "--chat", "--system", "Be brief.", "Hello there", "--max-tokens", "3"]) == 0
    )
    assert f"prompt {len(ids)} tokens" in capsys.readouterr().err
