"""Sleep releases every byte of device memory (slime.utils.device_memory and the backends' sleep and wake),
on CPU with torch.cuda's functions stood in for. The first GPU run left 67,108,864 B after sleep
(FSDP and Megatron: cuBLAS's workspaces, which empty_cache alone keeps) and 31,232 B more
(Megatron: megatron-core's rotary tables and inv_freq, outside the module's parameters)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from slime.backends import optim
from slime.backends.fsdp.actor import FSDPBackend
from slime.utils import device_memory

CLEAR = "_cuda_clearCublasWorkspaces"


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """torch.cuda (initialised), gc and cuBLAS's workspace clear, recording their calls in order."""
    seen: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: seen.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    monkeypatch.setattr(device_memory.gc, "collect", lambda *a: seen.append("gc") or 0)
    monkeypatch.setattr(torch._C, CLEAR, lambda: seen.append("clear_workspaces"), raising=False)
    return seen


def test_release_clears_the_cublas_workspaces_before_emptying_the_cache(calls):
    device_memory.release_device_memory()
    assert calls == ["synchronize", "gc", "clear_workspaces", "empty_cache"]


def test_release_without_the_workspace_function_still_empties_the_cache(calls, monkeypatch):
    monkeypatch.delattr(torch._C, CLEAR)
    device_memory.release_device_memory()
    assert calls == ["synchronize", "gc", "empty_cache"]


