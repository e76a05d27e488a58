"""The agent example (slime_plugins/examples/agent_tool): its generate function runs the OpenAI
client agent through the adapter with its tool in a LocalSandbox, and the sample it returns is
the engine's tokens with the tool's output masked; its SFT rows are the prompts the adapter
sends. The learning run itself is `pytest -m slow` (test_the_agent_example_learns)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from slime.agent.local_sandbox import _namespaces_work
from slime.utils.async_utils import run_sync
from slime.utils.misc import SingletonMeta
from slime.utils.net import host_port
from slime.utils.sample import Sample
from tests.test_agent_adapters import ScriptedEngine

pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not _namespaces_work(), reason="the example's sandbox needs user namespaces")


@pytest.fixture
def rollout():
    from slime_plugins.examples.agent_tool import rollout

    yield rollout
    service = SingletonMeta._instances.get(rollout.AdapterService)
    if service is not None:
        service.handle.stop()
    rollout.AdapterService.clear_instances()


def run(rollout, engine_url, model, label):
    host, port = host_port(engine_url)
    args = SimpleNamespace(sglang_router_ip=host, sglang_router_port=port, hf_checkpoint=model)
    sample = Sample(index=5, group_index=2, prompt="compute 6*7", label=label, tokens=[1, 2, 3])
    return run_sync(rollout.generate(args, sample, {"temperature": 1.0, "max_new_tokens": 96}))


def test_a_run_with_the_tool_is_rewarded_and_trains_only_the_models_tokens(rollout, tiny_model, tokenizer):
    """The model cannot be steered to call the tool, so the engine is scripted (module docstring
    of tests/test_agent_adapters.ScriptedEngine); the agent, adapter and sandbox are the real ones."""
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call><|im_end|>'
    engine = ScriptedEngine(tokenizer, [call, "42<|im_end|>"])
    try:
        sample = run(rollout, engine.url, tiny_model, "42")
    finally:
        engine.close()
    assert isinstance(sample, Sample) and sample.reward == 1.0 and sample.metadata["agent_answer"] == "42"
    text = tokenizer.decode(sample.tokens)
    assert "<|im_start|>tool\n42<|im_end|>" in text  # the sandbox ran the model's code
    trained = tokenizer.decode(
        [t for t, m in zip(sample.tokens[-sample.response_length :], sample.loss_mask) if m]
    )
    assert trained == call + "42<|im_end|>"  # the tool's output and the template's tokens are masked
    assert sample.metadata["rendered_in_full"] == 0 and sample.metadata["use_tool"]
    assert (sample.index, sample.group_index, sample.rollout_id) == (5, 2, 5)


def test_a_run_that_answers_wrong_gets_no_reward_and_one_that_crashes_trains_nothing(
    rollout, tiny_model, tokenizer, monkeypatch
):
    engine = ScriptedEngine(tokenizer, ["41<|im_end|>", "7<|im_end|>"])
    try:
        wrong = run(rollout, engine.url, tiny_model, "42")
        real_solve = rollout.solve

        async def crashing(client, question, run_code):  # one turn, then the agent program dies
            await real_solve(client, question, run_code, max_turns=1)
            raise RuntimeError("the agent crashed")

        monkeypatch.setattr(rollout, "solve", crashing)
        failed = run(rollout, engine.url, tiny_model, "42")
    finally:
        engine.close()
    assert wrong.reward == 0.0 and wrong.loss_mask == [1, 1, 1] and not wrong.remove_sample
    assert failed.remove_sample and failed.loss_mask == [0] and failed.status == Sample.Status.FAILED
    assert failed.metadata["agent_failure"] == "RuntimeError: the agent crashed"
    assert not rollout.AdapterService(None).adapter.manager._trees  # its recorded turn is gone


def test_sft_rows_are_the_prompts_the_adapter_sends(rollout, tiny_model, tokenizer, tmp_path):
    from slime_plugins.examples.agent_tool import task

    out = tmp_path / "task"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "slime_plugins.examples.agent_tool.task",
            "--out",
            str(out),
            "--hf-checkpoint",
            tiny_model,
            "--num-sft",
            "3",
        ],
        check=True,
    )
    train = [json.loads(x) for x in open(out / "train.jsonl")]
    held = {json.loads(x)["prompt"] for x in open(out / "eval.jsonl")}
    assert len(train) + len(held) == len(task.problems()) and not held & {r["prompt"] for r in train}
    rows = [json.loads(x) for x in open(out / "sft.jsonl")]
    assert len(rows) == 9  # per problem: the tool call, the answer from its output, an answer from memory
    a, b = (int(x) for x in train[0]["prompt"].removeprefix("compute ").split("*"))
    mine = [r for r in rows if f"compute {a}*{b}<" in r["prompt"]]
    first, second = [
        r for r in mine if "tool\n" not in r["prompt"] and r["response"].startswith("<tool_call>")
    ] + [r for r in mine if "tool\n" in r["prompt"]]
    assert [r["response"] for r in mine if "tool\n" not in r["prompt"] and r is not first] == [str(a * b)]
    call = f'<tool_call>{{"name": "python", "arguments": {{"code": "print({a}*{b})"}}}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call + "<|im_end|>", f"{a * b}<|im_end|>"])
    try:
        host, port = host_port(engine.url)
        args = SimpleNamespace(sglang_router_ip=host, sglang_router_port=port, hf_checkpoint=tiny_model)
        sample = Sample(prompt=train[0]["prompt"], label=train[0]["label"], tokens=[1])
        done = run_sync(rollout.generate(args, sample, {"max_new_tokens": 96}))
    finally:
        engine.close()
    assert done.reward == 1.0 and first["response"] == call and second["response"] == str(a * b)
    # What the model saw before each reply is the SFT row's prompt, token for token.
    prompt_len = len(done.tokens) - done.response_length
    assert tokenizer.decode(done.tokens[:prompt_len]) == first["prompt"]
    assert tokenizer.decode(done.tokens).startswith(second["prompt"])
    assert os.path.getsize(out / "train.jsonl") > 0


@pytest.mark.slow
def test_the_agent_example_learns(tmp_path):
    """scripts/run-agent-cpu.sh, shortened: held-out success rises (docs/agents.md has a full run)."""
    env = {**os.environ, "PYTHON": sys.executable, "NUM_ROLLOUT": "40", "EVAL_INTERVAL": "20"}
    proc = subprocess.run(
        ["bash", "scripts/run-agent-cpu.sh", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("held-out success")][-1]
    first, last = (float(x.split()[0]) for x in (line.split("success: ")[1], line.split("-> ")[1]))
    assert last > first + 0.05, line
    assert (tmp_path / "run" / "logs" / "reward_accuracy.png").exists()
