"""slime.tools.dry_run_scripts on a tiny fake slime checkout: which bash files are launch scripts,
what the stand-ins record and keep from happening, and the rows (exit code, first reason) the
dry runs of this project's train.py / train_async.py give."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slime.tools.dry_run_scripts import Options, find_launch_scripts, main, measure, summary, table

ROOT = Path(__file__).resolve().parents[1]

# Stand-ins first: neither line may touch anything (kill is the shell's own builtin).
PREAMBLE = """#!/bin/bash
rm -f keep.txt
kill -9 $$
sleep 30
ray stop --force
set -ex
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny.sh"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
"""

GOOD = (
    PREAMBLE
    + """N=$(python3 -c "import os; print(len(os.environ.get('NO_SUCH_VAR_X', 'ab')))")
python3 -c "import os; os.remove('keep.txt')"
ray start --head --num-gpus 8
ray job submit --address="http://127.0.0.1:8265" --runtime-env-json='{"env_vars": {}}' \\
   -- python3 train.py \\
   "${MODEL_ARGS[@]}" \\
   --hf-checkpoint {model} --prompt-data {prompts} --input-key prompt --label-key label \\
   --rm-type math --rollout-batch-size $N --n-samples-per-prompt 2 --num-rollout 1 \\
   --global-batch-size 4 --device cpu
"""
)

# Refused here (a custom layer spec), and it asks for a variable from its environment first.
BAD = (
    PREAMBLE
    + """if [ -z "${TINY_NODE_ADDR:-}" ]; then
  echo "TINY_NODE_ADDR is not set. Please set it to the master node address."
  exit 1
fi
python3 train_async.py "${MODEL_ARGS[@]}" --hf-checkpoint {model} --prompt-data {prompts} \\
   --input-key prompt --rm-type math --rollout-batch-size 2 --n-samples-per-prompt 2 --num-rollout 1 \\
   --global-batch-size 4 --device cpu --train-backend megatron --spec a b
"""
)

# Ends before it reaches train.py (a model file that is not there).
BROKEN = """#!/bin/bash
set -e
source /nonexistent/models/tiny.sh
python3 train.py --num-rollout 1
"""


@pytest.fixture
def fake_slime(tmp_path, tiny_model) -> Path:
    root = tmp_path / "slime"
    (root / "scripts" / "models").mkdir(parents=True)
    (root / "examples" / "x").mkdir(parents=True)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "What is 2 + 3?", "label": "5"}, {"prompt": "What is 7 - 4?", "label": "3"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "scripts" / "models" / "tiny.sh").write_text("MODEL_ARGS=(--seed 3)\n")
    for name, text in (("run-good.sh", GOOD), ("run-bad.sh", BAD)):
        (root / "scripts" / name).write_text(
            text.replace("{model}", tiny_model).replace("{prompts}", str(prompts))
        )
    (root / "examples" / "x" / "run_broken.sh").write_text(BROKEN)
    (root / "scripts" / "notes.sh").write_text("# python3 train.py --help\necho train.py.bak\n")
    (root / "keep.txt").write_text("still here\n")
    return root


def test_launch_scripts_are_bash_files_that_call_train(fake_slime):
    found = [str(p.relative_to(fake_slime)) for p in find_launch_scripts(fake_slime)]
    assert found == ["examples/x/run_broken.sh", "scripts/run-bad.sh", "scripts/run-good.sh"]


def test_rows_give_each_scripts_exit_code_and_first_reason(fake_slime, tmp_path):
    rows = {r.script: r for r in measure(Options(fake_slime, ROOT, sys.executable), jobs=2)}
    assert set(rows) == {"examples/x/run_broken.sh", "scripts/run-bad.sh", "scripts/run-good.sh"}

    good = rows["scripts/run-good.sh"]
    assert (good.exit_code, good.reason, good.entry, good.script_rc) == (0, "", "train.py", 0), good
    # MODEL_ARGS from the sourced file, then the flags; $N came from the harmless snippet.
    assert good.args[:2] == ["--seed", "3"]
    assert good.args[good.args.index("--rollout-batch-size") + 1] == "2"
    assert any("not run" in n and "os.remove" in n for n in good.notes), good.notes

    bad = rows["scripts/run-bad.sh"]
    assert (bad.exit_code, bad.entry) == (2, "train_async.py"), bad
    assert bad.reason.startswith("--spec a b: custom Megatron layer specs are not supported"), bad.reason
    assert bad.problems == [bad.reason]
    assert "set for the script: TINY_NODE_ADDR=127.0.0.1" in bad.notes

    broken = rows["examples/x/run_broken.sh"]
    assert (broken.exit_code, broken.script_rc) == (None, 1)
    assert broken.reason.startswith("script exited 1 without calling train.py:"), broken.reason
    assert "/nonexistent/models/tiny.sh: No such file or directory" in broken.reason

    # Nothing the scripts ran touched a file, and no copy of a script was left behind.
    assert (fake_slime / "keep.txt").read_text() == "still here\n"
    assert not list(fake_slime.rglob(".dryrun-*"))

    assert summary(list(rows.values())) == "1 of 3 scripts exit 0"
    text = table(list(rows.values()))
    assert "scripts/run-bad.sh [1]" in text and "[1] set for the script: TINY_NODE_ADDR=127.0.0.1" in text


def test_cli_writes_the_rows(fake_slime, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--slime-dir", str(fake_slime), "--only", "examples/*", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "examples/x/run_broken.sh" in printed and printed.rstrip().endswith("0 of 1 scripts exit 0")
    [row] = json.loads(out.read_text())
    assert (row["script"], row["exit_code"], row["only_missing_inputs"]) == (
        "examples/x/run_broken.sh",
        None,
        False,
    )


def test_a_schedule_counted_from_missing_prompt_data_is_a_missing_input():
    """With --num-epoch the learning-rate schedule's length is counted from the prompt data: where
    that data is absent, the schedule's problems are the absent input's, and nothing else is."""
    from slime.tools.dry_run_scripts import Row

    problems = [
        "--lr-warmup-fraction is a fraction of --lr-decay-iters (default: the run's optimizer steps, ...)",
        "--prompt-data '/root/data.parquet': no such file",
        "--lr-decay-style cosine needs --lr-decay-iters > 0",
    ]
    row = Row("sft.sh", 2, problems[0], "train_async.py", ["--num-epoch", "3"], problems)
    assert row.only_missing_inputs
    assert not Row(
        "sft.sh", 2, problems[0], "train_async.py", ["--num-rollout", "3"], problems
    ).only_missing_inputs
    other = [*problems, "--loss-mask-type qwen3_5 is not supported here"]
    assert not Row(
        "sft.sh", 2, problems[0], "train_async.py", ["--num-epoch", "3"], other
    ).only_missing_inputs
