"""Named evaluation sets: --eval-prompt-data NAME PATH pairs and --eval-config with slime's schema,
precedence (dataset entry > defaults > --eval-* flag > rollout flag) and metric names."""

from __future__ import annotations

import json

import pytest

from slime.config.eval_sets import EvalDataset
from slime.config.records import RolloutConfig
from slime.config.rollout import DataConfig, SamplingConfig
from slime.ray.cli import parse_args
from slime.rollout.summary import eval_metrics
from slime.utils.errors import UsageError
from slime.utils.sample import Sample, Status


@pytest.fixture
def files(tmp_path):
    out = {}
    for name in ("train", "aime", "gsm"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"prompt": "1+1=", "label": "2", "q": "2+2=", "a": "4"}) + "\n")
        out[name] = str(path)
    return out


def base(files, *extra):
    return [
        "--hf-checkpoint",
        "/m",
        "--prompt-data",
        files["train"],
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--rm-type",
        "math",
        "--rollout-temperature",
        "0.8",
        "--eval-interval",
        "5",
        *extra,
    ]


def test_name_path_pairs_make_named_sets(files):
    cfg = parse_args(
        base(
            files,
            "--eval-prompt-data",
            "aime",
            files["aime"],
            "gsm",
            files["gsm"],
            "--n-samples-per-eval-prompt",
            "4",
            "--eval-top-p",
            "0.9",
        )
    )
    aime, gsm = cfg.eval.datasets
    assert (aime.name, aime.data.prompt_data, gsm.name, gsm.data.prompt_data) == (
        "aime",
        files["aime"],
        "gsm",
        files["gsm"],
    )
    for ds in (aime, gsm):
        # --eval-* flags first, then the rollout's
        assert (ds.sampling.n_samples_per_prompt, ds.sampling.top_p, ds.sampling.temperature) == (4, 0.9, 0.8)
        assert ds.data.shuffle is False and ds.prefix == f"eval/{ds.name}"


def test_eval_config_precedence_entry_then_defaults_then_flags(files, tmp_path):
    yaml_path = tmp_path / "eval.yaml"
    yaml_path.write_text(
        f"""
eval:
  defaults:
    temperature: 0.6
    n_samples_per_eval_prompt: 2
  datasets:
    - name: aime
      path: {files["aime"]}
      n_samples_per_eval_prompt: 16
      max_response_len: 64
      rm_type: exact
    - name: gsm
      path: {files["gsm"]}
      input_key: q
      label_key: a
"""
    )
    cfg = parse_args(
        base(
            files,
            "--eval-config",
            str(yaml_path),
            "--eval-prompt-data",
            files["gsm"],
            "--eval-max-response-len",
            "32",
            "--eval-top-k",
            "7",
        )
    )
    aime, gsm = cfg.eval.datasets  # --eval-config wins over --eval-prompt-data
    assert (aime.sampling.n_samples_per_prompt, aime.sampling.max_response_len, aime.rm_type) == (
        16,
        64,
        "exact",
    )
    assert (gsm.sampling.n_samples_per_prompt, gsm.sampling.max_response_len, gsm.rm_type) == (2, 32, None)
    assert aime.sampling.temperature == gsm.sampling.temperature == 0.6  # defaults over --rollout-temperature
    assert aime.sampling.top_k == gsm.sampling.top_k == 7
    assert (gsm.data.input_key, gsm.data.label_key, aime.data.input_key) == ("q", "a", "prompt")
    # The mapping form of `datasets`, without the `eval:` root.
    yaml_path.write_text(f"datasets:\n  aime:\n    path: {files['aime']}\n")
    (only,) = parse_args(base(files, "--eval-config", str(yaml_path))).eval.datasets
    assert only.name == "aime" and only.sampling.temperature == 0.8


