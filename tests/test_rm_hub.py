"""slime's rule rewards (`slime.rollout.rm_hub`): every scorer against slime's own outputs, the
dispatch (`async_rm`, `batched_async_rm`, metadata rm_type, boxed_<type>), and remote_rm against
a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import socket
import subprocess
import sys
import textwrap
import types

import pytest
from aiohttp import web

from slime.rollout import rm_hub
from slime.rollout.rewards import RewardModel
from slime.rollout.rm_hub import deps
from slime.rollout.rm_hub.multiple_choice import gpqa_reward, picked_letter
from slime.utils.errors import UsageError
from slime.utils.sample import Sample
from tests.fixtures.rm_cases import CASES


def make_args(rm_type=None, custom_rm_path=None, rm_url=None):
    return types.SimpleNamespace(rm_type=rm_type, custom_rm_path=custom_rm_path, rm_url=rm_url)


def case_id(row) -> str:
    return f"{CASES.index(row)}-{row[0].strip()}"


@pytest.mark.parametrize("row", CASES, ids=case_id)
def test_scores_equal_slimes(row):
    """Same value, same type (int 1, float 1.0, bool acc), same exception class as slime."""
    rm_type, response, label, metadata, expected = row[:5]
    sample = Sample(response=response, label=label, metadata=copy.deepcopy(metadata))
    if isinstance(expected, tuple) and expected[0] == "raises":
        with pytest.raises(Exception) as info:
            asyncio.run(rm_hub.async_rm(make_args(rm_type), sample))
        assert type(info.value).__name__ == expected[1]
        return
    got = asyncio.run(rm_hub.async_rm(make_args(rm_type), sample))
    assert got == expected and type(got) is type(expected)
    if isinstance(expected, dict):
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in expected.items()}
    assert sample.metadata == (row[5] if len(row) > 5 else metadata)  # gpqa records correct_answer


def test_case_table_covers_every_local_scorer():
    covered = {rm_hub.split_rm_type(row[0])[0] for row in CASES}
    assert covered == {"math", "deepscaler", "dapo", "f1", "gpqa"}
    assert len(CASES) >= 100


# --- gpqa: what the case table cannot hold ------------------------------------------------


def test_gpqa_without_a_response_scores_zero_and_records_nothing():
    metadata = {"choices": ["London", "Paris"]}
    assert gpqa_reward(None, "Paris", metadata) == 0.0
    assert metadata == {"choices": ["London", "Paris"]}  # as slime: the key is never resolved
    assert gpqa_reward("", "Paris", metadata) == 0.0
    assert metadata["correct_answer"] == "Paris"


def test_gpqa_label_that_is_no_number_raises_as_int_does():
    with pytest.raises(ValueError):
        gpqa_reward("A", float("nan"), {})
    with pytest.raises(OverflowError):
        gpqa_reward("A", float("inf"), {})


def test_gpqa_malformed_metadata_names_the_key():
    with pytest.raises(TypeError, match=r'metadata\["choices"\] must be a list, got int'):
        gpqa_reward("A", 0, {"choices": 5})
    with pytest.raises(TypeError, match=r'metadata\["valid_letters"\]'):
        gpqa_reward("A", 0, {"valid_letters": 5})
    with pytest.raises(IndexError, match=r"option 2 of metadata\['choices'\].*names only 1"):
        gpqa_reward("A", "Paris", {"choices": ["London", "Paris"], "valid_letters": ["A"]})


def test_gpqa_pick_prefers_the_most_explicit_cue():
    letters = tuple("ABCD")
    assert picked_letter("B is correct. Final answer: C", letters) == "C"  # a phrase first
    assert picked_letter("A, B, then: C is correct", letters) == "C"  # "X is correct" next
    assert picked_letter("not A but B (or E)", letters) == "B"  # the last capital naming an option
    assert picked_letter("<think>answer: A</think> so D", letters) == "D"  # after the reasoning
    assert picked_letter("answer: e", letters) is None


# --- dispatch -------------------------------------------------------------------------------


def test_metadata_rm_type_wins_over_the_flag():
    sample = Sample(response=r"the cat \boxed{7}", label="cat", metadata={"rm_type": "f1"})
    assert asyncio.run(rm_hub.async_rm(make_args("math"), sample)) == pytest.approx(2 / 3)
    sample.metadata = {}
    assert asyncio.run(rm_hub.async_rm(make_args("math"), sample)) == 0
    sample.metadata = {"rm_type": ""}  # empty: the flag's type
    assert asyncio.run(rm_hub.async_rm(make_args(" f1 "), sample)) == pytest.approx(2 / 3)


def test_boxed_prefix_scores_the_last_box():
    sample = Sample(response=r"\boxed{wrong} then \boxed{the cat}", label="cat")
    assert asyncio.run(rm_hub.async_rm(make_args("boxed_f1"), sample)) == 1.0
    assert rm_hub.score_locally("boxed_f1", "no box at all", "cat") == 0  # scored as ""
    assert rm_hub.score_locally("boxed_exact", r"\boxed{ 4 }", "4") == 1.0
    assert rm_hub.split_rm_type(" boxed_gpqa ") == ("gpqa", True)


def test_metadata_rm_type_that_is_not_a_string_is_a_clear_error():
    sample = Sample(response="x", label="x", metadata={"rm_type": 3})
    with pytest.raises(ValueError, match=r'metadata\["rm_type"\] must be a string.*got int 3'):
        asyncio.run(rm_hub.async_rm(make_args("exact"), sample))
    with pytest.raises(UsageError, match=r'metadata\["rm_type"\]'):
        asyncio.run(RewardModel("exact", None, False, args=None).score_group([sample]))
    sample.metadata = {"rm_type": None}  # unset: the flag's type
    assert asyncio.run(rm_hub.async_rm(make_args("exact"), sample)) == 1.0


def test_unknown_type_is_a_clear_error():
    with pytest.raises(rm_hub.UnknownRewardType, match=r"--rm-type 'bogus'.*known: deepscaler, dapo, math"):
        rm_hub.check_rm_type("bogus")
    sample = Sample(response="x", label="x", metadata={"rm_type": "nope"})
    with pytest.raises(NotImplementedError, match=r"'nope'.*--rm-type.*boxed_<type>"):  # slime's class too
        asyncio.run(rm_hub.async_rm(make_args("math"), sample))
    with pytest.raises(UsageError, match="no reward type"):
        asyncio.run(rm_hub.async_rm(make_args(None), Sample(response="x")))
    with pytest.raises(UsageError, match=r"IFBench.*spacy.*--custom-rm-path"):
        rm_hub.check_rm_type("ifbench")
    with pytest.raises(UsageError, match="IFBench"):
        rm_hub.score_locally("boxed_ifbench", "x", "y")


def test_exact_and_random():
    assert rm_hub.score_locally("exact", " 12\n", 12) == 1.0
    assert rm_hub.score_locally("exact", "12", "13") == 0.0
    draws = [rm_hub.score_locally("random", "anything", None) for _ in range(200)]
    assert set(draws) == {0, 1} and all(type(d) is int for d in draws)


def test_batched_scores_each_sample_with_its_own_type():
    samples = [
        Sample(response="Answer: 3", label="3", metadata={"rm_type": "dapo"}),
        Sample(response=r"<think>x</think>\boxed{\frac12}", label="0.5"),
        Sample(response="The answer is B", label="B", metadata={"rm_type": "gpqa"}),
    ]
    rewards = asyncio.run(rm_hub.batched_async_rm(make_args("deepscaler"), samples))
    assert rewards == [{"score": 1.0, "acc": True, "pred": "3"}, 1, 1.0]


def test_custom_rm_path_scores_one_sample_or_the_batch(tmp_path, monkeypatch):
    (tmp_path / "my_rm_hub_rm.py").write_text(
        textwrap.dedent(
            """
            async def one(args, sample, **kwargs):
                return {"len": len(sample.response), **kwargs}
            def many(args, samples, **kwargs):
                return [float(i) for i, _ in enumerate(samples)]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = [Sample(response="ab"), Sample(response="abc", metadata={"rm_type": "math"})]
    got = asyncio.run(rm_hub.async_rm(make_args("math", "my_rm_hub_rm.one"), samples[1], tag=1))
    assert got == {"len": 3, "tag": 1}  # the custom function wins over every rm_type
    assert asyncio.run(rm_hub.batched_async_rm(make_args(None, "my_rm_hub_rm.many"), samples)) == [0.0, 1.0]
    with pytest.raises(UsageError, match=r"--custom-rm-path 'my_rm_hub_rm\.nope'"):
        asyncio.run(rm_hub.async_rm(make_args(None, "my_rm_hub_rm.nope"), samples[0]))
    sys.modules.pop("my_rm_hub_rm", None)


