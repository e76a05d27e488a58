"""OpenAI image content parts through the agent adapter to a vision-language model (tiny
Qwen3-VL on a real torch engine): the turn's images reach the engine, the held tokens are reused
with images in the history, and the session's sample trains with its images."""

from __future__ import annotations

import pytest
import torch

from slime.agent.adapters import OpenAIAdapter
from slime.utils.processing_utils import encode_image_for_rollout_engine, load_processor
from slime.utils.sample import Sample
from tests.test_agent_adapters import Served, chat
from tests.test_engine_vision import vlm_engine  # noqa: F401 - a fixture

openai = pytest.importorskip("openai")

SAMPLING = {"temperature": 1.0, "max_new_tokens": 6}


@pytest.fixture
def served_vlm(vlm_engine, tiny_vlm):
    processor = load_processor(tiny_vlm)
    s = Served(OpenAIAdapter(tokenizer=processor.tokenizer, sglang_url=vlm_engine.url, processor=processor))
    yield s
    s.close()


def _part(image):
    return {"type": "image_url", "image_url": {"url": encode_image_for_rollout_engine(image)}}


def test_image_parts_reach_the_model_and_the_sample_trains_with_them(served_vlm, tiny_vlm, dot_images):
    from transformers import AutoModelForImageTextToText

    s = served_vlm
    s.adapter.open_session("v1", sampling_defaults=SAMPLING)
    messages = [
        {"role": "user", "content": [_part(dot_images[0]), {"type": "text", "text": "How many dots?"}]}
    ]
    first = chat(s.url, "v1", messages, max_tokens=6)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": [{"type": "text", "text": "And here?"}, _part(dot_images[2])]},
    ]
    chat(s.url, "v1", messages, max_tokens=6)
    turns = s.turns
    pad = s.adapter.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [t.prompt_ids.count(pad) for t in turns] == [4, 8]  # each image's 4 tokens, in place
    assert [len(t.images) for t in turns] == [1, 2]
    # the second turn continues the first one's tokens (held, with its image), no re-rendering
    assert turns[1].prompt_ids[: len(turns[0].prompt_ids) + len(turns[0].output_ids)] == (
        turns[0].prompt_ids + turns[0].output_ids
    )
    (sample,) = s.finish("v1", reward=1.0)
    assert sample.metadata["rendered_in_full"] == 0
    assert len(sample.multimodal_inputs["images"]) == 2
    assert sample.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    # the engine saw the images: its log-probs are a teacher-forced forward's with them
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    ids = torch.tensor([sample.tokens])
    with torch.no_grad():
        logits = model(
            input_ids=ids, mm_token_type_ids=(ids == pad).int(), **sample.multimodal_train_inputs
        ).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    start = len(sample.tokens) - sample.response_length
    trained = [i for i, m in enumerate(sample.loss_mask) if m]
    ref = torch.stack([logp[start + i - 1, sample.tokens[start + i]] for i in trained])
    got = torch.tensor([sample.rollout_log_probs[i] for i in trained])
    assert (got - ref).abs().max().item() < 1e-5


def test_a_bad_image_part_is_a_400_naming_it(served_vlm):
    s = served_vlm
    s.adapter.open_session("v2", sampling_defaults=SAMPLING)
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"image 0 of the messages: image .* cannot be decoded"):
        chat(s.url, "v2", [{"role": "user", "content": [bad, {"type": "text", "text": "?"}]}], max_tokens=2)


def test_an_image_arriving_later_in_a_tool_message_and_a_cut_sample_keep_ids_and_images_together(
    served_vlm, dot_images
):
    s = served_vlm
    s.adapter.open_session("v3", sampling_defaults=SAMPLING)
    messages = [{"role": "user", "content": "Look at the screen."}]
    first = chat(s.url, "v3", messages, max_tokens=4)  # no image yet
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "tool", "content": [{"type": "text", "text": "screen:"}, _part(dot_images[1])]},
    ]
    chat(s.url, "v3", messages, max_tokens=4)
    turns = s.turns
    pad = s.adapter.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [len(t.images) for t in turns] == [0, 1] and turns[1].prompt_ids.count(pad) == 4
    # cut inside the image's tokens: the sample keeps neither the run's start nor the image
    cut = turns[1].prompt_ids.index(pad) + 2
    # (finish_session cuts at the session's max_context_tokens: the manager's own cut, directly)
    (sample,) = s.adapter.manager.get_trajectory(
        "v3", base_sample=Sample(index=0, prompt="p"), max_sample_tokens=cut
    )
    assert (
        pad not in sample.tokens
        and sample.multimodal_inputs is None
        and sample.multimodal_train_inputs is None
    )


def test_image_parts_must_be_data_or_http_urls(served_vlm, tmp_path, dot_images):
    s = served_vlm
    s.adapter.open_session("v4", sampling_defaults=SAMPLING)
    dot_images[0].save(tmp_path / "host.png")
    part = {"type": "image_url", "image_url": {"url": str(tmp_path / "host.png")}}
    with pytest.raises(openai.BadRequestError, match="give a data URL or an http"):
        chat(s.url, "v4", [{"role": "user", "content": [part]}], max_tokens=2)


def test_anthropic_image_blocks_in_user_messages_and_tool_results_reach_the_model(
    vlm_engine,
    tiny_vlm,
    dot_images,
):
    """Claude-style clients send base64 image blocks (a screenshot tool returns one in its
    tool_result): the same images as OpenAI parts, counted by count_tokens as the engine runs them."""
    import base64
    import io

    anthropic = pytest.importorskip("anthropic")
    from slime.agent.adapters import AnthropicAdapter

    def block(image):
        png = io.BytesIO()
        image.save(png, format="PNG")
        return {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/png",
                "data": base64.b64encode(png.getvalue()).decode(),
            },
        }

    processor = load_processor(tiny_vlm)
    s = Served(
        AnthropicAdapter(tokenizer=processor.tokenizer, sglang_url=vlm_engine.url, processor=processor)
    )
    try:
        s.adapter.open_session("a1", sampling_defaults=SAMPLING)
        client = anthropic.Anthropic(base_url=s.url, api_key="a1", max_retries=0)
        messages = [
            {"role": "user", "content": [block(dot_images[0]), {"type": "text", "text": "How many dots?"}]}
        ]
        first = client.messages.create(model="tiny", max_tokens=4, messages=messages)
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "screen:"}, block(dot_images[3])],
                    }
                ],
            },
        ]
        count = client.messages.count_tokens(model="tiny", messages=messages).input_tokens
        client.messages.create(model="tiny", max_tokens=4, messages=messages)
        turns = s.turns
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert first.usage.input_tokens == len(turns[0].prompt_ids)
        assert [t.prompt_ids.count(pad) for t in turns] == [4, 8] and [len(t.images) for t in turns] == [1, 2]
        assert count == len(turns[1].prompt_ids)  # the images' tokens counted as the engine runs them
        with pytest.raises(anthropic.BadRequestError, match="source of type 'file'"):
            client.messages.create(
                model="tiny",
                max_tokens=2,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f1"}}],
                    }
                ],
            )
    finally:
        s.close()
