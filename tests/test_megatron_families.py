"""GLM-4, GLM-4.5+, DeepSeek-V3, Qwen3-Next and Qwen3.5 in the Megatron backend, each from
`make_tiny_model --arch`: HF <-> Megatron conversion bitwise both ways with slime's Megatron names,
and megatron-core's GPTModel on converted weights giving Hugging Face's logits (GLM-4's interleaved
partial rotary and sandwich norms, GLM-4.5's sigmoid routing with the expert bias and a shared
expert, DeepSeek-V3's multi-latent attention and grouped routing, the Qwen hybrids' gated delta-net
layers beside gated full attention, zero-centred norms and a gated shared expert), on one rank and
split over TP, PP and EP ranks."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_model
from tests.dist_helpers import run_ranks

MEGATRON_FAMILIES = (
    "glm4",
    "glm4_moe",
    "deepseek_v3",
    "glm4_moe_lite",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
)
# three layers: DeepSeek-V3 and GLM-4.5 make the first dense, the others MoE (PP 2 splits them 1 + 2);
# the hybrids: linear, full, linear attention
SIZE = ("--hidden-size", "64", "--num-layers", "3")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_families")
    made = {arch: make_model(str(root / arch), 0, "--arch", arch, *SIZE) for arch in MEGATRON_FAMILIES}
    made["deepseek_v3_yarn"] = _with_yarn(made["deepseek_v3"], str(root / "deepseek_v3_yarn"))
    made["deepseek_v3_no_q_latent"] = _without_query_latent(made["deepseek_v3"], str(root / "no_q_latent"))
    return made


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
}
"""DeepSeek-V3's rope scaling (its released config: factor 40 over 4096 positions, mscale 1 and
1), at a tiny size; mscale differs from mscale_all_dim so the rotary magnitude is not 1."""


def _with_yarn(path, out):
    """The tiny DeepSeek-V3 with YaRN rotary scaling (its weights unchanged)."""
    import shutil

    from transformers import AutoConfig

    shutil.copytree(path, out)
    config = AutoConfig.from_pretrained(path)
    config.rope_parameters = dict(YARN)
    config.save_pretrained(out)
    return out


def _without_query_latent(path, out):
    """The tiny DeepSeek-V3 shaped as Moonlight / Kimi-K2's smaller kin: q_lora_rank null, the
    queries projected directly (`q_proj`), fresh seeded weights with a non-zero expert bias."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from slime.tools.tiny_families import seed_family_state

    config = AutoConfig.from_pretrained(path)
    config.q_lora_rank = None
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    seed_family_state(model, 3)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{path}/{name}", f"{out}/{name}")
    return out


def _hf(path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path), load_file(f"{path}/model.safetensors")


NAMES = {  # a tensor of each family's own, by the name slime's Megatron side gives it
    "deepseek_v3_no_q_latent": ["decoder.layers.0.self_attention.linear_q_proj.weight"],
    "glm4": [
        "decoder.layers.0.post_self_attn_layernorm.weight",
        "decoder.layers.2.post_mlp_layernorm.weight",
        "decoder.layers.1.self_attention.linear_qkv.bias",
    ],
    "glm4_moe": [
        "decoder.layers.1.mlp.router.expert_bias",
        "decoder.layers.2.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.self_attention.q_layernorm.weight",
    ],
    "deepseek_v3": [
        "decoder.layers.0.self_attention.linear_q_down_proj.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.1.self_attention.linear_kv_down_proj.weight",
        "decoder.layers.1.self_attention.kv_layernorm.weight",
        "decoder.layers.2.self_attention.linear_kv_up_proj.weight",
        "decoder.layers.2.mlp.router.expert_bias",
        "decoder.layers.2.mlp.shared_experts.linear_fc2.weight",
    ],
    "glm4_moe_lite": [
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.router.expert_bias",
        "decoder.layers.2.self_attention.linear_kv_down_proj.weight",
    ],
    "qwen3_next": [
        "decoder.layers.0.self_attention.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_attn.in_proj_qkvz.weight",
        "decoder.layers.2.self_attention.linear_attn.in_proj_ba.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.mlp.shared_experts.gate_weight",
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
    ],
    "qwen3_5": [
        "decoder.layers.0.self_attention.linear_attn.in_proj_qkv.weight",
        "decoder.layers.0.self_attention.linear_attn.in_proj_z.weight",
        "decoder.layers.2.self_attention.linear_attn.A_log",
        "decoder.layers.1.self_attention.q_layernorm.weight",
    ],
    "qwen3_5_moe": [
        "decoder.layers.0.self_attention.linear_attn.in_proj_b.weight",
        "decoder.layers.2.self_attention.linear_attn.conv1d.weight",
        "decoder.layers.1.mlp.shared_experts.gate_weight",
    ],
}


