"""LoRA on the FSDP actor (slime.backends.fsdp.lora, slime.config.lora) on real gloo groups:
PEFT's adapters on the tiny model, only they train, the reference is the base model with the
adapters off (step-0 gates exact), the engines get the merged weights PEFT's own merge gives,
two ranks train like one, and the flags are checked."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")

from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch

ALL = ("all-linear",)


def lora_run(
    rank,
    world_size,
    init_method,
    model,
    targets=ALL,
    exclude=(),
    save=None,
    load=None,
    rollouts=2,
    hf_dir=None,
    adapter=None,
    bf16_reference_first=False,
    parameters=(),
    dropout=0.0,
):
    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.config.lora import LoRAConfig
    from slime.config.train import FSDPConfig

    lora = LoRAConfig(
        rank=4,
        alpha=8,
        target_modules=targets,
        target_parameters=parameters,
        dropout=dropout,
        exclude_modules=exclude,
        adapter_path=adapter,
        save_merged=hf_dir is not None,
    )
    cfg = dataclasses.replace(
        base_config(model, micro_batch_size=2), check_precision=True, load=load, lora=lora
    )
    if bf16_reference_first:  # the engine's log-probs are the old policy: the reference pass runs first
        cfg = dataclasses.replace(
            cfg,
            fsdp=FSDPConfig(param_dtype="bfloat16"),
            loss=dataclasses.replace(cfg.loss, use_rollout_logprobs=True, use_tis=False),
        )
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    info = actor.init()

    def full() -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in actor.backend.model.named_parameters()}

    result = {
        "info": info,
        "before": full(),
        "outputs": [],
        "trainable": sorted(n for n, p in actor.backend.model.named_parameters() if p.requires_grad),
        "optimized": sum(p.numel() for g in actor.backend.optimizer.param_groups for p in g["params"]),
    }
    first = 0 if info["resumed_rollout_id"] is None else info["resumed_rollout_id"] + 1
    for r in range(first, rollouts):
        result["outputs"].append(actor.train(r, make_batch(r)))
        if save and r == 0:
            actor.save(r, save)
    result["after"] = full()
    result["exported"] = {n: t.clone() for bucket in actor.export_weights(1 << 30) for n, t in bucket}
    result["shapes"] = actor.weight_shapes()
    if hf_dir:
        actor.save_hf(hf_dir)
    actor.close()
    return result


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora") / "adapter")


@pytest.fixture(scope="module")
def one_rank(tiny_model, adapter_dir):
    return run_ranks(1, lora_run, tiny_model, ALL, (), None, None, 2, adapter_dir)[0]


def test_only_the_adapters_train(one_rank, tiny_model):
    """PEFT froze the base weights: only lora_A / lora_B require gradients, the optimizer holds
    them alone, and after two rollouts every other weight is bit for bit the checkpoint's."""
    trainable = one_rank["trainable"]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    # all-linear: the 7 projections of every layer (A and B each), never the LM head
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(tiny_model).num_hidden_layers
    assert len(trainable) == layers * 7 * 2 and not any("lm_head" in n for n in trainable)
    assert one_rank["optimized"] == sum(one_rank["before"][n].numel() for n in trainable)
    changed = {n for n, t in one_rank["before"].items() if not torch.equal(t, one_rank["after"][n])}
    assert changed == set(trainable)  # B from its zero start, A once B is not zero


def test_step0_the_model_is_the_base_model_and_the_reference_is_exact(one_rank):
    """B starts at zero: the first step's forward, the log-prob pass and the reference (the
    adapters off) agree bitwise; after a step the adapters make the reference differ."""
    first, second = one_rank["outputs"]
    assert first.steps[0]["ppo_kl"] == 0.0 and first.steps[0]["kl_loss"] == 0.0
    assert first.precision["ref_max_abs_diff"] == 0.0 and first.precision["first_step_max_abs_diff"] == 0.0
    assert second.precision["ref_max_abs_diff"] > 0.0


