"""slime_plugins/examples and the plugin API they use, through the rollout manager and a real
torch engine on loopback (in this process: the manager is not a Ray actor here)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from slime.utils.sample import Sample, Status
from slime_plugins.examples import calculator_tool, filters, group_rewards


def prompts(tmp_path, n=4, name="p.jsonl"):
    path = tmp_path / name
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n))
    )
    return str(path)


def manager(tiny_model, engine, tmp_path, *flags):
    from slime.ray.cli import parse_args
    from slime.ray.rollout_manager import RolloutManager

    cfg = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            prompts(tmp_path),
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "2",
            "--rollout-max-response-len",
            "20",
            "--save-debug-rollout-data",
            str(tmp_path / "dumps" / "r_{rollout_id}.pt"),
            *flags,
        ]
    )
    m = RolloutManager(cfg)
    m.connect([engine.url])
    return m


def generate_samples(m, rollout_id):
    """The rollout's samples, as its dump holds them."""
    from slime.rollout.dump import load_dump

    return [Sample.from_dict(d) for d in load_dump(m.generate(rollout_id).dump_path)["samples"]]


@pytest.mark.parametrize(
    "text, value",
    [
        ("2+3", "5"),
        ("x 2*(3+4)=", "14"),
        ("7/2", "3.5"),
        ("1/0", "error"),
        ("abc", "error"),
        ("2**100", "error"),
        ("__import__('os')", "error"),
        ("", "error"),
    ],
)
def test_the_calculator_evaluates_arithmetic_only(text, value):
    assert calculator_tool.calculate(text) == value


def test_a_multi_turn_tool_rollout_keeps_the_engines_tokens_and_masks_the_tool(
    tiny_model, tokenizer, engine, tmp_path, monkeypatch
):
    calls = []  # (input ids, output ids, log-probs) of every /generate request the function made
    real_post = calculator_tool.post

    async def recording_post(url, payload, *args, **kwargs):
        out = await real_post(url, payload, *args, **kwargs)
        pairs = out["meta_info"]["output_token_logprobs"]
        calls.append((list(payload["input_ids"]), [t for _, t, *_ in pairs], [lp for lp, *_ in pairs]))
        return out

    monkeypatch.setattr(calculator_tool, "post", recording_post)
    m = manager(
        tiny_model,
        engine,
        tmp_path,
        "--rm-type",
        "exact",
        "--custom-generate-function-path",
        "slime_plugins.examples.calculator_tool.generate",
    )
    samples = generate_samples(m, 0)
    tool_segments = 0
    for s in samples:
        prompt_len = len(s.tokens) - s.response_length
        assert s.tokens[:prompt_len] == tokenizer.encode(s.prompt, add_special_tokens=False)
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        pos = prompt_len
        while pos < len(s.tokens):
            # A model turn: some request was sent exactly the tokens so far, and its output ids are
            # the next tokens, with the engine's log-probs and loss mask 1.
            match = [c for c in calls if c[0] == s.tokens[:pos] and c[1] == s.tokens[pos : pos + len(c[1])]]
            assert match, f"sample {s.index}: no request made the tokens at {pos}"
            _, out, log_probs = match[0]
            r = pos - prompt_len
            assert s.loss_mask[r : r + len(out)] == [1] * len(out)
            assert s.rollout_log_probs[r : r + len(out)] == log_probs
            pos += len(out)
            if pos == len(s.tokens):
                break
            # The tool's answer: loss mask 0, log-prob 0, exactly the tool's text.
            end = pos
            while end < len(s.tokens) and s.loss_mask[end - prompt_len] == 0:
                end += 1
            r = pos - prompt_len
            assert s.rollout_log_probs[r : r + end - pos] == [0.0] * (end - pos)
            assert re.fullmatch(r"<result>(error|-?[0-9.e+]+)</result>", tokenizer.decode(s.tokens[pos:end]))
            tool_segments += 1
            pos = end
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward in (0.0, 1.0)
        assert s.weight_versions and s.effective_response_length == sum(s.loss_mask)
    assert tool_segments > 0  # 6-token turns of a random model: the tool is called


async def _async(fn, *args):
    return await fn(*args)


