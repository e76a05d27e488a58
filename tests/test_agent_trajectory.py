"""slime.agent.trajectory: a session's turns → samples (CLEAN appends, REALIGN, FORK, branches
trained once, the rewrite merge), with token exactness checked on every sample."""

from __future__ import annotations

import random

import pytest

from slime.agent.trajectory import TrajectoryManager, TurnRecord, common_prefix_len
from slime.utils.sample import Sample

BASE = Sample(index=3, group_index=1, prompt="task", label="42")


def msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def turn(prompt: list[int], out: list[int], version: str = "5", finish: str = "stop") -> TurnRecord:
    return TurnRecord(
        prompt, out, finish, [-0.1 * (i + 1) for i in range(len(out))], weight_versions=[version] * len(out)
    )


def trained_spans(sample: Sample) -> list[tuple[int, int]]:
    """(start, end) in `tokens` of each run of loss-mask-1 tokens."""
    start = len(sample.tokens) - sample.response_length
    spans, begin = [], None
    for i, m in enumerate([*sample.loss_mask, 0]):
        if m and begin is None:
            begin = i
        elif not m and begin is not None:
            spans.append((start + begin, start + i))
            begin = None
    return spans


def assert_token_exact(sample: Sample, turns: list[TurnRecord]) -> None:
    """Every trained span is one turn's output, preceded by exactly that turn's prompt, with its
    log-probs and weight versions."""
    versions = sample.token_weight_versions()
    start = len(sample.tokens) - sample.response_length
    for a, b in trained_spans(sample):
        (t,) = [t for t in turns if t.prompt_ids == sample.tokens[:a] and t.output_ids == sample.tokens[a:b]]
        assert sample.rollout_log_probs[a - start : b - start] == t.output_log_probs
        assert versions[a - start : b - start] == t.weight_versions


def test_appended_turns_make_one_sample_with_only_model_tokens_trained():
    m = TrajectoryManager()
    sys_user = [msg("system", "s"), msg("user", "u")]
    t1 = turn([1, 2, 3], [10, 11])
    m.record_turn("a", turn=t1, prompt_messages=sys_user, response_message=msg("assistant", "x"))
    t2 = turn([1, 2, 3, 10, 11, 20, 21], [12, 13, 14], version="6")
    m.record_turn(
        "a",
        turn=t2,
        prompt_messages=[*sys_user, msg("assistant", "x"), msg("tool", "r")],
        response_message=msg("assistant", "y"),
    )
    assert m.turn_count("a") == 2
    (s,) = m.get_trajectory("a", base_sample=BASE, reward=1.5)
    assert s.tokens == [1, 2, 3, 10, 11, 20, 21, 12, 13, 14] and s.response_length == 7
    assert s.loss_mask == [1, 1, 0, 0, 1, 1, 1]
    assert s.reward == 1.5 and (s.index, s.group_index, s.rollout_id, s.label) == (3, 1, 3, "42")
    assert s.weight_version_spans == [["5", 2], [None, 2], ["6", 3]] and s.weight_versions == ["5", "6"]
    assert s.metadata["forked_turns"] == 0 and s.metadata["realigned_turns"] == 0
    assert_token_exact(s, [t1, t2])
    assert m.get_trajectory("a", base_sample=BASE) == [] and not m.has_session("a")


def test_a_short_drift_inside_the_last_response_realigns_it_out_of_the_loss():
    m = TrajectoryManager(fork_threshold_tokens=8)
    user = [msg("user", "u")]
    t1 = turn([1, 2], [10, 11, 12])
    m.record_turn("a", turn=t1, prompt_messages=user, response_message=msg("assistant", "x"))
    # The same messages, but the template re-renders the response with 11 -> 99: inside it.
    t2 = turn([1, 2, 10, 99, 12, 30], [13])
    m.record_turn(
        "a",
        turn=t2,
        prompt_messages=[*user, msg("assistant", "x"), msg("user", "v")],
        response_message=msg("assistant", "z"),
    )
    (s,) = m.get_trajectory("a", base_sample=BASE)
    assert s.tokens == [1, 2, 10, 99, 12, 30, 13]
    assert s.loss_mask == [0, 0, 0, 0, 1]  # the drifted response is no longer trained
    assert s.metadata["realigned_turns"] == 1
    assert_token_exact(s, [t1, t2])


@pytest.mark.parametrize("where", ["before the last response", "a long last response"])
def test_other_drift_forks_into_a_new_sample(where):
    m = TrajectoryManager(fork_threshold_tokens=3)
    user = [msg("user", "u")]
    t1 = turn([1, 2], [10, 11])
    m.record_turn("a", turn=t1, prompt_messages=user, response_message=msg("assistant", "x"))
    prompt = [1, 7, 10, 11, 30] if where == "before the last response" else [1, 2, 10, 77, 30]
    t2 = turn(prompt, [13, 14, 15])  # 3 output tokens: not below the threshold
    m.record_turn(
        "a",
        turn=t2,
        prompt_messages=[*user, msg("assistant", "x"), msg("user", "v")],
        response_message=msg("assistant", "z"),
    )
    first, second = m.get_trajectory("a", base_sample=BASE, reward=1.0)
    assert first.tokens == [1, 2, 10, 11] and first.loss_mask == [1, 1]
    assert second.tokens == [*prompt, 13, 14, 15] and second.loss_mask == [1, 1, 1]
    assert second.metadata["forked_turns"] == 1 and first.reward == second.reward == 1.0
    for s in (first, second):
        assert_token_exact(s, [t1, t2])


