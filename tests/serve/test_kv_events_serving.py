"""KV events end to end: a server's ZMQ stream, decoded with vLLM's own struct definitions (msgspec), and its gRPC
stream each rebuild the server's prefix-cache index exactly after a workload with evictions; a subscriber that
never reads never blocks the engine; bad `--kv-events-config` input is refused naming the field."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import msgspec
import pytest
import zmq

from paged_jax.config.kv_events import KVEventsConfig
from paged_jax.errors import UsageError
from paged_jax.kv_cache.events import BlockStored as RecordedStored
from paged_jax.kv_cache.events import KVEventBatch as RecordedBatch
from paged_jax.kv_cache.hashing import HASH_BYTES
from serve.cli import kv_events_config
from serve.client import Client
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.kv_events import ZmqEventPublisher, attach, encode_batch, offset_endpoint
from serve.server import ServerThread

from support.serve_support import LIMITS, small_engine, wait_until

# vLLM 0.34.0's structs (vllm/distributed/kv_events.py), copied field for field with the same msgspec options:
# the decoder a vLLM consumer runs. Decoding is typed and strict: a field out of place fails.
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
PAGE = 16


def cache_index(manager) -> set[tuple[int, bytes]]:
    out = set()
    for key in manager.pool.cached:
        group = 0 if len(key) == HASH_BYTES else int.from_bytes(key[HASH_BYTES:], "little")
        out.add((group, bytes(key[:HASH_BYTES])))
    return out


def replay(index: set, events, stored=BlockStored, removed=BlockRemoved) -> None:
    for e in events:
        if isinstance(e, stored):
            index.update((e.group_idx, bytes(h)) for h in e.block_hashes)
        elif isinstance(e, removed):
            index.difference_update((e.group_idx, bytes(h)) for h in e.block_hashes)
        else:
            index.clear()


class ZmqSubscriber:
    """A vLLM-style consumer: SUB on the topic, and a DEALER that asks the replay socket for what it missed."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint, self.topic = replay_endpoint, topic
        self.batches: dict[int, bytes] = {}

    def poll(self) -> None:
        while self.sub.poll(0):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = payload

    def replay_from(self, start: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert dealer.poll(60_000), "the replay socket answers"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert (topic, payload) == (b"", b"")
                break
            assert topic == self.topic
            self.batches[int.from_bytes(seq, "big")] = payload
        dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


def workload(client: Client) -> None:
    """Prompts over a few shared prefixes, more distinct blocks than the pool holds: hits and evictions."""
    prefixes = [f"system prompt {i}: " + "abcdefghij"[i] * 40 for i in range(6)]
    for round_ in range(3):
        for i, prefix in enumerate(prefixes):
            out = client.generate(f"{prefix} user {round_}-{i} asks", max_tokens=6, temperature=0.0)
            assert out.usage.completion_tokens == 6 or out.completions[0].text is not None


TMP = "<tmp_path>"  # an engine option's value the `served` fixture replaces with the test's temporary directory


@pytest.fixture
def served(request, tmp_path):
    """A server publishing KV events; ``request.param``: more engine options (indirect parametrization)."""
    options = {k: str(tmp_path) if v == TMP else v for k, v in getattr(request, "param", {}).items()}
    engine = small_engine(num_pages=24, page_size=PAGE, max_num_batched_tokens=64, **options)
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:0",  # port 0: the OS picks free ports, the publisher reports the ones bound
        replay_endpoint="tcp://*:0",
        topic="kv@test",
    )
    hub = attach(engine, config)
    loop = EngineLoop(engine, on_step=hub.after_step(lambda e: None))
    loop.kv_events = hub
    loop.start()
    server = ServerThread(loop, ServingConfig(port=0, limits=LIMITS)).start()
    yield engine, hub, server
    server.stop()
    loop.stop()
    hub.close()


def local(endpoint: str) -> str:
    """A bound wildcard endpoint as a loopback address to connect to."""
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def wait_idle(engine, client: Client) -> None:
    wait_until(lambda: client.stats().num_open_requests == 0 and not engine.has_unfinished(), "idle")


