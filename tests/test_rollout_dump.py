"""Rollout dumps: templates, the weights_only round trip, format and tokenizer checks, subsampling."""

from __future__ import annotations

import pytest
import torch

from slime.rollout.dump import (
    FORMAT_VERSION,
    DumpError,
    check_fingerprint,
    load_dump,
    save_dump,
    subsample,
    tokenizer_fingerprint,
)
from slime.utils.files import template_problem
from slime.utils.sample import Sample, Status


def samples(n_groups=3, n=2):
    out = []
    for g in range(n_groups):
        for k in range(n):
            s = Sample(
                index=len(out),
                group_index=g,
                prompt=f"{g}+1=",
                tokens=[5, 6, 7],
                response="7",
                response_length=1,
                label=str(g + 1),
                reward={"acc": float(k), "len": 1},
                rollout_log_probs=[-0.25],
                status=Status.COMPLETED,
                weight_versions=["3"],
                metadata={"prompt_index": g},
            )
            out.append(s.to_dict())
    return out


def test_template_needs_rollout_id_and_only_known_fields():
    assert template_problem("d/r_{rollout_id}.pt", "--x") is None
    assert "must contain {rollout_id}" in template_problem("d/r.pt", "--save-debug-rollout-data")
    assert "--save-debug-rollout-data" in template_problem("d/r.pt", "--save-debug-rollout-data")
    assert "unknown fields ['step']" in template_problem("d/{rollout_id}_{step}.pt", "--x")
    assert "{rank}" in template_problem("d/{rollout_id}.pt", "--x", ("rollout_id", "rank"))
    assert "not a valid template" in template_problem("d/{rollout_id.pt", "--x")


def test_round_trip_is_weights_only_and_atomic(tmp_path):
    path = save_dump(
        str(tmp_path / "sub" / "r_{rollout_id}.pt"), 4, samples(), {"tokenizer_fingerprint": "ab"}
    )
    assert path.endswith("r_4.pt") and sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["r_4.pt"]
    raw = torch.load(path, weights_only=True)
    assert raw["format_version"] == FORMAT_VERSION and raw["rollout_id"] == 4
    back = [Sample.from_dict(d) for d in load_dump(path)["samples"]]
    assert [s.to_dict() for s in back] == samples()
    assert back[1].reward == {"acc": 1.0, "len": 1} and back[0].status == Status.COMPLETED


def test_traces_are_saved_and_loaded_back_weights_only(tmp_path):
    import numpy as np

    from slime.observability.trace_utils import build_sglang_meta_trace_attrs, trace_event, trace_span

    traced = [Sample.from_dict(d) for d in samples()]
    with trace_span(traced[:2], "generate_and_rm_group", attrs={"group_size": 2}):
        for s in traced[:2]:
            with trace_span(s, "sglang_generate", attrs={"max_new_tokens": 4}) as span:
                meta = {"e2e_latency": np.float64(0.25), "finish_reason": {"type": "stop"}, "id": "r"}
                span.update(build_sglang_meta_trace_attrs(meta))
            trace_event(s, "scored", attrs={"reward": s.reward})
    path = save_dump(str(tmp_path / "r_{rollout_id}.pt"), 0, [s.to_dict() for s in traced], {})
    rows = torch.load(path, weights_only=True)["samples"]
    assert rows[0]["trace"] == traced[0].trace and rows[2]["trace"] is None
    back = [Sample.from_dict(d) for d in load_dump(path)["samples"]]
    (scored,) = [e for e in back[1].trace["events"] if e["name"] == "scored"]
    assert back == traced and scored["attrs"] == {"reward": {"acc": 1.0, "len": 1}}
    assert back[0].trace["events"][2]["attrs"]["e2e_latency"] == 0.25


def test_bad_dumps_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(DumpError, match="does not exist"):
        load_dump(str(tmp_path / "nope.pt"))
    torch.save({"format_version": 99, "rollout_id": 0, "samples": [], "meta": {}}, tmp_path / "v.pt")
    with pytest.raises(DumpError, match=r"format_version 99; this build reads \[1, 2\] and slime"):
        load_dump(str(tmp_path / "v.pt"))
    torch.save({"tensor": torch.zeros(1), "fn": print}, tmp_path / "p.pt")  # not weights_only-loadable
    with pytest.raises(DumpError, match="weights_only=True"):
        load_dump(str(tmp_path / "p.pt"))


def test_tokenizer_fingerprint_mismatch_is_refused_unless_allowed(tokenizer):
    dump = {"meta": {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}}
    check_fingerprint(dump, "d.pt", tokenizer, allow_mismatch=False)
    dump["meta"]["tokenizer_fingerprint"] = "0" * 64
    with pytest.raises(DumpError, match="--allow-tokenizer-mismatch"):
        check_fingerprint(dump, "d.pt", tokenizer, allow_mismatch=False)
    check_fingerprint(dump, "d.pt", tokenizer, allow_mismatch=True)


def test_subsample_keeps_whole_groups_deterministically():
    all_samples = samples(n_groups=10, n=2)
    half = subsample(all_samples, 0.5)
    assert half == subsample(all_samples, 0.5) and len(half) == 10
    groups = [s["group_index"] for s in half]
    assert all(groups.count(g) == 2 for g in set(groups))  # never half a group
    assert subsample(all_samples, 1.0) is all_samples
    assert len(subsample(all_samples, 0.01)) == 2  # at least one group


