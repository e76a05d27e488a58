"""Scheduler decisions, with no model: admission, prefill budget, finish rules, abort."""

from __future__ import annotations

from slime.engines.torch_engine.scheduler import Scheduler
from slime.engines.torch_engine.sequence import SeqStatus, Sequence
from slime.utils.sampling_params import SamplingParams


def make(max_running=4, budget=1000, detok=None):
    return Scheduler(
        max_running, budget, {99}, detok or (lambda ids, skip: "".join(chr(97 + i % 26) for i in ids))
    )


def seq(rid, n=4, **params):
    return Sequence(rid=rid, prompt_ids=list(range(n)), params=SamplingParams(**params))


def test_admits_up_to_max_running_then_decodes():
    s = make(max_running=2)
    for i in range(3):
        s.add(seq(str(i)))
    plan = s.plan()
    assert plan.kind == "prefill" and [x.rid for x in plan.seqs] == ["0", "1"]
    plan = s.plan()
    assert plan.kind == "decode" and len(plan.seqs) == 2
    assert [x.rid for x in s.waiting] == ["2"]


def test_new_arrivals_join_before_next_decode():
    s = make()
    s.add(seq("a"))
    s.plan()
    s.add(seq("b"))
    plan = s.plan()
    assert plan.kind == "prefill" and [x.rid for x in plan.seqs] == ["b"]
    assert {x.rid for x in s.plan().seqs} == {"a", "b"}


def test_prefill_budget_splits_but_always_admits_one():
    s = make(budget=10)
    s.add(seq("big", n=50))
    s.add(seq("small", n=3))
    assert [x.rid for x in s.plan().seqs] == ["big"]
    assert [x.rid for x in s.plan().seqs] == ["small"]


def test_finish_rules():
    s = make()
    a, b, c, d = (
        seq("a", max_new_tokens=2),
        seq("b"),
        seq("c", stop_token_ids=(5,)),
        seq("d", ignore_eos=True),
    )
    for x in (a, b, c, d):
        s.add(x)
    s.plan()
    done = s.append_tokens([a, b, c, d], [1, 99, 5, 99], [-1.0] * 4, None)
    assert {x.rid for x in done} == {"b", "c"}
    assert b.finish_reason.to_json() == {"type": "stop", "matched": 99}
    assert c.finish_reason.to_json() == {"type": "stop", "matched": 5}
    done = s.append_tokens([a, d], [2, 3], [-1.0] * 2, None)
    assert done == [a] and a.finish_reason.to_json() == {"type": "length", "length": 2}
    assert d.status == SeqStatus.RUNNING and s.running == [d]


def test_stop_string_trims_text_unless_no_stop_trim():
    s = make()
    a, b = seq("a", stop=("cd",)), seq("b", stop=("cd",), no_stop_trim=True)
    for x in (a, b):
        s.add(x)
    s.plan()
    for tok in (0, 1, 2):  # "a", "b", "c"
        assert s.append_tokens([a, b], [tok, tok], [0.0, 0.0], None) == []
    done = s.append_tokens([a, b], [3, 3], [0.0, 0.0], None)  # "d" completes "cd"
    assert done == [a, b]
    assert a.stop_text_end == 2 and b.stop_text_end == 4
    assert a.finish_reason.to_json() == {"type": "stop", "matched": "cd"}


def test_abort_one_and_all():
    s = make(max_running=1)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.plan()
    assert s.abort("b", "x") == [b] and not s.waiting
    assert b.finish_reason.to_json() == {"type": "abort", "message": "x"}
    assert s.abort(None, "all") == [a] and not s.has_work()


def test_abort_by_identity_spares_a_namesake():
    s = make()
    gone, namesake = seq("same"), seq("same")
    s.add(gone)
    s.plan()
    s.abort_sequences([gone], "client left")
    s.add(namesake)  # a new request reuses the rid after the first finished
    assert s.abort_sequences([gone], "client left again") == []
    assert s.is_in_flight("same") and namesake.status == SeqStatus.WAITING
    assert s.abort("same", "x") == [namesake] and not s.is_in_flight("same")


