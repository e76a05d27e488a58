"""Context parallelism in the Megatron actor (slime.backends.megatron.context_parallel): each
sequence split over CP ranks in megatron-core's load-balanced chunks, torch's attention over the
all-gathered keys and values, log-probs gathered before the loss. CP ranks train like one FSDP
rank (metrics, log-probs and weights), packed and padded, with TP and PP too."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.test_megatron_actor import assert_trains_like, fsdp, train_run  # noqa: F401 - fsdp is a fixture


def test_chunks_are_megatron_cores_load_balanced_halves():
    from slime.backends.megatron.context_parallel import chunk_positions, local_order

    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # two sequences of 4 and 8 (padded bounds 0, 4, 12): each split on its own
    assert local_order([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    every = torch.cat([local_order([0, 4, 12], 2, r) for r in range(2)])
    assert sorted(every.tolist()) == list(range(12))


def test_the_cp_view_holds_each_samples_tokens_once_and_their_next_tokens():
    from slime.backends.megatron.context_parallel import cp_view
    from slime.backends.micro_batch import make_micro_batch

    tokens = [[5, 6, 7, 8, 9], [10, 11, 12]]
    for packed in (True, False):
        mb = make_micro_batch([0, 1], tokens, [2, 1], None, torch.device("cpu"), packed)
        views = [cp_view(mb, 2, r, None) for r in range(2)]
        ids = sorted(t for v in views for t, real in zip(v.ids[0].tolist(), v.real[0].tolist()) if real)
        assert ids == sorted(tokens[0] + tokens[1])
        # sample 0 (padded to 8) comes first in the global row; its last real token's next is padding
        where = views[0].where
        assert int(where[0, 4]) == 4 and int(where[0, 0]) == 0
        assert int(where[0 if packed else 1, 5 if packed else 0]) == 8  # sample 1 starts after 8 slots
        targets = {int(p): int(t) for v in views for p, t in zip(v.position_ids[0][:4], v.targets[:4])}
        assert targets[0] == 6 and targets[3] == 9


@pytest.mark.parametrize(
    "padded", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["packed", "padded"]
)
def test_two_cp_ranks_train_like_one_fsdp_rank(fsdp, tiny_model, padded):  # noqa: F811
    ranks = run_ranks(2, train_run, tiny_model, 1, 1, "megatron", None, False, False, padded, -1, None, 2)
    assert_trains_like(fsdp, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2xcp2", "pp2xcp2"])
def test_cp_with_tp_or_pp_trains_like_one_fsdp_rank(fsdp, tiny_model, tp, pp):  # noqa: F811
    ranks = run_ranks(4, train_run, tiny_model, tp, pp, "megatron", None, False, False, False, -1, None, 2)
    assert_trains_like(fsdp, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_cp_trains_multi_latent_attention_and_experts_like_fsdp(tmp_path, tiny_moe, arch):
    """DeepSeek-V3 (multi-latent attention, sigmoid routing with the expert bias) and Qwen3-MoE,
    CP 2 x EP 2 on two ranks."""
    from tests.conftest import make_model
    from tests.test_megatron_moe_actor import moe_run

    model = tiny_moe if arch == "qwen3_moe" else make_model(str(tmp_path / arch), 0, "--arch", arch,
                                                            "--hidden-size", "64", "--num-layers", "3")  # fmt: skip
    fsdp_run = run_ranks(1, moe_run, model, "fsdp")[0]
    ranks = run_ranks(2, moe_run, model, "megatron", 1, 1, 2, 2, None, None, False, False, 2)
    assert_trains_like(fsdp_run, ranks)


def test_cp_flags_are_accepted_and_what_is_not_built_is_refused(tiny_model, tiny_moe, tmp_path, capsys):
    from slime.ray.cli import parse_args
    from tests.test_flag_surface import base, error

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = parse_args(base(tiny_model, str(data), "--train-backend", "megatron", "--context-parallel-size", "2",
                          "--actor-num-gpus-per-node", "2", "--allgather-cp"))  # fmt: skip
    assert cfg.train.megatron.context_parallel_size == 2
    cases = [
        (tiny_model, ["--train-backend", "fsdp", "--context-parallel-size", "2"], "configure --train-backend megatron"),
        (tiny_model, ["--train-backend", "megatron", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "3"],
         "does not divide the 3 train ranks"),
        (tiny_moe, ["--train-backend", "megatron", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2",
                    "--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff with --context-parallel-size 2 is not built"),
    ]  # fmt: skip
    for model, extra, message in cases:
        assert message in error(capsys, base(model, str(data), *extra)), extra
