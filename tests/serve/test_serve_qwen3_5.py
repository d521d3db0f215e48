"""`paged-jax serve` on a Qwen3.5 Hugging Face directory (the tiny random hybrid of tests/data/hf_qwen3_5, with a
chat template given by file): the OpenAI client's chat and completions, greedy, through the recurrent-state pool
and its prefix cache (the second chat shares the first one's prompt), and `/metrics` showing the state slots and
snapshots."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from support.hf_golden import DATA
from support.serve_process import ServeProcess

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


@pytest.mark.slow  # a fresh process (start-up and the first requests' compiles)
def test_serve_a_qwen3_5_directory(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    with ServeProcess(
        *(str(DATA / "hf_qwen3_5"), "--port", "0", "--grpc-port", "0", "--chat-template", str(template)),
        *("--served-model-name", "qwen35", "--max-model-len", "128", "--num-pages", "64", "--max-num-seqs", "2"),
        *("--max-num-batched-tokens", "32", "--no-warmup"),
        unset=("PAGED_JAX_API_KEY", "PAGED_JAX_AUTH_TOKEN", "VLLM_API_KEY"),
    ) as server:
        base_url = server.wait_for(r"paged-jax OpenAI API on (http://\S+/v1)").group(1)
        server.drain()
        with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
            messages = [
                {"role": "system", "content": "You are a terse assistant. " * 2},
                {"role": "user", "content": "Hi"},
            ]
            kwargs = dict(model="qwen35", temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
            first = client.chat.completions.create(messages=messages, **kwargs)
            again = client.chat.completions.create(messages=messages, **kwargs)
            assert first.choices[0].message.content == again.choices[0].message.content  # a cache hit, same reply
            assert first.usage.completion_tokens == 6
            plain = client.completions.create(model="qwen35", prompt="Hello", temperature=0, max_tokens=5)
            assert plain.usage.completion_tokens <= 5 and plain.choices[0].text is not None
        metrics = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics").read().decode()
        assert "paged_jax_state_slots_in_use 0.0" in metrics
        hits = [line for line in metrics.splitlines() if line.startswith("paged_jax_state_snapshot_hits_total")]
        assert hits and float(hits[0].split()[-1]) >= 1
        assert server.sigterm() == 0
    assert "Traceback" not in "".join(server.lines)
