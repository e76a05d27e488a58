"""The Sample record: slime's fields, its methods as plugins call them, and the batch it becomes."""

from __future__ import annotations

import base64

import pytest
import torch

from slime.utils.sample import Sample, Status, samples_to_batch
from slime.utils.types import Sample as PluginSample


def test_one_class_with_the_nested_names_plugins_use():
    assert PluginSample is Sample and Sample.Status is Status
    assert Sample.Status.COMPLETED.value == "completed" and Sample.Status("aborted") is Status.ABORTED
    s = Sample()
    assert s.status is Sample.Status.PENDING and s.weight_versions == [] and s.remove_sample is False
    assert isinstance(s.spec_info, Sample.SpecInfo) and isinstance(
        s.prefix_cache_info, Sample.PrefixCacheInfo
    )
    assert Sample().weight_versions is not s.weight_versions  # no shared default list


def test_a_multi_turn_response_keeps_masks_and_log_probs_aligned():
    s = Sample(tokens=[1, 2], loss_mask=[])
    s.append_response_tokens(None, tokens=[10, 11], log_probs=[-0.5, -0.25], text="ab")
    s.append_response_tokens(None, tokens=torch.tensor([20, 21, 22]), trainable=False, text="<tool>")
    meta = {"finish_reason": {"type": "stop"}, "weight_version": 7, "cached_tokens": 2, "prompt_tokens": 7}
    s.append_response_tokens(None, tokens=[30], log_probs=torch.tensor([-1.0]), meta_info=meta, text="c")
    assert s.tokens == [1, 2, 10, 11, 20, 21, 22, 30] and s.response == "ab<tool>c" and s.response_length == 6
    assert s.loss_mask == [1, 1, 0, 0, 0, 1] and s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s.effective_response_length == 3
    assert s.status is Status.COMPLETED and s.weight_versions == ["7"]
    assert s.prefix_cache_info.prefix_cache_hit_rate == pytest.approx(2 / 7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tokens": [1, 2], "log_probs": [-1.0]}, "1 log_probs for 2 tokens"),
        ({"tokens": [1]}, "need their rollout log_probs"),
        ({"tokens": [1], "log_probs": [-1.0], "trainable": False}, "take no log_probs"),
    ],
)
def test_misaligned_appends_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sample().append_response_tokens(None, **kwargs)


def test_trainable_tokens_cannot_follow_a_response_without_log_probs():
    s = Sample(tokens=[1, 5], response_length=1)
    with pytest.raises(ValueError, match="without rollout_log_probs"):
        s.append_response_tokens(None, tokens=[6], log_probs=[-1.0])


@pytest.mark.parametrize("finish, status", [("length", Status.TRUNCATED), ("abort", Status.ABORTED)])
def test_the_finish_reason_sets_the_status(finish, status):
    s = Sample(tokens=[1])
    s.append_response_tokens(
        None, tokens=[2], log_probs=[-1.0], meta_info={"finish_reason": {"type": finish}}
    )
    assert s.status is status
    s2 = Sample(tokens=[1])
    s2.append_response_tokens(
        None,
        tokens=[2],
        log_probs=[-1.0],
        meta_info={"finish_reason": {"type": finish}},
        update_terminal_info=False,
    )
    assert s2.status is Status.PENDING


def _b64(values):
    return base64.b64encode(torch.tensor(values, dtype=torch.int32).numpy().tobytes()).decode()


def test_routed_experts_from_sglang_are_decoded_and_continued():
    class Args:
        num_layers, moe_router_topk = 2, 1

    s = Sample(tokens=[1, 2])  # 2 prompt tokens + 2 response tokens: 3 positions routed
    s.append_response_tokens(
        Args, tokens=[3, 4], log_probs=[-1.0, -1.0], meta_info={"routed_experts": _b64([0, 1, 2, 3, 4, 5])}
    )
    assert s.rollout_routed_experts.tolist() == [[[0], [1]], [[2], [3]], [[4], [5]]]
    # A continuation re-routes from row 2 on: rows before it are kept.
    s.append_response_tokens(
        Args,
        tokens=[5],
        log_probs=[-1.0],
        meta_info={"routed_experts": [9, 9, 8, 8], "routed_experts_start_len": 2},
    )
    assert s.rollout_routed_experts.tolist() == [[[0], [1]], [[2], [3]], [[9], [9]], [[8], [8]]]
    with pytest.raises(ValueError, match="do not fit 5 tokens x 2 layers"):
        s.append_response_tokens(Args, tokens=[6], log_probs=[-1.0], meta_info={"routed_experts": [1, 2]})


def test_top_p_replay_spans_grow_with_the_response():
    s = Sample(tokens=[1])
    meta = {"top_p_token_ids": [7, 8, 9], "top_p_token_offsets": [0, 2, 3]}
    s.append_response_tokens(None, tokens=[7, 9], log_probs=[-1.0, -1.0], meta_info=meta)
    s.append_response_tokens(None, tokens=[50], trainable=False)  # a tool token: an empty span
    s.append_response_tokens(
        None,
        tokens=[8],
        log_probs=[-1.0],
        meta_info={"top_p_kept_token_ids": _b64([8]), "top_p_kept_token_offsets": [0, 1]},
    )
    assert s.rollout_top_p_token_ids.tolist() == [7, 8, 9, 8]
    assert s.rollout_top_p_token_offsets.tolist() == [0, 2, 3, 3, 4]
    with pytest.raises(ValueError, match="do not fit 1 tokens"):
        s.append_response_tokens(
            None,
            tokens=[1],
            log_probs=[-1.0],
            meta_info={"top_p_token_ids": [1], "top_p_token_offsets": [0, 1, 1]},
        )


def test_round_trip_keeps_fields_and_attributes_and_copies():
    s = Sample(
        index=3,
        tokens=[1, 2],
        response_length=1,
        loss_mask=[1],
        reward={"acc": 1.0},
        status=Status.TRUNCATED,
        weight_versions=["1", "2"],
        train_metadata={"t": 1},
    )
    s.spec_info.add({"spec_accept_token_num": 3, "spec_draft_token_num": 4})
    s.extra = {"plugin": True}  # slime keeps attributes a plugin sets
    s.trace = {"version": 1, "trace_id": "t", "events": [{"type": "event", "name": "e", "ts": 1.0}]}
    d = s.to_dict()
    assert d["status"] == "truncated" and d["spec_info"]["spec_accept_token_num"] == 3 and d["extra"]
    d["tokens"].append(99)
    d["trace"]["events"].append({})
    assert s.tokens == [1, 2] and len(s.trace["events"]) == 1  # a deep copy
    back = Sample.from_dict(s.to_dict())
    assert back == s and back.extra == {"plugin": True} and back.spec_info.spec_accept_rate == 0.75


def test_remove_sample_masks_its_loss_but_keeps_its_reward():
    group = [Sample(index=i, tokens=[1, 2, 3], response_length=2, reward=float(i)) for i in range(2)]
    group[1].remove_sample = True
    batch = samples_to_batch(group)
    assert batch.loss_masks == [[1, 1], [0, 0]] and batch.rewards == [0.0, 1.0]


def test_a_loss_mask_of_the_wrong_length_is_named():
    with pytest.raises(ValueError, match="sample 4: loss_mask has 1 entries, response_length is 2"):
        samples_to_batch([Sample(index=4, tokens=[1, 2, 3], response_length=2, loss_mask=[1], reward=0.0)])
