"""Qwen3.5 as released: a vision-language model (model_type qwen3_5 / qwen3_5_moe,
`Qwen3_5ForConditionalGeneration`) whose language model is the gated delta-net hybrid. The tiny
checkpoint in the released layout, the torch engine serving it with and without images against
transformers' own model, and the FSDP actor training it on padded rows."""

from __future__ import annotations

import base64
import json
import math

import pytest
import torch

from slime.tools.tiny_vision import mrope_section
from slime.utils.model_families import FAMILIES, family, is_vision, packable
from slime.utils.processing_utils import encode_image_for_rollout_engine, load_processor
from tests.conftest import make_model, start_engine
from tests.dist_helpers import run_ranks
from tests.test_engine_moe import routed_by_layer
from tests.test_engine_vision import TEXT, _inputs, _run, _teacher_forced
from tests.test_fsdp_vision import _hf_log_probs, run, vision_batch

SIZE = ["--hidden-size", "64", "--num-heads", "2", "--num-kv-heads", "1", "--num-layers", "2"]
PLAIN = "<|im_start|>user\nHow many dots?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3_5_vl(tmp_path_factory) -> str:
    """A tiny Qwen3.5 vision-language checkpoint: a gated delta-net layer, then a gated attention
    layer, of width 64 (head dim 32), behind a 2-block vision tower; seed 0."""
    return make_model(str(tmp_path_factory.mktemp("models") / "qwen3_5_vl"), 0, "--arch", "qwen3_5_vl", *SIZE)


@pytest.fixture(scope="module")
def reference(qwen3_5_vl):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        qwen3_5_vl, dtype=torch.float32
    ).eval(), load_processor(qwen3_5_vl)


