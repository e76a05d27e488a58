"""On-policy distillation on the train side: the teacher's log-probs from the batch (--opd-type
sglang) or from the teacher's weights in the train ranks (--opd-type megatron), the reverse-KL
penalty on the advantages, the metrics and the train dumps; and the OPD flags."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch

COEF = 0.5


def opd_cfg(model, opd=None, dump=None):
    cfg = base_config(model, micro_batch_size=2)
    # GRPO without whitening, so the advantages before the penalty are the group scalars.
    loss = dataclasses.replace(cfg.loss, use_kl_loss=False, kl_loss_coef=0.0, use_tis=False)
    return dataclasses.replace(cfg, loss=loss, save_debug_train_data=dump, **({"opd": opd} if opd else {}))


def train_once(rank, world_size, init_method, model, opd, dump, teacher_lp=None, drop_teacher=False, tp=0):
    """One rollout's train call; returns the output, the train dump rows, the log-probs of the
    batch under this actor's weights and, for the refusal, the error without teacher log-probs.
    `tp` > 0: the Megatron backend at that tensor-parallel size."""
    from slime.backends import make_train_actor
    from slime.config.train import MegatronConfig

    cfg = opd_cfg(model, opd, dump)
    if tp:
        cfg = dataclasses.replace(
            cfg, backend="megatron", megatron=MegatronConfig(tensor_model_parallel_size=tp)
        )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    batch = make_batch(0)
    log_probs = actor.compute_log_probs(batch)
    error = None
    if drop_teacher:
        try:
            actor.train(0, batch)
        except Exception as e:
            error = str(e)
    if teacher_lp is not None:
        batch.teacher_log_probs = [teacher_lp[i] for i in range(len(batch))]
    output = actor.train(0, batch) if error is None else None
    actor.close()
    rows = None
    if output is not None and dump is not None and actor.backend.writes_train_data:  # one rank per replica
        rows = torch.load(dump.format(rollout_id=0, rank=actor.backend.dp_rank), weights_only=False)[
            "samples"
        ]
    return {"output": output, "rows": rows, "log_probs": log_probs, "error": error}


@pytest.fixture(scope="module")
def runs(tiny_model, tiny_model_b, tmp_path_factory):
    """The same rollout trained without OPD, with the teacher's weights in the actor (megatron
    type), and with the teacher's log-probs in the batch (sglang type); the teacher is another
    model of the same architecture (tiny_model_b)."""
    from slime.config.opd import OPDConfig

    out = tmp_path_factory.mktemp("opd")
    plain = run_ranks(1, train_once, tiny_model, None, str(out / "plain_{rollout_id}_{rank}.pt"))[0]
    teacher_lp = run_ranks(1, train_once, tiny_model_b, None, None)[0]["log_probs"]
    in_train = OPDConfig(True, "megatron", COEF, tiny_model_b)
    megatron = run_ranks(1, train_once, tiny_model, in_train, str(out / "m_{rollout_id}_{rank}.pt"))[0]
    batch_opd = OPDConfig(True, "sglang", COEF, teacher_url="http://127.0.0.1:1")
    sglang = run_ranks(
        1, train_once, tiny_model, batch_opd, str(out / "s_{rollout_id}_{rank}.pt"), teacher_lp
    )[0]
    return {"plain": plain, "teacher_lp": teacher_lp, "megatron": megatron, "sglang": sglang}


def _by_index(rows):
    return {r["sample_index"]: r for r in rows}


def test_the_train_pass_scores_with_the_teachers_weights(runs):
    """--opd-type megatron: the teacher's log-probs are what a model loaded from the teacher's
    directory computes, and the student's weights are back for the train step (its first step's
    forward gives the log-prob pass's bits: ppo_kl exactly 0)."""
    assert runs["megatron"]["output"].steps[0]["ppo_kl"] == 0.0
    rows = _by_index(runs["megatron"]["rows"])
    for i, teacher in runs["teacher_lp"].items():
        assert rows[i]["teacher_log_probs"] == pytest.approx(teacher, abs=1e-6)
        assert rows[i]["log_probs"] == pytest.approx(runs["plain"]["log_probs"][i], abs=1e-6)