@pytest.mark.parametrize("arch", [*MEGATRON_FAMILIES, "deepseek_v3_no_q_latent"])
def test_conversion_is_bitwise_both_ways_through_every_split(models, arch):
    from slime.backends.megatron.convert import Layout, hf_to_megatron, megatron_to_hf
    from slime.backends.megatron.export import full_shapes
    from slime.backends.megatron.sharding import merge_experts, merge_pp, merge_tp, rank_shard, split_pp

    config, hf = _hf(models[arch])
    layout = Layout.from_hf_config(config, stages=(1, None))  # PP 2 holds layer 0, then 1 and 2
    mc = hf_to_megatron(hf, layout, tp=2)
    assert set(NAMES[arch]) <= set(mc), sorted(set(NAMES[arch]) - set(mc))
    back = megatron_to_hf(mc, layout)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    assert {k: tuple(v[0]) for k, v in full_shapes(layout, 2).items()} == {
        k: tuple(v.shape) for k, v in mc.items()
    }
    # TP 2 x PP 2 (x EP 2 for the experts) and back
    ep = 2 if layout.num_experts else 1
    stages = split_pp(mc, layout, 2)
    joined = []
    for stage in stages:
        shards = {(t, e): rank_shard(stage, layout, 2, t, ep, 1, e, 0) for t in range(2) for e in range(ep)}
        dense = merge_tp(
            [{k: v for k, v in shards[(t, 0)].items() if "mlp.experts." not in k} for t in range(2)], layout
        )
        experts = (
            merge_experts({(e, 0): shards[(0, e)] for e in range(ep)}, layout) if layout.num_experts else {}
        )
        joined.append({**dense, **experts})
    again = merge_pp(joined, layout)
    assert again.keys() == mc.keys() and all(torch.equal(again[k], mc[k]) for k in mc)


def test_the_layouts_read_each_familys_fields(models):
    from slime.backends.megatron.convert import Layout

    glm4 = Layout.from_hf_config(_hf(models["glm4"])[0])
    assert (glm4.rotary_percent, glm4.rotary_interleaved, glm4.post_norms, glm4.fused_gate_up) == (
        0.5,
        True,
        True,
        True,
    )
    glm45 = Layout.from_hf_config(_hf(models["glm4_moe"])[0])
    assert glm45.expert_bias and glm45.shared_ffn_hidden_size == 32 and glm45.moe_layers == (0, 1, 1)
    assert (glm45.rotary_percent, glm45.rotary_interleaved, glm45.qkv_bias, glm45.qk_norm) == (
        0.5,
        False,
        True,
        True,
    )
    ds = Layout.from_hf_config(_hf(models["deepseek_v3"])[0])
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.head_dim, ds.qk_rope_head_dim, ds.v_head_dim) == (
        32,
        16,
        16,
        8,
        16,
    )
    lite = Layout.from_hf_config(_hf(models["glm4_moe_lite"])[0])  # values wider than the keys' nope part
    assert (lite.head_dim, lite.qk_rope_head_dim, lite.v_head_dim, lite.moe_layers) == (16, 8, 24, (0, 1, 1))


