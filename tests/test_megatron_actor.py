"""The Megatron train actor on real gloo process groups, megatron-core's own model and pipeline
schedules (on CPU through slime.backends.megatron.cpu_shim), against the FSDP actor on one rank.

The tiny Qwen3 checkpoint (QK norm, grouped-query attention, tied embeddings) trains two
rollouts of two optimizer steps with the FSDP test's loss (KL, entropy, TIS, asymmetric clip).
Every layout must train like one FSDP rank: TP 2, PP 2 (the tied embedding split over the first
and last stage), DP 2 and TP 2 x PP 2: same log-probs, step metrics and weights, within float32
rounding. The TP 2 run also checkpoints after rollout 0; a run resumed from it ends with the
same weights bit for bit, and the checkpoint converted to PP 2 by convert_checkpoint loads into
a PP 2 actor that computes the same log-probs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from slime.config.train import BatchConfig, MegatronConfig
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch
from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

ROLLOUTS = 2
PROBE = 7  # a batch no run trains on: log-probs of the weights after rollout 0


def config(model: str, tp: int = 1, pp: int = 1, **over):
    cfg = base_config(model, micro_batch_size=2)
    # --use-rollout-entropy: the log-prob passes' entropy is compared with FSDP's with every rollout metric
    cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, use_rollout_entropy=True))
    if over.get("backend", "megatron") == "megatron":
        cfg = dataclasses.replace(
            cfg,
            backend="megatron",
            megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        )
    return dataclasses.replace(cfg, **over)


def exported(actor) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for bucket in actor.export_weights(1 << 30):
        weights.update({n: t.detach().clone() for n, t in bucket})
    return weights


def train_run(
    rank,
    world_size,
    init_method,
    model,
    tp,
    pp,
    backend="megatron",
    save_dir=None,
    dynamic=False,
    recompute=False,
    padded=False,
    chunk=-1,
    first=None,
    cp=1,
):
    from slime.backends import make_train_actor
    from slime.config.train import FSDPConfig

    cfg = config(model, tp, pp, backend=backend, fsdp=FSDPConfig(gradient_checkpointing=recompute))
    if cp > 1:  # context parallelism: each sequence split over `cp` ranks
        cfg = dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, context_parallel_size=cp))
    if first is not None:  # uneven pipeline stages: `first` layers on the first stage, the rest on the last
        cfg = dataclasses.replace(
            cfg, megatron=dataclasses.replace(cfg.megatron, decoder_first_pipeline_num_layers=first)
        )
    # padded: one right-padded row per sample instead of packed micro-batches; chunk: the
    # log-softmax a few tokens at a time, recomputed in backward (TP collectives inside)
    cfg = dataclasses.replace(
        cfg, batch=dataclasses.replace(cfg.batch, padded_micro_batches=padded, log_probs_chunk_size=chunk)
    )
    if dynamic:  # token-budget micro-batches (different counts and shapes) instead of fixed pairs
        cfg = dataclasses.replace(
            cfg, batch=BatchConfig(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=32)
        )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    info = actor.init()
    batch = make_batch(0)
    result = {
        "info": info,
        "lp": actor.compute_log_probs(batch),
        "ref_lp": actor.compute_log_probs(batch, use_reference=True),
        "outputs": [],
    }
    for r in range(ROLLOUTS):
        result["outputs"].append(actor.train(r, make_batch(r)))
        if r == 0:
            result["probe"] = actor.compute_log_probs(make_batch(PROBE))
            if save_dir:
                actor.save(r, save_dir, extra={"next_prompt": 3})
    result["weights"] = exported(actor)
    if backend == "megatron":  # this stage's layers
        result["layers"] = len(getattr(actor.backend.model, "module", actor.backend.model).decoder.layers)
    actor.close()
    return result


def resumed_run(rank, world_size, init_method, model, tp, pp, load):
    from slime.backends import make_train_actor

    actor = make_train_actor(config(model, tp, pp, load=load), rank, world_size, init_method)
    info = actor.init()
    result = {"info": info, "probe": actor.compute_log_probs(make_batch(PROBE))}
    if info["resumed_rollout_id"] is not None:
        result["outputs"] = [
            actor.train(r, make_batch(r)) for r in range(info["resumed_rollout_id"] + 1, ROLLOUTS)
        ]
    result["weights"] = exported(actor)
    actor.close()
    return result


@pytest.fixture(scope="module")
def fsdp(tiny_model):
    return run_ranks(1, train_run, tiny_model, 1, 1, "fsdp")[0]


@pytest.fixture(scope="module")
def tp2(tiny_model, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("megatron") / "ckpt")
    return save_dir, run_ranks(2, train_run, tiny_model, 2, 1, "megatron", save_dir)


def steps(result) -> list[dict[str, float]]:
    return [s for out in result["outputs"] for s in out.steps]


def assert_trains_like(fsdp, ranks, only_rank0_exports=True):
    """Every rank's metrics and log-probs match the FSDP run's; rank 0 exports its weights (the
    only one to, with `only_rank0_exports`: Megatron's stream leaves from rank 0)."""
    expected_steps = steps(fsdp)
    assert len(expected_steps) == 2 * ROLLOUTS
    for result in ranks:
        for k, (a, b) in enumerate(zip(expected_steps, steps(result))):
            assert a.keys() == b.keys()
            # ppo_kl / kl_loss are differences of log-probs near -4.6: absolute float32 floor.
            bad = {m: (a[m], b[m]) for m in a if not math.isclose(a[m], b[m], rel_tol=2e-5, abs_tol=2e-6)}
            assert not bad, f"step {k}: {bad}"
        for out_a, out_b in zip(fsdp["outputs"], result["outputs"]):
            for key, value in out_a.rollout.items():
                assert math.isclose(value, out_b.rollout[key], rel_tol=1e-5, abs_tol=1e-6), key
        for name in ("lp", "probe"):  # each rank: its data-parallel share, keyed by sample index
            assert result[name], name
            for index, values in result[name].items():
                torch.testing.assert_close(
                    torch.tensor(values), torch.tensor(fsdp[name][index]), rtol=0, atol=2e-6
                )
    weights = ranks[0]["weights"]
    assert weights.keys() == fsdp["weights"].keys()
    for name, value in fsdp["weights"].items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=2e-5, msg=name)
    if only_rank0_exports:
        assert all(not r["weights"] for r in ranks[1:])


