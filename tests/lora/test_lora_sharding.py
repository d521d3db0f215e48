"""LoRA under tensor parallelism on 8 CPU devices: a batch mixing two adapters and the base model gives the
single-device tokens and logprobs at TP 2 (the tiny model's two KV heads split) and TP 4 (KV heads repeated, and
the adapters' k/v B arrays with them). A plain run re-runs this file in a child pytest with 8 host devices
(tests/support/mesh_child.py)."""

from __future__ import annotations

import numpy as np
import pytest

from support.lora_adapters import GREEDY, lora_engine, make_tiny_adapters, prompts, serve
from support.mesh_child import CHILD, run_mesh_child

if not CHILD:

    @pytest.mark.mesh
    def test_mesh_suite():
        run_mesh_child(__file__)

else:

    @pytest.fixture(scope="module")
    def requests(tmp_path_factory) -> list[tuple]:
        adapters = make_tiny_adapters(tmp_path_factory.mktemp("adapters"))
        a, b = adapters["all"], adapters["ok"]
        return [(f"r{i}", p, GREEDY, (a, b, None)[i % 3]) for i, p in enumerate(prompts(6, seed=8))]

    @pytest.fixture(scope="module")
    def one_device(requests) -> dict:
        return serve(lora_engine(), requests)

    @pytest.mark.parametrize("tp", [2, 4])
    def test_tensor_parallel_matches_one_device(tp, requests, one_device):
        engine = lora_engine(tensor_parallel_size=tp)
        layer = engine.runner.lora_weights.arrays[1]  # unrolled on CPU: one set of arrays per layer
        qkv_b, o_a = layer["qkv_b"], layer["o_a"]
        assert qkv_b.sharding.spec[3] == "tp" and o_a.sharding.spec[0] == "tp"  # qkv_b by KV heads, o_a by Hq
        assert len(qkv_b.sharding.device_set) == tp
        got = serve(engine, requests)
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in one_device.items()}
        for k in one_device:
            np.testing.assert_allclose(np.array(got[k][1]), np.array(one_device[k][1]), rtol=1e-4, atol=1e-4)