def test_routing_and_rotary_megatron_core_computes_otherwise_are_refused(models):
    from slime.backends.megatron.convert import ConversionError, Layout

    config = _hf(models["deepseek_v3"])[0]
    config.norm_topk_prob = False
    with pytest.raises(ConversionError, match="norm_topk_prob"):
        Layout.from_hf_config(config)
    config = _hf(models["deepseek_v3"])[0]
    config.num_experts_per_tok = 3  # groups scored by their best 3 in megatron-core, best 2 in HF
    with pytest.raises(ConversionError, match="best 2 experts"):
        Layout.from_hf_config(config)
    config = _hf(models["deepseek_v3"])[0]
    config.rope_interleave = False
    with pytest.raises(ConversionError, match="rope_interleave"):
        Layout.from_hf_config(config)
    config = _hf(models["deepseek_v3"])[0]
    config.rope_parameters = {**YARN, "mscale": None}  # transformers then scales rotary and softmax apart
    with pytest.raises(ConversionError, match="mscale_all_dim but no mscale"):
        Layout.from_hf_config(config)
    config = _hf(models["deepseek_v3"])[0]
    config.num_experts_per_tok, config.n_group = (
        1,
        1,
    )  # one expert: HF weighs it 1, megatron-core by its score
    with pytest.raises(ConversionError, match="to one expert with norm_topk_prob"):
        Layout.from_hf_config(config)
    config = _hf(models["deepseek_v3"])[0]
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ConversionError, match=r"quantization_config \(fp8\)"):
        Layout.from_hf_config(config)
    config = _hf(models["glm4"])[0]
    config.rope_parameters = {**YARN, "partial_rotary_factor": 0.5}
    with pytest.raises(ConversionError, match="YaRN with multi-latent attention only"):
        Layout.from_hf_config(config)
    for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # transformers then gives o_proj a bias too
        config = _hf(models[arch])[0]
        config.attention_bias = True
        with pytest.raises(ConversionError, match="the output projection's bias is not converted"):
            Layout.from_hf_config(config)