def test_zmq_and_grpc_streams_rebuild_the_cache_index(served):
    engine, hub, server = served
    publisher = hub.publishers[0]
    assert publisher.endpoint.startswith("tcp://0.0.0.0:") and not publisher.endpoint.endswith(":0")
    sub = ZmqSubscriber(local(publisher.endpoint), local(publisher.replay_endpoint), b"kv@test")
    grpc_batches: list = []
    with Client(server.target) as client:
        call = client.kv_events()
        wait_until(lambda: len(hub._subs) == 1, "the gRPC subscription")

        def read() -> None:
            try:
                grpc_batches.extend(call)
            except grpc.RpcError as e:  # the cancel below ends the stream
                assert e.code() == grpc.StatusCode.CANCELLED

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        workload(client)
        wait_idle(engine, client)
        wait_until(lambda: publisher.num_sent == publisher._next_seq, "every batch sent")
        sub.poll()
        sub.replay_from(0)  # whatever the SUB socket missed while it joined
        index = cache_index(engine.kv)
        assert engine.kv.pool.num_evictions > 0 and index
        wait_until(lambda: sum(1 for _ in grpc_batches) == publisher._next_seq, "every gRPC batch")
        call.cancel()
    sub.close()
    # ZMQ: consecutive sequence numbers from 0, each payload one vLLM KVEventBatch.
    assert sorted(sub.batches) == list(range(publisher._next_seq))
    zmq_index: set = set()
    kinds = set()
    for seq in sorted(sub.batches):
        batch = DECODER.decode(sub.batches[seq])
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for e in batch.events:
            kinds.add(type(e).__name__)
            if isinstance(e, BlockStored):
                assert e.block_size == PAGE and e.medium == "GPU" and len(e.token_ids) == PAGE * len(e.block_hashes)
                assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in e.block_hashes)
        replay(zmq_index, batch.events)
    assert kinds == {"BlockStored", "BlockRemoved"}
    assert zmq_index == index
    # gRPC: the same batches, the same sequence numbers.
    assert [b.sequence for b in grpc_batches] == list(range(publisher._next_seq))
    grpc_index: set = set()
    for b in grpc_batches:
        for e in b.events:
            kind = e.WhichOneof("event")
            if kind == "block_stored":
                grpc_index.update((e.block_stored.group_idx, h) for h in e.block_stored.block_hashes)
            elif kind == "block_removed":
                grpc_index.difference_update((e.block_removed.group_idx, h) for h in e.block_removed.block_hashes)
            else:
                grpc_index.clear()
    assert grpc_index == index


HOST_SLOTS = 4
PAGE_BYTES = 32768  # one page of the `tiny` model's cache at 16 tokens (every layer, K and V)


@pytest.mark.parametrize("served", [{"kv_host_cache_gib": HOST_SLOTS * PAGE_BYTES / 2**30}], indirect=True)
def test_zmq_stream_rebuilds_both_tiers_with_a_host_tier(served):
    """With a host tier, the ZMQ stream (decoded with vLLM's structs) carries the demotions (GPU removed, CPU
    stored), the restores (GPU stored) and the tier's drops (CPU removed): a consumer keeping one block set per
    medium ends with the server's device cache map and host-tier entries exactly. ~15 s here: 18 requests
    through the server, enough to demote, restore and drop blocks."""
    engine, hub, server = served
    tier = engine.kv.host_tier
    assert tier is not None and tier.capacity == HOST_SLOTS
    publisher = hub.publishers[0]
    sub = ZmqSubscriber(local(publisher.endpoint), local(publisher.replay_endpoint), b"kv@test")
    with Client(server.target) as client:
        workload(client)
        wait_idle(engine, client)
    wait_until(lambda: publisher.num_sent == publisher._next_seq, "every batch sent")
    sub.poll()
    sub.replay_from(0)
    sub.close()
    index: dict[str, set] = {"GPU": set(), "CPU": set()}
    counts: dict[tuple[str, str], int] = {}
    for seq in sorted(sub.batches):
        for e in DECODER.decode(sub.batches[seq]).events:
            kind = type(e).__name__
            assert kind != "AllBlocksCleared"
            counts[kind, e.medium] = counts.get((kind, e.medium), 0) + len(e.block_hashes)
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == PAGE * len(e.block_hashes) and e.block_size == PAGE
                index[e.medium].update((e.group_idx, bytes(h)) for h in e.block_hashes)
            else:
                index[e.medium].difference_update((e.group_idx, bytes(h)) for h in e.block_hashes)
    host = {(0, bytes(k)) for k in tier.entries}
    assert index == {"GPU": cache_index(engine.kv), "CPU": host}
    assert set(counts) == {(k, m) for k in ("BlockStored", "BlockRemoved") for m in ("GPU", "CPU")}, counts
    assert tier.stats().hits > 0  # some blocks came back from the tier (GPU stored again)


