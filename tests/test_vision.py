"""Vision-language inputs apart from the engine and the trainer: the tiny Qwen3-VL checkpoint,
slime.utils.processing_utils, --multimodal-keys rows, samples and dumps with images."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re

import pytest
import torch

from slime.rollout.data import DataError, PromptDataset, check_prompt_file
from slime.utils import processing_utils
from slime.utils.processing_utils import ImageError, load_image


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_tiny_vlm_same_seed_same_bytes_and_loads_with_its_processor(tiny_vlm, tmp_path):
    from transformers import AutoModelForImageTextToText

    from tests.conftest import make_model

    again = make_model(
        str(tmp_path / "again"), 0, "--arch", "qwen3_vl", "--hidden-size", "64", "--num-layers", "2"
    )
    for name in (
        "model.safetensors",
        "config.json",
        "preprocessor_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    ):
        a = hashlib.sha256(open(os.path.join(tiny_vlm, name), "rb").read()).hexdigest()
        assert a == hashlib.sha256(open(os.path.join(again, name), "rb").read()).hexdigest(), name
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    config = json.load(open(os.path.join(tiny_vlm, "config.json")))
    processor = processing_utils.load_processor(tiny_vlm)
    tok = processor.tokenizer
    assert (
        config["image_token_id"]
        == tok.convert_tokens_to_ids("<|image_pad|>")
        < config["text_config"]["vocab_size"]
    )
    # a text model's ids are unchanged: the vision markers come after them
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and config["image_token_id"] > 100


def test_chat_template_places_images_and_the_processor_expands_them(tiny_vlm, dot_images):
    processor = processing_utils.load_processor(tiny_vlm)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": dot_images[0]},
                {"type": "text", "text": "How many dots?"},
            ],
        }
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many dots?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    images = processing_utils.process_vision_info(messages, processor)
    out = processor(text=text, **processing_utils.build_processor_kwargs(images))
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert isinstance(out["input_ids"], list)  # text as lists, images as tensors (slime's convention)
    assert out["input_ids"][0].count(pad) == 4  # 64 x 64: 4 x 4 patches of 16, merged 2 x 2
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]] and out["pixel_values"].shape == (
        16,
        3 * 2 * 16 * 16,
    )


def test_load_image_reads_every_form_and_names_what_is_wrong(dot_images, tmp_path):
    image = dot_images[2]
    path = tmp_path / "dots.png"
    path.write_bytes(_png(image))
    encoded = base64.b64encode(_png(image)).decode()
    pixels = processing_utils.image_to_tensor(image)
    for source in (
        image,
        str(path),
        "data:image/png;base64," + encoded,
        encoded,
        {"type": "image", "image": str(path)},
    ):
        assert torch.equal(processing_utils.image_to_tensor(load_image(source)), pixels)
    url = processing_utils.encode_image_for_rollout_engine(image)
    assert url.startswith("data:image/png;base64,") and torch.equal(
        processing_utils.image_to_tensor(url), pixels
    )
    assert torch.equal(processing_utils.image_to_tensor(processing_utils.tensor_to_image(pixels)), pixels)
    with pytest.raises(ImageError, match="does not exist"):
        load_image(str(tmp_path / "missing.png"))
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    with pytest.raises(ImageError, match=r"bad.png.*cannot be decoded"):
        load_image(str(tmp_path / "bad.png"))
    with pytest.raises(ImageError, match=r"cannot be fetched.*give its path or base64"):
        load_image("http://127.0.0.1:9/nothing-listens-here.png")


def test_slimes_processing_utils_names_are_at_slimes_path():
    from slime.utils.processing_utils import (  # noqa: F401
        build_processor_kwargs,
        encode_image_for_rollout_engine,
        load_processor,
        load_tokenizer,
        process_vision_info,
    )

    kwargs = build_processor_kwargs({"images": ["x"], "images_kwargs": {"max_pixels": 4}})
    assert kwargs["images"] == ["x"] and kwargs["images_kwargs"] == {"max_pixels": 4, "return_tensors": "pt"}
    assert kwargs["text_kwargs"]["return_tensors"] is None and kwargs["videos_kwargs"] == {
        "return_tensors": "pt"
    }


def test_a_text_checkpoint_has_no_processor(tiny_model):
    assert processing_utils.load_processor(tiny_model) is None


def _data(tmp_path, rows, **over):
    from slime.config.rollout import DataConfig

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = dict(prompt_data=str(path), multimodal_keys={"image": "images"}, apply_chat_template=True)
    return DataConfig(**{**fields, **over})


def test_multimodal_keys_rows_become_prompts_with_expanded_ids(tiny_vlm, dot_images, tmp_path):
    from transformers import AutoTokenizer

    files = []
    for i, image in enumerate(dot_images[:2]):
        files.append(str(tmp_path / f"{i}.png"))
        image.save(files[-1])
    rows = [
        {"prompt": "<image>How many?", "images": [files[0]], "label": "1"},
        {"prompt": "Left <image> right <image>, more?", "images": files, "label": "2"},
        {"prompt": "no image here", "images": [], "label": "0"},
    ]
    cfg = _data(tmp_path, rows)
    assert check_prompt_file(cfg) == 3
    processor = processing_utils.load_processor(tiny_vlm)
    ds = PromptDataset(cfg, AutoTokenizer.from_pretrained(tiny_vlm), processor=processor)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [len(p.images) for p in ds.prompts] == [1, 2, 0]
    assert [p.token_ids.count(pad) for p in ds.prompts] == [4, 8, 0]
    from slime.rollout.rollout_function import DataSource

    group = DataSource(ds, 2).get_samples(1)[0]  # what a --rollout-function-path function is given
    assert group[0].tokens == ds.prompts[0].token_ids and len(group[0].multimodal_inputs["images"]) == 1
    assert group[0].multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    second = ds.prompts[1].text
    assert second.index("Left ") < second.index("<|vision_start|>") < second.index(" right ")
    assert torch.equal(
        processing_utils.image_to_tensor(ds.prompts[1].images[1]),
        processing_utils.image_to_tensor(dot_images[1]),
    )


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"prompt": "<image><image>", "images": ["a.png"]},
            "more <image> placeholders than field 'images' has",
        ),
        ({"prompt": "none", "images": ["a.png"]}, "field 'images' has 1 images but the prompt has only 0"),
        (
            {"prompt": "<image>", "images": ["MISSING.png"]},
            r"rows.jsonl:2: field 'images'\[0\]: image file .*MISSING.png",
        ),
    ],
)
def test_bad_image_rows_name_the_row_and_the_file_before_anything_starts(dot_images, tmp_path, row, message):
    dot_images[0].save(tmp_path / "a.png")
    row = {**row, "images": [str(tmp_path / n) for n in row["images"]], "label": "1"}
    good = {"prompt": "<image>", "images": [str(tmp_path / "a.png")], "label": "1"}
    with pytest.raises(DataError, match=message):
        check_prompt_file(_data(tmp_path, [good, row]))


def test_parquet_image_records_and_bytes_are_images(tiny_vlm, dot_images, tmp_path):
    """Hugging Face datasets store an image column as {"bytes", "path"} records (geo3k's parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from slime.config.rollout import DataConfig

    record = {"bytes": _png(dot_images[1]), "path": None}
    table = pa.table({"prompt": ["<image>How many?"], "images": [[record]], "label": ["2"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    cfg = DataConfig(
        prompt_data=str(tmp_path / "rows.parquet"),
        multimodal_keys={"image": "images"},
        apply_chat_template=True,
    )
    processor = processing_utils.load_processor(tiny_vlm)
    assert check_prompt_file(cfg, processor=processor) == 1
    prompt = PromptDataset(cfg, AutoTokenizer.from_pretrained(tiny_vlm), processor=processor).prompts[0]
    assert torch.equal(
        processing_utils.image_to_tensor(prompt.images[0]), processing_utils.image_to_tensor(dot_images[1])
    )
    assert torch.equal(
        processing_utils.image_to_tensor(_png(dot_images[1])), processing_utils.image_to_tensor(dot_images[1])
    )


def test_images_the_processor_refuses_and_per_image_sizes_stop_the_start(tiny_vlm, tmp_path):
    from PIL import Image

    processor = processing_utils.load_processor(tiny_vlm)
    Image.new("RGB", (1000, 4)).save(tmp_path / "strip.png")
    Image.new("RGB", (64, 64)).save(tmp_path / "ok.png")
    strip = {"prompt": "<image>", "images": [str(tmp_path / "strip.png")], "label": "1"}
    with pytest.raises(DataError, match=r"rows.jsonl:1: field 'images'\[0\]: .*aspect ratio"):
        check_prompt_file(_data(tmp_path, [strip]), processor=processor)
    sized = {
        "prompt": "<image>",
        "images": [{"type": "image", "image": str(tmp_path / "ok.png"), "max_pixels": 4096}],
        "label": "1",
    }
    with pytest.raises(
        DataError, match=r"\['max_pixels'\] \(Qwen-VL's per-image sizes\) are not applied here"
    ):
        check_prompt_file(_data(tmp_path, [sized]))
    with pytest.raises(ImageError, match="'img/0001': no such file, and not base64 of an image"):
        load_image("img/0001")


def test_the_driver_checks_images_with_the_checkpoints_processor(tiny_model, tiny_vlm, dot_images, tmp_path):
    from slime.ray.inputs import _check_prompts

    dot_images[0].save(tmp_path / "a.png")
    cfg = _data(tmp_path, [{"prompt": "<image>", "images": [str(tmp_path / "a.png")], "label": "1"}])
    _check_prompts(cfg, "--prompt-data", tiny_vlm)
    from PIL import Image

    Image.new("RGB", (1000, 4)).save(tmp_path / "strip.png")  # only the image processor refuses it
    strip = _data(tmp_path, [{"prompt": "<image>", "images": [str(tmp_path / "strip.png")], "label": "1"}])
    with pytest.raises(DataError, match="aspect ratio"):
        _check_prompts(strip, "--prompt-data", tiny_vlm)
    with pytest.raises(
        DataError, match=r"model_type 'qwen3', which runs as a text model here; images are built for qwen3_vl"
    ):
        _check_prompts(cfg, "--prompt-data", tiny_model)


def test_multimodal_keys_is_checked_when_parsed(tmp_path):
    with pytest.raises(ValueError, match="images only"):
        _data(tmp_path, [], multimodal_keys={"video": "clips"})
    with pytest.raises(ValueError, match="must map a modality to a field name"):
        _data(tmp_path, [], multimodal_keys="images")
    with pytest.raises(ValueError, match="--multimodal-keys needs --apply-chat-template"):
        _data(tmp_path, [], apply_chat_template=False)


def test_a_dump_keeps_images_as_pixels_and_loads_with_weights_only(tiny_vlm, dot_images, tmp_path):
    from slime.rollout.dump import load_dump, save_dump
    from slime.utils.processing_utils import prompt_images
    from slime.utils.sample import Sample, samples_to_batch

    processor = processing_utils.load_processor(tiny_vlm)
    images = prompt_images(processor, [dot_images[3]])
    sample = Sample(
        prompt="p",
        tokens=[1, 2, 3],
        response_length=1,
        reward=1.0,
        multimodal_inputs={"images": [dot_images[3]]},
        multimodal_train_inputs=images.train_inputs,
    )
    path = save_dump(str(tmp_path / "r{rollout_id}.pt"), 0, [sample.to_dict()], {})
    dump = load_dump(path)  # weights_only=True
    stored = dump["samples"][0]["multimodal_inputs"]["images"][0]
    assert stored.dtype == torch.uint8 and stored.shape == (64, 64, 3)
    back = Sample.from_dict(dump["samples"][0])
    assert torch.equal(
        processing_utils.image_to_tensor(back.multimodal_inputs["images"][0]),
        processing_utils.image_to_tensor(dot_images[3]),
    )
    batch = samples_to_batch([back])
    assert batch.multimodal_train_inputs is not None
    assert torch.equal(batch.multimodal_train_inputs[0]["pixel_values"], images.train_inputs["pixel_values"])
    assert (
        samples_to_batch(
            [Sample(prompt="p", tokens=[1, 2], response_length=1, reward=0.0)]
        ).multimodal_train_inputs
        is None
    )


def test_a_sample_keeps_image_references_as_given_and_they_are_checked_where_used(tiny_vlm, tmp_path):
    """A dump written where the images are must load where they are not (a replay, an inspection):
    references are serialized as they are, and the processor names the missing one when used."""
    from slime.rollout.dump import load_dump, save_dump
    from slime.utils.processing_utils import prompt_images
    from slime.utils.sample import Sample

    missing = str(tmp_path / "elsewhere.png")
    refs = {"images": ["some_url", missing, b"raw bytes"]}
    sample = Sample(prompt="p", tokens=[1, 2], response_length=1, reward=0.0, multimodal_inputs=refs)
    assert Sample.from_dict(sample.to_dict()).multimodal_inputs == refs
    path = save_dump(str(tmp_path / "r{rollout_id}.pt"), 0, [sample.to_dict()], {})
    back = Sample.from_dict(load_dump(path)["samples"][0])  # weights_only=True
    assert back.multimodal_inputs == refs
    processor = processing_utils.load_processor(tiny_vlm)
    with pytest.raises(ImageError, match=re.escape(f"image file {missing!r} does not exist")):
        prompt_images(processor, back.multimodal_inputs["images"][1:2])
