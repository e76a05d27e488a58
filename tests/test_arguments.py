"""train.py's command line: flags → configs, and one clear exit-2 message per bad combination."""

from __future__ import annotations

import json

import pytest

from slime.config.arguments import describe
from slime.ray.cli import parse_args


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return str(path)


def base(prompts, *extra):
    return [
        "--hf-checkpoint",
        "/m",
        "--prompt-data",
        prompts,
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "3",
        "--rm-type",
        "exact",
        *extra,
    ]


def test_flags_reach_their_components(prompts):
    cfg = parse_args(
        base(
            prompts,
            "--rollout-temperature",
            "0.7",
            "--global-batch-size",
            "4",
            "--colocate",
            "--actor-num-gpus-per-node",
            "2",
            "--update-weight-transport",
            "disk",
            "--lr",
            "1e-5",
        )
    )
    assert (
        cfg.cluster.num_train_ranks == 2
        and cfg.cluster.rollout_num_gpus == 2
        and cfg.cluster.num_engines == 2
    )
    assert cfg.rollout.sampling.temperature == 0.7 and cfg.train.rollout_temperature == 0.7
    assert cfg.rollout.data.prompt_data == prompts and cfg.rollout.rollout_batch_size == 4
    assert cfg.bridge.transport == "disk" and cfg.train.optimizer.lr == 1e-5
    assert cfg.train.batch.global_batch_size == 4
    assert cfg.logging.wandb_mode in ("offline", "online")
    assert describe(cfg)["layout"] == "colocated"
    assert "2 × fsdp rank (CPU process each)" in describe(cfg)["train"]