def test_reward_model_scores_builtin_types_through_rm_hub():
    samples = [Sample(index=i, response=f"Answer: {i}", label="1") for i in range(2)]
    rm = RewardModel("dapo", None, False, args=None)
    asyncio.run(rm.score_group(samples))
    assert [s.reward for s in samples] == [
        {"score": -1.0, "acc": False, "pred": "0"},
        {"score": 1.0, "acc": True, "pred": "1"},
    ]
    assert [s.scalar_reward("score") for s in samples] == [-1.0, 1.0]  # slime's --reward-key score
    samples[0].metadata = {"rm_type": "exact"}
    asyncio.run(rm.score_group(samples))
    assert samples[0].reward == 0.0 and samples[1].reward["acc"] is True


def test_reward_model_checks_its_type_at_construction():
    with pytest.raises(UsageError, match="--rm-type 'bogus'"):
        RewardModel("bogus", None, False, args=None)
    with pytest.raises(UsageError, match="--rm-url"):
        RewardModel("remote_rm", None, False, args=make_args(rm_url=None))
    with pytest.raises(UsageError, match="--rm-url 'localhost:1'"):
        RewardModel("remote_rm", None, False, args=make_args(rm_url="localhost:1"))
    with pytest.raises(UsageError, match="IFBench"):
        RewardModel("ifbench", None, False, args=None)
    with pytest.raises(UsageError, match="--group-rm needs --custom-rm-path"):
        RewardModel("math", None, True, args=None)
    with pytest.raises(UsageError, match="choose a reward"):
        RewardModel(None, None, False, args=None)
    for rm_type in ("deepscaler", "dapo", "math", "f1", "gpqa", "random", "exact", "boxed_math"):
        RewardModel(rm_type, None, False, args=None)


