"""The push topology (slime.bridge.topology) and the `distributed` transport's group arithmetic.

The group test runs two stand-in SGLang servers of tensor-parallel sizes 2 and 4 on loopback
(aiohttp, the routes the bridge calls). Like SGLang's model runner, each TP worker joins the
weight-update group as rank `rank_offset + tp_rank` and receives every broadcast tensor whole; here
a worker is a thread holding a gloo group of its own. The trainer side is the real bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from aiohttp import web

from slime.bridge.bridge import WeightBridge
from slime.bridge.ipc import IpcTransport
from slime.bridge.topology import EngineSpec, PushTopology, build_topology, group_layout
from slime.config.rollout import TopologyError, default_transport, transport_problem
from slime.utils import distributed as sdist
from slime.utils.shm_tensors import dtype_from_str

JOIN_TIMEOUT_S = 60.0


class StandInEngine:
    """A stand-in SGLang server of tensor-parallel size `tp_size` that reports `reported_tp_size`."""

    def __init__(self, tp_size: int, reported_tp_size: int | None = None):
        self.tp_size = tp_size
        self.reported_tp_size = tp_size if reported_tp_size is None else reported_tp_size
        self.workers = ThreadPoolExecutor(tp_size)  # one thread per TP worker
        self.groups: list[Any] = []
        self.joined: list[dict[str, Any]] = []
        self.received: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
        self.calls: list[str] = []
        self.weight_version = "0"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_post("/init_weights_update_group", self.init_group)
        app.router.add_post("/update_weights_from_distributed", self.update_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self.destroy_group)
        for path in (
            "/pause_generation",
            "/continue_generation",
            "/begin_weight_update",
            "/end_weight_update",
        ):
            app.router.add_post(path, self.ok)
        app.router.add_route("*", "/flush_cache", self.ok)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.calls.append(request.path)
        return await handler(request)

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"tp_size": self.reported_tp_size, "dtype": "float32"})

    async def _on_workers(self, fn: Any, *args_per_worker: Any) -> list[Any]:
        loop = asyncio.get_running_loop()
        return await asyncio.gather(
            *(loop.run_in_executor(self.workers, fn, k, *args_per_worker) for k in range(self.tp_size))
        )

    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()

        def join(tp_rank: int) -> Any:
            rank = body["rank_offset"] + tp_rank  # SGLang's rule
            return sdist.new_group(
                body["backend"],
                body["master_address"],
                body["master_port"],
                rank,
                body["world_size"],
                JOIN_TIMEOUT_S,
            )

        try:
            self.groups = await self._on_workers(join)
        except Exception as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        self.joined = [
            {
                **{k: body[k] for k in ("master_address", "world_size", "backend", "group_name")},
                "rank": body["rank_offset"] + k,
            }
            for k in range(self.tp_size)
        ]
        return web.json_response({"success": True, "message": "joined"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))

        def receive(tp_rank: int) -> None:  # every TP worker receives every tensor, in order
            for name, dtype, shape in specs:
                buf = torch.empty(shape, dtype=dtype_from_str(dtype))
                sdist.broadcast(self.groups[tp_rank], buf, root=0)
                self.received[tp_rank][name] = buf

        await self._on_workers(receive)
        self.weight_version = body.get("weight_version") or self.weight_version
        return web.json_response({"success": True, "message": "updated"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        for group in self.groups:
            sdist.destroy_group(group)
        self.groups = []
        return web.json_response({"success": True, "message": "destroyed"})


@contextlib.contextmanager
def serving(*engines: StandInEngine) -> Iterator[list[str]]:
    """Serve every stand-in on loopback (ports from the OS) from one event-loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start(engine: StandInEngine) -> tuple[web.AppRunner, str]:
        runner = web.AppRunner(engine.app())
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"

    started = [asyncio.run_coroutine_threadsafe(start(e), loop).result(10) for e in engines]
    try:
        yield [url for _, url in started]
    finally:
        for runner, _ in started:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        for e in engines:
            e.workers.shutdown()


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3.5])
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g).to(torch.float16),
        "model.norm.weight": torch.cat([special, torch.randn(1, generator=g)]),
        "model.step": torch.tensor([seed, -1, 2**40], dtype=torch.int64),
    }


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_group_of_tp2_and_tp4_engines_gives_every_tp_worker_every_tensor(tmp_path):
    engines = [StandInEngine(2), StandInEngine(4)]
    # Train rank 0's node address (127.0.0.2 is loopback too, but not the usual default): the
    # master address must come from the topology.
    with serving(*engines) as urls:
        topology = build_topology("distributed", "cpu", urls, tp_sizes=[2, 4], train_nodes=["127.0.0.2"])
        assert (topology.world_size, topology.rank_offsets, topology.master_address) == (
            7,
            (1, 3),
            "127.0.0.2",
        )
        bridge = WeightBridge.for_topology(topology, str(tmp_path), timeout_s=JOIN_TIMEOUT_S)
        pushed = [weights(1), weights(2)]  # two pushes over the one group

        async def push_all() -> list[dict[str, Any]]:
            try:
                out = []
                for version, state in enumerate(pushed, start=1):
                    buckets = [list(state.items())[:2], list(state.items())[2:]]
                    out.append(await bridge.push(buckets, str(version)))
                    for e in engines:
                        for got in e.received:
                            assert set(got) == set(state)
                            assert all(bit_equal(got[n], t) for n, t in state.items()), version
                            got.clear()
                return out
            finally:
                await bridge.close()

        stats = asyncio.run(push_all())
    assert [s["transport"] for s in stats] == ["distributed_gloo"] * 2
    assert [s["buckets"] for s in stats] == [2.0, 2.0]
    joined = [j for e in engines for j in e.joined]
    assert [j["rank"] for j in joined] == [1, 2, 3, 4, 5, 6]
    assert {(j["world_size"], j["master_address"], j["backend"]) for j in joined} == {
        (7, "127.0.0.2", "gloo")
    }
    for e in engines:
        assert e.weight_version == "2"
        assert e.calls.count("/init_weights_update_group") == 1
        assert e.calls.count("/update_weights_from_distributed") == 4
        first = e.calls.index("/update_weights_from_distributed")
        assert e.calls.index("/init_weights_update_group") < e.calls.index("/pause_generation") < first
        assert e.calls[-1] == "/destroy_weights_update_group"