def test_the_group_reward_ranks_the_shortest_correct_answer():
    group = [Sample(response=r, response_length=n, label="4") for r, n in (("4", 3), (" 4 ", 2), ("5", 1))]
    assert asyncio.run(group_rewards.shortest_correct(None, group)) == [1.0, 1.5, 0.0]
    wrong = [Sample(response="5", response_length=1, label="4")] * 2
    assert asyncio.run(group_rewards.shortest_correct(None, wrong)) == [0.0, 0.0]


def test_the_group_reward_runs_with_group_rm(tiny_model, engine, tmp_path):
    m = manager(
        tiny_model,
        engine,
        tmp_path,
        "--group-rm",
        "--custom-rm-path",
        "slime_plugins.examples.group_rewards.shortest_correct",
    )
    samples = generate_samples(m, 0)
    assert len(samples) == 4 and all(s.reward in (0.0, 1.0, 1.5) for s in samples)


@pytest.mark.parametrize(
    "rewards, keep, reason",
    [
        ([1.0, 0.0], True, None),
        ([1.0, 1.0], False, "all_correct"),
        ([0.0, 0.0], False, "all_wrong"),
        ([0.5, 0.5], False, "all_equal"),
    ],
)
def test_the_filter_names_why_it_drops(rewards, keep, reason):
    out = filters.drop_uniform_groups(None, [Sample(reward=r) for r in rewards])
    assert (out.keep, out.reason) == (keep, reason)


def parity_group_reward(args, samples):
    """Even prompts: one correct answer in the group; odd prompts: none."""
    even = samples[0].metadata["prompt_index"] % 2 == 0
    return [1.0 if even and k == 0 else 0.0 for k in range(len(samples))]


def test_the_filter_drops_uniform_groups_and_the_rollout_counts_the_reason(tiny_model, engine, tmp_path):
    m = manager(
        tiny_model,
        engine,
        tmp_path,
        "--group-rm",
        "--deterministic-mode",
        "--over-sampling-batch-size",
        "4",
        "--custom-rm-path",
        "tests.test_plugin_examples.parity_group_reward",
        "--dynamic-sampling-filter-path",
        "slime_plugins.examples.filters.drop_uniform_groups",
    )
    rollout = m.generate(0)
    # Groups are decided in draw order: prompt 0 kept, 1 dropped (4 drawn for 2 wanted), 2 kept.
    assert rollout.num_samples == 4 and rollout.metrics["rollout/dynamic_filter/drop_all_wrong"] == 1.0


def test_a_rollout_function_with_its_own_loop_over_two_rollouts_and_an_evaluation(
    tiny_model, engine, tmp_path
):
    m = manager(
        tiny_model,
        engine,
        tmp_path,
        "--rm-type",
        "exact",
        "--eval-prompt-data",
        prompts(tmp_path, 3, "e.jsonl"),
        "--rollout-function-path",
        "slime_plugins.examples.rollout_fn.generate_rollout",
    )
    for rollout_id in range(2):  # the second reuses GenerateState (its semaphore, on the same loop)
        rollout = m.generate(rollout_id)
        assert rollout.num_samples == 4 and rollout.metrics["rollout/example/kept_share"] == 0.5
    evaluation = m.evaluate(0)  # handed over to sglang_rollout.generate_rollout: the built-in rollout
    assert 0.0 <= evaluation.metrics["eval/reward_mean"] <= 1.0


def test_generate_rollout_needs_the_data_source_it_was_given():
    from slime.rollout.sglang_rollout import generate_rollout

    with pytest.raises(TypeError, match="data_source your --rollout-function-path function was given"):
        generate_rollout(None, 0, object())


def test_slimes_default_rollout_path_is_the_built_in_rollout(tiny_model, tmp_path):
    from slime.ray.cli import parse_args

    cfg = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            prompts(tmp_path),
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            "--rm-type",
            "exact",
            "--rollout-function-path",
            "slime.rollout.sglang_rollout.generate_rollout",
            "--custom-generate-function-path",
            "slime_plugins.examples.calculator_tool.generate",
        ]
    )
    assert cfg.rollout.rollout_function_path is None
    assert cfg.rollout.custom_generate_function_path == "slime_plugins.examples.calculator_tool.generate"


