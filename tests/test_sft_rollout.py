"""slime.utils.mask_utils (multi-turn loss masks) and slime.rollout.sft_rollout through the
rollout manager, on the tiny model's ChatML tokenizer and a template with a default system prompt."""

from __future__ import annotations

import copy
import json

import pytest

from slime.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths

CONVERSATION = [
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "5", "step_loss_mask": 0},  # a turn not to learn
    {"role": "tool", "content": "calc: 4"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "4"},
]


def ids(tokenizer, messages, **kw):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


@pytest.mark.parametrize("kind", ["qwen", "qwen3"])
def test_only_the_assistant_answers_count(tokenizer, kind):
    masks = MultiTurnLossMaskGenerator(tokenizer, kind)
    token_ids, mask = masks.get_loss_mask(CONVERSATION)
    assert token_ids == ids(tokenizer, CONVERSATION)  # the conversation as the template writes it
    assert len(mask) == len(token_ids)
    assert masks.get_text_from_loss_mask(token_ids, mask) == ["2<|im_end|>\n", "4<|im_end|>\n"]
    first = mask.index(1)
    assert tokenizer.decode(token_ids[:first]).endswith(
        "<|im_start|>assistant\n"
    )  # the header is not trained
    assert get_response_lengths([mask, [0, 0]]) == [len(mask) - first, 0]


def test_a_default_system_prompt_is_written_once(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou help.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    masks = MultiTurnLossMaskGenerator(tok, "qwen")
    assert masks.system_message_length == len(tok.encode("<|im_start|>system\nYou help.<|im_end|>\n"))
    token_ids, mask = masks.get_loss_mask(CONVERSATION[:2])
    assert token_ids == ids(tok, CONVERSATION[:2])
    assert masks.get_text_from_loss_mask(token_ids, mask) == ["2<|im_end|>\n"]
    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:2]]
    token_ids, _ = masks.get_loss_mask(with_system)
    assert token_ids == ids(tok, with_system) and "You help." not in tok.decode(token_ids)


def test_templates_that_rewrite_earlier_turns_are_refused(tokenizer):
    with pytest.raises(ValueError, match="--loss-mask-type 'qwen3_5' is not supported here"):
        MultiTurnLossMaskGenerator(tokenizer, "qwen3_5")


def test_sft_rollout_through_the_rollout_manager(tiny_model, tokenizer, tmp_path):
    from slime.ray.cli import parse_args
    from slime.rollout.dump import load_dump
    from slime.rollout.producer import RolloutProducer

    data = tmp_path / "sft.jsonl"
    rows = [CONVERSATION, [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}]]
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    dump = str(tmp_path / "r_{rollout_id}.pt")
    cfg = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            str(data),
            "--input-key",
            "messages",
            "--rollout-function-path",
            "slime.rollout.sft_rollout.generate_rollout",
            "--loss-mask-type",
            "qwen3",
            "--loss-type",
            "sft_loss",
            "--debug-train-only",
            "--rollout-batch-size",
            "2",
            "--num-rollout",
            "1",
            "--save-debug-rollout-data",
            dump,
        ]
    )
    rollout = RolloutProducer(cfg).generate(0)
    samples = load_dump(rollout.dump_path)["samples"]
    assert rollout.num_samples == 2 and [s["reward"] for s in samples] == [0, 0]
    for s, messages in zip(samples, rows):
        token_ids, mask = MultiTurnLossMaskGenerator(tokenizer, "qwen3").get_loss_mask(messages)
        first = mask.index(1)
        assert s["tokens"] == token_ids and s["response_length"] == len(token_ids) - first
        assert s["loss_mask"] == mask[first:] and s["status"] == "completed"


def test_list_prompts_without_a_chat_template_still_need_one_for_the_built_in_rollout(tiny_model, tmp_path):
    from slime.ray.cli import parse_args
    from slime.rollout.data import DataError, PromptDataset

    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION[:1], "label": "2"}) + "\n")
    cfg = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            str(data),
            "--input-key",
            "messages",
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            "--rm-type",
            "exact",
        ]
    )
    with pytest.raises(DataError, match="add --apply-chat-template"):
        PromptDataset(cfg.rollout.data, None)


def test_an_unsupported_loss_mask_type_is_named_at_parse_time(tiny_model, tmp_path, capsys):
    from slime.ray.cli import parse_args

    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(SystemExit) as e:
        parse_args(
            [
                "--hf-checkpoint",
                tiny_model,
                "--prompt-data",
                str(data),
                "--input-key",
                "messages",
                "--rollout-function-path",
                "slime.rollout.sft_rollout.generate_rollout",
                "--loss-mask-type",
                "qwen3_5",
                "--rollout-batch-size",
                "1",
                "--num-rollout",
                "1",
                "--loss-type",
                "sft_loss",
            ]
        )
    assert e.value.code == 2
    assert "--loss-mask-type qwen3_5 is not supported here" in capsys.readouterr().err