def _rank_model(rank, world_size, init_method, path, tp, pp, ep):
    """This rank's megatron-core GPTModel of the HF checkpoint at `path`, its converted shard loaded."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime.backends.megatron import cpu_shim
    from slime.backends.megatron.convert import Layout
    from slime.backends.megatron.model import build_gpt_model, model_state, transformer_config
    from slime.backends.megatron.sharding import hf_to_megatron_shard

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    cpu_shim.enable()
    cpu_shim.seed(0, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    config, hf = _hf(path)
    layout = Layout.from_hf_config(config, stages=(1, None) if pp > 1 else (None, None))
    mc_config = transformer_config(
        layout,
        config,
        cpu_init=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
    )
    model = build_gpt_model(layout, config, mc_config, tp)
    mine = hf_to_megatron_shard(
        hf,
        layout,
        tp,
        pp,
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ep,
        1,
        ps.get_expert_model_parallel_rank(),
        0,
    )
    built = {k: tuple(v.shape) for k, v in model_state(model).items()}
    missing = model.load_state_dict(mine, strict=False).missing_keys
    return config, model, mine, built, missing


def _forward(rank, world_size, init_method, path, tp, pp, ep, packed):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    config, model, mine, built, missing = _rank_model(rank, world_size, init_method, path, tp, pp, ep)
    model.eval()
    torch.manual_seed(1)
    lengths = (7, 5)
    ids = torch.randint(0, config.vocab_size, (2, 7))
    kwargs = {}
    if packed:  # both samples in one row, each attending to itself only
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor([0, 7, 12], dtype=torch.int32)
        kwargs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
        )
        row = torch.cat([ids[0], ids[1, :5]]).unsqueeze(0)
        inputs, positions = row, torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    else:
        inputs, positions = ids, torch.arange(7).expand(2, 7)
    with torch.no_grad():
        if pp == 1:
            logits = model(inputs, positions, None, **kwargs)
        else:  # the two stages by hand: stage 0's hidden states to stage 1
            model.set_input_tensor(None)
            if ps.is_pipeline_first_stage():
                dist.send(model(inputs, positions, None, **kwargs).contiguous(), dst=rank + world_size // 2)
                logits = None
            else:
                hidden = torch.empty(inputs.shape[1], inputs.shape[0], config.hidden_size)
                dist.recv(hidden, src=rank - world_size // 2)
                model.set_input_tensor(hidden)
                logits = model(inputs, positions, None, **kwargs)
    if logits is not None and tp > 1:  # vocabulary-parallel logits: gather this TP group's columns
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    reference = None
    if rank == world_size - 1:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            reference = [hf_model(ids[i : i + 1, :n]).logits[0] for i, n in enumerate(lengths)]
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {
        "built": built,
        "mine": {k: tuple(v.shape) for k, v in mine.items()},
        "packed": packed,
        "missing": [k for k in missing if not k.endswith("._extra_state")],
        "logits": logits,
        "reference": reference,
        "vocab": config.vocab_size,
        "lengths": lengths,
    }


def _check(results):
    for r in results:
        assert r["built"] == r["mine"], sorted(set(r["built"]) ^ set(r["mine"]))
        assert not r["missing"], r["missing"]
    last = results[-1]
    logits, (a, b) = last["logits"][..., : last["vocab"]], last["lengths"]
    got = [logits[0, :a], logits[0, a : a + b]] if last["packed"] else [logits[0], logits[1, :b]]
    for mine, ref in zip(got, last["reference"], strict=True):
        assert mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


# (TP, PP, EP, packed): one layout per family in the default run, the rest in the slow run
CASES = [
    ("glm4", 2, 1, 1, True),
    ("glm4_moe", 1, 2, 2, True),
    ("deepseek_v3", 2, 1, 2, True),
    ("glm4_moe_lite", 1, 1, 2, True),
    ("deepseek_v3_no_q_latent", 2, 1, 1, True),  # linear_q_proj, split over TP
    ("qwen3_5_moe", 1, 1, 2, True),  # delta-nets run per packed sequence
    *(
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [
            ("glm4", 1, 1, 1, False),
            ("glm4", 1, 2, 1, False),
            ("glm4_moe", 1, 1, 1, False),
            ("glm4_moe", 2, 1, 1, False),
            ("deepseek_v3", 1, 1, 1, False),
            ("deepseek_v3", 1, 2, 1, True),
            ("deepseek_v3_yarn", 1, 1, 1, False),
            ("deepseek_v3_yarn", 1, 1, 1, True),
            ("deepseek_v3_no_q_latent", 1, 1, 1, False),
            ("qwen3_next", 1, 1, 1, True),
            ("qwen3_next", 1, 2, 2, False),
            ("qwen3_5", 2, 1, 1, True),
            ("qwen3_5", 1, 2, 1, False),
            ("qwen3_5_moe", 2, 1, 1, False),
        ]
    ),
]


@pytest.mark.parametrize("arch, tp, pp, ep, packed", CASES)
def test_megatron_core_gives_hugging_faces_logits(models, arch, tp, pp, ep, packed):
    _check(run_ranks(max(tp, ep) * pp, _forward, models[arch], tp, pp, ep, packed))


# The Megatron actor trains each family like one FSDP rank trains transformers' model (same step
# metrics, log-probs and exported weights within the dense tests' bounds): slow, one layout each.
ACTOR_CASES = [
    ("glm4", 2, 1, 2),
    ("glm4_moe", 1, 2, 2),
    ("deepseek_v3", 1, 2, 2),
    ("glm4_moe_lite", 1, 1, 1),
    ("qwen3_next", 1, 2, 2),
    ("qwen3_5", 2, 1, 2),  # FSDP pads the hybrids' rows, Megatron packs them
]  # (arch, TP, EP, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("arch, tp, ep, world", ACTOR_CASES)
def test_the_megatron_actor_trains_each_family_like_fsdp(models, arch, tp, ep, world):
    from tests.test_megatron_actor import assert_trains_like
    from tests.test_megatron_moe_actor import moe_run

    fsdp = run_ranks(1, moe_run, models[arch], "fsdp")[0]
    ranks = run_ranks(world, moe_run, models[arch], "megatron", tp, 1, ep, 2)
    assert_trains_like(fsdp, ranks)
    if arch in ("glm4_moe", "deepseek_v3", "glm4_moe_lite"):  # the expert bias goes out with the weights
        from safetensors.torch import load_file

        hf = load_file(f"{models[arch]}/model.safetensors")
        name = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert torch.equal(ranks[0]["weights"][name], hf[name]) and hf[name].abs().sum() > 0


REPLAY_CASES = [
    ("glm4_moe", "r3", 2),  # sigmoid routers with an expert bias and two groups, EP 2
    pytest.param("deepseek_v3", "r2_aux", 2, marks=pytest.mark.slow),
    pytest.param("glm4_moe_lite", "r3", 1, marks=pytest.mark.slow),
    pytest.param("qwen3_next", "r2_aux", 2, marks=pytest.mark.slow),  # softmax, a gated shared expert
    pytest.param("qwen3_5_moe", "r3", 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch, options, ep", REPLAY_CASES)
def test_routing_replay_trains_each_moe_family_like_fsdp(models, arch, options, ep):
    """Routing replay (R3: tables unlike the model's own routing; R2 with the aux loss) on the
    sigmoid-routed and hybrid families: the Megatron actor gives the FSDP rank's log-probs, step
    metrics and weights (the FSDP actor's replay against Hugging Face's forced forward:
    tests/test_routing_families.py). One sample per micro-batch: the aux loss balances each
    micro-batch as a whole."""
    from tests.test_megatron_actor import assert_trains_like
    from tests.test_megatron_moe_actor import R2_AUX, R3, moe_run

    moe = R2_AUX if options == "r2_aux" else R3
    fsdp = run_ranks(1, moe_run, models[arch], "fsdp", 1, 1, 1, 1, None, moe)[0]
    ranks = run_ranks(ep, moe_run, models[arch], "megatron", 1, 1, ep, 1, None, moe)
    assert_trains_like(fsdp, ranks)
    if options == "r2_aux":
        assert all(s["moe_aux_loss"] > 0 for o in ranks[0]["outputs"] for s in o.steps)


@pytest.mark.slow
@pytest.mark.parametrize("arch, ep", [("qwen3_5", 1), ("qwen3_5_moe", 2)])
def test_context_parallel_runs_the_delta_nets_on_whole_sequences(models, arch, ep):
    """CP 2 (x EP 2) trains like one FSDP rank: every CP rank runs each delta-net layer on whole
    sequences and keeps its own chunks, the layer inputs' gradients summed over the CP ranks (with
    each rank's own slice only, step 0's grad norm already differs)."""
    from tests.test_megatron_actor import assert_trains_like
    from tests.test_megatron_moe_actor import moe_run

    fsdp = run_ranks(1, moe_run, models[arch], "fsdp")[0]
    # (TP 1, PP 1, EP, micro-batch 2, no save, no MoE options, no recompute, packed, CP 2)
    ranks = run_ranks(2, moe_run, models[arch], "megatron", 1, 1, ep, 2, None, None, False, False, 2)
    assert_trains_like(fsdp, ranks)


def _bf16_pp2_export(rank, world_size, init_method, model):
    import dataclasses

    from slime.backends import make_train_actor
    from slime.config.train import MegatronConfig
    from tests.test_fsdp_actor import base_config, make_batch
    from tests.test_megatron_actor import exported

    cfg = dataclasses.replace(
        base_config(model, micro_batch_size=2),
        backend="megatron",
        megatron=MegatronConfig(
            pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1, bf16=True
        ),
    )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    actor.train(0, make_batch(0))
    weights = exported(actor)
    actor.close()
    return weights


@pytest.mark.slow
def test_the_expert_bias_leaves_a_bf16_pipeline_in_float32_as_the_checkpoint_has_it(models):
    """--bf16 with PP 2 (layer 0, then 1 and 2): rank 0 receives the last stage's routers from the
    other stage; the bias stays float32 (megatron-core keeps it so) and untouched by training."""
    from safetensors.torch import load_file

    weights = run_ranks(2, _bf16_pp2_export, models["deepseek_v3"])[0]
    hf = load_file(f"{models['deepseek_v3']}/model.safetensors")
    for layer in (1, 2):
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], hf[name])
    assert weights["model.layers.2.mlp.gate.weight"].dtype == torch.bfloat16
    assert weights.keys() == hf.keys()


@pytest.mark.slow  # (conversion both ways runs in-process in the default run: the test above)
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4"])
def test_the_conversion_tools_move_a_family_between_layouts_and_back_bitwise(models, arch, tmp_path):
    """The tools as users run them: HF -> TP 2 (x EP 2) -> PP 2 with the first stage one layer ->
    HF, bit for bit; the checkpoint's args say the family's architecture in Megatron-LM's names."""
    from safetensors.torch import load_file

    from tests.test_megatron_tools import tool

    hf = models[arch]
    ep = ["--expert-model-parallel-size", "2"] if arch == "deepseek_v3" else []
    first = tmp_path / "tp2"
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        hf,
        "--save-dir",
        str(first),
        "--tensor-model-parallel-size",
        "2",
        *ep,
    )
    assert r.returncode == 0, r.stderr
    shard = torch.load(sorted(first.glob("release/mp_rank_01*"))[0] / "model_optim_rng.pt", weights_only=True)
    args = shard["args"]
    if arch == "deepseek_v3":
        assert (args["multi_latent_attention"], args["q_lora_rank"], args["kv_lora_rank"]) == (True, 32, 16)
        assert args["moe_router_enable_expert_bias"] and args["moe_shared_expert_intermediate_size"] == 32
        assert "decoder.layers.1.self_attention.linear_kv_up_proj.weight" in shard["model"]
    else:
        assert (
            args["post_self_attn_layernorm"] and args["rotary_interleaved"] and args["rotary_percent"] == 0.5
        )
    pp2 = tmp_path / "pp2"
    r = tool(
        "convert_checkpoint",
        "--load-dir",
        str(first),
        "--save-dir",
        str(pp2),
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "2",
        "--target-decoder-first-pipeline-num-layers",
        "1",
    )
    assert r.returncode == 0, r.stderr
    back = tmp_path / "hf_back"
    r = tool("convert_megatron_to_hf", "--load-dir", str(pp2), "--hf-checkpoint", hf, "--save-dir", str(back))
    assert r.returncode == 0, r.stderr
    want, got = load_file(f"{hf}/model.safetensors"), load_file(back / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _count_with_padding(rank, world_size, init_method, path):
    """megatron-core's own count of each expert's tokens in a training forward of two right-padded
    rows (7 and 4 real tokens), given the padding mask, and in a forward without autograd."""
    from megatron.core import parallel_state as ps

    _, model, *_ = _rank_model(rank, world_size, init_method, path, 1, 1, 1)
    ids = torch.randint(4, 101, (2, 7))
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 4:] = True
    model(ids, torch.arange(7).expand(2, 7), None, padding_mask=padding)
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    counted = [float(r.local_tokens_per_expert.sum()) for r in routers]
    with torch.no_grad():
        model(ids, torch.arange(7).expand(2, 7), None, padding_mask=padding)
    again = [float(r.local_tokens_per_expert.sum()) for r in routers]
    ps.destroy_model_parallel()
    return counted, again