def test_engine_reporting_another_tp_size_is_refused_before_any_join(tmp_path):
    engines = [StandInEngine(2), StandInEngine(4)]
    with serving(*engines) as urls:
        topology = build_topology("distributed", "cpu", urls, tp_sizes=[2, 2])
        bridge = WeightBridge.for_topology(topology, str(tmp_path), timeout_s=JOIN_TIMEOUT_S)
        with pytest.raises(
            TopologyError, match=r"reports tensor-parallel size 4.*--rollout-num-gpus-per-engine 4"
        ):
            asyncio.run(bridge.push([list(weights(1).items())], "1"))
    assert all("/init_weights_update_group" not in e.calls for e in engines)
    assert all("/pause_generation" not in e.calls for e in engines)


# ---- the topology: resolution, arithmetic, refusals -----------------------------------------


@pytest.mark.parametrize(
    ("transport", "device", "colocated", "label"),
    [
        ("tensor", "cpu", False, "shared_memory"),
        ("tensor", "cuda", True, "cuda_ipc"),
        ("ipc", "cpu", False, "cpu_ipc"),
        ("distributed", "cpu", False, "distributed_gloo"),
        ("distributed", "cpu", True, "distributed_gloo"),
        ("distributed", "cuda", False, "distributed_nccl"),
        ("disk", "cuda", True, "disk"),
    ],
)
def test_transport_is_resolved_once(transport, device, colocated, label):
    t = build_topology(transport, device, ["http://127.0.0.1:1"], colocated=colocated)
    assert t.label == label
    assert t.every_rank_shares == label.endswith("_ipc")
    assert t.backend == (label.removeprefix("distributed_") if transport == "distributed" else None)


def test_group_layout_offsets_are_cumulative_tp_sizes():
    assert group_layout([1]) == (2, (1,))
    assert group_layout([2, 4]) == (7, (1, 3))
    assert group_layout([1, 1, 1]) == (4, (1, 2, 3))
    assert group_layout([4, 2, 8]) == (15, (1, 5, 7))


def test_nodes_default_from_urls_and_master_is_train_rank_0():
    t = build_topology(
        "distributed", "cuda", ["http://127.0.0.1:1", "http://10.0.0.7:2"], [1, 2], train_nodes=["10.0.0.5"]
    )
    assert t.master_address == "10.0.0.5"
    assert t.engines == (
        EngineSpec("http://127.0.0.1:1", 1, "10.0.0.5"),
        EngineSpec("http://10.0.0.7:2", 2, "10.0.0.7"),
    )
    assert t.urls == ["http://127.0.0.1:1", "http://10.0.0.7:2"] and t.tp_sizes == (1, 2)
    assert pickle.loads(pickle.dumps(t)) == t  # it travels to the train ranks through Ray


def test_cuda_ipc_feeds_each_engine_gpu_from_the_train_rank_on_it():
    nodes = ["10.0.0.1"] * 2 + ["10.0.0.2"] * 4
    ok = build_topology(
        "tensor",
        "cuda",
        ["http://a:1", "http://b:1"],
        [2, 4],
        ["10.0.0.1", "10.0.0.2"],
        nodes,
        colocated=True,
    )
    assert ok.label == "cuda_ipc"
    with pytest.raises(
        TopologyError, match=r"engine 1 \(http://b:1\) runs on node 10.0.0.1, but train rank 2"
    ):
        build_topology(
            "tensor",
            "cuda",
            ["http://a:1", "http://b:1"],
            [2, 4],
            ["10.0.0.1", "10.0.0.1"],
            nodes,
            colocated=True,
        )
    with pytest.raises(TopologyError, match=r"the engines have 6 GPUs .* but there are 4 train ranks"):
        build_topology(
            "tensor",
            "cuda",
            ["http://a:1", "http://b:1"],
            [2, 4],
            train_nodes=["10.0.0.1"] * 4,
            engine_nodes=["10.0.0.1"] * 2,
            colocated=True,
        )


