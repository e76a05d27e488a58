"""The torch engine serving a vision-language model (tiny Qwen3-VL): SGLang's `image_data` on
/generate, a real server on loopback, compared with transformers' own model."""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image

from slime.engines.client import EngineClient, EngineError
from slime.utils.processing_utils import encode_image_for_rollout_engine, load_processor
from tests.conftest import start_engine

TEXT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many "
    "dots?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm, tmp_path_factory):
    proc = start_engine(tiny_vlm, tmp_path_factory.mktemp("engine-logs"))
    yield proc
    assert proc.stop() in (0, -15)


@pytest.fixture(scope="module")
def reference(tiny_vlm):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval(), load_processor(
        tiny_vlm
    )


def _inputs(processor, image):
    return processor(text=[TEXT], images=[image], return_tensors="pt")


def _teacher_forced(model, processor, image, output_ids, temperature):
    out = _inputs(processor, image)
    ids = torch.cat([out["input_ids"], torch.tensor([output_ids])], dim=1)
    with torch.no_grad():
        logits = (
            model(
                input_ids=ids,
                pixel_values=out["pixel_values"],
                image_grid_thw=out["image_grid_thw"],
                mm_token_type_ids=(ids == model.config.image_token_id).int(),
            )
            .logits[0]
            .float()
        )
    start = out["input_ids"].shape[1]
    logp = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def _run(url, fn):
    async def go():
        async with EngineClient(url) as c:
            return await fn(c)

    return asyncio.run(go())


