"""Weight updates through all three transports, refusals that change nothing, release/resume."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch
from safetensors.torch import load_file

from slime.engines.client import EngineClient, EngineError
from slime.utils import distributed as sdist
from slime.utils.shm_tensors import dtype_to_str, pack_named_tensors

PROMPT = [11, 12, 13, 14, 15]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def run(coro):
    return asyncio.run(coro)


async def _call(url, method, *args, **kw):
    async with EngineClient(url) as c:
        return await getattr(c, method)(*args, **kw)


def greedy(url) -> list[int]:
    return run(_call(url, "generate", input_ids=PROMPT, sampling_params=GREEDY))["output_ids"]


def version(url) -> str:
    return run(_call(url, "get_weight_version"))


def state_dict(path: str) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


@pytest.fixture(scope="module")
def outputs(engine, tiny_model, tiny_model_b):
    """Greedy outputs of model A (what the engine loaded) and model B, measured through the engine."""
    a = greedy(engine.url)
    run(_call(engine.url, "update_weights_from_disk", tiny_model_b))
    b = greedy(engine.url)
    run(_call(engine.url, "update_weights_from_disk", tiny_model))
    assert greedy(engine.url) == a
    assert a != b, "the two tiny models should not agree on greedy output"
    return {"a": a, "b": b}


def test_update_from_disk_changes_outputs_and_version(engine, tiny_model, tiny_model_b, outputs):
    v0 = version(engine.url)
    res = run(_call(engine.url, "update_weights_from_disk", tiny_model_b))
    assert res["success"] is True
    assert greedy(engine.url) == outputs["b"]
    # As in SGLang, an update that names no weight_version leaves the version alone.
    assert version(engine.url) == v0
    run(_call(engine.url, "update_weights_from_disk", tiny_model, weight_version="disk-a"))
    assert version(engine.url) == "disk-a"
    assert greedy(engine.url) == outputs["a"]
    res = run(_call(engine.url, "generate", input_ids=PROMPT, sampling_params=GREEDY))
    assert res["meta_info"]["weight_version"] == "disk-a"


def test_update_from_tensor_via_shared_memory(engine, tiny_model, tiny_model_b, outputs):
    named = list(state_dict(tiny_model_b).items())
    handle, buf = pack_named_tensors(named[: len(named) // 2])
    try:
        res = run(_call(engine.url, "update_weights_from_tensor", [handle], weight_version="t1"))
        assert res["success"] and version(engine.url) == "t1"
        # Reuse the same shared buffer for the second bucket, as the bridge does.
        handle, buf = pack_named_tensors(named[len(named) // 2 :], buf)
        run(_call(engine.url, "update_weights_from_tensor", [handle], weight_version="t2"))
        assert greedy(engine.url) == outputs["b"]
    finally:
        buf.close()
    handle, buf = pack_named_tensors(list(state_dict(tiny_model).items()))
    try:
        run(_call(engine.url, "update_weights_from_tensor", [handle]))
    finally:
        buf.close()
    assert greedy(engine.url) == outputs["a"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _push_distributed(
    url: str,
    named: list[tuple[str, torch.Tensor]],
    group,
    bad: bool = False,
    weight_version: str | None = None,
):
    """Trainer side: POST the metadata and broadcast the tensors concurrently."""
    names = [n for n, _ in named]
    shapes = [list(t.shape) for _, t in named]
    if bad:
        shapes[1] = [shapes[1][0] + 1, *shapes[1][1:]]

    async def go():
        async with EngineClient(url) as c:
            req = asyncio.create_task(
                c.update_weights_from_distributed(
                    names,
                    [dtype_to_str(t.dtype) for _, t in named],
                    shapes,
                    "wg",
                    weight_version=weight_version,
                )
            )

            def send():
                for i, (_, t) in enumerate(named):
                    tensor = t.contiguous()
                    if bad and i == 1:
                        tensor = torch.zeros(shapes[1], dtype=t.dtype)
                    sdist.broadcast(group, tensor, root=0)

            await asyncio.to_thread(send)
            return await req

    return run(go())


def test_update_from_distributed_gloo(engine, tiny_model, tiny_model_b, outputs):
    port = _free_port()
    holder = {}
    t = threading.Thread(target=lambda: holder.update(g=sdist.new_group("gloo", "127.0.0.1", port, 0, 2, 60)))
    t.start()
    res = run(_call(engine.url, "init_weights_update_group", "127.0.0.1", port, 1, 2, "wg", "gloo"))
    t.join()
    assert res["success"]
    group = holder["g"]
    res = _push_distributed(engine.url, list(state_dict(tiny_model_b).items()), group, weight_version="d1")
    assert res["success"] and version(engine.url) == "d1"
    assert greedy(engine.url) == outputs["b"]

    # A refused distributed update still drains the broadcasts, so the group stays usable.
    v = version(engine.url)
    with pytest.raises(EngineError) as info:
        _push_distributed(engine.url, list(state_dict(tiny_model).items()), group, bad=True)
    assert info.value.status == 400 and "shape" in info.value.message
    assert greedy(engine.url) == outputs["b"] and version(engine.url) == v

    res = _push_distributed(engine.url, list(state_dict(tiny_model).items()), group)
    assert res["success"] and greedy(engine.url) == outputs["a"]
    run(_call(engine.url, "destroy_weights_update_group", "wg"))


def _join_group(url: str, group_name: str = "wg"):
    """Trainer rank 0 of a new gloo group with the engine as rank 1."""
    port = _free_port()
    holder = {}
    t = threading.Thread(target=lambda: holder.update(g=sdist.new_group("gloo", "127.0.0.1", port, 0, 2, 60)))
    t.start()
    res = run(_call(url, "init_weights_update_group", "127.0.0.1", port, 1, 2, group_name, "gloo"))
    t.join()
    assert res["success"]
    return holder


def test_failed_distributed_receive_destroys_the_group(engine, tiny_model, tiny_model_b, outputs):
    holder = _join_group(engine.url)
    named = list(state_dict(tiny_model_b).items())
    v = version(engine.url)

    async def trainer_dies_after_one_tensor():
        async with EngineClient(engine.url) as c:
            req = asyncio.create_task(
                c.update_weights_from_distributed(
                    [n for n, _ in named],
                    [dtype_to_str(t.dtype) for _, t in named],
                    [list(t.shape) for _, t in named],
                    "wg",
                    weight_version="never",
                )
            )

            def send_one_then_go_away():
                sdist.broadcast(holder["g"], named[0][1].contiguous(), root=0)
                del holder["g"]  # the last reference: the trainer's connections close

            await asyncio.to_thread(send_one_then_go_away)
            return await req

    with pytest.raises(EngineError) as info:
        run(trainer_dies_after_one_tensor())
    assert info.value.status == 500 and "the group was destroyed" in info.value.message
    assert greedy(engine.url) == outputs["a"] and version(engine.url) == v
    with pytest.raises(EngineError) as info:
        run(_call(engine.url, "destroy_weights_update_group", "wg"))
    assert info.value.status == 400 and "no weight-update group" in info.value.message

    # The next init under the same name starts clean and works.
    holder = _join_group(engine.url)
    res = _push_distributed(engine.url, list(state_dict(tiny_model).items()), holder["g"])
    assert res["success"] and greedy(engine.url) == outputs["a"]
    run(_call(engine.url, "destroy_weights_update_group", "wg"))


def test_destroy_group_shuts_the_group_down():
    calls = []

    class GlooLikeGroup:
        def shutdown(self):
            calls.append("shutdown")

        def abort(self):
            calls.append("abort")

    sdist.destroy_group(GlooLikeGroup())
    sdist.destroy_group(GlooLikeGroup(), abort=True)  # only NCCL aborts; gloo shuts down
    assert calls == ["shutdown", "shutdown"]


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (
            lambda sd: sd.update({"model.layers.0.mlp.nonexistent.weight": torch.zeros(2)}),
            "unknown parameter name",
        ),
        (lambda sd: sd.update({"model.norm.weight": torch.zeros(7)}), "shape"),
        (lambda sd: sd.update({"model.norm.weight": torch.zeros(256, dtype=torch.int32)}), "floating-point"),
    ],
)
def test_rejected_update_changes_nothing(engine, tiny_model_b, outputs, mutate, needle):
    v = version(engine.url)
    sd = state_dict(tiny_model_b)
    mutate(sd)
    # The bad tensor is last: every good one before it must not have been applied.
    bad_name = list(sd)[-1] if needle == "unknown parameter name" else "model.norm.weight"
    ordered = [(k, t) for k, t in sd.items() if k != bad_name] + [(bad_name, sd[bad_name])]
    handle, buf = pack_named_tensors(ordered)
    try:
        with pytest.raises(EngineError) as info:
            run(_call(engine.url, "update_weights_from_tensor", [handle]))
    finally:
        buf.close()
    assert info.value.status == 400 and needle in info.value.message and bad_name in info.value.message
    assert greedy(engine.url) == outputs["a"]
    assert version(engine.url) == v


def test_tied_lm_head_alias_accepted(engine, tiny_model, outputs):
    sd = state_dict(tiny_model)
    handle, buf = pack_named_tensors([("lm_head.weight", sd["model.embed_tokens.weight"])])
    try:
        assert run(_call(engine.url, "update_weights_from_tensor", [handle]))["success"]
    finally:
        buf.close()
    assert greedy(engine.url) == outputs["a"]


def test_release_and_resume_memory(engine, tiny_model, outputs):
    async def scenario():
        async with EngineClient(engine.url) as c:
            await c.release_memory_occupation()
            info = await c.get_server_info()
            assert info["internal_states"][0]["memory_released"] is True
            assert await c.health()
            with pytest.raises(EngineError) as err:
                await c.generate(input_ids=PROMPT, sampling_params=GREEDY)
            assert err.value.status == 503 and "released" in err.value.message
            with pytest.raises(EngineError) as err:
                await c.update_weights_from_disk(tiny_model)
            assert err.value.status == 409
            await c.resume_memory_occupation()
            with pytest.raises(EngineError) as err:
                await c.generate(input_ids=PROMPT, sampling_params=GREEDY)
            assert err.value.status == 503 and "not reloaded" in err.value.message
            await c.update_weights_from_disk(tiny_model)
            return (await c.generate(input_ids=PROMPT, sampling_params=GREEDY))["output_ids"]

    assert run(scenario()) == outputs["a"]


def test_release_refused_with_requests_in_flight(engine):
    async def scenario():
        async with EngineClient(engine.url) as c:
            task = asyncio.create_task(
                c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1500, "ignore_eos": True})
            )
            while (await c.get_server_info())["internal_states"][0]["num_running_reqs"] < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineError) as err:
                await c.release_memory_occupation()
            await c.abort_request(abort_all=True)
            await task
            return err.value

    err = run(scenario())
    assert err.status == 409 and "in flight" in err.message
