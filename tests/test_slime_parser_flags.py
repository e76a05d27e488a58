"""Every flag slime's own parsers define is known here: built with slime's meaning, or refused
by name with the reason (tests/fixtures/slime_parser_flags.txt holds slime's list, with its date)."""

from __future__ import annotations

import json
import os

import pytest

from slime.config.arguments import build_parser
from slime.config.derived import SPECS
from slime.config.surface import REFUSED
from slime.ray.cli import parse_args

FLAGS = os.path.join(os.path.dirname(__file__), "fixtures", "slime_parser_flags.txt")


def slime_flags() -> list[str]:
    return [line.strip() for line in open(FLAGS) if line.strip() and not line.startswith("#")]


def test_every_flag_of_slimes_parsers_is_built_or_refused_by_name():
    flags = slime_flags()
    assert len(flags) == 218
    known = build_parser()._option_string_actions
    assert [f for f in flags if f not in known] == []
    refused = {s.flag for s in SPECS if REFUSED in (s.fsdp, s.megatron)}
    for flag in refused & set(flags):  # each refusal says why, in --help
        assert len(known[flag].help) > 40, flag


@pytest.fixture
def base(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    model = tmp_path / "m"
    model.mkdir()
    return [
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "2",
        "--rm-type",
        "exact",
    ]


def error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_train_env_vars_is_a_json_object_of_strings(base, capsys):
    cfg = parse_args([*base, "--train-env-vars", '{"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": 2}'])
    assert cfg.cluster.train_env_vars == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "2"}
    assert "--train-env-vars" in error(capsys, [*base, "--train-env-vars", "NCCL_DEBUG=INFO"])
    assert "JSON object" in error(capsys, [*base, "--train-env-vars", '["a"]'])


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--update-weights-interval", "0"], "--update-weights-interval must be >= 1"),
        (["--update-weights-interval", "2", "--colocate"], "every rollout must push"),
        (["--start-rollout-id", "-1"], "--start-rollout-id must be >= 0"),
        (["--rollout-data-transport", "nixl"], "NIXL"),
        (["--qwen-gdn-backend", "flashqla"], "Hopper"),
        (["--sglang-pp-size", "2"], "pipeline parallelism"),
        (["--megatron-deepgemm-forward-layers", "0", "1"], "DeepGEMM"),
        (["--teacher-port", "7999"], "megatron_server.py"),
        (["--ref-ckpt-step", "100"], "Hugging Face directory"),
        (["--ref-update-interval", "2"], "no loss term uses"),
        (["--eval-min-new-tokens", "5", "--eval-prompt-data", "e.jsonl"], "the torch engine does not apply"),
        (["--eval-min-new-tokens", "5"], "applies to evaluation requests: give --eval-prompt-data"),
        (["--balance-by-flops"], "add --use-dynamic-batch-size"),
        (["--keep-old-actor", "--partial-rollout", "--fully-async"], "mixes versions within a rollout"),
        (["--update-weight-mode", "delta"], "use --update-weight-transport disk"),
        (
            ["--update-weight-mode", "delta", "--update-weight-transport", "disk"],
            "needs --update-weight-disk-dir and --update-weight-local-checkpoint-dir",
        ),
        (
            ["--update-weight-local-checkpoint-dir", "/x"],
            "full disk pushes are read from --update-weight-disk-dir",
        ),
        (
            [
                "--update-weight-mode",
                "delta",
                "--update-weight-transport",
                "disk",
                "--update-weight-disk-dir",
                "/s",
                "--update-weight-local-checkpoint-dir",
                "/s/local",
            ],
            "must be apart from --hf-checkpoint and --update-weight-disk-dir",
        ),
        (["--apply-chat-template-kwargs", "enable_thinking=False"], "--apply-chat-template-kwargs"),
    ],
)
def test_slime_flags_this_run_cannot_honour_exit_2_naming_them(base, capsys, extra, words):
    assert words in error(capsys, [*base, *extra])