@pytest.mark.parametrize(
    "text, message",
    [
        ("datasets: []", "`datasets` must be a non-empty list"),
        ("datasets:\n  - name: a\n", "datasets[0] needs a `name` and a `path`"),
        ("datasets:\n  - {name: a, path: P, tempreature: 1}\n", "unknown key `tempreature`"),
        (
            "datasets:\n  - {name: a, path: P, multimodal_keys: images}\n",
            "--multimodal-keys must map a modality to a field name",
        ),
        ("datasets:\n  - {name: a, path: P}\n  - {name: a, path: P}\n", "repeat a name"),
        ("[1, 2", "not valid YAML"),
        (
            "datasets:\n  - {name: a, path: P, rm_type: dapo}\n",
            "evaluation set a: rm_type dapo returns a dict",
        ),
        (
            "datasets:\n  - {name: a, path: P, top_k: 0}\n",
            "evaluation set 'a': its top_k must be -1 (disabled) or >= 1, got 0: the engines refuse",
        ),
    ],
)
def test_bad_eval_configs_exit_2_naming_the_file_and_key(files, tmp_path, capsys, text, message):
    yaml_path = tmp_path / "eval.yaml"
    yaml_path.write_text(text.replace("P", files["aime"]))
    with pytest.raises(SystemExit) as e:
        parse_args(base(files, "--eval-config", str(yaml_path)))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_an_odd_number_of_values_is_refused(files, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(base(files, "--eval-prompt-data", "aime", files["aime"], "gsm"))
    assert e.value.code == 2 and "one PATH or NAME PATH pairs; got 3 values" in capsys.readouterr().err


def _sample(reward: float, status: Status = Status.COMPLETED) -> Sample:
    s = Sample(prompt="p", label="2", index=0, group_index=0)
    s.reward, s.status, s.response_length = reward, status, 3
    return s


def test_named_sets_log_slimes_metric_names_and_the_unnamed_set_keeps_ours():
    samples = [_sample(1.0), _sample(0.0, Status.TRUNCATED), _sample(1.0), _sample(1.0)]
    data, sampling = DataConfig("x.jsonl"), SamplingConfig()
    cfg = RolloutConfig(data=data, sampling=sampling, rollout_batch_size=1, num_rollout=1, num_epoch=None)
    named = eval_metrics(EvalDataset("aime", data, sampling), samples, cfg)
    assert named["eval/aime"] == named["eval/aime/reward_mean"] == 0.75
    assert named["eval/aime-truncated_ratio"] == named["eval/aime/truncated_ratio"] == 0.25
    assert named["eval/aime/accuracy"] == 0.75
    unnamed = eval_metrics(EvalDataset(None, data, sampling), samples, cfg)
    assert unnamed["eval/accuracy"] == 0.75 and not any(k.startswith("eval/aime") for k in unnamed)


def test_metric_flags_pass_at_k_reward_categories_and_the_eval_reward_key():
    import dataclasses

    rewards = [{"acc": 1.0, "score": 0.5, "why": "ok"}, {"acc": 0.0, "score": 0.0, "why": "format"}] * 2
    samples = []
    for i, r in enumerate(rewards):
        s = _sample(0.0)
        s.reward, s.group_index, s.index = r, i // 2, i
        samples.append(s)
    data, sampling = DataConfig("x.jsonl"), SamplingConfig()
    cfg = RolloutConfig(
        data=data,
        sampling=sampling,
        rollout_batch_size=2,
        num_rollout=1,
        num_epoch=None,
        reward_key="score",
        eval_reward_key="acc",
        log_passrate=True,
        log_reward_category="why",
    )
    m = eval_metrics(EvalDataset("aime", data, sampling), samples, cfg)
    assert m["eval/aime"] == 0.5  # the acc entry, not the trained score
    # each group: one of two passes -> pass@1 = 1/2, pass@2 = 1
    assert m["eval/aime-pass@1"] == 0.5 and m["eval/aime-pass@2"] == 1.0
    assert m["eval/aime/error_cat/ok"] == 0.5 and m["eval/aime/error_cat/format"] == 0.5
    with pytest.raises(UsageError, match="--log-reward-category missing"):
        eval_metrics(
            EvalDataset("aime", data, sampling),
            samples,
            dataclasses.replace(cfg, log_reward_category="missing"),
        )


def test_pass_at_k_is_the_unbiased_estimate():
    from math import comb

    from slime.rollout.summary import pass_at_k

    samples = []
    for i, r in enumerate([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]):  # one group of 8, 2 pass
        s = _sample(r)
        s.index = i
        samples.append(s)
    got = pass_at_k(samples, None)
    assert sorted(got) == ["pass@1", "pass@2", "pass@4", "pass@8"]
    for k in (1, 2, 4, 8):
        assert got[f"pass@{k}"] == pytest.approx(1 - comb(6, k) / comb(8, k))


def test_multi_turn_metrics_count_raw_and_trained_response_tokens():
    from slime.rollout.summary import multi_turn_metrics

    a, b = _sample(1.0), _sample(0.0)
    a.response_length, a.loss_mask, a.metadata = 6, [1, 1, 0, 0, 1, 1], {"round_number": 2}
    b.response_length, b.loss_mask, b.metadata = 4, [1, 1, 1, 1], {"round_number": 1}
    m = multi_turn_metrics([a, b], max_response_len=6)
    assert (
        m["raw_response_length/response_length_mean"] == 5
        and m["raw_response_length/response_length_max"] == 6
    )
    assert (
        m["wo_obs_response_length/response_length_mean"] == 4
        and m["wo_obs_response_length/response_length_min"] == 4
    )
    assert m["raw_response_length/response_length_clip_ratio"] == 0.5
    assert m["multi_turn_metric/round_number_mean"] == 1.5