def test_a_sample_with_its_own_reward_function(tmp_path):
    from slime.rollout.rewards import RewardModel

    samples = [
        Sample(response="2", label="2"),
        Sample(response="2", label="2", custom_rm_path=f"{__name__}.minus_one"),
    ]
    asyncio.run(RewardModel("exact", None, False, None).score_group(samples))
    assert [s.reward for s in samples] == [1.0, -1.0]


def minus_one(args, sample):
    return -1.0


@pytest.fixture(autouse=True)
def fresh_generate_state():
    """GenerateState is one per process: each test starts without the last one's."""
    from slime.rollout.sglang_rollout import GenerateState

    GenerateState.clear_instances()
    yield
    GenerateState.clear_instances()


def remove_first(args, groups):
    """A --rollout-sample-filter-path: the first sample of every group counts in no loss."""
    for group in groups:
        group[0].remove_sample = True


def test_the_sample_filter_marks_samples_out_of_the_loss(tiny_model, engine, tmp_path):
    from slime.utils.sample import samples_to_batch

    m = manager(
        tiny_model,
        engine,
        tmp_path,
        "--rm-type",
        "exact",
        "--rollout-sample-filter-path",
        "tests.test_plugin_examples.remove_first",
    )
    rollout = m.generate(0)
    assert rollout.metrics["rollout/removed_samples"] == 2.0
    from slime.rollout.dump import load_dump

    samples = [Sample.from_dict(d) for d in load_dump(rollout.dump_path)["samples"]]
    assert [s.remove_sample for s in samples] == [True, False, True, False]
    masks = samples_to_batch(samples).loss_masks
    assert [any(m) for m in masks] == [False, True, False, True]


def answer_eval(args, rollout_id, data_source, evaluation=False):
    """A rollout function that answers evaluation prompts itself and leaves the reward to the set."""
    from slime.rollout.base_types import RolloutFnEvalOutput

    assert evaluation
    samples = [s for g in data_source.get_samples(2) for s in g]
    for s in samples:
        assert s.custom_rm_path == "tests.test_plugin_examples.minus_one"  # the set's, as slime sets it
        s.response, s.status = "x", Status.COMPLETED
        s.tokens, s.response_length = [*s.tokens, 5], 1
    return RolloutFnEvalOutput(data={"hard": {"samples": samples}})


def test_an_evaluation_sets_own_reward_reaches_a_rollout_function(tiny_model, engine, tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"datasets:\n  - name: hard\n    path: {prompts(tmp_path, 2, 'e.jsonl')}\n"
        "    custom_rm_path: tests.test_plugin_examples.minus_one\n"
    )
    m = manager(
        tiny_model,
        engine,
        tmp_path,
        "--rm-type",
        "exact",
        "--eval-config",
        str(config),
        "--rollout-function-path",
        "tests.test_plugin_examples.answer_eval",
    )
    assert m.evaluate(0).metrics["eval/hard"] == -1.0


def test_an_evaluation_sets_own_generate_function_and_reward_in_the_built_in_rollout(
    tiny_model, engine, tmp_path
):
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"datasets:\n  - name: calc\n    path: {prompts(tmp_path, 2, 'e.jsonl')}\n"
        "    custom_rm_path: tests.test_plugin_examples.minus_one\n"
        "    custom_generate_function_path: slime_plugins.examples.calculator_tool.generate\n"
    )
    # Greedy: whether a turn ends on a stop token (and so calls no tool) must not depend on the
    # shared engine's sampling state, which the module's other tests and their timing move.
    m = manager(
        tiny_model,
        engine,
        tmp_path,
        "--rm-type",
        "exact",
        "--eval-config",
        str(config),
        "--save-debug-eval-data",
        str(tmp_path / "eval_{rollout_id}.pt"),
        "--eval-temperature",
        "0",
    )
    evaluation = m.evaluate(0)
    assert evaluation.metrics["eval/calc"] == -1.0
    from slime.rollout.dump import load_dump

    samples = load_dump(evaluation.dump_path)["samples"]
    assert any(0 in s["loss_mask"] for s in samples)  # the calculator's tool tokens: its function ran