def test_neutral_values_of_refused_flags_are_accepted(base):
    cfg = parse_args(
        [
            *base,
            "--rollout-data-transport",
            "object-store",
            "--qwen-gdn-backend",
            "fla",
            "--sglang-pp-size",
            "1",
            "--min-batch-collection-ratio",
            "0.5",
            "--http-proxy",
            "http://p:1",
        ]
    )
    assert cfg.rollout.num_rollout == 2


def test_the_torch_engine_refuses_min_new_tokens_it_would_not_apply():
    from slime.utils.sampling_params import FieldError, SamplingParams

    assert SamplingParams.from_json({"min_new_tokens": 0}).max_new_tokens == 128
    with pytest.raises(FieldError, match="min_new_tokens"):
        SamplingParams.from_json({"min_new_tokens": 4})


def test_without_the_global_dataset_a_rollout_function_gets_numbered_blank_groups(base, capsys):
    from slime.rollout.rollout_function import DataSource

    source = DataSource(None, 2, blank=True)
    first, second = source.get_samples(2), source.get_samples(1)
    groups = [g[0].group_index for g in first + second]
    assert groups == sorted(set(groups)) and [len(g) for g in first] == [2, 2]
    assert first[0][0].prompt == "" and first[0][1].index == first[0][0].index + 1
    cfg = parse_args([*base, "--disable-rollout-global-dataset", "--rollout-function-path", "m.f"])
    assert cfg.rollout.global_dataset is False
    assert "--rollout-function-path" in error(capsys, [*base, "--disable-rollout-global-dataset"])


def test_dump_details_puts_every_dump_under_one_directory(base, capsys, tmp_path):
    cfg = parse_args([*base, "--dump-details", str(tmp_path / "d")])
    assert cfg.debug.save_rollout_data == str(tmp_path / "d" / "rollout_data" / "{rollout_id}.pt")
    assert cfg.debug.save_eval_data == str(tmp_path / "d" / "rollout_data" / "eval_{rollout_id}.pt")
    assert cfg.train.save_debug_train_data == str(tmp_path / "d" / "train_data" / "{rollout_id}_{rank}.pt")
    argv = [*base, "--dump-details", "d", "--save-debug-rollout-data", "x_{rollout_id}.pt"]
    assert "drop --save-debug-rollout-data" in error(capsys, argv)


def test_release_train_gives_the_trainers_memory_up_during_rollouts(base):
    assert parse_args([*base, "--release-train"]).cluster.offload
    assert not parse_args(base).cluster.offload


def test_forge_load_replays_dumps_by_rollout_id_with_rollout_0_as_the_fallback(tmp_path):
    import argparse

    from slime.rollout import forge_load
    from slime.rollout.dump import save_dump
    from slime.utils.errors import UsageError
    from slime.utils.sample import Sample

    template = str(tmp_path / "r_{rollout_id}.pt")
    for rid, reward in ((0, 0.0), (1, 1.0)):
        s = Sample(prompt="p", tokens=[1, 2, 3], response="r", response_length=1, reward=reward, index=rid)
        save_dump(template, rid, [s.to_dict()], {})
    args = argparse.Namespace(load_forge_rollout_data=template)
    assert forge_load.generate_rollout(args, 1, None).samples[0].reward == 1.0
    assert forge_load.generate_rollout(args, 7, None).samples[0].reward == 0.0  # no r_7.pt: rollout 0's
    single = argparse.Namespace(load_forge_rollout_data=str(tmp_path / "r_1.pt"))
    assert forge_load.generate_rollout(single, 5, None).samples[0].reward == 1.0
    with pytest.raises(UsageError, match="--load-forge-rollout-data"):
        forge_load.generate_rollout(argparse.Namespace(load_forge_rollout_data=None), 0, None)


def _ci_step(rollout_id, steps, rollout):
    from slime.loop.parts import Step
    from slime.utils.rollout_batch import TrainOutput

    step = Step(rollout_id)
    step.output = TrainOutput(steps=steps, rollout=rollout)
    return step


