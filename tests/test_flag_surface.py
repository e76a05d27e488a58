"""slime's launch-script flag surface: every flag its scripts pass is known, each has an effect
(checked, applied, no effect, refused), the architecture flags are checked against the HF config,
`auto` backends resolve as slime means them, and --dry-run lists every problem or the plan."""

from __future__ import annotations

import json
import os

import pytest

from slime.config import resolve as resolve_mod
from slime.config.arguments import build_parser
from slime.config.derived import SPECS
from slime.config.surface import APPLIED, CHECKED, NO_EFFECT, REFUSED
from slime.ray.cli import parse_args
from slime.tools import flag_table

FLAGS = os.path.join(os.path.dirname(__file__), "fixtures", "slime_launch_flags.txt")


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return str(path)


def base(model, prompts, *extra):
    return [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        prompts,
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "3",
        "--rm-type",
        "math",
        *extra,
    ]


def model_args(model) -> list[str]:
    """The Megatron-LM flags that describe the tiny Qwen3 checkpoint, as slime's scripts write them."""
    c = json.load(open(os.path.join(model, "config.json")))
    theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
    out = [
        "--swiglu",
        "--num-layers",
        str(c["num_hidden_layers"]),
        "--hidden-size",
        str(c["hidden_size"]),
        "--ffn-hidden-size",
        str(c["intermediate_size"]),
        "--num-attention-heads",
        str(c["num_attention_heads"]),
        "--group-query-attention",
        "--num-query-groups",
        str(c["num_key_value_heads"]),
        "--kv-channels",
        str(c["head_dim"]),
        "--vocab-size",
        str(c["vocab_size"]),
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        str(c["rms_norm_eps"]),
        "--disable-bias-linear",
        "--qk-layernorm",
        "--use-rotary-position-embeddings",
        "--rotary-base",
        str(theta),
    ]
    return out + ([] if c.get("tie_word_embeddings") else ["--untie-embeddings-and-output-weights"])


def error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2, captured
    return captured.err + captured.out


def test_every_flag_slimes_launch_scripts_pass_is_known():
    known = set(build_parser()._option_string_actions)
    flags = [line.strip() for line in open(FLAGS) if line.strip()]
    assert len(flags) > 200
    # --sglang-* are SGLang's own (checked by SGLang's parser where it is installed, passed through
    # otherwise).
    assert [f for f in flags if f not in known and not f.startswith("--sglang-")] == []


def test_every_spec_has_one_effect_per_backend_and_says_it_in_help():
    flags = [s.flag for s in SPECS]
    assert len(flags) == len(set(flags))
    parser = build_parser()
    for spec in SPECS:
        assert {spec.fsdp, spec.megatron} <= {CHECKED, APPLIED, NO_EFFECT, REFUSED}, spec.flag
        text = parser._option_string_actions[spec.flag].help
        assert spec.note.split(" ")[0] in text
        if spec.fsdp == spec.megatron == NO_EFFECT:
            assert text.startswith("no effect in this backend")


def test_the_docs_flag_table_is_the_parsers():
    with open(flag_table.DOC) as f:
        assert flag_table.section(f.read()) == flag_table.render(), (
            "run: python -m slime.tools.flag_table --write"
        )


def test_a_matching_model_description_parses_and_no_effect_flags_are_listed(tiny_model, prompts):
    cfg = parse_args(
        base(
            tiny_model,
            prompts,
            *model_args(tiny_model),
            "--attention-backend",
            "flash",
            "--optimizer-cpu-offload",
            "--expert-tensor-parallel-size",
            "1",
            "--balance-data",
        )
    )
    assert (
        "no effect in this backend (fsdp): --attention-backend, --optimizer-cpu-offload"
        in cfg.args.resolution
    )
    assert "device: cpu (auto: no GPU is visible)" in cfg.args.resolution


def test_each_disagreeing_architecture_flag_names_the_config_key(tiny_model, prompts, capsys):
    args = model_args(tiny_model)
    args[args.index("--num-layers") + 1] = "36"
    args.remove("--qk-layernorm")  # Megatron-LM's default for a described model: off
    args.remove("--swiglu")
    err = error(capsys, base(tiny_model, prompts, *args))
    assert f"--num-layers 36 disagrees with --hf-checkpoint {tiny_model}" in err
    assert "config.json num_hidden_layers = " in err
    # The dry run lists every problem, on stdout.
    with pytest.raises(SystemExit) as e:
        parse_args(base(tiny_model, prompts, *args, "--dry-run", "--device", "cpu"))
    out = capsys.readouterr().out
    assert e.value.code == 2 and "3 problems:" in out
    assert "no --qk-layernorm (Megatron-LM's default: off) disagrees" in out
    assert "no --swiglu (Megatron-LM's default: off) disagrees" in out and "hidden_act = silu" in out