def test_image_requests_sample_like_the_model_and_see_their_image(vlm_engine, reference, dot_images):
    model, processor = reference
    urls = [encode_image_for_rollout_engine(image) for image in dot_images]
    expanded = [[int(t) for t in _inputs(processor, image)["input_ids"][0]] for image in dot_images]
    sampling = {"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True}

    async def scenario(c):
        state = await c.get_server_info()
        assert state["runner"] == "BatchedVisionRunner"  # decode steps batch the rows
        before = state["internal_states"][0]["num_images_encoded"]
        by_text = await c.generate(
            text=[TEXT] * 4, image_data=[[u] for u in urls], sampling_params=sampling, return_logprob=True
        )
        by_ids = await c.generate(
            input_ids=expanded[0],
            image_data=[urls[0]],
            return_logprob=True,
            sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        )
        after = (await c.get_server_info())["internal_states"][0]["num_images_encoded"]
        info = await c.request("GET", "/model_info")
        return by_text, by_ids, after - before, info

    by_text, by_ids, encoded, info = _run(vlm_engine.url, scenario)
    assert encoded == 5  # the vision tower ran once per image, not per step
    assert info["has_image_understanding"] is True
    for image, ids, res in zip(dot_images, expanded, by_text, strict=True):
        assert res["meta_info"]["prompt_tokens"] == len(ids)  # the processor's expansion
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        ref = _teacher_forced(model, processor, image, res["output_ids"], 0.8)
        assert (got - ref).abs().max().item() < 1e-5
        other = _teacher_forced(
            model, processor, dot_images[(dot_images.index(image) + 1) % 4], res["output_ids"], 0.8
        )
        assert (
            got - other
        ).abs().max().item() > 1e-3  # another image gives other log-probs: the image is seen
    with torch.no_grad():
        out = _inputs(processor, dot_images[0])
        greedy = model.generate(**out, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert by_ids["output_ids"] == greedy[0, out["input_ids"].shape[1] :].tolist()


def test_a_row_keeps_its_rotary_offset_when_a_finished_row_is_refilled(vlm_engine, reference, dot_images):
    """An image prompt's rotary positions run behind its token positions (its image tokens share
    positions), a text prompt's do not. Three prompts decode together; when the first image
    request ends, its row is refilled by the text request, which takes its own offset along: the
    log-probs of all three are still a teacher-forced forward's."""
    model, processor = reference
    urls = [encode_image_for_rollout_engine(image) for image in dot_images[:2]]
    plain = "a picture of nothing"

    async def scenario(c):
        return await c.generate(
            text=[TEXT, TEXT, plain],
            image_data=[[urls[0]], [urls[1]], None],
            sampling_params=[
                {"max_new_tokens": n, "temperature": 0.8, "ignore_eos": True} for n in (3, 7, 10)
            ],
            return_logprob=True,
        )

    first, second, text = _run(vlm_engine.url, scenario)
    for image, res in ((dot_images[0], first), (dot_images[1], second)):
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        assert (got - _teacher_forced(model, processor, image, res["output_ids"], 0.8)).abs().max() < 1e-5
    ids = processor.tokenizer(plain)["input_ids"] + text["output_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    start = len(ids) - len(text["output_ids"])
    ref = torch.log_softmax(logits[start - 1 : -1] / 0.8, dim=-1).gather(
        -1, torch.tensor(text["output_ids"])[:, None]
    )
    got = torch.tensor([lp for lp, _, _ in text["meta_info"]["output_token_logprobs"]])
    assert len(got) == 10 and (got - ref[:, 0]).abs().max() < 1e-5


def test_bad_image_requests_are_refused_with_the_reason(vlm_engine, reference, dot_images, tmp_path):
    _, processor = reference
    url = encode_image_for_rollout_engine(dot_images[0])
    sp = {"max_new_tokens": 2}
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    cases = [
        (
            dict(text=TEXT, image_data=[url, url]),
            r"'text' holds 1 image placeholder\(s\) .* for 2 image\(s\)",
        ),
        (
            dict(input_ids=[5, pad, pad, 6], image_data=[url]),
            r"1 image\(s\) of \[4\] tokens, but the prompt holds 1 run",
        ),
        (
            dict(text=TEXT, image_data=[str(tmp_path / "none.png")]),
            r"'image_data'\[0\]: image file .* does not exist",
        ),
        (
            dict(text=TEXT, image_data=["data:image/png;base64,AAAA"]),
            r"'image_data'\[0\]: image .* cannot be decoded",
        ),
        (dict(input_ids=[5, pad, 6]), r"holds image tokens .* but the request has no 'image_data'"),
        (dict(text="a <|video_pad|> b"), "video tokens .*: videos are not supported"),
        (
            dict(text=TEXT, image_data=[encode_image_for_rollout_engine(Image.new("RGB", (1000, 4)))]),
            "the model's processor refuses an image .*aspect ratio",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(EngineError, match=message) as err:
            _run(vlm_engine.url, lambda c, kw=kwargs: c.generate(sampling_params=sp, **kw))
        assert err.value.status == 400


def test_image_data_to_a_text_model_is_refused(engine, dot_images):
    with pytest.raises(EngineError, match="'image_data': model_type 'qwen3' is a text model"):
        _run(
            engine.url,
            lambda c: c.generate(
                text="hi",
                image_data=[encode_image_for_rollout_engine(dot_images[0])],
                sampling_params={"max_new_tokens": 2},
            ),
        )


def test_the_engine_never_samples_image_placeholders(vlm_engine, reference, dot_images):
    """At temperature 4 the tiny model is near uniform over its 105 tokens: in 1,536 tokens an
    unbanned placeholder would come up about 30 times (each its log-prob: the whole vocabulary)."""
    model, processor = reference
    url = encode_image_for_rollout_engine(dot_images[2])
    sp = {"max_new_tokens": 96, "temperature": 4.0, "ignore_eos": True}
    out = _run(
        vlm_engine.url,
        lambda c: c.generate(
            text=[TEXT] * 16, image_data=[[url]] * 16, sampling_params=sp, return_logprob=True
        ),
    )
    banned = {model.config.image_token_id, model.config.video_token_id}
    assert not banned & {t for r in out for t in r["output_ids"]}
    ref = _teacher_forced(model, processor, dot_images[2], out[0]["output_ids"], 4.0)
    got = torch.tensor([lp for lp, _, _ in out[0]["meta_info"]["output_token_logprobs"]])
    assert (got - ref).abs().max().item() < 1e-5


def test_sampling_leaves_out_the_never_sampled_ids_only():
    from slime.engines.torch_engine.sampling import sample
    from slime.utils.sampling_params import SamplingParams

    logits = torch.zeros(64, 10)
    logits[:, 7] = 5.0  # the placeholder is the favourite
    params = [SamplingParams(max_new_tokens=1, temperature=1.0)] * 32 + [
        SamplingParams(max_new_tokens=1, temperature=0)
    ] * 32
    out = sample(logits, params, [None] * 64, torch.Generator().manual_seed(0), never=[7])
    assert 7 not in out.tokens
    full = torch.log_softmax(logits[0], -1)
    assert all(abs(lp - float(full[t])) < 1e-6 for t, lp in zip(out.tokens, out.logprobs))


def test_a_partial_sample_with_images_goes_on_like_one_request(vlm_engine, reference, dot_images):
    """--partial-rollout: an aborted sample continues from its tokens with its images."""
    from slime.rollout.default_generate import continue_sample
    from slime.utils.sample import Sample, Status

    model, processor = reference
    url = encode_image_for_rollout_engine(dot_images[3])
    prompt = [int(t) for t in _inputs(processor, dot_images[3])["input_ids"][0]]
    sp = {"max_new_tokens": 8, "temperature": 0.7, "ignore_eos": True}

    async def scenario(c):
        first = await c.generate(
            input_ids=prompt,
            image_data=[url],
            return_logprob=True,
            sampling_params={**sp, "max_new_tokens": 3},
        )
        sample = Sample(tokens=list(prompt), status=Status.ABORTED)
        sample.append_response_tokens(
            None,
            tokens=first["output_ids"],
            log_probs=[lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]],
        )
        sample.status = Status.ABORTED
        return await continue_sample(c, sample, sp, image_data=[url])

    sample = _run(vlm_engine.url, scenario)
    assert sample.response_length == 8 and len(sample.rollout_log_probs) == 8
    ref = _teacher_forced(model, processor, dot_images[3], sample.tokens[len(prompt) :], 0.7)
    assert (torch.tensor(sample.rollout_log_probs) - ref).abs().max().item() < 1e-5


def test_abort_with_images_in_flight(vlm_engine, dot_images):
    url = encode_image_for_rollout_engine(dot_images[1])

    async def scenario(c):
        sp = {"max_new_tokens": 400, "ignore_eos": True}
        task = asyncio.create_task(
            c.generate(text=TEXT, image_data=[url], sampling_params=sp, rid="img-victim", return_logprob=True)
        )
        while (await c.get_server_info())["internal_states"][0]["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        assert (await c.abort_request("img-victim"))["num_aborted"] == 1
        aborted = await task
        again = await c.generate(
            text=TEXT, image_data=[url], sampling_params={"max_new_tokens": 3, "temperature": 0}
        )
        return aborted, again

    aborted, again = _run(vlm_engine.url, scenario)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and len(aborted["output_ids"]) < 400
    assert len(again["output_ids"]) == 3  # the engine goes on serving images