@pytest.mark.parametrize("kind", ["megatron", "sglang"])
def test_advantages_lose_the_reverse_kl_on_loss_tokens(runs, kind):
    """advantage = the estimator's - coef * (log p_student - log p_teacher) on every loss token;
    a token outside the loss keeps its 0 (slime's semantics, before whitening)."""
    plain, rows = _by_index(runs["plain"]["rows"]), _by_index(runs[kind]["rows"])
    assert rows.keys() == plain.keys()
    for i, row in rows.items():
        student, teacher = torch.tensor(row["log_probs"]), torch.tensor(runs["teacher_lp"][i])
        mask = torch.tensor(row["loss_mask"], dtype=torch.float32)
        expected = torch.tensor(plain[i]["advantages"]) - COEF * (student - teacher) * mask
        torch.testing.assert_close(torch.tensor(row["advantages"]), expected, rtol=0, atol=1e-5)
        assert row["teacher_log_probs"] == pytest.approx(runs["teacher_lp"][i], abs=1e-5)
    assert "teacher_log_probs" not in next(iter(plain.values()))


@pytest.mark.parametrize("kind", ["megatron", "sglang"])
def test_rollout_metrics_report_the_teacher_and_the_reverse_kl(runs, kind):
    """slime's rollout/teacher_log_probs and rollout/opd_reverse_kl: token means over the loss mask."""
    rows = runs[kind]["rows"]
    masks = [torch.tensor(r["loss_mask"]).bool() for r in rows]
    teacher = torch.cat([torch.tensor(r["teacher_log_probs"])[m] for r, m in zip(rows, masks)])
    student = torch.cat([torch.tensor(r["log_probs"])[m] for r, m in zip(rows, masks)])
    metrics = runs[kind]["output"].rollout
    assert metrics["teacher_log_probs"] == pytest.approx(float(teacher.mean()), abs=1e-5)
    assert metrics["opd_reverse_kl"] == pytest.approx(float((student - teacher).mean()), abs=1e-5)
    assert "opd_reverse_kl" not in runs["plain"]["output"].rollout