DISK_FILES = 12  # the disk tier's bound, in files of one page


@pytest.mark.parametrize(
    "served", [{"kv_disk_cache_dir": TMP, "kv_disk_cache_gib": DISK_FILES * (PAGE_BYTES + 512) / 2**30}], indirect=True
)
def test_zmq_stream_rebuilds_the_disk_tier_from_its_files(served):
    """With a disk tier, the ZMQ stream (decoded with vLLM's structs) tells its files as medium "STORAGE" (vLLM's
    `MEDIUM_STORAGE`): each stored once its file is written (published while the server is idle too: the files
    are written behind the step), with its tokens, and removed when the size bound deletes it. A consumer keeping
    one block set per medium ends with the files in the directory, and the device's and host tier's sets. ~15 s
    here: the same 18 requests as the host-tier test."""
    engine, hub, server = served
    tier = engine.kv.host_tier
    assert tier is not None and tier.disk is not None
    publisher = hub.publishers[0]
    sub = ZmqSubscriber(local(publisher.endpoint), local(publisher.replay_endpoint), b"kv@test")
    with Client(server.target) as client:
        workload(client)
        wait_idle(engine, client)

    def on_disk() -> set:
        return {(0, bytes.fromhex(p.stem)) for p in tier.disk.dir.glob("*.kvb")}

    def rebuilt() -> tuple[dict[str, set], dict[tuple[str, str], int]]:
        sub.replay_from(max(sub.batches, default=-1) + 1)  # the batches published since the last look
        index: dict[str, set] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        counts: dict[tuple[str, str], int] = {}
        for seq in sorted(sub.batches):
            for e in DECODER.decode(sub.batches[seq]).events:
                counts[type(e).__name__, e.medium] = counts.get((type(e).__name__, e.medium), 0) + len(e.block_hashes)
                if isinstance(e, BlockStored):
                    assert len(e.token_ids) == PAGE * len(e.block_hashes) and e.block_size == PAGE
                    index[e.medium].update((e.group_idx, bytes(h)) for h in e.block_hashes)
                else:
                    index[e.medium].difference_update((e.group_idx, bytes(h)) for h in e.block_hashes)
        return index, counts

    tier.disk.flush()  # every file written; the idle engine loop publishes them within its poll
    wait_until(lambda: rebuilt()[0]["STORAGE"] == on_disk(), "the disk tier's files in the stream")
    sub.close()
    index, counts = rebuilt()
    assert index == {"GPU": cache_index(engine.kv), "CPU": {(0, bytes(k)) for k in tier.entries}, "STORAGE": on_disk()}
    assert counts.get(("BlockStored", "STORAGE"), 0) > DISK_FILES and counts.get(("BlockRemoved", "STORAGE"), 0) > 0
    assert 0 < len(index["STORAGE"]) <= DISK_FILES


def test_reset_prefix_cache_route_clears_the_rebuilt_index(served):
    """POST /reset_prefix_cache (vLLM's route, behind the API key): refused while a request runs, then the stream
    carries AllBlocksCleared and the index a subscriber rebuilds is the server's again (empty, then refilled)."""
    import json
    import urllib.error
    import urllib.request

    from serve.openai_api.server import HttpServerThread

    engine, hub, server = served
    publisher = hub.publishers[0]
    sub = ZmqSubscriber(local(publisher.endpoint), local(publisher.replay_endpoint), b"kv@test")
    config = ServingConfig(port=0, http_port=0, auth_token="sesame", limits=LIMITS)
    http = HttpServerThread(server.server.loop, config).start()
    url = http.base_url.removesuffix("/v1") + "/reset_prefix_cache"
    auth = {"Authorization": "Bearer sesame"}

    def post(headers: dict) -> tuple[int, dict]:
        req = urllib.request.Request(url, data=b"", headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def rebuilt() -> set:
        wait_until(lambda: publisher.num_sent == publisher._next_seq, "every batch sent")
        sub.poll()
        sub.replay_from(0)
        index: set = set()
        for seq in sorted(sub.batches):
            replay(index, DECODER.decode(sub.batches[seq]).events)
        return index

    try:
        with Client(server.target) as client:
            workload(client)
            call = client.generate_stream("a long one", max_tokens=200, ignore_eos=True, temperature=0.0)
            next(call)  # running: its blocks must stay findable
            status, body = post(auth)
            assert status == 409 and "requests are running" in body["error"]["message"]
            call.cancel()
            wait_idle(engine, client)
            assert post({})[0] == 401
            assert cache_index(engine.kv) and rebuilt() == cache_index(engine.kv)
            assert post(auth) == (200, {"status": "ok"})
            assert cache_index(engine.kv) == set() and rebuilt() == set()
            workload(client)
            wait_idle(engine, client)
            assert cache_index(engine.kv) and rebuilt() == cache_index(engine.kv)
    finally:
        http.stop()
        sub.close()


def test_wire_layout_matches_vllm_encoding():
    """Our payload decodes to the same values, fields in the same order, as msgspec's encoding of vLLM's structs
    holding them (the bytes differ only in map headers: msgspec writes a 16-bit length for a struct of more than 15
    fields, msgpack the shortest)."""
    stored = RecordedStored([b"a" * 16, b"b" * 16], None, list(range(32)), 16, 3, "GPU", "ad", [("salt:x",), None], 0,
                            "full_attention", None)  # fmt: skip
    batch = RecordedBatch(ts=12.5, events=[stored], data_parallel_rank=0)
    theirs = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored(
                [b"a" * 16, b"b" * 16],
                None,
                list(range(32)),
                16,
                3,
                "GPU",
                "ad",
                [("salt:x",), None],
                0,
                "full_attention",
            )
        ],  # fmt: skip
        data_parallel_rank=0,
    )
    ours, expected = msgspec.msgpack.decode(encode_batch(batch)), msgspec.msgpack.decode(msgspec.msgpack.encode(theirs))
    assert ours == expected
    assert list(ours[1][0].items()) == list(expected[1][0].items())  # the same keys in the same order
    assert DECODER.decode(encode_batch(batch)) == theirs


