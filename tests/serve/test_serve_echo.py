"""The OpenAI front's evaluation features: completions `echo` (vLLM's legacy logprobs over prompt + completion),
`max_tokens: 0`, vLLM's `prompt_logprobs` extra, `logit_bias`, and the `/tokenize`, `/detokenize`,
`/tokenizer_info` routes, through the official `openai` client (or raw HTTP where the client has no method).

Prompt logprobs are checked against the dense model (`paged_jax.model.reference`: log_softmax of the logits one
position before each prompt token); completions against the same server's non-echo answer. Every test ends with
every page free.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from paged_jax.model.families import causal_lm
from paged_jax.model.reference import full_logits
from paged_jax.sampling_params import MAX_LOGIT_BIAS
from paged_jax.tokenization.chat_template import apply_chat_template
from serve.client import Client

from support.serve_support import shared, wait_idle

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
PROMPT = "The capital of France is Paris, and"
ATOL = 1e-4


@pytest.fixture(scope="module")
def dense():
    """The dense model's log_softmax [len, V] (float64) at every position of a prompt."""
    s = shared()
    model = causal_lm(s.engine.config)

    def get(prompt: list[int]) -> np.ndarray:
        n = 1 << max(4, (len(prompt) - 1).bit_length())
        buf = jnp.zeros(n, jnp.int32).at[: len(prompt)].set(jnp.asarray(prompt, jnp.int32))
        x = np.asarray(full_logits(model, s.params, buf, jnp.int32(len(prompt))), np.float64)[: len(prompt)]
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))

    return get


def post(fronts, path: str, body: dict) -> tuple[int, dict]:
    root = fronts[0].base_url.removesuffix("/v1")
    request = urllib.request.Request(f"{root}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def token_text(token_id: int) -> str:
    return shared().engine.tokenizer.decode([token_id], skip_special_tokens=False)


def check_legacy_shape(lp, ids: list[int], k: int) -> None:
    """vLLM's legacy logprobs starting with tokens `ids`: parallel lists, text offsets the running length of the
    token strings, the alternatives holding the token itself and at most k others."""
    assert lp.tokens[: len(ids)] == [token_text(t) for t in ids]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        if value is not None:
            assert top[tok] == value and 1 <= len(top) <= k + 1 and value <= 0


def test_echo_scores_the_prompt_like_the_dense_model(oai, dense):
    """max_tokens 0: the prompt alone (text as given; a token-id prompt decoded), first token null, every other
    logprob and top-2 alternatives the dense model's."""
    ids = shared().engine.tokenizer.encode(PROMPT)
    want = dense(ids)
    for prompt in (PROMPT, ids):
        out = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        c = out.choices[0]
        assert c.text == (shared().engine.tokenizer.decode(ids, skip_special_tokens=False) if prompt is ids else PROMPT)
        assert c.finish_reason == "length" and out.usage.completion_tokens == 0
        assert out.usage.prompt_tokens == len(ids)
        lp = c.logprobs
        check_legacy_shape(lp, ids, 2)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = np.array(lp.token_logprobs[1:])
        np.testing.assert_allclose(got, [want[p - 1, ids[p]] for p in range(1, len(ids))], atol=ATOL)
        for p in range(1, len(ids)):
            best = np.argsort(-want[p - 1])[:2]
            top = lp.top_logprobs[p]
            for t in best:  # byte tokens above 0x7f all read "\ufffd" alone: their keys collide
                if int(t) - 3 < 0x80:
                    assert abs(top[token_text(int(t))] - want[p - 1, t]) < ATOL


def test_echo_with_a_completion_and_n(oai):
    """The prompt, then the completion: text, tokens and logprobs equal the non-echo answer's after the prompt;
    every one of n choices echoes it; streamed, a choice's first chunk carries the prompt."""
    ids = shared().engine.tokenizer.encode(PROMPT)
    args = dict(model="tiny", prompt=PROMPT, max_tokens=5, logprobs=1, extra_body={"ignore_eos": True})
    plain = oai.completions.create(**args, temperature=0)
    echo = oai.completions.create(**args, temperature=0, echo=True)
    c, p = echo.choices[0], plain.choices[0]
    assert c.text == PROMPT + p.text
    assert len(c.logprobs.tokens) == len(ids) + 5 and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.tokens[len(ids) :] == p.logprobs.tokens
    np.testing.assert_allclose(c.logprobs.token_logprobs[len(ids) :], p.logprobs.token_logprobs, atol=1e-6)
    check_legacy_shape(c.logprobs, ids, 1)
    sampled = oai.completions.create(**args, temperature=0.8, seed=3, n=2, echo=True)
    assert len(sampled.choices) == 2
    assert all(s.text.startswith(PROMPT) and s.logprobs.token_logprobs[0] is None for s in sampled.choices)
    assert all(len(s.logprobs.tokens) == len(ids) + 5 for s in sampled.choices)
    text, tokens, offsets = "", [], []
    for chunk in oai.completions.create(**args, temperature=0, echo=True, stream=True):
        for s in chunk.choices:
            text += s.text
            if s.logprobs is not None:
                tokens += s.logprobs.tokens
                offsets += s.logprobs.text_offset
    assert text == c.text and tokens == c.logprobs.tokens and offsets == c.logprobs.text_offset


def test_vllm_prompt_logprobs_extra(oai, dense):
    """vLLM's `prompt_logprobs`: per choice, None then {token id: {logprob, rank, decoded_token}} holding the
    prompt token and its top alternatives (ranks 1..k); without echo the text is the completion alone."""
    ids = shared().engine.tokenizer.encode(PROMPT)
    want = dense(ids)
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3, "ignore_eos": True}
    )
    c = out.choices[0]
    assert not c.text.startswith(PROMPT) and c.logprobs is None
    entries = c.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = entries[p]
        assert abs(entry[str(ids[p])]["logprob"] - want[p - 1, ids[p]]) < ATOL
        best = np.argsort(-want[p - 1])[:3]
        for rank, t in enumerate(best, 1):
            assert entry[str(int(t))]["rank"] == rank and entry[str(int(t))]["decoded_token"] == token_text(int(t))
        assert len(entry) in (3, 4)