def test_megatron_cores_count_leaves_padding_out(models):
    counted, again = run_ranks(1, _count_with_padding, models["glm4_moe"])[0]
    assert counted == again == [11.0 * 2] * 2  # 11 real tokens, 2 experts each, in both MoE layers


def test_the_bias_update_favours_experts_below_the_mean():
    from slime.backends.expert_bias import updated_bias

    bias = torch.tensor([[0.5, 0.0, -0.25, 0.0]])
    new = updated_bias(bias, torch.tensor([[4.0, 0.0, 2.0, 2.0]]), 0.125)  # mean 2
    assert torch.equal(new, torch.tensor([[0.375, 0.125, -0.25, 0.0]]))


def test_the_fsdp_count_takes_real_tokens_of_training_forwards_once(models):
    """TokenCounts on HF's DeepSeek-V3 routers: padding and no-grad passes are not counted, and
    a second forward of the same micro-batch (a recompute) does not count it twice."""
    from transformers import AutoModelForCausalLM

    from slime.backends.expert_bias import TokenCounts

    model = AutoModelForCausalLM.from_pretrained(models["deepseek_v3"], dtype=torch.float32)
    counts = TokenCounts.find(model)
    assert counts is not None and len(counts.routers) == 2  # the two MoE layers
    ids = torch.randint(4, 101, (2, 6))
    real = torch.ones(12, dtype=torch.bool)
    real[9:] = False  # the second row's last three tokens are padding
    with torch.no_grad():
        counts.begin(real)
        model(ids)
        counts.end()
    assert counts.totals == [None, None]
    counts.begin(real)
    model(ids)
    model(ids)  # recomputed
    counts.end()
    k = model.config.num_experts_per_tok
    assert [float(t.sum()) for t in counts.totals] == [9.0 * k] * 2
    from slime.backends.expert_bias import updated_bias

    # moving the model (as sleep and wake do) replaces its buffers: the update reaches the live ones
    model.to(torch.float64).to(torch.float32)
    expected = [updated_bias(b, t, 0.01) for b, t in zip(counts.biases, counts.totals, strict=True)]
    counts.step(0.01)
    live = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert all(torch.equal(b, want) for b, want in zip(live, expected, strict=True))
    assert counts.totals == [None, None]


