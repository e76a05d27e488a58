"""scripts/models/*.sh and the cluster launch scripts scripts/run-*.sh, checked with --dry-run.

Each model script's MODEL_ARGS is read out of bash and dry-run against a config.json written
from tests/fixtures/hf_configs.py (the published configs, typed independently of the scripts):
every architecture flag must agree with the model the script names. Each launch script is run
as users run it, `bash scripts/run-X.sh --dry-run`, with its paths pointed at temporary files.

No GPU, weights, tokenizer, network or Ray: the dry run plans for a GPU machine from this one
(the GPU check is answered "none here", so what is installed here does not matter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.hf_configs import HF_CONFIGS, write_config

ROOT = Path(__file__).resolve().parents[1]
MODEL_SCRIPTS = sorted((ROOT / "scripts" / "models").glob("*.sh"))

# launch script -> (the model script it sources, the train backend its dry run must plan)
RUN_SCRIPTS = {
    "run-qwen3-4B.sh": ("qwen3-4B", "megatron"),
    "run-qwen2.5-7B.sh": ("qwen2.5-7B", "megatron"),
    "run-llama3.1-8B.sh": ("llama3.1-8B", "fsdp"),
    "run-qwen3-30B-A3B.sh": ("qwen3-30B-A3B", "megatron"),
}
# Launch scripts that run a whole job rather than describing a cluster run (not dry-run here).
NOT_CLUSTER_SCRIPTS = {"run-tiny-cpu.sh", "run-agent-cpu.sh", "run-vision-cpu.sh"}

# Flags every model script gives (the scripts describe the model completely: an absent size is
# not compared by the architecture check, so its absence is caught here).
REQUIRED = [
    "--swiglu",
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--group-query-attention",
    "--num-query-groups",
    "--kv-channels",
    "--vocab-size",
    "--normalization",
    "--norm-epsilon",
    "--disable-bias-linear",
    "--position-embedding-type",
    "--rotary-base",
    "--max-position-embeddings",
]


# model_types dry-run with FSDP rather than Megatron. Llama 3.x's llama3 RoPE scaling is not in
# the Megatron conversion: FSDP trains it.
FSDP_DRY_RUN = ("llama",)

# model_types whose attention always normalises queries and keys (whatever else config.json says)
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

GQA = ["--group-query-attention", "--num-query-groups"]
MLA = [
    "--multi-latent-attention",
    "--q-lora-rank",
    "--kv-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
]


def model_args(name: str) -> list[str]:
    """MODEL_ARGS of scripts/models/<name>.sh, as bash expands it."""
    script = ROOT / "scripts" / "models" / f"{name}.sh"
    out = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source "$1"; printf "%s\\0" "${MODEL_ARGS[@]}"', "_", str(script)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split("\0")[:-1]


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "What is 2 + 3?", "label": "5"}, {"prompt": "What is 7 - 4?", "label": "3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def no_gpu_here(monkeypatch):
    """Plan for the GPU cluster whatever this machine has (on a GPU machine the dry run would
    otherwise also check that machine's packages, e.g. Transformer Engine)."""
    import slime.config.resolve as resolve

    monkeypatch.setattr(resolve, "_cuda_visible", lambda: False)


def dry_run(capsys, argv: list[str]) -> tuple[int, str]:
    """parse_args(argv + --dry-run) in this process: (exit code, stdout)."""
    from slime.ray.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--dry-run"])
    return e.value.code, capsys.readouterr().out


def base_flags(hf_dir: Path, prompts: Path) -> list[str]:
    return [
        "--hf-checkpoint",
        str(hf_dir),
        "--prompt-data",
        str(prompts),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rm-type",
        "math",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "2",
        "--global-batch-size",
        "16",
        "--actor-num-gpus-per-node",
        "8",
        "--colocate",
        "--device",
        "cuda",
    ]


# ---- the tables agree with each other -----------------------------------------------------------


def test_every_model_script_has_its_published_config():
    assert {p.stem for p in MODEL_SCRIPTS} == set(HF_CONFIGS)


def test_every_cluster_launch_script_is_dry_run_here():
    found = {p.name for p in (ROOT / "scripts").glob("run-*.sh")} - NOT_CLUSTER_SCRIPTS
    assert found == set(RUN_SCRIPTS), "add new launch scripts to RUN_SCRIPTS"


# ---- scripts/models/*.sh ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [p.stem for p in MODEL_SCRIPTS])
def test_model_script_describes_its_model(name, tmp_path, prompt_file, capsys, no_gpu_here):
    args = model_args(name)
    hf = HF_CONFIGS[name]
    # multi-latent attention has no key/value head groups: its latent flags describe it instead
    required = [f for f in REQUIRED if not (hf.get("kv_lora_rank") and f in GQA)] + (
        [f for f in MLA if f != "--q-lora-rank" or hf.get("q_lora_rank")] if hf.get("kv_lora_rank") else []
    )
    if hf.get("kv_lora_rank") and not hf.get("q_lora_rank"):  # queries without a latent: no rank to give
        assert "--q-lora-rank" not in args
    missing = [f for f in required if f not in args]
    assert not missing, f"{name}.sh lacks {missing}"
    family = hf["model_type"]
    # q/k/v biases: Qwen2's always, GLM's where attention_bias says so (multi-latent attention's
    # latent projections have none)
    qkv_bias = family == "qwen2" or (bool(hf.get("attention_bias")) and not hf.get("kv_lora_rank"))
    assert ("--add-qkv-bias" in args) == qkv_bias
    # q/k norms: Qwen3's and the hybrids' by family, GLM-4.5's where use_qk_norm says so,
    # multi-latent attention's on its latents (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash)
    qk_norm = family in QK_NORM_FAMILIES or bool(hf.get("use_qk_norm")) or bool(hf.get("kv_lora_rank"))
    assert ("--qk-layernorm" in args) == qk_norm
    assert ("--untie-embeddings-and-output-weights" in args) == (not hf["tie_word_embeddings"])
    assert ("--use-rope-scaling" in args) == (family == "llama")

    hf_dir = write_config(name, tmp_path / name)
    backend = ["--train-backend", "fsdp"] if family in FSDP_DRY_RUN else []
    code, out = dry_run(capsys, [*args, *base_flags(hf_dir, prompt_file), *backend])
    assert code == 0, out
    assert "plan:" in out
    from slime.config.megatron_lm import SPECS

    architecture = {s.flag for s in SPECS if s.group == "architecture"}
    given = sum(1 for a in args if a in architecture)
    assert given >= len(required)
    assert f"its {given} architecture flags agree with it" in out
    experts = hf.get("num_experts") or hf.get("n_routed_experts")
    if experts:
        assert f"{experts} experts, {hf['num_experts_per_tok']} per token" in out
    assert f"train backend: {'fsdp' if backend else 'megatron'}" in out


def test_a_released_qwen3_5_checkpoint_is_checked_against_its_text_model(
    tmp_path, prompt_file, capsys, no_gpu_here
):
    """Qwen3.5's released config.json is the vision-language model's (model_type qwen3_5, the text
    model's fields under text_config): the script's flags are compared with the text model's, and
    both backends make the plan (the Megatron backend builds its language model)."""
    text = dict(HF_CONFIGS["qwen3.5-9B"])
    released = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    hf_dir = write_config("qwen3.5-9B", tmp_path / "released")
    (hf_dir / "config.json").write_text(json.dumps(released))
    args = [*model_args("qwen3.5-9B"), *base_flags(hf_dir, prompt_file)]
    code, out = dry_run(capsys, [*args, "--train-backend", "fsdp"])
    assert code == 0, out
    assert "architecture flags agree with it" in out
    code, out = dry_run(capsys, [*args, "--train-backend", "megatron", "--transformer-impl", "local"])
    assert code == 0 and "train: megatron" in out and "architecture flags agree with it" in out, out
    # slime's script for the vision-language model swaps in its provider: FSDP builds the checkpoint's model
    vl_spec = ["--spec", "slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider"]
    code, out = dry_run(capsys, [*args, *vl_spec, "--train-backend", "fsdp"])
    assert code == 0, out
    text_dir = write_config("qwen3.5-9B", tmp_path / "text")
    code, out = dry_run(
        capsys,
        [*model_args("qwen3.5-9B"), *base_flags(text_dir, prompt_file), *vl_spec, "--train-backend", "fsdp"],
    )
    assert code == 2 and "is slime's layer spec for model_type qwen3_5, qwen3_5_moe" in out, out


def test_model_script_for_another_model_lists_every_disagreement(tmp_path, prompt_file, capsys, no_gpu_here):
    """Qwen3-4B's flags against Qwen3-8B's config.json: same depth and heads, other widths and
    untied embeddings; each difference is named with the config key and its value."""
    hf_dir = write_config("qwen3-8B", tmp_path / "qwen3-8B")
    code, out = dry_run(capsys, [*model_args("qwen3-4B"), *base_flags(hf_dir, prompt_file)])
    assert code == 2, out
    assert "plan:" not in out
    assert "3 problems:" in out
    problems = [line for line in out.splitlines() if line.startswith("  - ")]
    expected = [
        ("--hidden-size 2560", "hidden_size = 4096"),
        ("--ffn-hidden-size 9728", "intermediate_size = 12288"),
        ("--untie-embeddings-and-output-weights", "tie_word_embeddings = False"),
    ]
    for flag, config in expected:
        assert any(flag in p and config in p and str(hf_dir) in p for p in problems), (flag, out)


def test_model_script_for_another_family_lists_every_disagreement(tmp_path, prompt_file, capsys, no_gpu_here):
    """Qwen2.5-7B's flags against Qwen3-8B's config.json: nearly everything differs."""
    hf_dir = write_config("qwen3-8B", tmp_path / "qwen3-8B")
    code, out = dry_run(capsys, [*model_args("qwen2.5-7B"), *base_flags(hf_dir, prompt_file)])
    assert code == 2, out
    problems = [line for line in out.splitlines() if line.startswith("  - ")]
    expected = [
        ("--num-layers 28", "num_hidden_layers = 36"),
        ("--hidden-size 3584", "hidden_size = 4096"),
        ("--ffn-hidden-size 18944", "intermediate_size = 12288"),
        ("--num-attention-heads 28", "num_attention_heads = 32"),
        ("--num-query-groups 4", "num_key_value_heads = 8"),
        ("--vocab-size 152064", "vocab_size = 151936"),
        ("--max-position-embeddings 131072", "max_position_embeddings = 40960"),
        ("--add-qkv-bias", "qwen3"),
        ("--qk-layernorm", "qwen3"),
    ]
    for flag, config in expected:
        assert any(flag in p and config in p for p in problems), (flag, out)


# ---- scripts/run-*.sh ---------------------------------------------------------------------------


def run_script(script: str, tmp_path: Path, prompts: Path, config: dict | None = None, *extra: str):
    """`bash scripts/<script> --dry-run *extra` with every path in tmp_path: the model's
    published config.json (or `config`), the prompt file as eval data too."""
    model, _ = RUN_SCRIPTS[script]
    hf_dir = write_config(model, tmp_path / model)
    if config is not None:
        (hf_dir / "config.json").write_text(json.dumps(config))
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(prompts.read_text())
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "HF_CHECKPOINT": str(hf_dir),
        "PROMPT_DATA": str(prompts),
        "EVAL_DATA": str(eval_file),
        "SAVE_DIR": str(tmp_path / "save"),
        "CUDA_VISIBLE_DEVICES": "",  # plan for the cluster, not for this machine (see no_gpu_here)
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), "--dry-run", *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # the script finds train.py and its model file from its own path
    )
    return proc, hf_dir, eval_file