def test_ci_checks_end_the_job_on_slimes_conditions(base, tmp_path):
    from slime.loop.ci_checks import CICheckFailed, CIChecks

    debug = parse_args([*base, "--ci-test"]).debug
    good = {"log_probs": -0.5, "ref_log_probs": -0.5, "train_rollout_logprob_abs_diff": 0.01}
    CIChecks(debug, False).after_train(
        None, _ci_step(0, [{"ppo_kl": 0.0, "pg_clipfrac": 0.0, "kl_loss": 0.0}], good)
    )
    for steps, rollout, words in (
        ([{"ppo_kl": 1e-3, "pg_clipfrac": 0.0}], good, "train/ppo_kl"),
        ([{"kl_loss": 1e-3}], good, "train/kl_loss"),
        ([], {**good, "ref_log_probs": -0.6}, "rollout/ref_log_probs"),
        ([], {**good, "log_probs": -1.5, "ref_log_probs": -1.5}, "not in (-1, 0)"),
        ([], {**good, "train_rollout_logprob_abs_diff": 0.5}, "threshold 0.1"),
    ):
        with pytest.raises(CICheckFailed, match=words.replace("(", r"\(").replace(")", r"\)")):
            CIChecks(debug, False).after_train(None, _ci_step(0, steps, rollout))
    relaxed = parse_args([*base, "--ci-test", "--ci-disable-kl-checker"]).debug
    CIChecks(relaxed, False).after_train(None, _ci_step(0, [{"ppo_kl": 1e-3, "pg_clipfrac": 0.0}], good))


def test_ci_grad_norms_are_saved_and_compared(base, tmp_path):
    from slime.loop.ci_checks import CICheckFailed, CIChecks

    template = str(tmp_path / "gn" / "{role}_{rollout_id}_{step_id}.pt")
    save = parse_args([*base, "--ci-save-grad-norm", template]).debug
    CIChecks(save, False).after_train(None, _ci_step(3, [{"grad_norm": 2.0}, {"grad_norm": 1.0}], {}))
    assert sorted(os.listdir(tmp_path / "gn")) == ["actor_3_0.pt", "actor_3_1.pt"]
    load = parse_args([*base, "--ci-load-grad-norm", template]).debug
    CIChecks(load, False).after_train(None, _ci_step(3, [{"grad_norm": 2.015}, {"grad_norm": 1.005}], {}))
    with pytest.raises(CICheckFailed, match=r"grad norm 2\.5 against 2\.0"):
        CIChecks(load, False).after_train(None, _ci_step(3, [{"grad_norm": 2.5}], {}))


def test_delta_mode_flags_reach_the_push_topology(base, tmp_path):
    argv = [
        *base,
        "--update-weight-mode",
        "delta",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "shared"),
        "--update-weight-local-checkpoint-dir",
        str(tmp_path / "local"),
        "--update-weight-delta-encoding",
        "overwrite",
        "--update-weight-delta-checksum",
        "adler32",
    ]
    b = parse_args(argv).bridge
    assert (b.mode, b.delta_encoding, b.delta_checksum) == ("delta", "overwrite", "adler32")
    from slime.bridge.bridge import make_transport
    from slime.bridge.delta import DeltaDiskTransport
    from slime.bridge.topology import DiskSettings, build_topology

    disk = DiskSettings(b.mode, b.disk_dir, b.local_dir, b.delta_encoding, b.delta_checksum)
    topology = build_topology("disk", "cpu", ["http://10.0.0.9:1"], disk=disk)  # another node: a shared dir
    transport = make_transport(topology, "/m")
    assert isinstance(transport, DeltaDiskTransport) and topology.label == "disk_delta"
    assert (transport.encoding, transport.checksum, transport.local_dir) == (
        "overwrite",
        "adler32",
        b.local_dir,
    )


def test_balance_by_flops_reaches_the_batch_config(base):
    cfg = parse_args([*base, "--balance-by-flops", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    assert cfg.train.batch.balance_by_flops
