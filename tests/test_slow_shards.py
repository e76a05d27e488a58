"""tests/slow_shards.py: every slow test in exactly one shard, the shards about equally long, and
the durations read back from a junit report."""

from __future__ import annotations

import pytest

from tests.slow_shards import assign, junit_seconds, parse_shard


def test_every_test_lands_in_one_shard_and_the_shards_are_balanced():
    seconds = {f"tests/t.py::test_{i}": float(s) for i, s in enumerate([300, 200, 120, 90, 60, 60, 30, 10])}
    new = "tests/t.py::test_new"  # not measured yet: counted as a typical job
    shard = assign([*seconds, new], 3, seconds)
    assert set(shard) == {*seconds, new} and set(shard.values()) == {0, 1, 2}
    loads = [sum(seconds.get(t, 60.0) for t, k in shard.items() if k == i) for i in range(3)]
    assert max(loads) - min(loads) <= 60  # greedy, longest first: within one test of each other
    assert assign(reversed(list(seconds)), 3, seconds) == assign(seconds, 3, seconds)  # any order
    assert set(assign(seconds, 1, seconds).values()) == {0}


def test_a_shard_is_k_of_n():
    assert parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "x", "1"):
        with pytest.raises(ValueError, match="--slow-shard"):
            parse_shard(bad)


def test_durations_come_from_a_junit_report(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_chaos" name="test_fault_matrix[eval]@e2e" time="71.234"/>'
        '<testcase classname="tests.test_loop_e2e" name="test_resume" time="60.0"/>'
        "</testsuite></testsuites>"
    )
    assert junit_seconds(str(report)) == {
        "tests/test_chaos.py::test_fault_matrix[eval]": 71.2,
        "tests/test_loop_e2e.py::test_resume": 60.0,
    }
