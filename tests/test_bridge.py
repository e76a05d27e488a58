"""The weight-update bridge against a real torch engine: every transport, bitwise, in order."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from slime.bridge.bridge import WeightBridge
from slime.bridge.topology import build_topology
from slime.engines.client import EngineClient
from slime.utils.buckets import iter_buckets
from slime.utils.checksum import tensor_checksum
from tests.conftest import start_engine


@pytest.fixture(scope="module")
def engine_a(tiny_model, tmp_path_factory):
    proc = start_engine(tiny_model, tmp_path_factory.mktemp("bridge-logs"))
    yield proc
    proc.stop()


def buckets_of(state: dict[str, torch.Tensor], bucket_bytes: int):
    return iter_buckets(state.items(), bucket_bytes)


class RecordingClient(EngineClient):
    """A real client that also records which control calls the bridge made, in order."""

    def __init__(self, url: str, log: list[str]):
        super().__init__(url)
        self.log = log

    async def request(self, method, path, body=None, **kw):
        self.log.append(path)
        return await super().request(method, path, body, **kw)


async def push_and_check(url: str, transport_name: str, state, version: str, model_dir: str) -> list[str]:
    log: list[str] = []
    topology = build_topology(transport_name, "cpu", [url])
    bridge = WeightBridge.for_topology(topology, model_dir, make_client=lambda u: RecordingClient(u, log))
    try:
        stats = await bridge.push(buckets_of(state, 200_000), version)
        assert stats["buckets"] > 3
        assert stats["transport"] == {"tensor": "shared_memory", "distributed": "distributed_gloo"}.get(
            transport_name, transport_name
        )
        async with EngineClient(url) as client:
            result = await client.weights_checksum()
    finally:
        await bridge.close()
    assert result["weight_version"] == version
    expected = {n: tensor_checksum(t) for n, t in state.items()}
    assert result["checksums"] == expected
    return log


@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk"])
def test_every_parameter_arrives_bitwise(engine_a, tiny_model, tiny_model_b, transport):
    target = load_file(f"{tiny_model_b}/model.safetensors")
    original = load_file(f"{tiny_model}/model.safetensors")
    assert any(not torch.equal(target[n], original[n]) for n in target)
    log = asyncio.run(push_and_check(engine_a.url, transport, target, f"{transport}-1", tiny_model))
    # restore the fixture engine's weights for the next transport
    asyncio.run(push_and_check(engine_a.url, transport, original, f"{transport}-0", tiny_model))
    control = [p for p in log if p in ("/pause_generation", "/flush_cache", "/continue_generation")]
    assert control == ["/pause_generation", "/flush_cache", "/continue_generation"]
    updates = [i for i, p in enumerate(log) if p.startswith("/update_weights")]
    assert updates and log.index("/flush_cache") < updates[0] <= updates[-1] < log.index(
        "/continue_generation"
    )


def test_refused_push_still_continues_generation(engine_a, tiny_model):
    bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    log: list[str] = []

    async def go():
        bridge = WeightBridge.for_topology(
            build_topology("tensor", "cpu", [engine_a.url]),
            tiny_model,
            make_client=lambda u: RecordingClient(u, log),
        )
        try:
            await bridge.push(buckets_of(bad, 1 << 20), "bad")
        finally:
            await bridge.close()

    with pytest.raises(Exception, match="shape"):
        asyncio.run(go())
    assert log[-1] == "/continue_generation"


def test_request_in_flight_during_a_push_finishes_with_the_new_version(engine_a, tiny_model, tiny_model_b):
    target = load_file(f"{tiny_model_b}/model.safetensors")
    original = load_file(f"{tiny_model}/model.safetensors")

    async def go():
        async with EngineClient(engine_a.url) as client:
            long = asyncio.create_task(
                client.generate(
                    input_ids=[5, 6, 7],
                    sampling_params={"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0},
                )
            )
            await asyncio.sleep(0.3)  # the request is running
            bridge = WeightBridge.for_topology(build_topology("tensor", "cpu", [engine_a.url]), tiny_model)
            await bridge.push(buckets_of(target, 1 << 20), "mid-flight")
            out = await long
            await bridge.push(buckets_of(original, 1 << 20), "restored")
            await bridge.close()
            return out

    out = asyncio.run(go())
    assert out["meta_info"]["weight_version"] == "mid-flight"
    assert out["meta_info"]["completion_tokens"] == 1500