def test_the_engines_get_peft_s_merged_weights(one_rank, tiny_model):
    """The push exports the base weights with each adapter merged, under the checkpoint's names:
    exactly what PEFT's merge_and_unload makes of the same adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    state = {"base_model.model." + n: t for n, t in one_rank["after"].items()}
    loaded = peft_model.load_state_dict(state, strict=False)
    assert not loaded.unexpected_keys
    merged = peft_model.merge_and_unload().state_dict()
    exported = one_rank["exported"]
    assert set(exported) == set(merged) - {"lm_head.weight"}  # tied: the LM head is the embedding
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)
    assert {n: tuple(t.shape) for n, t in exported.items()} == one_rank["shapes"]


def test_save_hf_writes_a_peft_adapter_that_peft_and_lora_adapter_path_load(
    one_rank, tiny_model, adapter_dir
):
    """--save-hf with LoRA: PeftModel.from_pretrained on the base model loads the directory and
    computes what the merged weights compute; --lora-adapter-path starts a run from it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    merged.load_state_dict(one_rank["exported"], strict=False)
    tokens = torch.tensor([make_batch(0).tokens[0]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits, merged(tokens).logits, rtol=0, atol=2e-5)
    again = run_ranks(1, lora_run, tiny_model, ALL, (), None, None, 0, None, adapter_dir)[0]
    for name, tensor in one_rank["after"].items():
        assert torch.equal(again["before"][name], tensor), name


def test_lora_save_merged_writes_the_merged_model_beside_the_adapter(one_rank, tiny_model, adapter_dir):
    """--lora-save-merged: <--save-hf>/merged is a plain Hugging Face checkpoint holding exactly the
    weights the merged push sends, and it computes what PEFT's merge_and_unload computes."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    merged_dir = os.path.join(adapter_dir, "merged")
    saved = {}
    for f in sorted(os.listdir(merged_dir)):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(merged_dir, f)))
    assert saved.keys() == one_rank["exported"].keys()
    for name, tensor in one_rank["exported"].items():
        assert torch.equal(saved[name], tensor.to(saved[name].dtype)), name
    model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
    tokens = torch.tensor([make_batch(0).tokens[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=2e-5)


def test_an_adapter_of_another_rank_is_refused(
    one_rank, tiny_model, adapter_dir, tmp_path
):  # one_rank writes it
    import json
    import shutil

    other = str(tmp_path / "r8")
    shutil.copytree(adapter_dir, other)
    config = json.loads(open(f"{other}/adapter_config.json").read())
    json.dump({**config, "r": 8}, open(f"{other}/adapter_config.json", "w"))
    with pytest.raises(Exception, match=r"was trained with r 8 \(the flags: --lora-rank 4\)"):
        run_ranks(1, lora_run, tiny_model, ALL, (), None, None, 0, None, other)
    json.dump({**config, "use_rslora": True}, open(f"{other}/adapter_config.json", "w"))
    with pytest.raises(Exception, match="has use_rslora True: only plain LoRA"):
        run_ranks(1, lora_run, tiny_model, ALL, (), None, None, 0, None, other)


def test_mixed_precision_trains_when_the_reference_pass_comes_first(tiny_model):
    """--fsdp-param-dtype bfloat16 with --use-rollout-logprobs: the first forward is the reference
    pass, with the adapters off; the adapters must still get their float32 gradients after it
    (FSDP2 fixes a group's gradient dtypes at its first forward)."""
    result = run_ranks(1, lora_run, tiny_model, ALL, (), None, None, 2, None, None, True)[0]
    steps = [s for o in result["outputs"] for s in o.steps]
    assert steps and all(s["grad_norm"] > 0 for s in steps)
    assert any(not torch.equal(result["before"][n], result["after"][n]) for n in result["trainable"])


def test_adapters_resume_only_onto_the_base_they_were_trained_on(tiny_model, tiny_model_b, tmp_path):
    save = str(tmp_path / "ckpt")
    run_ranks(1, lora_run, tiny_model, ALL, (), save, None, 1)
    with pytest.raises(Exception, match=r"holds LoRA adapters trained on .*, not on --hf-checkpoint"):
        run_ranks(1, lora_run, tiny_model_b, ALL, (), None, save, 1)


def test_two_ranks_train_like_one(one_rank, tiny_model):
    ranks = run_ranks(2, lora_run, tiny_model)
    for a, b in zip(one_rank["outputs"], ranks[0]["outputs"], strict=True):
        for sa, sb in zip(a.steps, b.steps, strict=True):
            for key in sa:
                assert sb[key] == pytest.approx(sa[key], rel=2e-5, abs=1e-6), key
    for name, tensor in one_rank["exported"].items():
        torch.testing.assert_close(ranks[0]["exported"][name], tensor, rtol=0, atol=1e-6)


def test_a_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(one_rank, tiny_model, tmp_path):
    """--save with LoRA: the adapters and their optimizer state only (the base is --hf-checkpoint);
    a resumed run trains rollout 1 to the same weights."""
    import torch.distributed.checkpoint as dcp

    save = str(tmp_path / "ckpt")
    run_ranks(1, lora_run, tiny_model, ALL, (), save)
    stored = dcp.FileSystemReader(str(tmp_path / "ckpt" / "iter_0000000" / "model_optim")).read_metadata()
    model_keys = [k for k in stored.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    resumed = run_ranks(1, lora_run, tiny_model, ALL, (), None, save)[0]
    assert resumed["info"]["resumed_rollout_id"] == 0
    assert resumed["outputs"][0].steps == one_rank["outputs"][1].steps
    for name, tensor in one_rank["after"].items():
        assert torch.equal(resumed["after"][name], tensor), name


@pytest.mark.parametrize(
    "targets, exclude, message",
    [
        (
            ("q_proj", "qkv_proj"),
            (),
            "--target-modules qkv_proj: no linear layer of this model has that name",
        ),
        (ALL, ("down_projection",), "--exclude-modules down_projection: no linear layer"),
        (("q_proj", "lm_head"), (), "--target-modules lm_head: this model ties its LM head to the embedding"),
    ],
    ids=["unknown-target", "unknown-exclude", "tied-lm-head"],
)
def test_a_module_name_the_model_lacks_is_refused(tiny_model, targets, exclude, message):
    with pytest.raises(Exception, match=message):
        run_ranks(1, lora_run, tiny_model, targets, exclude)


def test_named_targets_and_exclusions_choose_the_adapted_layers(tiny_model):
    """Plain names as PEFT matches them: the last part of a module's name, or a dotted tail."""
    targets = ("self_attn.q_proj", "v_proj", "down_proj")
    result = run_ranks(1, lora_run, tiny_model, targets, ("down_proj",), None, None, 1)[0]
    layers = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in result["trainable"]}
    assert layers == {"q_proj", "v_proj"}


def _parse(tiny_model, tmp_path, *flags):
    from slime.ray.cli import parse_args

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            "2",
            "--num-rollout",
            "1",
            "--rm-type",
            "math",
            *flags,
        ]
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--target-modules", "q_proj"], "--target-modules configures LoRA: give --lora-rank too"),
        (["--lora-rank", "8"], "--lora-rank 8 needs --target-modules"),
        (["--lora-rank", "8", "--target-modules", "all-linear,q_proj"], "give it alone"),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (
            ["--lora-rank", "8", "--target-modules", "q_proj", "--lora-dropout", "1.5"],
            "--lora-dropout must be",
        ),
        (
            ["--lora-rank", "8", "--target-modules", "q_proj", "--lora-adapter-path", "/nonexistent"],
            "has no adapter_config.json",
        ),
        (
            [
                "--lora-rank",
                "8",
                "--target-modules",
                "q_proj",
                "--enable-mtp-training",
                "--mtp-num-layers",
                "1",
                "--train-backend",
                "megatron",
            ],
            "--enable-mtp-training with --lora-rank: the multi-token prediction modules get no adapters",
        ),
        (
            ["--lora-rank", "8", "--target-modules", "q_proj", "--ref-load", "/elsewhere", "--use-kl-loss"],
            "a LoRA run's reference is its base model",
        ),
        (["--lora-push", "adapter"], "--lora-push configures LoRA: give --lora-rank too"),
        (
            [
                "--lora-rank",
                "8",
                "--target-modules",
                "q_proj",
                "--lora-push",
                "adapter",
                "--update-weight-transport",
                "disk",
            ],
            "--lora-push adapter with --update-weight-transport disk: the adapter is handed over as tensors",
        ),
        (
            [
                "--lora-rank",
                "8",
                "--target-modules",
                "q_proj",
                "--lora-push",
                "adapter",
                "--update-weight-transport",
                "distributed",
            ],
            "no engine route takes an adapter through a process group",
        ),
        (
            [
                "--lora-rank",
                "8",
                "--target-modules",
                "q_proj",
                "--lora-push",
                "adapter",
                "--rollout-backend",
                "sglang",
                "--fully-async",
            ],
            "--lora-push adapter to SGLang engines with --fully-async: upstream SGLang replaces",
        ),
        (
            ["--lora-rank", "8", "--target-modules", "q_proj", "--lora-save-merged"],
            "--lora-save-merged writes the merged model beside --save-hf's adapter: give --save-hf DIR",
        ),
    ],
    ids=[
        "target-without-rank",
        "rank-without-targets",
        "all-linear-and-more",
        "negative-rank",
        "dropout",
        "adapter-path",
        "mtp-training",
        "ref-load",
        "push-without-rank",
        "push-by-disk",
        "push-by-group",
        "push-to-sglang-fully-async",
        "save-merged-without-save-hf",
    ],
)
def test_lora_flags_are_checked(tiny_model, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        _parse(tiny_model, tmp_path, *flags)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err + captured.out


def test_the_adapter_push_launches_engines_that_serve_it_and_checks_it(tiny_model, tmp_path):
    """SGLang engines get --enable-lora with the rank and SGLang's short module names up front
    (unless --sglang-* flags gave them); the weight checks turn the adapter's checksums on."""
    from slime.config.lora import engine_launch_args

    lora = ["--lora-rank", "8", "--target-modules", "self_attn.q_proj,v_proj", "--lora-push", "adapter"]
    config = _parse(tiny_model, tmp_path, *lora, "--rollout-backend", "sglang", "--check-weight-update-equal")
    assert config.bridge.verify
    assert engine_launch_args(config.train.lora, sglang=True) == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
    ]
    given = ("--max-lora-rank=16", "--enable-lora")
    assert engine_launch_args(config.train.lora, True, given) == ["--lora-target-modules", "q_proj", "v_proj"]
    assert engine_launch_args(config.train.lora, sglang=False) == ["--enable-lora"]
    every = _parse(
        tiny_model, tmp_path, "--lora-rank", "8", "--target-modules", "all-linear", "--lora-push", "adapter"
    )
    assert engine_launch_args(every.train.lora, sglang=True)[-2:] == ["--lora-target-modules", "all"]
    assert not every.bridge.verify
    assert _parse(tiny_model, tmp_path, *lora, "--check-precision").bridge.verify
    merged = _parse(tiny_model, tmp_path, "--lora-rank", "8", "--target-modules", "q_proj")
    assert engine_launch_args(merged.train.lora, sglang=True) == []


