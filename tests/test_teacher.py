"""The OPD teacher engine's side (--use-opd --opd-type sglang), against a real torch engine on
loopback: the teacher's log-probs on the samples, the tokenizer checks (before the job starts
and at connection), and slime's recipe functions at slime's import path."""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from slime.engines.client import EngineClient
from slime.utils.errors import UsageError
from slime.utils.sample import Sample
from tests.conftest import start_engine
from tests.test_engine_server import teacher_forced_logprobs

TEMPERATURE = 0.8


def swapped_tokenizer(model: str, out) -> str:
    """A copy of `model` whose tokenizer gives '7' and '8' each other's ids."""
    shutil.copytree(model, out)
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["7"], vocab["8"] = vocab["8"], vocab["7"]
    path.write_text(json.dumps(spec))
    return str(out)


@pytest.fixture(scope="module")
def teacher_engine(tiny_model_b, tmp_path_factory):
    handle = start_engine(tiny_model_b, tmp_path_factory.mktemp("teacher-logs"))
    yield handle
    handle.stop()


def samples(tokenizer) -> list[Sample]:
    out = []
    for i, (prompt, response) in enumerate([("12+7=", "19"), ("3*3=", "9<|im_end|>"), ("hi", "")]):
        p, r = tokenizer.encode(prompt), tokenizer.encode(response)
        s = Sample(index=i, tokens=p + r, response_length=len(r))
        out.append(s)
    return out


def scorer(url):
    from slime.rollout.teacher import TeacherScorer

    return TeacherScorer(url, EngineClient(url), TEMPERATURE)


async def _score(url, batch):
    s = scorer(url)
    try:
        await s.score_all(batch, per_request=2)
    finally:
        await s.client.close()


async def _check(url, tokenizer, student):
    s = scorer(url)
    try:
        await s.check(tokenizer, student)
    finally:
        await s.client.close()


def test_samples_get_the_teachers_response_log_probs(teacher_engine, tokenizer, tiny_model_b):
    """Each response token's log-prob under the teacher at the rollout temperature, as a
    teacher-forced forward of the teacher computes it; an empty response gets []."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_b, dtype=torch.float32).eval()
    batch = samples(tokenizer)
    asyncio.run(_score(teacher_engine.url, batch))
    for s in batch:
        assert s.teacher_log_probs is not None and len(s.teacher_log_probs) == s.response_length
        if not s.response_length:
            continue
        prompt, response = s.tokens[: -s.response_length], s.tokens[-s.response_length :]
        ref = teacher_forced_logprobs(model, prompt, response, TEMPERATURE)
        assert torch.tensor(s.teacher_log_probs) == pytest.approx(ref, abs=1e-5)
    # already scored samples are left as they are
    kept = samples(tokenizer)
    kept[0].teacher_log_probs = [0.0, 0.0]
    asyncio.run(_score(teacher_engine.url, kept))
    assert kept[0].teacher_log_probs == [0.0, 0.0] and kept[1].teacher_log_probs == batch[1].teacher_log_probs


def test_the_connection_check_passes_a_teacher_with_the_students_tokenizer(
    teacher_engine, tokenizer, tiny_model
):
    """A teacher of other weights with the same tokenizer is fine (tiny_model_b vs tiny_model)."""
    asyncio.run(_check(teacher_engine.url, tokenizer, tiny_model))


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model, tokenizer, tmp_path):
    """Before the job starts (the directories) and at connection (the engine names its ids):
    both errors name the two sides."""
    from slime.rollout.teacher import check_same_tokenizer

    other = swapped_tokenizer(tiny_model, tmp_path / "swapped")
    check_same_tokenizer(tiny_model, tiny_model)
    with pytest.raises(
        UsageError,
        match=r"--opd-teacher-load .*swapped.*its tokenizer \(101 tokens\) is not "
        r"--hf-checkpoint .*'s \(101 tokens\); id \d+ is '[78]'",
    ):
        check_same_tokenizer(tiny_model, other)
    handle = start_engine(other, tmp_path)
    try:
        with pytest.raises(
            UsageError, match=r"has another tokenizer than --hf-checkpoint .*: token id \d+ is '[78]'"
        ):
            asyncio.run(_check(handle.url, tokenizer, tiny_model))
    finally:
        handle.stop()


def test_slimes_recipe_functions_give_the_same_log_probs(teacher_engine, tokenizer):
    """slime.rollout.on_policy_distillation: reward_func asks --rm-url from token 0, the
    post-process moves the log-probs onto the samples and trains on 0 rewards."""
    from slime.rollout.on_policy_distillation import post_process_rewards, reward_func

    expected = samples(tokenizer)
    asyncio.run(_score(teacher_engine.url, expected))
    args = SimpleNamespace(rm_url=teacher_engine.url + "/generate", rollout_temperature=TEMPERATURE)
    batch = samples(tokenizer)

    async def rewards():
        return await asyncio.gather(*(reward_func(args, s) for s in batch))

    for s, answer in zip(batch, asyncio.run(rewards()), strict=True):
        s.reward, s.teacher_log_probs = answer, None
    raw, trained = post_process_rewards(args, batch)
    assert raw == trained == [0.0, 0.0, 0.0]
    for s, e in zip(batch, expected, strict=True):
        assert s.teacher_log_probs == pytest.approx(e.teacher_log_probs, abs=1e-6)