@pytest.mark.parametrize("script", sorted(RUN_SCRIPTS))
def test_launch_script_dry_run(script, tmp_path, prompt_file):
    proc, hf_dir, eval_file = run_script(script, tmp_path, prompt_file)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    _, backend = RUN_SCRIPTS[script]
    assert "plan:" in out
    assert f"train backend: {backend}" in out
    assert "rollout backend: sglang" in out
    assert f"model: {hf_dir} " in out  # the paths come from the environment
    assert str(eval_file) in out
    assert "colocated" in out
    assert "8 ranks" in out
    assert "bfloat16" in out


def test_launch_script_flags_after_it_override_its_own(tmp_path, prompt_file):
    """run-qwen2.5-7B.sh's note: Qwen2.5-7B-Instruct (max_position_embeddings 32768) is checked
    as a different model, and passes with --max-position-embeddings 32768 after the script."""
    instruct = {**HF_CONFIGS["qwen2.5-7B"], "max_position_embeddings": 32768}
    proc, _, _ = run_script("run-qwen2.5-7B.sh", tmp_path, prompt_file, instruct)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--max-position-embeddings 131072" in proc.stdout
    assert "max_position_embeddings = 32768" in proc.stdout
    assert "1 problem:" in proc.stdout
    proc, _, _ = run_script(
        "run-qwen2.5-7B.sh", tmp_path, prompt_file, instruct, "--max-position-embeddings", "32768"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plan:" in proc.stdout


def test_deepseek_v3s_yarn_factor_is_checked(tmp_path, prompt_file, capsys, no_gpu_here):
    """With --multi-latent-attention, Megatron-LM reads --rotary-scaling-factor as YaRN's factor:
    compared with config.json's rope scaling like the other architecture flags."""
    args = model_args("deepseek-v3")
    args[args.index("--rotary-scaling-factor") + 1] = "32"
    hf_dir = write_config("deepseek-v3", tmp_path / "deepseek-v3")
    code, out = dry_run(capsys, [*args, *base_flags(hf_dir, prompt_file)])
    assert code == 2
    assert (
        "--rotary-scaling-factor 32.0 disagrees with" in out and "rope_parameters.factor (yarn) = 40" in out
    )
