"""A follower of `paged-jax serve --distributed` warms up (`serve.follower_warmup`): it compiles the step shapes
process 0 compiles while process 0 does, so the steps of requests sent afterwards compile nothing on it."""

from __future__ import annotations

import pytest

from serve.client import Client

from support.serve_process import ServeProcess, free_port, wait_for_health

FLAGS = ["tiny", "--num-pages", "64", "--max-model-len", "256", "--max-num-seqs", "4"]
PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(3, 130))]


@pytest.mark.slow  # two fresh processes, each compiling every serving shape: ~4.5 min on a loaded 2-core CPU
def test_a_warmed_follower_compiles_nothing_for_the_steps():
    """The follower reports its warm-up done; the requests sent after it (prefills of three lengths, decodes)
    compile no executable on the follower, and SIGTERM to process 0 stops it with status 0."""
    coordinator = f"127.0.0.1:{free_port()}"
    grpc_port = free_port()
    job = [*FLAGS, "--distributed", "--coordinator-address", coordinator, "--num-processes", "2"]
    env = {"PAGED_JAX_COMPILE_CACHE": "off"}  # every shape compiled here, none loaded from an earlier run
    with ServeProcess(*job, "--process-id", "1", env=env) as follower:
        serving = ["--process-id", "0", "--grpc-port", str(grpc_port), "--port", str(free_port())]
        with ServeProcess(*job, *serving, env=env) as leader:
            leader.drain()
            follower.wait_for(r"multi-host follower 1: warm-up done, [1-9]\d* step shapes compiled")
            follower.drain()
            with Client(f"127.0.0.1:{grpc_port}") as client:
                wait_for_health(client, 600)
                for prompt in PROMPTS:
                    reply = client.generate(prompt, timeout=600, temperature=0, max_tokens=8, ignore_eos=True)
                    assert len(reply.completions[0].token_ids) == 8
            assert leader.sigterm() == 0
        assert follower.proc.wait(timeout=60) == 0
    log = "".join(follower.lines)
    assert "multi-host follower 1: 0 executables compiled after its warm-up" in log, log[-3000:]