def test_the_tiny_checkpoint_is_the_released_layout_and_its_own_family(qwen3_5_vl, tmp_path):
    from safetensors import safe_open

    again = make_model(str(tmp_path / "again"), 0, "--arch", "qwen3_5_vl", *SIZE)
    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "tokenizer.json"):
        assert (tmp_path / "again" / name).read_bytes() == open(f"{qwen3_5_vl}/{name}", "rb").read(), name
    config = json.load(open(f"{again}/config.json"))
    assert config["model_type"] == "qwen3_5" and config["architectures"] == [
        "Qwen3_5ForConditionalGeneration"
    ]
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text"
    assert text["layer_types"] == ["linear_attention", "full_attention"]
    assert text["rope_parameters"]["mrope_section"] == [2, 1, 1]  # 32 x 0.25 / 2 frequencies, interleaved
    assert mrope_section(32) == [11, 11, 10]  # Qwen3.5-9B's: head dim 256, a quarter rotated
    with safe_open(f"{again}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in keys
    assert "model.visual.merger.linear_fc2.weight" in keys and "lm_head.weight" in keys
    assert not any("deepstack" in k for k in keys)
    # the released model_types are vision-language families; their text models are text families
    for released, text_type in (("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")):
        assert is_vision(released) and not is_vision(text_type)
        assert family(released) is FAMILIES[released] and not packable(released)
    processor = load_processor(again)
    assert type(processor).__name__.startswith("Qwen3VLProcessor")


def test_make_tiny_model_names_a_head_dim_too_small_to_split(tmp_path, capsys):
    from slime.tools.make_tiny_model import main

    with pytest.raises(SystemExit) as e:
        main(
            ["--out", str(tmp_path / "m"), "--arch", "qwen3_5_vl", "--hidden-size", "64", "--num-heads", "4"]
        )
    assert e.value.code == 2
    assert (
        "--arch qwen3_5_vl: the head dim (--hidden-size / --num-heads = 16) must be"
        in capsys.readouterr().err
    )


def test_the_engine_serves_it_like_the_model_with_and_without_images(
    qwen3_5_vl, reference, dot_images, tmp_path
):
    model, processor = reference
    urls = [encode_image_for_rollout_engine(image) for image in dot_images[:2]]
    expanded = [int(t) for t in _inputs(processor, dot_images[0])["input_ids"][0]]
    plain = processor.tokenizer.encode(PLAIN)
    sampling = {"max_new_tokens": 8, "temperature": 0.8, "ignore_eos": True}
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def scenario(c):
        by_text = await c.generate(
            text=[TEXT] * 2, image_data=[[u] for u in urls], sampling_params=sampling, return_logprob=True
        )
        by_ids = await c.generate(input_ids=expanded, image_data=[urls[0]], sampling_params=greedy)
        text_only = await c.generate(input_ids=plain, sampling_params=sampling, return_logprob=True)
        stats = (await c.get_server_info())["internal_states"][0]
        return by_text, by_ids, text_only, stats

    proc = start_engine(qwen3_5_vl, tmp_path)
    try:
        by_text, by_ids, text_only, stats = _run(proc.url, scenario)
    finally:
        assert proc.stop() in (0, -15)
    assert stats["num_images_encoded"] == 3  # once per image, not per decoded token
    for i, res in enumerate(by_text):
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        ref = _teacher_forced(model, processor, dot_images[i], res["output_ids"], 0.8)
        assert (got - ref).abs().max().item() < 1e-5, i
        other = _teacher_forced(model, processor, dot_images[1 - i], res["output_ids"], 0.8)
        assert (got - other).abs().max().item() > 1e-3  # the image is seen
    with torch.no_grad():  # the engine never samples the image placeholders: HF leaves them out too
        out = _inputs(processor, dot_images[0])
        hf = model.generate(
            **out,
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            suppress_tokens=[model.config.image_token_id, model.config.video_token_id],
        )
    assert by_ids["output_ids"] == hf[0, out["input_ids"].shape[1] :].tolist()
    # a prompt without an image (text RL on a released checkpoint): transformers' text positions
    ids = torch.tensor([plain + text_only["output_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(plain) - 1 : -1].float()
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(text_only["output_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in text_only["meta_info"]["output_token_logprobs"]])
    assert (got - ref).abs().max().item() < 1e-5


def test_fsdp_trains_it_on_padded_rows_like_the_model(qwen3_5_vl):
    # packed micro-batches asked for: the family's gated delta-net layers take padded rows
    result = run_ranks(1, run, qwen3_5_vl, False, False)[0]
    reference = _hf_log_probs(qwen3_5_vl, vision_batch(qwen3_5_vl))
    for i, ref in enumerate(reference):
        got = torch.as_tensor(result["log_probs"][i])
        assert (got - ref).abs().max().item() < 1e-5, i
        assert torch.equal(got, torch.as_tensor(result["ref"][i]))
    assert result["steps"][0]["kl_loss"] == 0.0
    visual = {n for n in result["names"] if ".visual." in n}
    assert visual and not result["moved"] & visual and result["moved"]  # the tower frozen by default
    assert result["pushed"] == result["names"]


def test_a_checkpoint_saved_without_its_image_processor_serves_text_and_refuses_images(qwen3_5_vl, tmp_path):
    """A fine-tune saved with the model and tokenizer only: the engine starts (text prompts run as
    on the whole checkpoint) and a request with images is refused naming what is missing."""
    import os
    import shutil

    from transformers import AutoConfig

    from slime.engines.protocol import ProtocolError, parse_generate
    from slime.engines.torch_engine.vision import ImagePreparer

    path = str(tmp_path / "no-processor")
    shutil.copytree(qwen3_5_vl, path)
    os.remove(os.path.join(path, "preprocessor_config.json"))
    preparer = ImagePreparer.of(path, AutoConfig.from_pretrained(path))
    assert preparer is not None and preparer.processor is None
    preparer.check_no_images([5, 6, 7])
    with pytest.raises(ProtocolError, match="image tokens"):
        preparer.check_no_images([5, preparer.image_token_id])
    requests, _ = parse_generate({"text": TEXT, "image_data": ["data:image/png;base64,AAAA"]})
    with pytest.raises(ProtocolError, match=r"has no image processor \(preprocessor_config.json\)"):
        preparer.prepare_request(requests[0])


def _text_only(rank, world_size, init_method, model):
    """The FSDP actor's log-probs of samples without images (no multimodal_train_inputs at all:
    text RL on a vision-language checkpoint)."""
    from slime.backends.fsdp.actor import FSDPTrainActor
    from tests.test_fsdp_actor import base_config, make_batch

    actor = FSDPTrainActor(base_config(model, micro_batch_size=2), rank, world_size, init_method)
    actor.init()
    batch = make_batch(0)
    out = {"batch": batch, "log_probs": actor.compute_log_probs(batch), "steps": actor.train(0, batch).steps}
    actor.close()
    return out


def test_fsdp_trains_prompts_without_images_like_the_model(qwen3_5_vl):
    from transformers import AutoModelForImageTextToText

    result = run_ranks(1, _text_only, qwen3_5_vl)[0]
    model = AutoModelForImageTextToText.from_pretrained(qwen3_5_vl, dtype=torch.float32).eval()
    batch = result["batch"]
    assert batch.multimodal_train_inputs is None
    for i, (ids, r) in enumerate(zip(batch.tokens, batch.response_lengths)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        n = len(ids)
        ref = torch.log_softmax(logits[n - r - 1 : n - 1], -1).gather(
            -1, torch.tensor(ids[n - r :])[:, None]
        )[:, 0]
        assert (torch.as_tensor(result["log_probs"][i]) - ref).abs().max().item() < 1e-5, i
    assert result["steps"][0]["kl_loss"] == 0.0 and result["steps"][0]["grad_norm"] > 0


def test_ppo_s_critic_on_prompts_without_images_is_transformers_token_classifier(qwen3_5_vl):
    """Text RL with PPO on a released checkpoint: the critic is Qwen3_5ForTokenClassification (the
    vision tower in it, frozen) with slime's fresh value head; its values equal transformers' and
    the value loss trains it."""
    from transformers import AutoModelForTokenClassification

    from tests.test_critic import critic_run
    from tests.test_fsdp_actor import base_config, make_batch

    result = run_ranks(1, critic_run, qwen3_5_vl)[0]
    hf = AutoModelForTokenClassification.from_pretrained(qwen3_5_vl, num_labels=1, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5ForTokenClassification"
    text = hf.config.get_text_config()
    g = torch.Generator().manual_seed(base_config(qwen3_5_vl).seed)
    with torch.no_grad():
        hf.score.weight.copy_(torch.randn(1, text.hidden_size, generator=g) * text.initializer_range)
        hf.score.bias.zero_()
    batch = make_batch(0)
    for i, (tokens, n) in enumerate(zip(batch.tokens, batch.response_lengths)):
        with torch.no_grad():
            out = hf(torch.tensor([tokens])).logits[0, len(tokens) - n - 1 : len(tokens) - 1, 0]
        assert (torch.tensor(result["values"][i]) - out).abs().max().item() < 1e-5, i
    steps = [s for o in result["outputs"] for s in o.steps]
    assert all(math.isfinite(s["value_loss"]) and s["grad_norm"] > 0 for s in steps)
    assert result["after"] != result["values"]  # it trained


def test_lora_adapts_the_language_model_only_and_pushes_peft_s_merge(qwen3_5_vl, tmp_path):
    """All-linear LoRA on the released layout: adapters on the language model's layers (none on the
    vision tower), only they train, step 0 is the base model exactly, and the push is PEFT's own
    merge of the adapter directory --save-hf writes (loaded by PEFT as it is)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from slime.backends.fsdp.lora import inject
    from slime.config.lora import LoRAConfig
    from slime.utils.errors import UsageError
    from tests.test_lora import ALL, lora_run

    adapter = str(tmp_path / "adapter")
    result = run_ranks(1, lora_run, qwen3_5_vl, ALL, (), None, None, 2, adapter)[0]  # --save-hf: the adapter
    first = result["outputs"][0]
    assert first.steps[0]["kl_loss"] == 0.0 and first.precision["ref_max_abs_diff"] == 0.0
    assert result["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
    assert not any(".visual." in n for n in result["trainable"])
    assert any(".linear_attn." in n for n in result["trainable"])  # the gated delta-nets are adapted too
    hf = AutoModelForImageTextToText.from_pretrained(qwen3_5_vl, dtype=torch.float32)
    base = {n: t.clone() for n, t in hf.state_dict().items()}
    peft_model = PeftModel.from_pretrained(hf, adapter)  # the saved config keeps the tower out
    assert not any("lora_A" in n and ".visual." in n for n, _ in peft_model.named_parameters())
    merged = peft_model.merge_and_unload().state_dict()
    assert result["exported"].keys() == merged.keys()
    for name, tensor in result["exported"].items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)
    moved = {n for n, t in result["exported"].items() if not torch.equal(t, base[n])}
    assert moved and not any(n.startswith("model.visual.") for n in moved)  # trained; the tower as it was
    with pytest.raises(UsageError, match="a vision-language model's vision tower takes no adapters"):
        inject(
            AutoModelForImageTextToText.from_pretrained(qwen3_5_vl),
            LoRAConfig(rank=4, alpha=8, target_modules=("linear_fc1",)),
        )


@pytest.mark.slow  # an engine (about 8 s); the engine's LoRA runs by default on text (test_engine_lora)
def test_the_engine_serves_a_lora_adapter_with_images_like_peft(qwen3_5_vl, reference, dot_images, tmp_path):
    """A PEFT adapter of the language model (the engine's --enable-lora): a request with an image
    and the adapter samples what PEFT's model with that image gives, within 1e-5."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    _, processor = reference
    hf = AutoModelForImageTextToText.from_pretrained(qwen3_5_vl, dtype=torch.float32)
    tower = [
        n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.visual.")
    ]
    torch.manual_seed(3)
    peft_model = get_peft_model(
        hf, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=tower)
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    adapter = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter)
    url = encode_image_for_rollout_engine(dot_images[1])

    async def scenario(c):
        return await c.generate(
            text=[TEXT, TEXT],
            image_data=[[url], [url]],
            lora_path=["a1", None],
            return_logprob=True,
            sampling_params={"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
        )

    proc = start_engine(qwen3_5_vl, tmp_path, "--enable-lora", "--lora-paths", f"a1={adapter}")
    try:
        with_adapter, base = _run(proc.url, scenario)
    finally:
        assert proc.stop() in (0, -15)
    peft_model.eval()
    for res, model in ((with_adapter, peft_model), (base, reference[0])):
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        assert (
            got - _teacher_forced(model, processor, dot_images[1], res["output_ids"], 1.0)
        ).abs().max() < 1e-5
    without = _teacher_forced(reference[0], processor, dot_images[1], with_adapter["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in with_adapter["meta_info"]["output_token_logprobs"]])
    assert (got - without).abs().max() > 1e-3  # the adapter changes the model


@pytest.mark.slow  # two gloo jobs; the same case of Qwen3-VL runs by default (test_fsdp_vision)
def test_a_trained_tower_on_two_ranks_trains_like_one(qwen3_5_vl):
    one = run_ranks(1, run, qwen3_5_vl, False, True, 1)[0]
    visual = {n for n in one["names"] if ".visual." in n}
    assert visual <= one["moved"]
    for rank in run_ranks(2, run, qwen3_5_vl, False, True, 1):
        assert rank["moved"] == one["moved"]
        for a, b in zip(one["steps"], rank["steps"], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key


@pytest.mark.slow  # an engine and a gloo job (about 8 s); the dense model's cases run by default
def test_the_moe_model_serves_and_trains_like_the_model(tmp_path, dot_images):
    """Qwen3.5-MoE as released (its experts fused, as transformers keeps them)."""
    from transformers import AutoModelForImageTextToText

    path = make_model(str(tmp_path / "moe"), 0, "--arch", "qwen3_5_moe_vl", *SIZE)
    assert json.load(open(f"{path}/config.json"))["model_type"] == "qwen3_5_moe"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = load_processor(path)
    url = encode_image_for_rollout_engine(dot_images[2])

    async def scenario(c):
        return await c.generate(
            text=TEXT,
            image_data=[url],
            return_logprob=True,
            return_routed_experts=True,
            sampling_params={"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
        )

    proc = start_engine(path, tmp_path, "--enable-return-routed-experts")
    try:
        res = _run(proc.url, scenario)
    finally:
        assert proc.stop() in (0, -15)
    layers = model.model.language_model.layers
    with routed_by_layer(layers) as chosen:
        ref = _teacher_forced(model, processor, dot_images[2], res["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
    assert (got - ref).abs().max() < 1e-5
    # The experts of every token but the last (prompt and image tokens included), as the model routes them
    raw = base64.b64decode(res["meta_info"]["routed_experts"])
    routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(
        -1, len(layers), model.config.text_config.num_experts_per_tok
    )
    want = torch.stack([chosen[li] for li in range(len(layers))], dim=1).to(torch.int32)
    assert routed.shape[0] == want.shape[0] - 1 and torch.equal(routed, want[:-1])
    result = run_ranks(1, run, path, True, False)[0]
    for i, ref in enumerate(_hf_log_probs(path, vision_batch(path))):
        assert (torch.as_tensor(result["log_probs"][i]) - ref).abs().max().item() < 1e-5, i


def test_megatrons_layout_of_the_released_checkpoint_is_its_text_models(qwen3_5_vl):
    """The Megatron backend builds the released checkpoint's language model
    (tests/test_megatron_vision_language.py trains it), tied or not as transformers ties the whole
    model: by its own tie_word_embeddings, not text_config's."""
    pytest.importorskip("megatron.core")
    from transformers import AutoConfig

    from slime.backends.megatron.convert import Layout

    config = AutoConfig.from_pretrained(qwen3_5_vl)
    layout = Layout.from_hf_config(config)
    assert layout.model_type == "qwen3_5_text" and layout.num_layers == config.text_config.num_hidden_layers
    assert not layout.tied_embeddings
    config.tie_word_embeddings, config.text_config.tie_word_embeddings = True, False
    assert Layout.from_hf_config(config).tied_embeddings


@pytest.mark.slow  # a whole job, about 30 s each; the Qwen3-VL job runs by default (test_vision_e2e)
@pytest.mark.e2e
@pytest.mark.parametrize(
    "lora", [[], ["--lora-rank", "4", "--target-modules", "all-linear", "--lr", "1e-3"]], ids=["full", "lora"]
)
def test_a_job_trains_it_with_engine_and_trainer_agreeing(qwen3_5_vl, tmp_path, lora):
    """train.py with --multimodal-keys on the released layout, fully or with LoRA (the merged
    push): real Ray, a torch engine, a gloo train rank; the trainer's log-probs of rollout 0 are
    the engine's, images included."""
    from slime.tools.make_vision_task import main
    from tests.test_loop_e2e import run_job
    from tests.test_vision_e2e import KEYS

    task = str(tmp_path / "task")
    assert main(["--out", task, "--train-size", "8", "--eval-size", "4", "--sft-size", "0"]) == 0
    proc = run_job(
        "train.py",
        qwen3_5_vl,
        f"{task}/train.jsonl",
        tmp_path,
        *KEYS,
        "--rm-type",
        "exact",
        "--rollout-max-response-len",
        "2",
        "--check-precision",
        *lora,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--check-precision: passed at rollout 0" in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert len(steps) == 2 and steps[0]["rollout/train_rollout_logprob_abs_diff_max"] < 1e-5


def test_what_the_released_checkpoints_lack_is_refused_when_parsed(qwen3_5_vl, tmp_path, capsys):
    """PPO's critic on prompts with images or of the MoE (transformers has no token classifier of
    it) and LoRA on the vision tower: exit 2 naming the model, before anything starts; the MoE's
    routing replay and LoRA are accepted (its experts read from its language model's config)."""
    from tests.test_flag_surface import base, error

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    images = ["--apply-chat-template", "--multimodal-keys", '{"image": "images"}', "--input-key", "prompt"]
    err = error(capsys, base(qwen3_5_vl, str(prompts), "--advantage-estimator", "ppo", *images))
    assert (
        "--advantage-estimator ppo with --multimodal-keys: PPO's critic on prompts with images is not built"
        in err
    )
    lora = ["--lora-rank", "4", "--target-modules", "all-linear"]
    err = error(
        capsys, base(qwen3_5_vl, str(prompts), *lora, "--train-vision-model", "--train-backend", "fsdp")
    )
    assert "--train-vision-model with --lora-rank: the adapters are the language model's" in err
    moe = make_model(str(tmp_path / "moe"), 0, "--arch", "qwen3_5_moe_vl", *SIZE)
    capsys.readouterr()
    err = error(capsys, base(moe, str(prompts), "--advantage-estimator", "ppo"))
    assert (
        "the critic starts from" in err
        and "not built with FSDP (transformers has no token classifier of it)" in err
    )
    from slime.ray.cli import parse_args  # routing replay is built: its language model's routers

    assert parse_args(
        base(moe, str(prompts), "--use-rollout-routing-replay")
    ).train.moe.use_rollout_routing_replay
    assert parse_args(base(moe, str(prompts), *lora)).train.lora.rank == 4  # LoRA: its language model's
