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
    template_problem,
    tokenizer_fingerprint,
)  # fmt: skip
from slime.rollout.sample import Sample, Status


def samples(n_groups=3, n=2):
    out = []
    for g in range(n_groups):
        for k in range(n):
            s = Sample(index=len(out), group_index=g, prompt=f"{g}+1=", tokens=[5, 6, 7], response="7",
                       response_length=1, label=str(g + 1), reward={"acc": float(k), "len": 1},
                       rollout_log_probs=[-0.25], status=Status.COMPLETED, weight_version="3",
                       metadata={"prompt_index": g})  # fmt: skip
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


def test_bad_dumps_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(DumpError, match="does not exist"):
        load_dump(str(tmp_path / "nope.pt"))
    torch.save({"format_version": 99, "rollout_id": 0, "samples": [], "meta": {}}, tmp_path / "v.pt")
    with pytest.raises(DumpError, match="format_version 99; this build reads 1"):
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