def test_planned_engines_without_urls_are_checked_by_node():
    # The job checks the push from the placement group's nodes before any engine has a URL.
    planned = build_topology("distributed", "cpu", ["", ""], [1, 1], ["10.0.0.2", "10.0.0.2"], ["10.0.0.1"])
    assert planned.world_size == 3  # two planned engines are not "listed twice"
    with pytest.raises(
        TopologyError, match=r"engine 1 runs on node 10.0.0.2, not on train rank 0's node 10.0.0.1"
    ):
        build_topology("tensor", "cpu", ["", ""], [1, 1], ["10.0.0.1", "10.0.0.2"], ["10.0.0.1", "10.0.0.2"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"transport": "tensor", "device": "cuda"},
            "add --colocate, or use --update-weight-transport distributed",
        ),
        ({"transport": "distributed", "device": "cuda", "colocated": True}, "NCCL refuses"),
        ({"transport": "rdma"}, "--update-weight-transport 'rdma' is not one of"),
        ({"transport": "tensor", "engine_nodes": ["10.0.0.9"]}, "shared-memory files"),
        ({"transport": "disk", "engine_nodes": ["10.0.0.9"]}, "temporary directory on train rank 0's node"),
        ({"transport": "distributed", "engine_nodes": ["10.0.0.9"]}, "master address 127.0.0.1 is loopback"),
        ({"transport": "distributed", "tp_sizes": 0}, "--rollout-num-gpus-per-engine must be >= 1"),
        ({"transport": "distributed", "tp_sizes": [1, 1]}, "2 tensor-parallel sizes for 1 engines"),
        ({"transport": "distributed", "device": "tpu"}, "--device must be cpu or cuda"),
    ],
)
def test_impossible_topologies_are_refused_naming_the_flag(kwargs, message):
    args = {"transport": "distributed", "device": "cpu", "engine_urls": ["http://127.0.0.1:1"], **kwargs}
    with pytest.raises(TopologyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_topology(**args)


def test_remote_engines_join_a_group_on_train_rank_0s_node_address():
    t = build_topology("distributed", "cpu", ["http://10.0.0.9:1"], train_nodes=["10.0.0.1"])
    assert t.master_address == "10.0.0.1" and t.engines[0].node == "10.0.0.9"


def test_no_engines_and_duplicate_engines_are_refused():
    with pytest.raises(TopologyError, match="at least one engine"):
        PushTopology("tensor", "cpu", (), ("127.0.0.1",))
    with pytest.raises(TopologyError, match="listed twice"):
        build_topology("tensor", "cpu", ["http://127.0.0.1:1"] * 2)


def test_flag_rules_for_parse_time():
    assert default_transport("cuda", colocate=False) == "distributed"
    assert default_transport("cuda", colocate=True) == "tensor"
    assert default_transport("cpu", colocate=False) == "tensor"
    for device in ("cpu", "cuda"):
        for colocate in (False, True):
            assert transport_problem(default_transport(device, colocate), device, colocate) is None


def test_ipc_transport_sends_each_engine_the_payloads_of_its_tp_ranks():
    class Engine:
        def __init__(self) -> None:
            self.got: list[list[str]] = []

        async def update_weights_from_tensor(self, payloads, **kw):
            self.got.append(payloads)

    engines = [Engine(), Engine(), Engine()]
    transport = IpcTransport([1, 2, 3])
    transport.payloads = [f"rank{r}" for r in range(6)]
    asyncio.run(transport.send(engines, [], "1"))  # type: ignore[arg-type]
    assert [e.got for e in engines] == [[["rank0"]], [["rank1", "rank2"]], [["rank3", "rank4", "rank5"]]]
    transport.payloads = ["rank0"] * 5
    with pytest.raises(RuntimeError, match=r"need one per engine GPU"):
        asyncio.run(transport.send(engines, [], "2"))  # type: ignore[arg-type]


def test_master_address_not_on_train_rank_0s_node_is_refused():
    from slime.bridge.distributed import DistributedTransport

    transport = DistributedTransport("gloo", "192.0.2.1")  # TEST-NET-1: no interface of this machine
    with pytest.raises(TopologyError, match=r"cannot listen on 192\.0\.2\.1"):
        asyncio.run(transport.setup([]))


def test_distinct_loopback_nodes_are_distinct_nodes():
    # A loopback test cluster: nodes on 127.0.0.3 and 127.0.0.2 are two Ray nodes; 127.0.0.1 is
    # "this machine" (no node known), the same as any loopback node.
    with pytest.raises(TopologyError, match="shared-memory files"):
        build_topology("tensor", "cpu", ["http://127.0.0.2:1"], 1, ["127.0.0.2"], ["127.0.0.3"])
    assert build_topology("tensor", "cpu", ["http://127.0.0.2:1"], 1, ["127.0.0.2"], ["127.0.0.1"]).label
