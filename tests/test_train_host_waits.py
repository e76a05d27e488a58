"""A train step waits for the device a fixed number of times, however many micro-batches it holds.

On a GPU every read on the host of a device tensor (`.cpu()`, `.item()`, `float(t)`, `.tolist()`,
`bool(t)`) waits for the kernels queued so far, and so does torch's blocking copy to the device
(`t.to(device)`: a synchronisation of the stream follows it). One inside the micro-batch loop keeps
the host from launching the next work while the device computes. On CPU such calls are free, so
this counts them instead: a step of four micro-batches must make as many as a step of one (the
FSDP and the Megatron actors, one gloo rank). Copies to a device count where slime's own code
makes them without `non_blocking` (the model's own `.to(x.device)` of a tensor already there
copies nothing).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

import slime
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch

READS = ("cpu", "item", "tolist", "__float__", "__bool__", "__int__", "__index__", "nonzero", "__getitem__")
"""Tensor methods that read the device: `__getitem__` where a boolean mask indexes (the result's
size is the mask's count), the others always."""
SLIME = os.path.dirname(slime.__file__)


ROPE = "_apply_rotary_pos_emb_thd"
"""megatron-core's unfused rotary embedding of packed rows, which reads the rows' bounds in every
attention layer. slime hands it the bounds on the host (context_parallel._thd_params): its reads
are not counted, and which tensor it gets is checked instead (the device tensor of the bounds
carries HOST_BOUNDS, the host copy does not)."""

HOST_SIDE = (ROPE, "cp_view", "_own_places", "_predicting", "real_token_index")
"""Functions whose reads are of host tensors: ROPE's (checked as said), those that cut a
context-parallel rank's share of a micro-batch from the ids MicroBatch keeps on the host, and the
one that finds a micro-batch's real tokens for the load-balancing losses in its host sample ids."""

FOREIGN = ("megatron/core/transformer/moe/",)
"""Code whose reads are not counted: megatron-core's MoE layers, whose token dispatcher brings the
routing's counts to the host once a layer by design (the experts' shapes depend on them) and whose
experts and chunk sorting read those host copies."""

R2_AUX = {"use_routing_replay": True, "moe_aux_loss_coeff": 0.01}
MOE = {
    "fsdp-moe": ("tiny_moe", R2_AUX),
    "megatron-moe": ("tiny_moe", {**R2_AUX, "moe_router_load_balancing_type": "seq_aux_loss"}),
    "fsdp-moe-sigmoid": ("sigmoid_moe", {**R2_AUX, "moe_router_bias_update_rate": 1e-3}),
}
"""The mixture-of-experts rows: their model and flags. R2 (the log-prob pass records each layer's
experts, the training steps replay them) and a load-balancing loss in every MoE layer; with a
sigmoid router (GLM-4.5's), its expert bias updated from the counts of the tokens routed."""

BACKENDS = ["fsdp", "megatron", pytest.param("megatron-cp2", marks=pytest.mark.slow), *MOE]
"""The trainers counted: FSDP, Megatron, Megatron with context parallelism over two ranks, and
both with a mixture-of-experts model (MOE)."""


def blocking_copy(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)`, called from slime's code, is a copy to a device
    that waits for it."""
    moves = any(isinstance(a, (torch.device, str)) for a in (*args, kwargs.get("device")))
    return moves and not kwargs.get("non_blocking") and sys._getframe(2).f_code.co_filename.startswith(SLIME)


@contextlib.contextmanager
def counting_waits(counts: dict[str, int]):
    """Count in `counts["waits"]` the reads of tensors (READS) and blocking copies to a device,
    and in "rope_device_bounds" the calls of megatron-core's ROPE given bounds on the device."""
    from megatron.core.models.common.embeddings import rope_utils

    from slime.backends.micro_batch import HOST_BOUNDS

    originals = {name: getattr(torch.Tensor, name) for name in (*READS, "to")}
    rope = getattr(rope_utils, ROPE)

    def waits(name: str, args: tuple, kwargs: dict) -> bool:
        if name == "to":
            return blocking_copy(args, kwargs)
        caller = sys._getframe(2).f_code
        if caller.co_name in HOST_SIDE or any(part in caller.co_filename for part in FOREIGN):
            return False
        if name == "__getitem__":
            index = args[0] if isinstance(args[0], tuple) else (args[0],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        return True

    def counted(name):
        def call(self, *args, **kwargs):
            counts["waits"] += waits(name, args, kwargs)
            return originals[name](self, *args, **kwargs)

        return call

    def watched_rope(t, cu_seqlens, *args, **kwargs):
        counts["rope_calls"] += 1
        counts["rope_device_bounds"] += hasattr(cu_seqlens, HOST_BOUNDS)
        return rope(t, cu_seqlens, *args, **kwargs)

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    setattr(rope_utils, ROPE, watched_rope)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        setattr(rope_utils, ROPE, rope)


def count_step_waits(
    rank, world_size, init_method, model, micro_batch_size, critic, passes=False, backend="fsdp"
):
    """The waits of each optimizer step of one train call: the policy's (`train_step` of the
    backend's class), or with `critic` the value model's (`value_step`); --check-precision on, so
    that the step-0 gaps are kept too. With `passes`, the waits of the no-grad passes instead (the
    policy's log-prob passes, the critic's value passes). `backend`: one of BACKENDS."""
    import dataclasses

    from slime.backends import make_train_actor
    from slime.config.train import MegatronConfig, MoEOptions

    moe = MoEOptions(**MOE[backend][1]) if backend in MOE else MoEOptions()
    backend, cp = backend.split("-")[0], backend.partition("-cp")[2]
    cfg = dataclasses.replace(
        base_config(model, micro_batch_size=micro_batch_size),
        check_precision=True,
        backend=backend,
        megatron=MegatronConfig(context_parallel_size=int(cp or 1)),
        moe=moe,
    )
    trainer = make_train_actor(cfg, rank, world_size, init_method, critic=critic)
    trainer.init()
    batch = make_batch(0)
    owner = type(trainer.backend)
    method = {(False, False): "train_step", (True, False): "value_step"}.get((critic, passes))
    method = method or ("value_pass" if critic else "log_prob_pass")
    counts = {"steps": 0, "waits": 0, "rope_calls": 0, "rope_device_bounds": 0}
    step = getattr(owner, method)

    def counting_step(self, *args, **kwargs):
        with counting_waits(counts):
            counts["steps"] += 1
            return step(self, *args, **kwargs)

    setattr(owner, method, counting_step)
    try:
        if critic:
            old = trainer.compute_values(batch)  # (empty past the first CP rank: the job takes its)
            old = old or {i: [0.0] * n for i, n in enumerate(batch.response_lengths)}
            returns = {i: [r] * n for i, (r, n) in enumerate(zip(batch.rewards, batch.response_lengths))}
            trainer.train_values(0, batch, old, returns)
        else:
            trainer.train(0, batch)
    finally:
        setattr(owner, method, step)
        trainer.close()
    return counts


def counted_on_rank_0(backend: str, *args) -> dict[str, int]:
    ranks = 2 if backend.endswith("-cp2") else 1
    return run_ranks(ranks, count_step_waits, *args, backend)[0]


@pytest.fixture(scope="module")
def sigmoid_moe(tmp_path_factory) -> str:
    from tests.conftest import FAMILY_SIZE, make_model

    return make_model(
        str(tmp_path_factory.mktemp("models") / "glm4_moe"), 0, "--arch", "glm4_moe", *FAMILY_SIZE
    )


def model_of(request, backend: str) -> str:
    return request.getfixturevalue(MOE[backend][0] if backend in MOE else "tiny_model")


def rows(kinds: tuple[str, str]) -> list:
    """(critic, backend) test rows, named `kind-backend`: each backend as the policy (kinds[0]) and
    as the critic (kinds[1]); the MoE ones as the policy only (the critic's router hooks are the
    same code)."""
    out = []
    for row in BACKENDS:
        backend, marks = (row, ()) if isinstance(row, str) else (row.values[0], row.marks)
        for critic, kind in zip((False, True), kinds):
            if not (critic and backend in MOE):
                out.append(pytest.param(critic, backend, marks=marks, id=f"{kind}-{backend}"))
    return out


@pytest.mark.parametrize("critic, backend", rows(("policy", "critic")))
def test_a_train_step_waits_for_the_device_as_often_with_four_micro_batches_as_with_one(
    request, critic, backend
):
    model = model_of(request, backend)
    one = counted_on_rank_0(backend, model, 4, critic, False)
    four = counted_on_rank_0(backend, model, 1, critic, False)
    assert one["steps"] == four["steps"] == 2  # 8 samples, 4 a step
    assert four["waits"] == one["waits"], (four, one)
    assert (four["rope_calls"] > 0) == backend.startswith("megatron") and four["rope_device_bounds"] == 0


@pytest.mark.parametrize("critic, backend", rows(("log-prob-pass", "value-pass")))
def test_a_no_grad_pass_waits_once_for_its_results_however_many_micro_batches(request, critic, backend):
    """The passes before the train steps bring their results down in one copy, not one per
    micro-batch (8 micro-batches of 1 sample against 2 of 4); R2's recorded experts too."""
    model = model_of(request, backend)
    two = counted_on_rank_0(backend, model, 4, critic, True)
    eight = counted_on_rank_0(backend, model, 1, critic, True)
    assert two["steps"] == eight["steps"] >= 1
    assert eight["waits"] == two["waits"], (eight, two)
    assert (eight["rope_calls"] > 0) == backend.startswith("megatron") and eight["rope_device_bounds"] == 0


def test_the_precision_gap_is_a_masked_max_that_keeps_a_nan():
    from slime.backends.measures import DeviceMax

    gap = DeviceMax()
    assert gap.value == 0.0
    a, b = torch.tensor([[1.0, 5.0, 2.0]]), torch.tensor([[1.5, 0.0, 2.0]])
    gap.add(a, b, torch.tensor([[1, 0, 1]]))  # the 5 is masked out
    assert gap.value == 0.5
    gap.add(a, b, torch.zeros(1, 3))  # nothing masked in: 0, the max stays
    assert gap.value == 0.5
    gap.add(torch.tensor([[float("nan"), 9.0]]), torch.zeros(1, 2), torch.tensor([[0, 1]]))
    assert gap.value == 9.0  # a NaN outside the mask does not count
    gap.add(torch.tensor([[float("nan")]]), torch.zeros(1, 1), torch.ones(1, 1))
    assert gap.value != gap.value  # a NaN inside it stays, whatever comes after
    gap.add(a, b, torch.ones(1, 3))
    assert gap.value != gap.value