def test_a_subscriber_that_never_reads_never_blocks_the_engine():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", hwm=4, max_queue_size=8)
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)  # connects and subscribes, then never reads
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 4)
    sub.connect(local(publisher.endpoint))
    big = RecordedBatch(1.0, [RecordedStored([b"h" * 16] * 64, None, [1] * 1024, 16, None, "GPU", None)])
    for _ in range(8):  # not yet started: the bounded queue fills, then drops (and counts) without waiting
        publisher.publish(big)
    seqs = [publisher.publish(big) for _ in range(4)]
    assert seqs == [8, 9, 10, 11] and publisher.num_dropped == 4
    publisher.start()
    for _ in range(2000):  # far past both high-water marks: the PUB socket drops, the engine thread goes on
        publisher.publish(big)
    assert publisher._queue.qsize() <= config.max_queue_size
    wait_until(lambda: publisher._queue.qsize() == 0, "the publisher thread drains its queue")
    assert publisher.num_sent + publisher.num_dropped == 2012
    publisher.close()
    sub.close(linger=0)


def test_grpc_stream_refused_without_events():
    engine = small_engine()
    loop = EngineLoop(engine).start()
    server = ServerThread(loop, ServingConfig(port=0, limits=LIMITS)).start()
    try:
        with Client(server.target) as client, pytest.raises(grpc.RpcError) as err:
            next(iter(client.kv_events(timeout=30)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--kv-events-config" in err.value.details()
    finally:
        server.stop()
        loop.stop()


def test_lagging_grpc_subscription_is_ended():
    import asyncio

    from serve.kv_events import Subscription

    async def run() -> list:
        sub = Subscription(asyncio.get_running_loop(), max_backlog=2)
        batch = RecordedBatch(1.0, [])
        for seq in range(5):
            sub.push((0, seq, batch))
        await asyncio.sleep(0)
        return [await sub.get() for _ in range(3)]

    got = asyncio.run(run())
    assert [g[1] for g in got[:2]] == [0, 1] and got[2] is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}', "endpiont: unknown field"),
        ('{"enable_kv_cache_events": true, "publisher": "nats"}', "publisher: must be one of null, zmq"),
        ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "endpoint: must be a ZMQ endpoint"),
        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm: must be an integer"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events: must be true or false"),
    ],
)
def test_bad_kv_events_config_names_the_field(text, why):
    with pytest.raises(UsageError, match="--kv-events-config: " + why):
        kv_events_config(text)


def test_vllm_defaults_and_rank_offsets():
    c = kv_events_config('{"enable_kv_cache_events": true}')
    assert c is not None and c.publisher_kind == "zmq" and c.endpoint == "tcp://*:5557" and c.buffer_steps == 10_000
    assert KVEventsConfig().publisher_kind == "null" and not KVEventsConfig().active
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1" and offset_endpoint("tcp://*:5557", 0).endswith("57")