def test_a_run_of_tokens_is_kept_up_to_the_one_that_finishes_it():
    """Several decode steps' tokens at once (decode rounds): each sequence keeps its run up to its
    stop token, its stop string or its max_new_tokens, and drops what was sampled after."""
    s = make(max_running=8)
    eos, ids, length, text, free, ignore = (
        seq("eos"),
        seq("ids", stop_token_ids=(7,)),
        seq("length", max_new_tokens=3),
        seq("text", stop=["cd"]),
        seq("free"),
        seq("ignore", ignore_eos=True),
    )
    for x in (eos, ids, length, text, free, ignore):
        s.add(x)
    s.plan()
    run = [1, 99, 4, 5]
    done = s.append_runs(
        [eos, ids, length, text, free, ignore],
        [run, [1, 7, 7, 2], [1, 2, 3, 4], [0, 2, 3, 4], [1, 2, 3, 4], run],
        [[-0.5, -1.0, -1.5, -2.0]] * 6,
    )
    assert done == [eos, ids, length, text]
    assert eos.output_ids == [1, 99] and eos.output_logprobs == [-0.5, -1.0]
    assert eos.finish_reason.to_json()["matched"] == 99
    assert ids.output_ids == [1, 7] and ids.finish_reason.to_json()["matched"] == 7
    assert length.output_ids == [1, 2, 3] and length.finish_reason.to_json()["type"] == "length"
    assert text.output_ids == [0, 2, 3] and text.finish_reason.to_json()["matched"] == "cd"  # "acd"
    assert free.output_ids == [1, 2, 3, 4] and not free.is_finished
    assert ignore.output_ids == run and not ignore.is_finished and len(ignore.output_logprobs) == 4
    assert [x.rid for x in s.running] == ["free", "ignore"]


def test_a_stop_string_check_decodes_each_token_with_its_context_and_places_the_hit_in_the_whole_text():
    """Each token's check decodes the token with the one before it, not the whole output (that
    cost the square of its length); a hit is then placed in the whole text."""
    decoded = []

    def detok(ids, skip):
        decoded.append(len(ids))
        return "".join(chr(97 + i % 26) for i in ids)

    s = make(detok=detok)
    a = seq("a", stop=("xyz",), max_new_tokens=1000)
    s.add(a)
    s.plan()
    for tok in range(60):  # "a" to "w" over and over: no "x", "y" or "z"
        assert s.append_tokens([a], [tok % 23], [0.0], None) == []
    assert max(decoded) == 2 < len(a.output_ids)
    for tok in (23, 24):  # "x", "y"
        assert s.append_tokens([a], [tok], [0.0], None) == []
    assert s.append_tokens([a], [25], [0.0], None) == [a]  # "z" completes "xyz"
    assert a.finish_reason.to_json() == {"type": "stop", "matched": "xyz"}
    assert decoded[-1] == len(a.output_ids) == 63 and a.stop_text_end == 60


def test_a_stop_string_whose_characters_lie_far_apart_in_tokens_is_found():
    """A stop string whose characters lie far apart in tokens (here 40 special tokens, decoded
    to nothing, between two newlines) is still found at the token that completes it."""

    def detok(ids, skip):
        return "".join("\n" if i == 10 else "" if i >= 50 else chr(97 + i % 26) for i in ids)

    s = make(detok=detok)
    a = seq("a", stop=("\n\n",), max_new_tokens=1000)
    s.add(a)
    s.plan()
    for tok in [0, 1, 10] + [60] * 40:  # "ab\n", then nothing
        assert s.append_tokens([a], [tok], [0.0], None) == []
    assert s.append_tokens([a], [10], [0.0], None) == [a]  # the second newline
    assert a.finish_reason.to_json() == {"type": "stop", "matched": "\n\n"} and a.stop_text_end == 2