def test_eval_sampling_inherits_the_rollout_and_takes_eval_flags(prompts):
    cfg = parse_args(
        base(
            prompts,
            "--rollout-temperature",
            "0.7",
            "--rollout-top-k",
            "5",
            "--eval-interval",
            "2",
            "--eval-prompt-data",
            prompts,
            "--eval-temperature",
            "0",
            "--n-samples-per-eval-prompt",
            "3",
        )
    )
    (only,) = cfg.eval.datasets
    s = only.sampling
    assert only.name is None and only.prefix == "eval" and only.data.prompt_data == prompts
    assert (s.temperature, s.top_k, s.n_samples_per_prompt) == (0.0, 5, 3)
    assert s.max_response_len == cfg.rollout.sampling.max_response_len
    assert cfg.rollout.sampling.temperature == 0.7 and cfg.eval.before_train
    assert not parse_args(base(prompts, "--skip-eval-before-train")).eval.before_train


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--global-batch-size", "3"], "not a multiple of --global-batch-size 3"),
        (["--colocate", "--rollout-num-gpus", "3"], "--colocate puts engines"),
        (["--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "2"], "tensor-parallel size 1"),
        (
            ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2", "--rollout-backend", "sglang"],
            "not a multiple",
        ),
        (["--save-interval", "2"], "--save-interval needs --save"),
        (["--eval-interval", "2"], "--eval-interval needs --eval-prompt-data"),
        (["--over-sampling-batch-size", "2"], "--over-sampling-batch-size must be >="),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1"),
        # the engines' own check of every request's sampling_params (slime.utils.sampling_params)
        (["--rollout-top-p", "1.5"], "--rollout-top-p must be in (0, 1], got 1.5: the engines refuse"),
        (["--eval-prompt-data", "PROMPTS", "--eval-top-k", "0"], "--eval-prompt-data: its top_k must be -1"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "both set the warm-up"),
        (["--eval-prompt-data", "/nope.jsonl"], "--eval-prompt-data '/nope.jsonl': no such file"),
        (["--rollout-health-check-interval", "5"], "run only with --use-fault-tolerance: add it"),
        (
            ["--use-fault-tolerance", "--rollout-health-check-timeout", "0"],
            "--rollout-health-check-timeout must be > 0",
        ),
        (["--use-fault-tolerance", "--rollout-health-check-first-wait", "-1"], "first-wait must be >= 0"),
        (
            ["--use-fault-tolerance", "--colocate", "--device", "cuda"],
            "with --colocate on GPUs is not built yet",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_message(prompts, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        parse_args(base(prompts, *(prompts if a == "PROMPTS" else a for a in extra)))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_fault_tolerance_takes_slimes_flags_and_defaults(prompts):
    r = parse_args(base(prompts)).rollout
    assert not r.fault_tolerance
    r = parse_args(base(prompts, "--use-fault-tolerance")).rollout
    assert (
        r.fault_tolerance,
        r.health_check_interval,
        r.health_check_timeout,
        r.health_check_first_wait,
    ) == (
        True,
        30.0,
        30.0,
        0.0,
    )
    r = parse_args(
        base(
            prompts,
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "10",
            "--rollout-health-check-timeout",
            "5",
            "--rollout-health-check-first-wait",
            "600",
        )
    ).rollout
    assert (r.health_check_interval, r.health_check_timeout, r.health_check_first_wait) == (10.0, 5.0, 600.0)


def test_required_flags(prompts, capsys):
    for argv, message in [
        (
            ["--hf-checkpoint", "/m", "--prompt-data", prompts, "--num-rollout", "1", "--rm-type", "exact"],
            "--rollout-batch-size is required",
        ),
        (
            [
                "--hf-checkpoint",
                "/m",
                "--prompt-data",
                prompts,
                "--rollout-batch-size",
                "1",
                "--rm-type",
                "exact",
            ],
            "--num-rollout or --num-epoch",
        ),
        (
            [
                "--hf-checkpoint",
                "/m",
                "--prompt-data",
                prompts,
                "--rollout-batch-size",
                "1",
                "--num-rollout",
                "1",
            ],
            "choose a reward",
        ),
        (
            [
                "--prompt-data",
                prompts,
                "--rollout-batch-size",
                "1",
                "--num-rollout",
                "1",
                "--rm-type",
                "exact",
            ],
            "--hf-checkpoint is required",
        ),
    ]:
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_help_is_grouped(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for group in ("cluster:", "data:", "rollout:", "weight bridge:", "train: loss:", "train: FSDP:"):
        assert group in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--save-debug-rollout-data", "d/rollout.pt"], "must contain {rollout_id}"),
        (
            ["--save-debug-train-data", "d/{rollout_id}.pt"],
            "--save-debug-train-data 'd/{rollout_id}.pt' must contain {rank}",
        ),
        (["--debug-rollout-only", "--debug-train-only"], "exclude each other"),
        (["--debug-train-only"], "--load-debug-rollout-data TEMPLATE"),
        (
            [
                "--load-debug-rollout-data",
                "d/{rollout_id}.pt",
                "--eval-interval",
                "1",
                "--eval-prompt-data",
                "P",
            ],
            "--debug-train-only starts none",
        ),
        (["--load-debug-rollout-data-subsample", "0.5"], "needs --load-debug-rollout-data"),
        (
            ["--load-debug-rollout-data", "d/{rollout_id}.pt", "--load-debug-rollout-data-subsample", "0"],
            "(0, 1]",
        ),
    ],
)
def test_debug_mode_flags_exit_2(prompts, capsys, extra, message):
    extra = [prompts if a == "P" else a for a in extra]
    with pytest.raises(SystemExit) as e:
        parse_args(base(prompts, *extra))
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_load_implies_train_only_and_needs_no_rollout_flags(tmp_path):
    cfg = parse_args(
        [
            "--hf-checkpoint",
            "/m",
            "--load-debug-rollout-data",
            str(tmp_path / "r_{rollout_id}.pt"),
            "--num-rollout",
            "2",
            "--load-debug-rollout-data-subsample",
            "0.5",
        ]
    )
    assert cfg.debug.train_only and not cfg.debug.rollout_only and cfg.debug.subsample == 0.5


def test_the_weight_transport_follows_the_layout(prompts, capsys):
    """On GPU the tensor transport is CUDA IPC, which only colocated engines can open."""
    assert parse_args(base(prompts)).bridge.transport == "tensor"  # CPU: shared memory
    assert parse_args(base(prompts, "--device", "cuda")).bridge.transport == "distributed"
    assert parse_args(base(prompts, "--device", "cuda", "--colocate")).bridge.transport == "tensor"
    with pytest.raises(SystemExit) as e:
        parse_args(base(prompts, "--device", "cuda", "--update-weight-transport", "tensor"))
    assert (
        e.value.code == 2
        and "add --colocate, or use --update-weight-transport distributed" in capsys.readouterr().err
    )


def test_sglang_engines_get_the_weight_checks_they_can_answer(prompts, capsys):
    sglang = ["--rollout-backend", "sglang", "--rollout-external-engine-addrs", "10.0.0.5:30000"]
    assert parse_args(base(prompts, *sglang, "--check-precision")).bridge.verify is False
    assert parse_args(base(prompts, "--check-precision")).bridge.verify is True
    assert parse_args(base(prompts, *sglang, "--check-weight-update-equal")).debug.check_weight_update_equal
    for flag in (["--check-weight-sync"], ["--debug-sync-parameters-path", "/tmp/x"]):
        with pytest.raises(SystemExit) as e:
            parse_args(base(prompts, *sglang, *flag))
        assert e.value.code == 2 and "use --check-weight-update-equal" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--tensor-model-parallel-size", "2"],
            "--tensor-model-parallel-size configure --train-backend megatron",
        ),
        (
            [
                "--train-backend",
                "megatron",
                "--actor-num-gpus-per-node",
                "4",
                "--tensor-model-parallel-size",
                "3",
            ],
            "= 3 does not divide the 4 train ranks",
        ),
        (
            [
                "--train-backend",
                "megatron",
                "--actor-num-gpus-per-node",
                "8",
                "--tensor-model-parallel-size",
                "8",
            ],
            "TP 8 must divide the attention heads (4) and the key/value heads (2)",
        ),
        (
            [
                "--train-backend",
                "megatron",
                "--actor-num-gpus-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
            "--sequence-parallel needs --transformer-impl transformer_engine",
        ),
        (
            [
                "--train-backend",
                "megatron",
                "--actor-num-gpus-per-node",
                "2",
                "--expert-model-parallel-size",
                "2",
            ],
            "EP 2: expert parallelism needs a mixture-of-experts model",
        ),
        (
            ["--train-backend", "megatron", "--transformer-impl", "transformer_engine"],
            "Transformer Engine is not installed",
        ),
        (
            ["--train-backend", "megatron", "--fsdp-cpu-offload", "--device", "cuda"],
            "--fsdp-cpu-offload configure the FSDP backend",
        ),
        (["--train-backend", "megatron", "--fsdp-torch-compile"], "--fsdp-torch-compile configure the FSDP"),
    ],
)
def test_megatron_layout_flags_are_checked_against_ranks_and_model(
    tiny_model, prompts, capsys, extra, message
):
    argv = base(prompts, *extra)
    argv[argv.index("/m")] = tiny_model  # a real config: 4 heads, 2 key/value heads, 4 layers
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


@pytest.mark.parametrize(
    "extra",
    [
        ["--actor-num-gpus-per-node", "4", "--pipeline-model-parallel-size", "4"],
        [
            "--actor-num-gpus-per-node",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],
        ["--actor-num-gpus-per-node", "2"],
    ],
)
def test_megatron_layouts_that_fit_the_model_parse(tiny_model, prompts, extra):
    argv = base(prompts, "--train-backend", "megatron", *extra)
    argv[argv.index("/m")] = tiny_model
    cfg = parse_args(argv)
    assert cfg.train.backend == "megatron"
    layout = cfg.train.megatron
    assert layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size <= 4