def test_lora_flags_reach_the_actor_but_not_the_critic(tiny_model, tmp_path):
    config = _parse(
        tiny_model,
        tmp_path,
        "--lora-rank",
        "8",
        "--lora-alpha",
        "32",
        "--target-modules",
        "q_proj, v_proj",
        "--advantage-estimator",
        "ppo",
    )
    lo = config.train.lora
    assert (lo.rank, lo.alpha, lo.target_modules, lo.scaling) == (8, 32, ("q_proj", "v_proj"), 4.0)
    assert config.critic is not None and not config.critic.train.lora.enabled


def adapter_push_run(rank, world_size, init_method, model, urls):
    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.bridge.bridge import WeightBridge
    from slime.bridge.push import push_actor_weights
    from slime.bridge.topology import build_topology
    from slime.config.lora import LoRAConfig

    lora = LoRAConfig(rank=4, alpha=8, target_modules=ALL, push="adapter")
    actor = FSDPTrainActor(
        dataclasses.replace(base_config(model, micro_batch_size=2), lora=lora), rank, world_size, init_method
    )
    actor.init()
    actor.train(0, make_batch(0))
    # The CUDA-IPC push's code path with CPU buffers: engine j opens train rank j's copy.
    topology = build_topology("ipc", "cpu", urls, train_nodes=["127.0.0.1"] * world_size)
    bridge = WeightBridge.for_topology(topology, model) if rank == 0 else None
    stats = push_actor_weights(actor, bridge, "step-1", 1 << 20, verify=True, topology=topology)
    named, _ = actor.export_adapter()
    if bridge is not None:
        from slime.utils.async_utils import run_sync

        run_sync(bridge.close())
    actor.close()
    return {"stats": stats, "adapter": {n: t.clone() for n, t in named}}