@pytest.mark.slow
def test_the_expert_bias_moves_alike_in_both_backends(models):
    """--moe-router-bias-update-rate: one FSDP rank, two FSDP ranks and Megatron at EP 2 train
    GLM-4.5 alike, expert bias included (its steps differ from the checkpoint's)."""
    from safetensors.torch import load_file

    from tests.test_megatron_actor import assert_trains_like
    from tests.test_megatron_moe_actor import moe_run

    moe = {"moe_router_bias_update_rate": 1e-3}
    path = models["glm4_moe"]
    fsdp = run_ranks(1, moe_run, path, "fsdp", 1, 1, 1, 2, None, moe)[0]
    assert_trains_like(
        fsdp, run_ranks(2, moe_run, path, "fsdp", 1, 1, 1, 2, None, moe), only_rank0_exports=False
    )
    assert_trains_like(fsdp, run_ranks(2, moe_run, path, "megatron", 1, 1, 2, 2, None, moe))
    # padded rows (their padding is not counted) and megatron-core's full recompute (a layer
    # forwarded twice is counted once)
    padded = run_ranks(1, moe_run, path, "fsdp", 1, 1, 1, 2, None, moe, False, True)[0]
    assert_trains_like(padded, run_ranks(2, moe_run, path, "megatron", 1, 1, 2, 2, None, moe, True, True))
    hf = load_file(f"{path}/model.safetensors")
    for layer in (1, 2):
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        moved = (fsdp["weights"][name] - hf[name]).abs()
        assert moved.max() > 1e-4, name  # the rate times a sum of signs over the steps


