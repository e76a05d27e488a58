"""A train step waits for the device a fixed number of times, however many micro-batches it holds.

On a GPU every read on the host of a device tensor (`.cpu()`, `.item()`, `float(t)`, `.tolist()`,
`bool(t)`) waits for the kernels queued so far, and so does torch's blocking copy to the device
(`t.to(device)`: a synchronisation of the stream follows it). One inside the micro-batch loop keeps
the host from launching the next work while the device computes. On CPU such calls are free, so
this counts them instead: a step of four micro-batches must make as many as a step of one (the
FSDP actor, one gloo rank). Copies to a device count where slime's own code makes them without
`non_blocking` (the model's own `.to(x.device)` of a tensor already there copies nothing).
"""

from __future__ import annotations

import os
import sys

import torch

import slime
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch

READS = ("cpu", "item", "tolist", "__float__", "__bool__", "__int__")
SLIME = os.path.dirname(slime.__file__)


def blocking_copy(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)`, called from slime's code, is a copy to a device
    that waits for it."""
    moves = any(isinstance(a, (torch.device, str)) for a in (*args, kwargs.get("device")))
    return moves and not kwargs.get("non_blocking") and sys._getframe(2).f_code.co_filename.startswith(SLIME)


def count_train_step_waits(rank, world_size, init_method, model, micro_batch_size):
    from slime.backends.fsdp.actor import FSDPBackend, FSDPTrainActor

    cfg = base_config(model, micro_batch_size=micro_batch_size)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    counts = {"steps": 0, "waits": 0}
    originals = {name: getattr(torch.Tensor, name) for name in (*READS, "to")}

    def counted(name):
        def call(self, *args, **kwargs):
            if name != "to" or blocking_copy(args, kwargs):
                counts["waits"] += 1
            return originals[name](self, *args, **kwargs)

        return call

    train_step = FSDPBackend.train_step

    def counting_step(self, *args, **kwargs):
        for name in originals:
            setattr(torch.Tensor, name, counted(name))
        try:
            counts["steps"] += 1
            return train_step(self, *args, **kwargs)
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)

    FSDPBackend.train_step = counting_step
    try:
        actor.train(0, make_batch(0))
    finally:
        FSDPBackend.train_step = train_step
        actor.close()
    return counts


def test_a_train_step_waits_for_the_device_as_often_with_four_micro_batches_as_with_one(tiny_model):
    one = run_ranks(1, count_train_step_waits, tiny_model, 4)[0]
    four = run_ranks(1, count_train_step_waits, tiny_model, 1)[0]
    assert one["steps"] == four["steps"] == 2  # 8 samples, 4 a step
    assert four["waits"] == one["waits"], (four, one)