def test_rm_url_is_checked_only_where_remote_rm_reads_it(tmp_path, monkeypatch):
    bad = make_args(rm_url="localhost:1")  # no scheme: refused where it is used
    rm = RewardModel("exact", None, False, args=bad)
    assert rm.remote is None
    samples = [Sample(response="4", label="4")]
    asyncio.run(rm.score_group(samples))
    assert samples[0].reward == 1.0
    assert asyncio.run(rm_hub.async_rm(make_args("exact", rm_url="localhost:1"), samples[0])) == 1.0
    (tmp_path / "my_url_rm.py").write_text("def f(args, sample):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    RewardModel(None, "my_url_rm.f", False, args=bad)  # a custom reward does not read --rm-url
    sys.modules.pop("my_url_rm", None)
    # A sample that asks for remote_rm itself meets the check when it is scored.
    samples[0].metadata = {"rm_type": "remote_rm"}
    with pytest.raises(UsageError, match="--rm-url 'localhost:1'"):
        asyncio.run(rm.score_group(samples))


def test_missing_optional_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(deps, "_installed", lambda module: module != "pylatexenc")
    with pytest.raises(UsageError, match=r"--rm-type math: .*pylatexenc.*pip install 'slime\[rewards\]'"):
        RewardModel("math", None, False, args=None)
    with pytest.raises(ImportError, match=r"slime\[rewards\]"):
        rm_hub.score_locally("deepscaler", r"</think>\boxed{1}", "1")
    RewardModel("f1", None, False, args=None)  # needs nothing optional


def test_importing_the_package_stays_light():
    code = (
        "import sys, slime, slime.rollout.rm_hub, slime.rollout.rewards\n"
        "heavy = {'sympy', 'pylatexenc', 'aiohttp', 'torch'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- remote_rm ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def reward_server(handler):
    app = web.Application()
    app.router.add_post("/reward", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/reward"
    finally:
        await runner.cleanup()


def fast(url: str, **kw) -> rm_hub.RemoteRMConfig:
    return rm_hub.RemoteRMConfig(url=url, backoff_s=0.01, max_backoff_s=0.02, **kw)


def test_remote_rm_posts_prompt_response_label():
    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body)
        return web.json_response({"score": len(body["response"]) / 10, "label": body["label"]})

    async def main():
        async with reward_server(handler) as url:
            sample = Sample(prompt=[{"role": "user", "content": "hi"}], response="hello", label=3)
            direct = await rm_hub.remote_rm(make_args(rm_url=url), sample)
            via_async_rm = await rm_hub.async_rm(make_args("boxed_remote_rm", rm_url=url), sample)
            return direct, via_async_rm

    direct, via_async_rm = asyncio.run(main())
    assert direct == via_async_rm == {"score": 0.5, "label": 3}
    # boxed_ does not change what is posted: the server gets the whole response, as in slime
    assert seen == [{"prompt": [{"role": "user", "content": "hi"}], "response": "hello", "label": 3}] * 2


def test_remote_rm_retries_after_a_500():
    calls = []

    async def handler(request):
        calls.append(await request.json())
        if len(calls) == 1:
            return web.Response(status=500, text="busy")
        return web.json_response(1.0)

    async def main():
        async with reward_server(handler) as url:
            rm = RewardModel("remote_rm", None, False, args=make_args(rm_url=url))
            assert rm.remote is not None
            rm.remote = dataclasses.replace(rm.remote, backoff_s=0.01)
            samples = [Sample(response="a", label="x"), Sample(response=r"\boxed{2}", label="2")]
            samples[1].metadata = {"rm_type": "math"}  # scored locally, next to the remote one
            await rm.score_group(samples)
            return samples

    samples = asyncio.run(main())
    assert [s.reward for s in samples] == [1.0, 1]
    assert len(calls) == 2


def test_remote_rm_gives_one_error_naming_the_url_after_the_last_retry():
    calls = []

    async def handler(request):
        calls.append(1)
        return web.Response(status=503, text="down")

    async def main():
        async with reward_server(handler) as url:
            async with rm_hub.RemoteRewardClient(fast(url, max_retries=3)) as client:
                with pytest.raises(rm_hub.RemoteRewardError) as info:
                    await client.score("p", "r", "l")
            return url, info.value

    url, error = asyncio.run(main())
    assert len(calls) == 3
    assert f"POST {url} failed 3 times" in str(error) and "503" in str(error)


def test_remote_rm_times_out_and_reports_unreachable_servers():
    async def slow(request):
        await asyncio.sleep(1.0)  # past the client's 0.2 s timeout; the server waits for it on close
        return web.json_response(1.0)

    async def main():
        async with (
            reward_server(slow) as url,
            rm_hub.RemoteRewardClient(fast(url, max_retries=2, timeout_s=0.2)) as client,
        ):
            with pytest.raises(rm_hub.RemoteRewardError, match=r"failed 2 times; last error: .*Timeout"):
                await client.score("p", "r", "l")
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = f"http://127.0.0.1:{s.getsockname()[1]}/reward"
        async with rm_hub.RemoteRewardClient(fast(closed, max_retries=2)) as client:
            with pytest.raises(
                rm_hub.RemoteRewardError, match=rf"POST {closed} failed 2 times; last error: Client"
            ):
                await client.score("p", "r", "l")

    asyncio.run(main())


def test_remote_rm_without_url_names_the_flag():
    sample = Sample(response="x", metadata={"rm_type": "remote_rm"})
    with pytest.raises(UsageError, match="--rm-url"):
        asyncio.run(rm_hub.async_rm(make_args("math"), sample))
    with pytest.raises(UsageError, match="--rm-url"):
        asyncio.run(RewardModel("math", None, False, args=None).score_group([sample]))


def test_the_helper_names_slimes_plugins_import():
    from slime.rollout import rm_hub
    from slime.rollout.rm_hub.dapo import dapo_reward
    from slime.rollout.rm_hub.math_dapo_utils import compute_score
    from slime.rollout.rm_hub.math_utils import extract_answer, grade_answer_mathd, grade_answer_verl

    assert rm_hub.compute_score_dapo is compute_score and rm_hub.grade_answer_verl is grade_answer_verl
    for response, label in (("Answer: 42", "42"), ("x\nAnswer: 41", "42"), ("no answer", "3")):
        assert compute_score(response, label) == dapo_reward(response, label)
    strict = compute_score(r"so \boxed{4{2}} and \boxed 5", "4{2}", strict_box_verify=True)
    assert strict == {"score": 1.0, "acc": True, "pred": "4{2}"}
    assert compute_score("x" * 200 + r"\boxed{1}" + "y" * 100, "1", strict_box_verify=True)["score"] == -1.0
    assert extract_answer(r"a \boxed{\frac{1}{2}} b") == r"\frac{1}{2}" and extract_answer("none") is None
    assert grade_answer_verl(r"\boxed{\frac{1}{2}}", "0.5") and not grade_answer_verl("0.5", "0.5")
    assert (
        grade_answer_mathd("10\\%", "10")
        and rm_hub.get_deepscaler_rule_based_reward("</think>\\boxed{2}", "2") == 1
    )