def test_branches_are_samples_of_one_group_and_a_shared_response_trains_once():
    m = TrajectoryManager()
    root = [msg("system", "s"), msg("user", "u")]
    t1 = turn([1, 2], [10])
    m.record_turn("a", turn=t1, prompt_messages=root, response_message=msg("assistant", "plan"))
    after = [*root, msg("assistant", "plan")]
    t2 = turn([1, 2, 10, 3], [20])
    m.record_turn(
        "a",
        turn=t2,
        prompt_messages=[*after, msg("user", "branch A")],
        response_message=msg("assistant", "a"),
    )
    t3 = turn([1, 2, 10, 4], [30])
    m.record_turn(
        "a",
        turn=t3,
        prompt_messages=[*after, msg("user", "branch B")],
        response_message=msg("assistant", "b"),
    )
    # A sub-agent with a history of its own.
    t4 = turn([5, 6], [40, 41])
    m.record_turn(
        "a", turn=t4, prompt_messages=[msg("user", "sub-task")], response_message=msg("assistant", "c")
    )
    samples = m.get_trajectory("a", base_sample=BASE, reward=0.5)
    assert [s.tokens for s in samples] == [[1, 2, 10, 3, 20], [1, 2, 10, 4, 30], [5, 6, 40, 41]]
    assert [s.loss_mask for s in samples] == [[1, 0, 1], [0, 0, 1], [1, 1]]  # "plan" trained once
    assert {s.group_index for s in samples} == {1} and {s.rollout_id for s in samples} == {3}
    for s in samples:
        assert_token_exact(s, [t1, t2, t3, t4])


def test_a_rewritten_short_reply_replaces_its_leaf_instead_of_training_twice():
    m = TrajectoryManager(fork_threshold_tokens=8)
    user = [msg("user", "u")]
    t1 = turn([1, 2], [10, 11])
    m.record_turn("a", turn=t1, prompt_messages=user, response_message=msg("assistant", "ok"))
    t2 = turn([1, 2, 10, 12, 30], [13])  # the reply came back as "ok " (a whitespace rewrite)
    m.record_turn(
        "a",
        turn=t2,
        prompt_messages=[*user, msg("assistant", "ok "), msg("user", "v")],
        response_message=msg("assistant", "z"),
    )
    (s,) = m.get_trajectory("a", base_sample=BASE)  # "ok" is now part of the prompt, not trained
    assert s.tokens == [1, 2, 10, 12, 30, 13] and s.loss_mask == [1] and s.response_length == 1


def test_max_sample_tokens_truncates_and_a_turn_with_bad_log_probs_is_refused():
    m = TrajectoryManager()
    m.record_turn(
        "a",
        turn=turn([1, 2], [10, 11, 12, 13]),
        prompt_messages=[msg("user", "u")],
        response_message=msg("assistant", "x"),
    )
    (s,) = m.get_trajectory("a", base_sample=BASE, max_sample_tokens=4)
    assert s.tokens == [1, 2, 10, 11] and s.loss_mask == [1, 1] and len(s.rollout_log_probs) == 2
    with pytest.raises(ValueError, match="2 log-probs for 3 output tokens"):
        m.record_turn(
            "b",
            turn=TurnRecord([1], [2, 3, 4], "stop", [0.0, 0.0]),
            prompt_messages=[msg("user", "u")],
            response_message=None,
        )


def test_random_sessions_keep_every_trained_token_exact():
    """Sessions of random appends, rewrites and branches: whatever the manager does, a trained
    token is one the engine produced after exactly the tokens before it."""
    rng = random.Random(0)
    for trial in range(30):
        m = TrajectoryManager(fork_threshold_tokens=rng.choice([0, 2, 5, 1024]))
        turns, histories = [], [([msg("user", f"task{trial}")], [1, 2, 3])]
        for k in range(8):
            messages, ids = rng.choice(histories)
            out = [100 + 10 * k + j for j in range(rng.randint(1, 4))]
            t = turn(list(ids), out, version=str(k))
            turns.append(t)
            reply = msg("assistant", f"r{k}")
            m.record_turn("s", turn=t, prompt_messages=messages, response_message=reply)
            nxt, next_ids = [*messages, reply, msg("user", f"u{k}")], [*ids, *out, 50 + k]
            if rng.random() < 0.3:  # the client rewrites the history: drift somewhere
                at = rng.randrange(len(next_ids))
                next_ids = [*next_ids[:at], 999, *next_ids[at + 1 :]]
                nxt = [*messages, msg("assistant", f"r{k}!"), msg("user", f"u{k}")]
            histories.append((nxt, next_ids))
        samples = m.get_trajectory("s", base_sample=BASE, reward=1.0)
        assert samples
        trained = 0
        for s in samples:
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            assert_token_exact(s, turns)
            trained += sum(s.loss_mask)
        assert trained <= sum(len(t.output_ids) for t in turns)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), [*range(500), -1]) == 500
