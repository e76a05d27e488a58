"""Request parsing: SGLang field names, batch forms, and errors that name the field."""

from __future__ import annotations

import pytest

from slime.engines.protocol import (
    CompletionRequest,
    ProtocolError,
    SamplingParams,
    parse_generate,
    parse_tensor_specs,
)


def test_single_and_batch_forms():
    reqs, batch = parse_generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "rid": "r"})
    assert not batch and reqs[0].rid == "r" and reqs[0].input_ids == (1, 2)
    assert reqs[0].sampling_params.max_new_tokens == 3
    reqs, batch = parse_generate(
        {
            "text": ["a", "b"],
            "sampling_params": [{"temperature": 0}, {"top_k": 5}],
            "rid": ["x", "y"],
            "return_logprob": True,
        }
    )
    assert batch and [r.rid for r in reqs] == ["x", "y"] and all(r.return_logprob for r in reqs)
    assert reqs[0].sampling_params.greedy and reqs[1].sampling_params.top_k == 5


def test_defaults_follow_sglang():
    p = SamplingParams.from_json({})
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.skip_special_tokens and not p.ignore_eos
    assert SamplingParams.from_json({"seed": 3}).sampling_seed == 3


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, "x"]}, "input_ids"),
        ({}, "exactly one"),
        ({"text": "a", "stream": True}, "stream"),
        ({"text": ["a", "b"], "rid": "same"}, "rid"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "distinct"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"text": "a", "sampling_params": {"min_p": 2}}, "min_p"),
        ({"text": "a", "sampling_params": {"stop": [1]}}, "stop"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
        ({"text": "a", "sampling_params": {"temperature": float("nan")}}, "temperature"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": "a", "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),
        ({"text": "a", "sampling_params": {"sampling_seed": -1}}, "sampling_seed"),
        ({"input_ids": [[1], []]}, "input_ids"),
    ],
)
def test_errors_name_the_field(body, needle):
    with pytest.raises(ProtocolError) as info:
        parse_generate(body)
    assert needle in info.value.message and info.value.status == 400


def test_tensor_specs():
    specs = parse_tensor_specs(
        {"names": ["a", "b"], "dtypes": ["torch.bfloat16", "float32"], "shapes": [[2], []]}
    )
    assert specs[0].dtype == "bfloat16" and specs[1].shape == ()
    with pytest.raises(ProtocolError, match="dtypes"):
        parse_tensor_specs({"names": ["a"], "dtypes": [], "shapes": [[1]]})


def test_completion_request():
    req = CompletionRequest.from_json({"prompt": [1, 2, 3], "n": 2, "logprobs": 1, "stop": "\n"})
    assert req.prompts == [[1, 2, 3]] and req.n == 2 and req.stop == ("\n",)
    with pytest.raises(ProtocolError, match="'n'"):
        CompletionRequest.from_json({"prompt": "x", "n": 0})


def test_seed_bounds():
    assert SamplingParams.from_json({"sampling_seed": 2**64 - 1}).sampling_seed == 2**64 - 1
    assert CompletionRequest.from_json({"prompt": "x", "seed": 2**64 - 2, "n": 2}).seed == 2**64 - 2
    with pytest.raises(ProtocolError, match="'seed'"):
        CompletionRequest.from_json({"prompt": "x", "seed": 2**64 - 1, "n": 2})


@pytest.mark.parametrize("prompt", [[[]], [[1.5]], [["a"]], [[True]], [[1], "a"], [1, False], []])
def test_completion_prompt_forms_refused(prompt):
    with pytest.raises(ProtocolError, match="prompt"):
        CompletionRequest.from_json({"prompt": prompt})


def test_completion_prompt_forms_accepted():
    assert CompletionRequest.from_json({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    assert CompletionRequest.from_json({"prompt": ["a", "b"]}).prompts == ["a", "b"]