def test_release_is_a_no_op_before_cuda_starts(calls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    device_memory.release_device_memory()
    assert calls == []


def fake_actor(cls: type, model: torch.nn.Module, params: list[torch.Tensor]):
    """A backend of `cls` with only what sleep and wake read, "on CUDA" (its tensors stay on the CPU)."""
    actor = cls.__new__(cls)
    actor.device = torch.device("cuda", 0)
    actor.model = model
    actor.optimizer = torch.optim.SGD(params or [torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    return actor


def counted_release(monkeypatch, module: types.ModuleType) -> list[str]:
    released: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: released.append("synchronize"))
    monkeypatch.setattr(module, "release_device_memory", lambda: released.append("release"))
    return released


@pytest.mark.parametrize("keep_params", [False, True])
def test_sleep_releases_device_memory_once_and_wake_does_not(monkeypatch, keep_params):
    released = counted_release(monkeypatch, optim)
    model = torch.nn.Linear(3, 2)
    actor = fake_actor(FSDPBackend, model, list(model.parameters()))
    model(torch.ones(1, 3)).sum().backward()
    actor.optimizer.step()  # momentum buffers: optimizer state to move
    actor.sleep(keep_params=keep_params)
    assert released == ["release"]
    released.clear()
    actor.model = torch.nn.Module()  # nothing to move to a device this machine lacks
    actor.optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    actor.wake()
    assert released == ["synchronize"]


def test_no_local_of_the_sleep_path_holds_a_tensor_when_memory_is_released(monkeypatch):
    """A tensor still referenced by the releasing frame is freed only after the release: its
    block's segment stays reserved (the second H200 run: 2 MiB after a loop variable's tensor)."""
    held: list[list[str]] = []

    def release() -> None:
        frame = sys._getframe(1)
        held.append([k for k, v in frame.f_locals.items() if isinstance(v, torch.Tensor)])

    monkeypatch.setattr(optim, "release_device_memory", release)
    model = torch.nn.Linear(3, 2)
    actor = fake_actor(FSDPBackend, model, list(model.parameters()))
    model(torch.ones(1, 3)).sum().backward()
    actor.optimizer.step()
    actor.sleep()
    assert held == [[]]


def test_sleep_drops_the_last_steps_gradients_and_copies_asynchronously(monkeypatch):
    """Offload moves no gradient (every train step starts from none) and asks for non-blocking
    copies, which torch makes into pinned host memory (pageable copies took 4.4 s for Qwen3-0.6B's
    offload on an H200); wake's copies are non-blocking too, then synchronised."""
    released = counted_release(monkeypatch, optim)
    blocking: list[bool] = []
    to = torch.Tensor.to

    def recorded(self, *args, **kwargs):
        # Module.to passes non_blocking third and positionally; move_state by keyword
        blocking.append(not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        return to(self, "cpu", *args[1:], **kwargs)  # "cuda": this machine has none

    monkeypatch.setattr(torch.Tensor, "to", recorded)
    model = torch.nn.Linear(3, 2)
    actor = fake_actor(FSDPBackend, model, list(model.parameters()))
    weight = model.weight.detach().clone()
    model(torch.ones(1, 3)).sum().backward()
    actor.optimizer.step()
    stepped = model.weight.detach().clone()
    assert not torch.equal(weight, stepped)
    actor.sleep()
    assert [p.grad for p in model.parameters()] == [None, None]
    assert blocking and not any(blocking), blocking
    assert len(blocking) == 4  # two parameters, two momentum buffers: no gradient
    blocking.clear()
    actor.wake()
    assert len(blocking) == 4 and not any(blocking) and released == ["release", "synchronize"]
    assert torch.equal(model.weight, stepped)


def test_sleep_on_a_cpu_actor_touches_no_device(monkeypatch):
    released = counted_release(monkeypatch, optim)
    actor = fake_actor(FSDPBackend, torch.nn.Linear(2, 2), [])
    actor.device = torch.device("cpu")
    actor.sleep()
    actor.wake()
    assert released == []


# ---- Megatron ---------------------------------------------------------------------------------


def rotary_model(monkeypatch) -> tuple[torch.nn.Module, object]:
    """A module holding megatron-core's RotaryEmbedding with two tables in its forward's cache."""
    rope = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    rotary = rope.RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    # get_emb moves inv_freq to torch.cuda.current_device(): here, the CPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    rotary(12), rotary(20)
    assert rope.RotaryEmbedding.forward.cache_info().currsize >= 2
    return torch.nn.ModuleDict({"rotary": rotary}), rope.RotaryEmbedding


def test_megatron_rotary_tables_move_and_the_cache_empties(monkeypatch):
    from slime.backends.megatron.model import move_rotary_tables

    model, rotary_cls = rotary_model(monkeypatch)
    inv_freq = model["rotary"].inv_freq
    assert not [n for n, _ in model.named_buffers()], "inv_freq is no buffer: model.to leaves it behind"
    move_rotary_tables(model, "meta")
    assert model["rotary"].inv_freq.device.type == "meta" and model["rotary"].inv_freq.shape == inv_freq.shape
    assert rotary_cls.forward.cache_info().currsize == 0


def megatron_actor(monkeypatch, bf16: bool):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    from slime.backends.megatron.actor import MegatronBackend

    model, rotary_cls = rotary_model(monkeypatch)
    scratch = types.SimpleNamespace(buffer={"attention": torch.zeros(4)})
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: scratch)
    master = torch.zeros(3, requires_grad=True)
    master.grad = torch.ones(3)  # the last step's gradient, kept until the next zero_grad
    actor = fake_actor(MegatronBackend, model, [master])
    from slime.backends.megatron.masters import MasterWeights

    actor.masters = MasterWeights({torch.zeros(3): master} if bf16 else {})
    return actor, master, scratch, rotary_cls


def test_megatron_sleep_drops_the_rotary_tables_and_the_scratch_buffer(monkeypatch):
    actor, _, scratch, rotary_cls = megatron_actor(monkeypatch, bf16=False)
    released = counted_release(monkeypatch, optim)
    actor.sleep()
    assert released == ["release"]
    assert scratch.buffer == {} and rotary_cls.forward.cache_info().currsize == 0


def test_megatron_sleep_takes_the_bf16_masters_gradients_along(monkeypatch):
    """The masters' gradients live until the next step's zero_grad: sleep moves them with their
    masters (the tensors stay on this CPU-only machine: which ones `.to` was asked to move counts)."""
    actor, master, _, _ = megatron_actor(monkeypatch, bf16=True)
    counted_release(monkeypatch, optim)
    moved: list[torch.Tensor] = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: moved.append(self) or to(self, *a, **k))
    grad = master.grad
    assert grad is not None
    pointers = {master.data_ptr(): "master", grad.data_ptr(): "gradient"}
    actor.sleep()
    assert {pointers.get(t.data_ptr()) for t in moved} >= {"master", "gradient"}


# ---- the GPU tests' report of what sleep left (tests/gpu_memory.py) --------------------------


def test_the_leftover_report_lists_live_blocks_with_their_stacks(monkeypatch):
    from tests import gpu_memory

    torch_frame = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_apply"}
    ours = {"filename": "/x/megatron/core/rotary_pos_embedding.py", "line": 160, "name": "get_emb"}
    segments = [
        {
            "blocks": [
                {
                    "size": 512,
                    "requested_size": 128,
                    "address": 4096,
                    "state": "active_allocated",
                    "frames": [torch_frame, ours],
                },
                {"size": 1 << 20, "address": 8192, "state": "inactive"},
            ]
        },
        {
            "blocks": [
                {"size": 67_108_864, "requested_size": 67_108_864, "address": 0, "state": "active_allocated"}
            ]
        },
    ]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 67_109_376)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 69_206_016)
    left = gpu_memory.left_on_device()
    assert len(left["blocks"]) == 2 and "67,108,864 B" in left["blocks"][0]  # largest first, inactive out
    assert "no stack recorded" in left["blocks"][0]
    assert "rotary_pos_embedding.py:160 get_emb" in left["blocks"][1] and "module.py" not in left["blocks"][1]
    with pytest.raises(AssertionError) as failure:
        gpu_memory.assert_released(left, "some actor")
    assert "67,109,376 B still allocated" in str(failure.value) and left["blocks"][1] in str(failure.value)
    gpu_memory.assert_released({"allocated": 0, "reserved": 0, "blocks": []}, "some actor")
    with pytest.raises(AssertionError, match="2,097,152 B reserved"):
        gpu_memory.assert_released(
            {"allocated": 0, "reserved": 2 << 20, "blocks": [], "segments": ["seg"]}, "x"
        )


def test_run_checks_reports_every_failure():
    from tests.gpu_memory import run_checks

    def fails(message: str):
        def check() -> None:
            raise AssertionError(message)

        return check

    with pytest.raises(AssertionError) as failure:
        run_checks(fails("memory left"), lambda: None, fails("numbers differ"))
    assert "memory left" in str(failure.value) and "numbers differ" in str(failure.value)