def test_refused_flags_name_the_feature_and_neutral_values_pass(tiny_model, prompts, capsys):
    err = error(capsys, base(tiny_model, prompts, "--num-experts", "64"))
    assert f"--num-experts 64 disagrees with --hf-checkpoint {tiny_model}: config.json num_experts = 0" in err
    err = error(capsys, base(tiny_model, prompts, "--num-experts", "64", "--train-backend", "megatron"))
    assert f"--num-experts 64 disagrees with --hf-checkpoint {tiny_model}: config.json num_experts = 0" in err
    err = error(
        capsys, base(tiny_model, prompts, "--moe-aux-loss-coeff", "0.01", "--train-backend", "megatron")
    )
    assert "--moe-aux-loss-coeff needs a mixture-of-experts model" in err
    for backend in ("fsdp", "megatron"):
        err = error(
            capsys, base(tiny_model, prompts, "--use-rollout-routing-replay", "--train-backend", backend)
        )
        assert "--use-rollout-routing-replay needs a mixture-of-experts model" in err
    err = error(capsys, base(tiny_model, prompts, "--multi-latent-attention"))
    assert (
        f"--multi-latent-attention disagrees with --hf-checkpoint {tiny_model}: config.json kv_lora_rank "
        "= None" in err
    )
    # checked against config.json with either backend now that Megatron builds MLA
    err = error(capsys, base(tiny_model, prompts, "--multi-latent-attention", "--train-backend", "megatron"))
    assert f"--multi-latent-attention disagrees with --hf-checkpoint {tiny_model}" in err
    err = error(capsys, base(tiny_model, prompts, "--apply-layernorm-1p", "--train-backend", "megatron"))
    assert f"--apply-layernorm-1p disagrees with --hf-checkpoint {tiny_model}" in err
    err = error(capsys, base(tiny_model, prompts, "--opd-kl-coef", "0.5"))
    assert "--opd-kl-coef sets on-policy distillation: add --use-opd" in err
    # --hidden-dropout is Megatron's: the FSDP backend's HF modules have none, so only 0 is accepted.
    assert "dropout after attention and MLP" in error(
        capsys, base(tiny_model, prompts, "--hidden-dropout", "0.1")
    )
    parse_args(base(tiny_model, prompts, "--hidden-dropout", "0.0", "--update-weight-mode", "full"))
    err = error(capsys, base(tiny_model, prompts, "--offload", "--no-offload-train"))
    assert "--offload and --no-offload-train contradict each other" in err
    assert parse_args(base(tiny_model, prompts, "--offload-train")).cluster.offload


def test_colocation_offloads_as_in_slime(tiny_model, prompts, capsys):
    # --colocate: the trainer and the engines each give their memory up while the other works.
    c = parse_args(base(tiny_model, prompts, "--colocate")).cluster
    assert c.offload and c.offload_rollout
    c = parse_args(
        base(tiny_model, prompts, "--colocate", "--no-offload-train", "--no-offload-rollout")
    ).cluster
    assert not c.offload and not c.offload_rollout
    c = parse_args(base(tiny_model, prompts, "--offload-rollout")).cluster  # as slime: even disaggregated
    assert not c.offload and c.offload_rollout
    c = parse_args(base(tiny_model, prompts, "--offload")).cluster  # slime's --offload is both
    assert c.offload and c.offload_rollout
    c = parse_args(base(tiny_model, prompts, "--offload-train")).cluster
    assert c.offload and not c.offload_rollout
    err = error(capsys, base(tiny_model, prompts, "--colocate", "--offload-rollout", "--no-offload-rollout"))
    assert "--offload-rollout and --no-offload-rollout contradict each other" in err