def test_a_bias_update_rate_needs_routers_with_a_bias(tiny_moe, models, tmp_path, capsys):
    from slime.ray.cli import parse_args
    from tests.test_flag_surface import base, error

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    for backend in ("fsdp", "megatron"):
        err = error(
            capsys,
            base(
                tiny_moe, str(prompts), "--moe-router-bias-update-rate", "0.001", "--train-backend", backend
            ),
        )
        assert (
            "--moe-router-bias-update-rate 0.001 needs routers with an expert bias" in err
            and "qwen3_moe" in err
        )
        cfg = parse_args(
            base(
                models["deepseek_v3"],
                str(prompts),
                "--moe-router-bias-update-rate",
                "0.001",
                "--train-backend",
                backend,
            )
        )
        assert cfg.train.moe.moe_router_bias_update_rate == 0.001
    # with replay: FSDP counts the replayed experts; megatron-core counts its own choice (refused)
    rate = ["--moe-router-bias-update-rate", "0.001", "--use-rollout-routing-replay"]
    assert parse_args(base(models["deepseek_v3"], str(prompts), *rate)).train.moe.use_rollout_routing_replay
    err = error(capsys, base(models["deepseek_v3"], str(prompts), *rate, "--train-backend", "megatron"))
    assert "--use-rollout-routing-replay with --moe-router-bias-update-rate is not built with" in err