def test_the_megatron_backend_scores_with_the_teachers_weights_too(runs, tiny_model, tiny_model_b, tmp_path):
    """--opd-type megatron with --train-backend megatron at TP 2: each rank holds its shard of the
    teacher; the teacher's log-probs and the advantages are the FSDP actor's."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
    from slime.config.opd import OPDConfig

    dump = str(tmp_path / "meg_{rollout_id}_{rank}.pt")
    run_ranks(
        2, train_once, tiny_model, OPDConfig(True, "megatron", COEF, tiny_model_b), dump, None, False, 2
    )
    rows = _by_index(torch.load(dump.format(rollout_id=0, rank=0), weights_only=False)["samples"])
    fsdp = _by_index(runs["megatron"]["rows"])
    assert rows.keys() == fsdp.keys()
    for i, row in rows.items():
        assert row["teacher_log_probs"] == pytest.approx(runs["teacher_lp"][i], abs=1e-5)
        assert row["advantages"] == pytest.approx(fsdp[i]["advantages"], abs=1e-5)


def test_a_batch_without_teacher_log_probs_is_refused(tiny_model):
    from slime.config.opd import OPDConfig

    opd = OPDConfig(True, "sglang", COEF, teacher_url="http://127.0.0.1:1")
    result = run_ranks(1, train_once, tiny_model, opd, None, None, True)[0]
    assert "the rollout's samples carry no 'teacher_log_probs'" in result["error"]


def test_a_teacher_of_another_architecture_is_refused_in_the_train_pass(tiny_model, tmp_path):
    """Other shapes, or the same shapes with another forward (rope_theta): the teacher's weights
    would run in the student's model, so either is refused, naming the field."""
    import json
    import shutil

    from slime.backends.hf_checkpoint import check_hf_checkpoint, check_same_architecture
    from slime.config.opd import OTHER_ARCHITECTURE, OPDConfig
    from tests.conftest import make_model

    wider = make_model(str(tmp_path / "wider"), 2, "--hidden-size", "96")
    opd = OPDConfig(True, "megatron", COEF, wider)
    with pytest.raises(
        Exception, match=r"head_dim is 24, --hf-checkpoint's is 64.*goes with --opd-type sglang"
    ):
        run_ranks(1, train_once, tiny_model, opd, None)
    rope = tmp_path / "rope"
    shutil.copytree(tiny_model, rope)
    config = json.loads((rope / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 1234.0
    (rope / "config.json").write_text(json.dumps(config))
    student = check_hf_checkpoint(tiny_model)
    with pytest.raises(
        ValueError, match=r"rope_parameters is \{.*'rope_theta': 1234.0.*--hf-checkpoint's is"
    ):
        check_same_architecture(student, str(rope), "--opd-teacher-load", OTHER_ARCHITECTURE)
    check_same_architecture(student, tiny_model, "--opd-teacher-load", OTHER_ARCHITECTURE)


def _parse(tiny_model, prompts, *flags):
    from slime.ray.cli import parse_args

    return parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            prompts,
            "--rm-type",
            "math",
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            *flags,
        ]
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--opd-kl-coef", "0.5"], "--opd-kl-coef sets on-policy distillation: add --use-opd"),
        (["--use-opd"], "--use-opd needs --opd-type sglang"),
        (["--use-opd", "--opd-type", "sglang"], "--opd-type sglang needs a teacher: --opd-teacher-load DIR"),
        (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
        (
            [
                "--use-opd",
                "--opd-type",
                "megatron",
                "--opd-teacher-load",
                "x",
                "--opd-teacher-url",
                "http://h:1",
            ],
            "--opd-teacher-url names a teacher engine: it goes with --opd-type sglang",
        ),
        (
            [
                "--use-opd",
                "--opd-type",
                "sglang",
                "--opd-teacher-load",
                "x",
                "--opd-teacher-url",
                "http://h:1",
            ],
            "give one of them",
        ),
        (["--opd-teacher-ckpt-step", "3"], "it picks a step of a Megatron teacher checkpoint"),
        (
            [
                "--use-opd",
                "--opd-type",
                "sglang",
                "--opd-teacher-url",
                "http://h:1",
                "--apply-chat-template",
                "--multimodal-keys",
                '{"image": "images"}',
            ],
            "--opd-type sglang with --multimodal-keys is not built",
        ),
        (
            ["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://h:1", "--opd-kl-coef", "-1"],
            "--opd-kl-coef must be >= 0",
        ),
        (
            [
                "--use-opd",
                "--opd-type",
                "sglang",
                "--opd-teacher-url",
                "http://h:1",
                "--loss-type",
                "sft_loss",
            ],
            "--loss-type sft_loss has none",
        ),
    ],
)
def test_opd_flags_are_checked(tiny_model, tmp_path, capsys, flags, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1", "label": "2"}\n')
    with pytest.raises(SystemExit) as e:
        _parse(tiny_model, str(prompts), *flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_opd_flags_reach_both_sides(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1", "label": "2"}\n')
    config = _parse(
        tiny_model, str(prompts), "--use-opd", "--opd-type", "sglang", "--opd-teacher-load", tiny_model
    )
    assert config.opd == config.train.opd
    assert config.opd.kl_coef == 1.0 and config.opd.teacher_engine and not config.opd.in_train
    # slime's recipe: the user's reward and post-process functions set the teacher's log-probs.
    recipe = _parse(
        tiny_model,
        str(prompts),
        "--use-opd",
        "--opd-type",
        "sglang",
        "--custom-rm-path",
        "slime.rollout.on_policy_distillation.reward_func",
        "--opd-kl-coef",
        "0.3",
    )
    assert recipe.opd.enabled and not recipe.opd.scores_in_rollout and recipe.opd.kl_coef == 0.3


def test_a_sample_without_teacher_log_probs_is_named_before_it_trains():
    """--opd-type sglang: a rollout whose samples lack `teacher_log_probs` once post-processed (a
    custom function, a dump made without OPD) stops the rollout naming the first such sample."""
    from slime.config.train import BatchConfig
    from slime.rollout.summary import package_rollout
    from slime.utils.errors import UsageError
    from slime.utils.sample import Sample

    samples = [
        Sample(
            index=i,
            group_index=i // 2,
            tokens=[1, 2, 3],
            response_length=1,
            reward=1.0,
            teacher_log_probs=None if i == 2 else [-0.5],
        )
        for i in range(4)
    ]
    split = (BatchConfig(), 1)
    with pytest.raises(UsageError, match=r"sample 2 \(group 1\) carries no 'teacher_log_probs'"):
        package_rollout(0, samples, None, split, lambda p: p, {}, None, True)
    (part,) = package_rollout(0, samples, None, split, lambda p: p, {}).parts  # without OPD: not needed
    assert part.batch.teacher_log_probs is None
    samples[2].teacher_log_probs = [-0.25]
    (part,) = package_rollout(0, samples, None, split, lambda p: p, {}, None, True).parts
    assert part.batch.teacher_log_probs == [[-0.5], [-0.5], [-0.25], [-0.5]]