def test_tp2_trains_like_one_fsdp_rank(fsdp, tp2):
    assert {"entropy", "ref_entropy"} <= tp2[1][0]["outputs"][0].rollout.keys()  # compared with FSDP's below
    assert_trains_like(fsdp, tp2[1])


@pytest.mark.parametrize(
    "tp, pp, world, dynamic, recompute, padded, chunk",
    [
        (1, 2, 2, False, False, False, -1),
        (1, 1, 2, False, False, False, -1),
        (2, 2, 4, False, False, False, -1),
        (1, 2, 2, True, False, False, -1),
        (2, 1, 2, False, True, False, 3),
        (1, 2, 2, True, False, True, -1),
    ],
    ids=[
        "pp2",
        "dp2",
        "tp2xpp2",
        "pp2-dynamic-batches",
        "tp2-recompute-log-probs-chunks",
        "pp2-dynamic-padded",
    ],
)
def test_layouts_train_like_one_fsdp_rank(fsdp, tiny_model, tp, pp, world, dynamic, recompute, padded, chunk):
    """Packed micro-batches (the default) and --padded-micro-batches alike."""
    ranks = run_ranks(
        world, train_run, tiny_model, tp, pp, "megatron", None, dynamic, recompute, padded, chunk
    )
    assert [r["info"]["dp"] for r in ranks] == [world // (tp * pp)] * world
    assert_trains_like(fsdp, ranks)


def test_uneven_pipeline_stages_train_like_one_fsdp_rank(fsdp, tiny_model):
    """--decoder-first-pipeline-num-layers 1 with PP 2: one layer on the first stage, three on the last."""
    ranks = run_ranks(2, train_run, tiny_model, 1, 2, "megatron", None, False, False, False, -1, 1)
    assert [r["info"]["dp"] for r in ranks] == [1, 1] and [r["layers"] for r in ranks] == [1, 3]
    assert_trains_like(fsdp, ranks)


def test_tp2_reports_the_perf_metrics_per_gpu(tp2, tiny_model):
    """slime's perf/* from the Megatron actor: the two tensor-parallel ranks share the FLOPs."""
    from tests.test_fsdp_actor import assert_perf

    assert_perf(tp2[1][0]["outputs"], [make_batch(r) for r in range(ROLLOUTS)], tiny_model, 2)


def test_step0_reference_equals_actor_bitwise(tp2):
    for result in tp2[1]:
        assert result["lp"] == result["ref_lp"]
        first = result["outputs"][0].steps[0]
        assert first["ppo_kl"] == 0.0 and first["kl_loss"] == 0.0
        assert result["outputs"][0].steps[1]["kl_loss"] != 0.0


def test_vocabulary_is_padded_and_padding_stays_zero(tp2):
    """TP 2 pads the 101-token vocabulary to 256 rows (128 x 2); the export drops them."""
    assert tp2[1][0]["weights"]["model.embed_tokens.weight"].shape[0] == 101


def test_resume_from_tp2_checkpoint_is_bitwise(tiny_model, tp2):
    save_dir, ranks = tp2
    resumed = run_ranks(2, resumed_run, tiny_model, 2, 1, save_dir)
    assert resumed[0]["info"]["resumed_rollout_id"] == 0
    assert resumed[0]["info"]["resumed_extra"] == {"next_prompt": 3}
    assert resumed[0]["probe"] == ranks[0]["probe"]
    continued = [s for out in ranks[0]["outputs"][1:] for s in out.steps]
    assert [s for out in resumed[0]["outputs"] for s in out.steps] == continued
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], value), name