def test_plugin_hook_flags(tiny_model, prompts, capsys):
    hooks = "tests.fixtures.loss_hooks"
    cfg = parse_args(
        base(
            tiny_model,
            prompts,
            "--use-tis",
            "--custom-tis-function-path",
            f"{hooks}.clamp_tis",
            "--custom-pg-loss-reducer-function-path",
            f"{hooks}.sample_mean_reducer",
            "--custom-reward-post-process-path",
            f"{hooks}.group_mean_only",
        )
    )
    loss = cfg.train.loss
    assert loss.custom_tis_function_path == f"{hooks}.clamp_tis"
    assert loss.custom_pg_loss_reducer_function_path == f"{hooks}.sample_mean_reducer"
    assert cfg.rollout.reward_post_process_path == f"{hooks}.group_mean_only"
    assert cfg.train.plugin_args is not None and cfg.train.plugin_args.tis_clip == 2.0  # hooks read args
    assert parse_args(base(tiny_model, prompts)).train.plugin_args is None
    assert "only with --use-tis" in error(
        capsys, base(tiny_model, prompts, "--custom-tis-function-path", f"{hooks}.clamp_tis")
    )
    argv = base(tiny_model, prompts)
    argv[argv.index("math")] = "dapo"
    assert "--rm-type dapo returns a dict {score, acc, pred}: add --reward-key score" in error(capsys, argv)
    assert parse_args([*argv, "--reward-key", "score"]).rollout.reward_key == "score"
    # A custom generate function may set rewards itself: no reward flag is needed (slime's rule).
    argv = base(tiny_model, prompts, "--custom-generate-function-path", "tests.fixtures.loss_hooks.one_short")
    argv.remove("--rm-type"), argv.remove("math")
    assert parse_args(argv).rollout.rm_type is None


def test_training_flags_reach_the_config(tiny_model, prompts, tmp_path):
    cfg = parse_args(
        base(
            tiny_model,
            prompts,
            "--optimizer",
            "sgd",
            "--sgd-momentum",
            "0.5",
            "--attention-dropout",
            "0.1",
            "--recompute-granularity",
            "full",
            "--lr-decay-style",
            "cosine",
            "--lr-warmup-fraction",
            "0.25",
            "--global-batch-size",
            "4",
        )
    )
    o = cfg.train.optimizer
    # 3 rollouts x (8 samples / 4 per step) = 6 steps: the decay's default, and a quarter of it warms up.
    assert (o.optimizer, o.sgd_momentum, o.lr_decay_iters, o.lr_warmup_iters) == ("sgd", 0.5, 6, 2)
    assert cfg.train.model.attention_dropout == 0.1 and cfg.train.fsdp.gradient_checkpointing
    custom = tmp_path / "custom.yaml"
    custom.write_text("lr: 5e-1\nmy_plugin_setting: [1, 2]\n")  # YAML reads 5e-1 as a string
    cfg = parse_args(base(tiny_model, prompts, "--lr", "0.1", "--custom-config-path", str(custom)))
    assert cfg.train.optimizer.lr == 0.5 and cfg.args.my_plugin_setting == [1, 2]
    cfg = parse_args(
        base(tiny_model, prompts, "--rollout-max-context-len", "64", "--update-weight-transport", "nccl")
    )
    assert (
        cfg.rollout.data.max_prompt_len == 63 and cfg.bridge.transport == "tensor"
    )  # slime's nccl: our default


def test_epoch_runs_size_the_schedule_from_the_prompts_and_tp1_sequence_parallel_is_off(tiny_model, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(10)))
    argv = base(
        tiny_model,
        str(rows),
        "--lr-warmup-fraction",
        "0.5",
        "--lr-decay-style",
        "linear",
        "--sequence-parallel",
        "--train-backend",
        "megatron",
    )
    argv[argv.index("--num-rollout") : argv.index("--num-rollout") + 2] = ["--num-epoch", "2"]
    cfg = parse_args(argv)
    # 2 epochs x 10 prompts / 4 per rollout = 5 rollouts of one step: decay over 5, warm up for 2 (round 2.5).
    assert (cfg.train.optimizer.lr_decay_iters, cfg.train.optimizer.lr_warmup_iters) == (5, 2)
    assert not cfg.train.megatron.sequence_parallel
    assert (
        "--sequence-parallel: off with --tensor-model-parallel-size 1 (as in Megatron-LM)"
        in cfg.args.resolution
    )


def test_auto_means_sglang_and_megatron_where_a_gpu_is_visible(tiny_model, prompts, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(resolve_mod, "_cuda_visible", lambda: True)
    # Transformer Engine is a GPU machine's package: pretend it is installed.
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "transformer_engine" else real(n, *a)
    )
    cfg = parse_args(base(tiny_model, prompts, "--rollout-num-gpus", "1"))
    c = cfg.cluster
    assert (c.device, c.rollout_backend, c.train_backend) == ("cuda", "sglang", "megatron")
    assert cfg.train.megatron.transformer_impl == "transformer_engine"
    assert "rollout backend: sglang (auto: SGLang engines on GPUs, as in slime)" in cfg.args.resolution
    # Flags given win over auto.
    cfg = parse_args(base(tiny_model, prompts, "--train-backend", "fsdp", "--rollout-backend", "torch"))
    assert (cfg.cluster.train_backend, cfg.cluster.rollout_backend) == ("fsdp", "torch")


