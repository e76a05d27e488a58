"""Helpers slime's plugins import: slime.utils.misc and slime.utils.async_utils."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from slime.utils.async_utils import get_async_loop, run
from slime.utils.errors import UsageError
from slime.utils.misc import SingletonMeta, load_function


def test_load_function_takes_slimes_dotted_path():
    assert load_function("slime.utils.async_utils.run") is run
    with pytest.raises(UsageError, match="no function 'nope'"):
        load_function("slime.utils.async_utils.nope")


def test_singletons_are_built_once_until_cleared():
    class Counter(metaclass=SingletonMeta):
        def __init__(self, start: int = 0):
            self.value = start

    class Other(metaclass=SingletonMeta):
        pass

    first, other = Counter(5), Other()
    assert Counter(9) is first and first.value == 5
    Counter.clear_instances()
    assert Counter(9) is not first and Counter().value == 9
    assert Other() is other  # another class keeps its instance


def test_run_keeps_one_loop_between_calls():
    async def loop_of_caller():
        return asyncio.get_running_loop()

    assert run(loop_of_caller()) is run(loop_of_caller()) is get_async_loop().loop

    async def fails():
        raise ValueError("from the coroutine")

    with pytest.raises(ValueError, match="from the coroutine"):
        run(fails())


def test_sample_at_slimes_path_with_its_nested_status():
    from slime.utils.sample import Sample as Ours
    from slime.utils.sample import Status
    from slime.utils.types import Sample

    assert Sample is Ours and Sample.Status.COMPLETED is Status.COMPLETED
    s = Sample(prompt="p", status=Sample.Status.TRUNCATED, reward={"score": 1.0})
    d = s.to_dict()
    assert "Status" not in d and d["status"] == "truncated"
    assert Sample.from_dict(d) == s
    assert s.get_reward_value(SimpleNamespace(reward_key="score")) == 1.0