def test_checkpoint_converted_to_pp2_loads_the_same_weights(tiny_model, tp2, tmp_path):
    from slime.tools.convert_checkpoint import main as convert

    save_dir, ranks = tp2
    target = str(tmp_path / "pp2")
    args = [
        "--load-dir",
        save_dir,
        "--save-dir",
        target,
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "2",
    ]
    assert convert(args) == 0
    loaded = run_ranks(2, resumed_run, tiny_model, 1, 2, target)
    assert loaded[0]["info"]["resumed_rollout_id"] is None  # a converted checkpoint: weights only
    for index, values in ranks[0]["probe"].items():
        torch.testing.assert_close(
            torch.tensor(loaded[0]["probe"][index]), torch.tensor(values), rtol=0, atol=2e-6
        )


# ~35 s; the actor, push and checkpoints are tested in process in this file and test_actor_push.py
@pytest.mark.slow
@pytest.mark.e2e
def test_grpo_job_with_the_megatron_backend(tiny_model, prompts, tmp_path):
    """train.py as users start it: two GRPO rollouts at TP 2 on real Ray with a colocated torch
    engine, the step-0 precision gates and the weight checks on, a checkpoint at the end (the
    CPU counterpart of tests/test_megatron_gpu.py's GRPO run)."""
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--train-backend",
        "megatron",
        "--actor-num-gpus-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--colocate",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--check-precision",
        "--check-weight-update-equal",
        "--save",
        str(tmp_path / "ckpt"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after the first push every engine parameter equals the checkpoint" in proc.stderr
    assert len(set(re.findall(r"46 tensors match on every engine, weight version (\d+)", proc.stderr))) == 3
    assert (
        "--check-precision: passed at rollout 0: ppo_kl 0, actor == reference bitwise, kl_loss 0"
        in proc.stderr
    )
    gates = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert len(gates) == 6 and all(g["ok"] for g in gates)
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1] and all(r["train/grad_norm"] > 0 for r in records)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    ranks = sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000001").iterdir())
    assert ranks == ["mp_rank_00", "mp_rank_01"]


def bf16_run(rank, world_size, init_method, model, tp, backend="megatron", save_dir=None, load=None):
    from slime.backends import make_train_actor
    from slime.config.train import FSDPConfig

    if backend == "megatron":
        mc = MegatronConfig(tensor_model_parallel_size=tp, bf16=True)
        cfg = dataclasses.replace(config(model, tp), megatron=mc, load=load)
    else:  # FSDP's mixed precision: bfloat16 compute, float32 parameters and reductions
        cfg = config(model, backend="fsdp", fsdp=FSDPConfig(param_dtype="bfloat16"))
    actor = make_train_actor(cfg, rank, world_size, init_method)
    info = actor.init()
    batch = make_batch(0)
    result = {
        "info": info,
        "lp": actor.compute_log_probs(batch),
        "ref_lp": actor.compute_log_probs(batch, True),
    }
    start = info["resumed_rollout_id"] + 1 if info["resumed_rollout_id"] is not None else 0
    result["outputs"] = []
    for r in range(start, ROLLOUTS):
        result["outputs"].append(actor.train(r, make_batch(r)))
        if r == 0 and save_dir:
            actor.save(r, save_dir)
    result["weights"] = exported(actor)
    if backend == "megatron":
        params = list(actor.backend.model.parameters())
        result["dtypes"] = {str(p.dtype) for p in params} | {
            str(m.dtype) for m in actor.backend.masters.values()
        }
        result["rounded"] = all(torch.equal(p, actor.backend.masters[p].to(p.dtype)) for p in params)
        result["finer"] = any(not torch.equal(actor.backend.masters[p], p.float()) for p in params)
    actor.close()
    return result