def test_the_adapter_push_shares_each_ranks_copy_with_the_engine_on_its_gpu(tiny_model, tmp_path):
    """--lora-push adapter with the IPC topology (--colocate on GPU; CPU buffers here): every train
    rank shares its own copy of the adapter and engine j loads rank j's, checked against the
    trainer's sha256 as it arrives; each engine then holds the trainer's adapter (its dump)."""
    import json as _json

    from slime.config.lora import ADAPTER_NAME
    from slime.utils.peft_files import LORA_TENSOR, dump_name
    from tests.conftest import start_engine
    from tests.test_engine_server import raw_post

    engines = [
        start_engine(tiny_model, tmp_path, "--enable-lora", "--debug-dump-dir", str(tmp_path / "dump"))
        for j in range(2)
    ]
    try:
        rank0, rank1 = run_ranks(2, adapter_push_run, tiny_model, [e.url for e in engines])
        for j, e in enumerate(engines):
            status, _ = raw_post(e.url, "/slime/dump_parameters", _json.dumps({"path": str(j)}))
            assert status == 200
    finally:
        for e in engines:
            e.stop()
    assert rank1["stats"] is None and rank0["stats"]["transport"] == "lora_adapter_cpu_ipc"
    assert rank0["adapter"].keys() == rank1["adapter"].keys() and len(rank0["adapter"]) == 56
    moved = 0
    for name, tensor in rank0["adapter"].items():
        m = LORA_TENSOR.match(name)
        assert m is not None
        for j in range(2):
            held = torch.load(tmp_path / "dump" / str(j) / dump_name(ADAPTER_NAME, m.group(1), m.group(2)))
            assert torch.equal(held, tensor.to(held.dtype)), name
        moved += bool(m.group(2) == "B" and tensor.abs().sum() > 0)
    assert moved == 28  # every B left zero by the step: the engines hold the trained adapter


def test_the_adapter_config_keeps_module_names_as_lists():
    """adapter_config.json (and the config an adapter push sends) holds --target-modules and
    --exclude-modules as JSON lists, which PEFT reads back; the str of a Python set it held
    before matched no module, so PEFT excluded nothing on loading."""
    from peft import LoraConfig

    from slime.backends.fsdp.lora import adapter_config_dict, peft_config
    from slime.config.lora import LoRAConfig

    cfg = LoRAConfig(
        rank=4, alpha=8, target_modules=("q_proj", "v_proj"), exclude_modules=("layers.0.self_attn.q_proj",)
    )
    data = adapter_config_dict(peft_config(cfg, ["model.visual.blocks.0.attn.qkv"]), "base")
    assert data["target_modules"] == ["q_proj", "v_proj"]
    assert data["exclude_modules"] == ["layers.0.self_attn.q_proj", "model.visual.blocks.0.attn.qkv"]
    back = LoraConfig(**{k: v for k, v in data.items() if k in LoraConfig.__dataclass_fields__})
    assert back.exclude_modules == {"layers.0.self_attn.q_proj", "model.visual.blocks.0.attn.qkv"}