def test_dry_run_prints_the_plan_and_starts_nothing(tiny_model, prompts, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(
            base(
                tiny_model,
                prompts,
                *model_args(tiny_model),
                "--dry-run",
                "--actor-num-nodes",
                "2",
                "--actor-num-gpus-per-node",
                "4",
                "--rollout-num-gpus",
                "4",
                "--rollout-num-gpus-per-engine",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--global-batch-size",
                "4",
                "--bf16",
                "--sglang-mem-fraction-static",
                "0.7",
            )
        )
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    for line in (
        "device: cuda (auto: --dry-run plans for a GPU machine",
        "train backend: megatron (auto",
        "rollout: 4 prompts x 2 samples = 8 samples per rollout; 3 rollouts",
        "8 ranks = TP 2 x PP 1 x CP 1 x DP 4",
        "global batch 4 samples -> 2 optimizer step(s) per rollout, 6 in all",
        "takes 1 samples per step in 1 micro-batches of 1, each packed into one row without padding",
        "node 0: train rank 0: GPU 0; train rank 1: GPU 1; train rank 2: GPU 2; train rank 3: GPU 3",
        "node 1: train rank 4: GPU 0",
        "node 2: engine 0: GPU 0,1; engine 1: GPU 2,3",
        "precision: bfloat16 (--bf16)",
    ):
        assert line in out, (line, out)
    assert "warning: --hf-checkpoint" not in out  # the tiny model has its weights


def test_dry_run_lists_unknown_flags_with_the_rest(tiny_model, prompts, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(
            base(
                tiny_model,
                prompts,
                "--dry-run",
                "--no-such-flag",
                "--num-experts",
                "8",
                "--rm-type",
                "nonesuch",
            )
        )
    out = capsys.readouterr().out
    assert e.value.code == 2
    assert "unrecognized argument: --no-such-flag" in out and "--num-experts 8 disagrees" in out
    assert "--rm-type 'nonesuch' is not a reward type" in out


def test_dry_run_reports_a_missing_checkpoint_directory(tmp_path, prompts, capsys):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(SystemExit) as e:
        parse_args(
            [
                "--hf-checkpoint",
                missing,
                "--prompt-data",
                prompts,
                "--rollout-batch-size",
                "1",
                "--num-rollout",
                "1",
                "--rm-type",
                "math",
                "--dry-run",
            ]
        )
    out = capsys.readouterr().out
    assert e.value.code == 2 and "problem" in out and missing in out


@pytest.mark.parametrize(
    "flag", ["--custom-loss-function-path", "--custom-advantage-function-path", "--rollout-sample-hook-path"]
)
def test_slimes_other_hooks_are_refused_by_name(tiny_model, prompts, capsys, flag):
    err = error(capsys, base(tiny_model, prompts, flag, "my.hook"))
    assert f"{flag} my.hook: slime's" in err and "not built yet" in err


def test_uneven_pipeline_stage_flags(tiny_model, prompts, capsys):
    """--decoder-first/last-pipeline-num-layers: no effect with FSDP (no stages), the stages'
    layers with Megatron, checked against the ranks and the model at parse time."""
    cfg = parse_args(base(tiny_model, prompts, "--decoder-last-pipeline-num-layers", "3"))
    assert any("--decoder-last-pipeline-num-layers" in line for line in cfg.args.resolution)
    megatron = ["--train-backend", "megatron", "--actor-num-gpus-per-node", "2"]
    err = error(capsys, base(tiny_model, prompts, *megatron, "--decoder-first-pipeline-num-layers", "1"))
    assert (
        "--decoder-first-pipeline-num-layers sets a pipeline stage's layers: give "
        "--pipeline-model-parallel-size > 1" in err
    )
    err = error(
        capsys,
        base(
            tiny_model,
            prompts,
            *megatron,
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "4",
        ),
    )
    assert "does not split the model's 4 layers" in err
    cfg = parse_args(
        base(
            tiny_model,
            prompts,
            *megatron,
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "1",
        )
    )
    assert cfg.train.megatron.stage_layers == (1, None)