def slime_written(rollout_id=3):
    """A dump in the layout slime's --save-debug-rollout-data writes: no format_version, no meta,
    samples as slime's Sample.to_dict() gives them (its field names, status as its value,
    spec_info and prefix_cache_info as dicts, tensors left as tensors)."""
    rows = []
    for g in range(2):
        for k in range(2):
            rows.append(
                {
                    "group_index": g,
                    "index": 2 * g + k,
                    "rollout_id": None,
                    "prompt": "1+1=",
                    "tokens": [5, 6, 7, 8],
                    "multimodal_inputs": None,
                    "multimodal_train_inputs": None,
                    "multimodal_train_input_id": None,
                    "apply_chat_template_kwargs": {},
                    "response": "2",
                    "response_length": 2,
                    "label": "2",
                    "reward": float(k),
                    "loss_mask": [1, 0],
                    "weight_versions": ["4", "5"],
                    "rollout_log_probs": [-0.5, 0.0],
                    "rollout_top_p_token_ids": None,
                    "rollout_top_p_token_offsets": None,
                    "rollout_routed_experts": torch.zeros(3, 2, 1, dtype=torch.int32),
                    "remove_sample": False,
                    "teacher_log_probs": None,
                    "status": "truncated",
                    "metadata": {"src": "x"},
                    "generate_function_path": None,
                    "custom_rm_path": None,
                    "train_metadata": {"loss": "a"},
                    "session_id": "s-1",
                    "non_generation_time": 0.5,
                    "spec_info": {
                        "spec_accept_token_num": 1,
                        "spec_draft_token_num": 2,
                        "spec_verify_ct": 1,
                        "completion_token_num": 2,
                    },
                    "prefix_cache_info": {"cached_tokens": 3, "total_prompt_tokens": 4},
                    "an_attribute_a_plugin_set": [1],
                }
            )
    return {"rollout_id": rollout_id, "samples": rows}


def test_a_dump_slime_wrote_loads_with_a_warning_and_keeps_every_field(tmp_path, caplog):
    torch.save(slime_written(), tmp_path / "s_3.pt")
    with caplog.at_level("WARNING"):
        dump = load_dump(str(tmp_path / "s_3.pt"))
    assert "written by slime" in caplog.text and "no tokenizer fingerprint" in caplog.text
    assert dump["format_version"] == "slime" and dump["rollout_id"] == 3
    check_fingerprint(dump, "s_3.pt", tokenizer=None, allow_mismatch=False)  # nothing to check against
    s = Sample.from_dict(dump["samples"][1])
    assert s.status is Status.TRUNCATED and s.weight_versions == ["4", "5"] and s.loss_mask == [1, 0]
    assert s.spec_info.spec_accept_rate == 0.5 and s.prefix_cache_info.prefix_cache_hit_rate == 0.75
    assert s.rollout_routed_experts.shape == (3, 2, 1) and s.train_metadata == {"loss": "a"}
    assert s.an_attribute_a_plugin_set == [1]  # kept as an attribute, as slime's from_dict does
    again = s.to_dict()
    original = slime_written()["samples"][1]
    # our extra field (per-token versions, docs/async.md) and the trace slime sets as an attribute
    # (None: never traced); slime's from_dict keeps unknown keys
    assert set(again) == set(original) | {"weight_version_spans", "trace"}
    assert again["weight_version_spans"] == [] and again["trace"] is None
    assert all(again[k] == original[k] for k in original if k != "rollout_routed_experts")


def test_our_dumps_use_slimes_field_names_and_values(tmp_path):
    """slime's loader does Sample.from_dict on each of dump["samples"]: every key slime's Sample
    has must be there, status as its value."""
    path = save_dump(str(tmp_path / "r_{rollout_id}.pt"), 0, samples(), {})
    row = torch.load(path, weights_only=True)["samples"][0]
    slime_fields = set(slime_written()["samples"][0]) - {"an_attribute_a_plugin_set"}
    assert slime_fields <= set(row), slime_fields - set(row)
    assert row["status"] == "completed" and row["weight_versions"] == ["3"]
    assert isinstance(row["spec_info"], dict) and isinstance(row["prefix_cache_info"], dict)


def test_version_1_dumps_still_load(tmp_path):
    rows = samples(1, 1)
    for r in rows:
        del r["weight_versions"]
        r["weight_version"] = "9"
    torch.save({"format_version": 1, "rollout_id": 0, "samples": rows, "meta": {}}, tmp_path / "v1.pt")
    s = Sample.from_dict(load_dump(str(tmp_path / "v1.pt"))["samples"][0])
    assert s.weight_versions == ["9"] and not hasattr(s, "weight_version")


def test_a_sample_without_what_a_replay_needs_is_named(tmp_path):
    bad = slime_written()
    del bad["samples"][2]["group_index"]
    torch.save(bad, tmp_path / "b.pt")
    with pytest.raises(DumpError, match=r"sample 2 has no \['group_index'\]"):
        load_dump(str(tmp_path / "b.pt"))
    torch.save({"samples": [], "rollout_id": "x"}, tmp_path / "c.pt")
    with pytest.raises(DumpError, match="no integer rollout_id"):
        load_dump(str(tmp_path / "c.pt"))


def test_a_replay_of_a_slime_dump_saves_a_dump_that_still_says_so():
    resaved = {
        "format_version": FORMAT_VERSION,
        "meta": {"written_by": "slime", "tokenizer_fingerprint": None},
    }
    check_fingerprint(resaved, "again.pt", tokenizer=None, allow_mismatch=False)  # never checked: not refused
    ours = {"format_version": FORMAT_VERSION, "meta": {"tokenizer_fingerprint": None}}
    with pytest.raises(DumpError, match="another tokenizer"):
        check_fingerprint(ours, "ours.pt", tokenizer=_NoVocab(), allow_mismatch=False)


class _NoVocab:
    all_special_tokens = ()
    chat_template = None

    def get_vocab(self):
        return {}
