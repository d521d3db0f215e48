"""The committed generated code matches the .proto; bad wire bytes become field-named InvalidRequests."""

from __future__ import annotations

import filecmp
from pathlib import Path

from serve import codegen
from serve.convert import InvalidRequest, lenient_deserializer
from serve.proto.paged_jax.v1 import generate_pb2 as pb


def test_generated_code_does_not_drift(tmp_path: Path) -> None:
    fresh = codegen.generate(tmp_path)
    committed = codegen.generated_files()
    assert len(fresh) == len(committed) == 3 * len(codegen.proto_files()) >= 3
    for new, old in zip(fresh, committed, strict=True):
        assert old.exists(), f"{old} is missing: run `python -m serve.codegen`"
        assert filecmp.cmp(new, old, shallow=False), f"{old} drifted from the .proto: run `python -m serve.codegen`"


def _with_bad_utf8(msg, good: str) -> bytes:
    data = msg.SerializeToString()
    assert data.count(good.encode()) == 1
    return data.replace(good.encode(), b"\xff\xfe" + b"x" * (len(good.encode()) - 2))


def test_invalid_utf8_names_the_field() -> None:
    parse = lenient_deserializer(pb.GenerateRequest)
    ok = pb.GenerateRequest(text="héllo", sampling=pb.SamplingParams(stop=["ab", "stopme"]))
    assert parse(ok.SerializeToString()) == ok
    assert parse(_with_bad_utf8(ok, "héllo")) == InvalidRequest("text: is not valid UTF-8")
    assert parse(_with_bad_utf8(ok, "stopme")) == InvalidRequest("sampling.stop[1]: is not valid UTF-8")
    salted = pb.GenerateRequest(text="a", cache_salt="tenant-1")
    assert parse(_with_bad_utf8(salted, "tenant-1")) == InvalidRequest("cache_salt: is not valid UTF-8")


def test_garbage_bytes_are_an_invalid_request() -> None:
    parse = lenient_deserializer(pb.GenerateRequest)
    result = parse(b"\x0a\xff\xff\xff\xff\x0f")  # field 1 with an impossible length
    assert isinstance(result, InvalidRequest) and result.message.startswith("request: ")
    assert parse(b"") == pb.GenerateRequest()  # empty is a valid (empty) message: the servicer rejects it