def test_bf16_trains_bfloat16_weights_from_float32_masters(tiny_model, tmp_path):
    """--bf16: bfloat16 parameters and activations, float32 master weights and reductions. The
    parameters are the masters rounded; the masters keep what the rounding drops; step 0's KL is
    exactly 0; a resumed run is bitwise the uninterrupted one; and the run follows FSDP's
    bfloat16 mixed precision as closely as two bfloat16 implementations can."""
    save_dir = str(tmp_path / "ckpt")
    ranks = run_ranks(2, bf16_run, tiny_model, 2, "megatron", save_dir)
    fsdp_bf16 = run_ranks(1, bf16_run, tiny_model, 1, "fsdp")[0]
    resumed = run_ranks(2, bf16_run, tiny_model, 2, "megatron", None, save_dir)
    for result in ranks:
        assert result["dtypes"] == {"torch.bfloat16", "torch.float32"}
        assert result["rounded"] and result["finer"]
        assert result["lp"] == result["ref_lp"]
        first = result["outputs"][0].steps[0]
        assert first["ppo_kl"] == 0.0 and first["kl_loss"] == 0.0
    for name, value in ranks[0]["weights"].items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(resumed[0]["weights"][name], value), name
    assert [s for o in resumed[0]["outputs"] for s in o.steps] == [
        s for o in ranks[0]["outputs"][1:] for s in o.steps
    ]
    # Two bfloat16 implementations: log-probs differ by about 0.01 (FSDP's bfloat16 against its own
    # float32 differs as much); gradient norms within 0.5% (measured).
    for index, values in ranks[0]["lp"].items():
        torch.testing.assert_close(
            torch.tensor(values), torch.tensor(fsdp_bf16["lp"][index]), rtol=0, atol=0.03
        )
    for a, b in zip(steps(fsdp_bf16), steps(ranks[0])):
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=0.01), (a, b)
        assert math.isclose(a["entropy"], b["entropy"], rel_tol=1e-3), (a, b)


def broken_save_and_load(rank, world_size, init_method, model, root):
    """A save where rank 1 cannot write its shard, then loads of a checkpoint whose rank 1 shard
    is truncated, then missing: each must fail on every rank (none may wait in a collective)."""
    import os
    import shutil

    import torch.distributed as dist

    from slime.backends import make_train_actor

    actor = make_train_actor(config(model, 2), rank, world_size, init_method)
    actor.init()
    errors = []
    original = os.makedirs

    def refuse_rank_1(path, *a, **k):  # a real OSError on one rank, the other writes normally
        if rank == 1 and str(path).endswith("mp_rank_01"):
            raise PermissionError(13, "Permission denied", path)
        return original(path, *a, **k)

    os.makedirs = refuse_rank_1
    try:
        actor.save(0, os.path.join(root, "failed"))
    except Exception as e:
        errors.append(str(e))
    finally:
        os.makedirs = original
    published = os.path.exists(os.path.join(root, "failed", "latest_checkpointed_iteration.txt"))
    actor.save(0, os.path.join(root, "ok"))
    shard_1 = os.path.join(root, "ok", "iter_0000000", "mp_rank_01")
    for damage in ("truncate", "remove"):
        if rank == 0:
            if damage == "truncate":
                with open(os.path.join(shard_1, "model_optim_rng.pt"), "r+b") as f:
                    f.truncate(1000)
            else:
                shutil.rmtree(shard_1)
        dist.barrier()
        try:
            actor.backend.load(os.path.join(root, "ok"))
        except Exception as e:
            errors.append(str(e))
    actor.close()
    return {"errors": errors, "published": published}


def test_a_shard_that_cannot_be_written_or_read_fails_every_rank(tiny_model, tmp_path):
    results = run_ranks(2, broken_save_and_load, tiny_model, str(tmp_path))
    for r in results:
        assert len(r["errors"]) == 3 and not r["published"], r
        assert "rank 1 cannot write its shard" in r["errors"][0] and "Permission denied" in r["errors"][0]
        assert "rank 1 cannot read its shard" in r["errors"][1]
        assert "no iter_0000000/mp_rank_01/model_optim_rng.pt for TP 2 x PP 1" in r["errors"][2]


def freeze_run(rank, world_size, init_method, model):
    from slime.backends import make_train_actor
    from slime.config.train import OptimizerConfig

    opt = OptimizerConfig(lr=1e-3, only_train_params_name_list=[r"layers\.0\.mlp"])
    cfg = dataclasses.replace(config(model), optimizer=opt, megatron=MegatronConfig(bf16=True))
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    before = exported(actor)
    actor.train(0, make_batch(0))
    after = exported(actor)
    actor.close()
    return sorted(n for n in before if not torch.equal(before[n], after[n]))


def test_only_train_params_name_list_trains_the_megatron_parameters_it_names(tiny_model):
    """Megatron's names (decoder.layers.0.mlp.*), bfloat16 weights with float32 masters: only
    those masters are in the optimizer, the rest stay bitwise."""
    changed = run_ranks(1, freeze_run, tiny_model)[0]
    assert changed and all(n.startswith("model.layers.0.mlp.") for n in changed), changed
