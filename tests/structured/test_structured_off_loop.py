"""A server never compiles a grammar on its engine thread: the fronts' input processor (`serve.convert.
serving_inputs`) compiles each structured-output request's matchers, first mask included, on the front's thread
inside the compile deadline, and the engine takes them as they are."""

from __future__ import annotations

import re
import threading
from functools import partial

import pytest

from paged_jax.engine.input_processor import GenerationRequest
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.structured import GrammarError, LLGuidanceBackend, StructuredLimits
from paged_jax.tokenization.tokenizer import ByteTokenizer
from serve.config import ServingLimits
from serve.convert import serving_inputs

from support.engines import make_engine as _make_engine

make_engine = partial(_make_engine, num_pages=93)
REGEX = "(ab|cd){2,5}x"


def run(engine, rid: str, prompt, params: SamplingParams | None = None) -> tuple[list[int], str]:
    engine.add_request(rid, prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None
    return final.outputs[0].token_ids, final.outputs[0].text


def test_a_servers_grammars_compile_on_the_fronts_thread_and_the_engine_takes_them_as_they_are(
    tiny_config, tiny_params
):
    engine = make_engine(tiny_config, tiny_params)
    backend = engine.structured.backend
    params = SamplingParams(max_tokens=12, temperature=0.0, n=2, structured_outputs=StructuredOutputs(regex=REGEX))
    inputs = serving_inputs(engine, ServingLimits())
    processed, threads = [], []

    def front() -> None:  # what the HTTP and gRPC fronts do on their CPU pool
        threads.append(threading.current_thread().name)
        processed.append(inputs.process(GenerationRequest(list(range(5, 15)), params)))

    thread = threading.Thread(target=front, name="front")
    thread.start()
    thread.join(120)
    (p,) = processed
    assert threads == ["front"] and p.matchers is not None and len(p.matchers) == 2
    assert backend.compiled == 1  # one compile, its copy forked for the second sample
    served = run(engine, "served", p)
    assert backend.compiled == 1  # the engine compiled nothing when the request was added
    assert re.fullmatch(REGEX, served[1]), served
    assert served == run(engine, "offline", list(range(5, 15)), params)  # compiled when added
    assert backend.compiled == 2


def test_a_refused_grammar_is_a_field_error_where_the_request_is_processed(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    inputs = serving_inputs(engine, ServingLimits())
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="(a{700}){700}"))
    with pytest.raises(GrammarError) as e:
        inputs.process(GenerationRequest([5, 6, 7], bad))
    assert e.value.field == "structured_outputs.regex" and engine.structured.backend.compiled == 0


def test_the_first_mask_is_computed_inside_the_compile_deadline():
    # The regex bound lifted so that llguidance gets this grammar: it compiles in milliseconds and pays on its
    # first mask (seconds); that mask is part of the compile now, so the deadline refuses it.
    limits = StructuredLimits(max_regex_expansion=10**9, compile_timeout_s=0.2)
    backend = LLGuidanceBackend(ByteTokenizer(), 320, (2,), limits)
    with pytest.raises(GrammarError, match="did not compile within the server's limit of 0.2 s"):
        backend.matcher(StructuredOutputs(regex="(a{600}){600}"))
    tokenizer = ByteTokenizer()
    fast = LLGuidanceBackend(tokenizer, 320, (2,), limits).matcher(StructuredOutputs(regex=REGEX))
    assert all(fast.accept(t) for t in tokenizer.encode("abcd", add_special_tokens=False))