def test_logit_bias_forces_and_bans(oai, dense):
    """+100 forces a token on greedy and on sampled rows (chat too); -100 bans the greedy choice (greedy takes the
    dense model's second best); the logprobs stay the model's own (the forced token is not certain)."""
    forced = shared().engine.tokenizer.encode("Q", add_special_tokens=False)[0]
    for kwargs in (dict(temperature=0), dict(temperature=1.0, seed=5, n=2)):
        out = oai.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=6,
            logprobs=0,
            logit_bias={str(forced): 100},
            extra_body={"ignore_eos": True},
            **kwargs,
        )
        for c in out.choices:
            assert c.text == "Q" * 6
            assert all(v < -1e-3 for v in c.logprobs.token_logprobs)
    ids = shared().engine.tokenizer.encode(PROMPT)
    first, second = np.argsort(-dense(ids)[-1])[:2]  # the greedy next token, and the one after it
    banned = oai.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logprobs=0,
        logit_bias={str(first): -100},
        extra_body={"ignore_eos": True},
    )
    assert abs(banned.choices[0].logprobs.token_logprobs[0] - dense(ids)[-1, second]) < ATOL
    chat = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == "QQQ"


def _status(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={"1.5": 1}), "logit_bias"),
        (dict(logit_bias={"5": "big"}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(logit_bias={"320": 1}), "logit_bias"),
        (dict(logit_bias={"-1": 1}), "logit_bias"),
        (dict(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
        (dict(logit_bias=[1]), "logit_bias"),
        (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
        (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
        (dict(extra_body={"prompt_logprobs": "2"}), "prompt_logprobs"),
        (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
        (dict(echo="yes"), "echo"),
        (dict(max_tokens=-1), "max_tokens"),
    ],
)
def test_invalid_fields_are_400_naming_the_param(oai, kwargs, param):
    args = dict(model="tiny", prompt="hi", max_tokens=2) | kwargs
    e = _status(lambda: oai.completions.create(**args))
    assert e.status_code == 400 and e.body["param"] == param, e.body
    assert e.body["message"].startswith(f"{param}: "), e.body


@pytest.mark.parametrize(
    "kwargs, param",
    [(dict(extra_body={"echo": True}), "echo"), (dict(max_tokens=0), "max_tokens")],
)
def test_chat_refuses_echo_and_max_tokens_0(oai, kwargs, param):
    args = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2) | kwargs
    e = _status(lambda: oai.chat.completions.create(**args))
    assert e.status_code == 400 and e.body["param"] == param, e.body


def test_tokenize_detokenize_and_tokenizer_info(fronts):
    tokenizer = shared().engine.tokenizer
    status, body = post(fronts, "/tokenize", {"model": "tiny", "prompt": "héllo", "return_token_strs": True})
    assert status == 200 and body["tokens"] == tokenizer.encode("héllo") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == shared().engine.max_model_len
    assert body["token_strs"] == [token_text(t) for t in body["tokens"]]
    status, bare = post(fronts, "/tokenize", {"prompt": "hello", "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode("hello", add_special_tokens=False) and bare["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}]
    status, chat = post(fronts, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and chat["tokens"] == apply_chat_template(tokenizer, messages, add_generation_prompt=False)[1]
    status, back = post(fronts, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "héllo"}
    with urllib.request.urlopen(fronts[0].base_url.removesuffix("/v1") + "/tokenizer_info") as r:
        info = json.loads(r.read())
    assert "eos_token" in info and info["chat_template"] == TEMPLATE and info["model_max_length"] > 0
    for path, body, param in [
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a" * (shared().engine.max_model_len * 8 + 1)}, "prompt"),
        ("/detokenize", {"tokens": [1, 320]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ]:
        status, error = post(fronts, path, body)
        assert status == 400 and error["error"]["param"] == param, (path, body, error)
    status, error = post(fronts, "/tokenize", {"model": "gpt-4", "prompt": "a"})
    assert status == 404 and error["error"]["param"] == "model"


def test_grpc_prompt_logprobs_logit_bias_and_scoring(fronts, dense):
    """gRPC's `sampling.prompt_logprobs` (unary response and the stream's Final: one entry per prompt token
    after the first), `max_tokens: 0` and `sampling.logit_bias`; invalid values INVALID_ARGUMENT naming them."""
    ids = shared().engine.tokenizer.encode(PROMPT)
    want = dense(ids)
    forced = shared().engine.tokenizer.encode("Q", add_special_tokens=False)[0]
    with Client(fronts[1].target) as client:
        reply = client.generate(PROMPT, max_tokens=0, prompt_logprobs=2)
        assert reply.completions[0].token_ids == [] and reply.usage.completion_tokens == 0
        got = reply.prompt_logprobs
        assert [lp.token_id for lp in got] == ids[1:]
        np.testing.assert_allclose(
            [lp.logprob for lp in got], [want[p - 1, ids[p]] for p in range(1, len(ids))], atol=ATOL
        )
        for p, lp in enumerate(got, 1):
            assert [t.token_id for t in lp.top] == np.argsort(-want[p - 1])[:2].tolist()
        final = list(client.generate_stream(PROMPT, max_tokens=1, temperature=0, prompt_logprobs=2))[-1].final
        assert list(final.prompt_logprobs) == list(got)
        biased = client.generate(PROMPT, max_tokens=3, temperature=0, ignore_eos=True, logit_bias={forced: 100.0})
        assert biased.completions[0].text == "QQQ" and not biased.prompt_logprobs
        for kwargs, field in [
            (dict(logit_bias={forced: 101.0}), "sampling.logit_bias"),
            (dict(logit_bias={10**6: 1.0}), "sampling.logit_bias"),
            (dict(prompt_logprobs=21), "sampling.prompt_logprobs"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                client.generate(PROMPT, max_tokens=1, **kwargs)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"{field}: "), e.value.details()
    wait_idle(Client(fronts[1].target))
