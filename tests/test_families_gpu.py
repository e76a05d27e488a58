"""The model families of docs/models.md on a GPU (skipped without CUDA): the torch engine serving
each family on CUDA like Hugging Face's float32 forward on CPU; megatron-core unpatched on CUDA
(multi-latent attention, GLM-4's sandwich norms, sigmoid routing with the expert bias) giving
Hugging Face's logits on converted weights in float32 and bfloat16; and a GRPO job per backend on
a family of its own (Megatron: DeepSeek-V3 with the expert bias moving every step; FSDP: Qwen3.5's
hybrid linear attention) with the step-0 gates and the weight-sync check, pushed over CUDA IPC.
`pytest -m gpu -s tests/test_families_gpu.py` prints the figures for docs/gpu.md."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest
import torch

from slime.tools.tiny_families import NEW_FAMILIES
from tests.conftest import start_engine
from tests.test_engine_server import teacher_forced_logprobs
from tests.test_loop_e2e import prompts  # noqa: F401 - a fixture
from tests.test_megatron_families import models  # noqa: F401 - a fixture (3-layer Megatron families)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

ENGINE_BOUND = 1e-4
"""|engine on CUDA - Hugging Face float32 on CPU| of a sampled token's log-prob: float32 on both
(no TF32 in matmuls by torch's default), so kernel order only; an error in a layer is ~1."""


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_the_engine_on_cuda_serves_each_family_like_hugging_face_on_cpu(family_models, tmp_path, arch):
    """Greedy: each token is Hugging Face's argmax (within the bound, so a near-tie may go either
    way); sampled: log-probs equal a teacher-forced float32 forward on CPU within ENGINE_BOUND."""
    from transformers import AutoModelForCausalLM

    from slime.engines.client import EngineClient

    path = family_models[arch]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    requests = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40]]
    with start_engine(path, tmp_path, "--device", "cuda") as eng:

        async def scenario():
            async with EngineClient(eng.url) as c:
                params = {"max_new_tokens": 12, "ignore_eos": True}
                greedy = await c.generate(
                    requests, sampling_params={**params, "temperature": 0}, return_logprob=True
                )
                sampled = await c.generate(
                    requests, sampling_params={**params, "temperature": 0.8}, return_logprob=True
                )
                return greedy, sampled

        greedy, sampled = asyncio.run(scenario())
    worst_gap = worst_argmax = 0.0
    for prompt, res in zip(requests, sampled, strict=True):
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        worst_gap = max(
            worst_gap,
            (got - teacher_forced_logprobs(model, prompt, res["output_ids"], 0.8)).abs().max().item(),
        )
    for prompt, res in zip(requests, greedy, strict=True):
        ids = torch.tensor([prompt + res["output_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(res["output_ids"])[:, None])[:, 0]
        worst_argmax = max(worst_argmax, (logits.max(dim=1).values - chosen).max().item())
    print(
        f"{arch} engine on cuda vs HF float32 on cpu: sampled log-probs max |diff| {worst_gap:.3g}; "
        f"greedy tokens below HF's argmax logit by at most {worst_argmax:.3g}"
    )
    assert worst_gap < ENGINE_BOUND, (arch, worst_gap)
    assert worst_argmax < ENGINE_BOUND, (arch, worst_argmax)


@pytest.fixture(scope="module")
def megatron_on_cuda():
    """One NCCL rank with megatron-core's model parallel state of size 1, and no CPU shim."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def _megatron_logits(path: str, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """megatron-core's logits (float32) on CUDA for the HF checkpoint at `path`, run in `dtype`
    (the router's expert bias stays float32, as megatron-core keeps it)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from slime.backends.megatron.convert import Layout, hf_to_megatron
    from slime.backends.megatron.model import build_gpt_model, model_state, transformer_config

    model_parallel_cuda_manual_seed(0)
    config = AutoConfig.from_pretrained(path)
    layout = Layout.from_hf_config(config)
    bf16 = dtype == torch.bfloat16
    mc = transformer_config(
        layout,
        config,
        dtype,
        bf16=bf16,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        moe_token_dispatcher_type="alltoall",
    )
    model = build_gpt_model(layout, config, mc, tp=1)
    if bf16:
        model.bfloat16()
    model = model.cuda().eval()
    converted = {
        k: v if k.endswith("expert_bias") else v.to(dtype)
        for k, v in hf_to_megatron(load_file(f"{path}/model.safetensors"), layout, 1).items()
    }
    missing = model.load_state_dict(converted, strict=False).missing_keys
    assert not [k for k in missing if not k.endswith("._extra_state")], missing
    assert set(model_state(model)) == set(converted)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            assert buf.dtype == torch.float32, name
    pos = torch.arange(ids.shape[1], device="cuda").expand(ids.shape[0], -1)
    with torch.no_grad():  # no mask: causal (the multi-latent core attention takes no other)
        return model(ids, pos, attention_mask=None)[..., : layout.vocab_size].float()


def _hf_logits(path: str, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(ids.device).eval()
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "arch",
    ["glm4", "glm4_moe", "deepseek_v3", "deepseek_v3_yarn", "deepseek_v3_no_q_latent", "glm4_moe_lite"],
)
def test_megatron_core_on_cuda_gives_hugging_faces_logits_for_each_family(
    models,
    megatron_on_cuda,
    arch,
    dtype,
):
    """As tests/test_megatron_gpu.py judges Qwen/Llama (tests.logit_tolerance): float32 (TF32 off)
    to float32 rounding; bfloat16 within a small factor of Hugging Face's own bfloat16 error."""
    from tests.logit_tolerance import logits_agree
    from tests.test_megatron_gpu import no_tf32

    path = models[arch]
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    ids = torch.randint(0, vocab, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with no_tf32():
        want = _hf_logits(path, torch.float32, ids)
        got = _megatron_logits(path, dtype, ids)
        reference_error = (
            None if dtype == torch.float32 else (_hf_logits(path, dtype, ids) - want).abs().max().item()
        )
    verdict = logits_agree(got, want, dtype, reference_error)
    print(f"{arch} megatron on cuda vs hf: {verdict.summary}")
    assert verdict, f"{arch}: {verdict.summary}"


# One job per backend, each on a family the other job does not cover.
JOBS = {
    "megatron-deepseek_v3": (
        "deepseek_v3",
        [
            "--train-backend",
            "megatron",
            "--transformer-impl",
            "local",
            "--moe-router-bias-update-rate",
            "0.001",
        ],
    ),
    "fsdp-qwen3_5": ("qwen3_5", ["--train-backend", "fsdp"]),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_a_family_grpo_job_on_cuda_passes_the_step_0_gates(family_models, prompts, tmp_path, job):
    """Colocated on the one GPU, pushed over CUDA IPC with --offload: --check-precision's gates at
    step 0 and --check-weight-sync on every push (the expert bias included, as it moves)."""
    from safetensors import safe_open

    from tests.test_loop_e2e import run_job

    arch, flags = JOBS[job]
    model = family_models[arch]
    proc = run_job(
        "train.py",
        model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--device",
        "cuda",
        "--colocate",
        "--rollout-backend",
        "torch",
        "--update-weight-transport",
        "tensor",
        "--offload",
        "--advantage-estimator",
        "grpo",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--check-precision",
        "--check-weight-sync",
        *flags,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    checks = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert checks and all(c["ok"] is not False for c in checks), checks
    print(
        f"{job}: "
        + next(line for line in out.splitlines() if "--check-precision: passed at rollout 0" in line)
    )
    synced = [int(n) for n in re.findall(r"--check-weight-sync: (\d+) tensors match on every engine", out)]
    with safe_open(f"{model}/model.safetensors", "pt") as f:
        assert len(synced) >= 2 and set(synced) == {len(f.keys())}, synced
    assert set(re.findall(r"weight_version \d+ via ([a-z_]+)", out)) == {"cuda_ipc"}, out[-3000:]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_megatron_cores_mtp_loss_on_cuda_is_the_reference_built_from_hf_layers(
    tmp_path, megatron_on_cuda, packed
):
    """slime.backends.megatron.mtp on CUDA (megatron-core's MTP block unpatched, float32, TF32
    off): the depth-1 MTP loss of two samples equals the reference from transformers' layers on CPU."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from slime.backends.megatron import mtp
    from slime.backends.megatron.convert import Layout, hf_to_megatron
    from slime.backends.megatron.export import Mesh
    from slime.backends.megatron.model import build_gpt_model, transformer_config
    from tests.conftest import make_model
    from tests.test_megatron_gpu import no_tf32
    from tests.test_megatron_mtp import mtp_loss_of, mtp_samples, reference_mean

    path = make_model(
        str(tmp_path / "ds"),
        0,
        "--arch",
        "deepseek_v3",
        "--hidden-size",
        "64",
        "--num-layers",
        "3",
        "--mtp-layers",
        "1",
    )
    model_parallel_cuda_manual_seed(0)
    config = AutoConfig.from_pretrained(path)
    layout = Layout.from_hf_config(config, mtp_layers=1)
    mc = transformer_config(
        layout,
        config,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        moe_token_dispatcher_type="alltoall",
        variable_seq_lengths=True,
    )
    model = build_gpt_model(layout, config, mc, tp=1).cuda().eval()
    state = {
        k: v.cuda() for k, v in hf_to_megatron(load_file(f"{path}/model.safetensors"), layout, 1).items()
    }
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert not [k for k in missing if not k.endswith("._extra_state")], missing
    mtp.attach(model, layout, Mesh.from_parallel_state(), train=True)
    tokens = mtp_samples(config.vocab_size)
    with no_tf32():
        got = mtp_loss_of(model, tokens, packed, "cuda")
    want = reference_mean(path, tokens)
    print(
        f"deepseek_v3 MTP loss on cuda ({'packed' if packed else 'padded'}): {got:.7f}, reference "
        f"{want:.7f}, relative {abs(got - want) / want:.2g}"
    )
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_the_mtp_actor_on_cuda_trains_like_on_cpu(tmp_path):
    """--enable-mtp-training on one GPU (megatron-core unpatched) against the same run on CPU:
    the same MTP losses and MTP weights after two rollouts, within float32 rounding."""
    from tests.conftest import make_model
    from tests.dist_helpers import run_ranks
    from tests.test_megatron_mtp import _actor_run

    path = make_model(
        str(tmp_path / "ds"),
        0,
        "--arch",
        "deepseek_v3",
        "--hidden-size",
        "64",
        "--num-layers",
        "3",
        "--mtp-layers",
        "1",
    )
    cpu = run_ranks(1, _actor_run, path, True, 1, "cpu")[0]
    gpu = run_ranks(1, _actor_run, path, True, 1, "cuda")[0]
    cpu_steps = [s for o in cpu["outputs"] for s in o]
    gpu_steps = [s for o in gpu["outputs"] for s in o]
    worst = max(
        abs(a["mtp_loss"] - b["mtp_loss"]) / a["mtp_loss"] for a, b in zip(cpu_steps, gpu_steps, strict=True)
    )
    moved = max((gpu["after"][k] - cpu["after"][k]).abs().max().item() for k in cpu["after"])
    print(f"MTP actor cuda vs cpu: mtp_loss relative {worst:.2g}, MTP weights max |diff| {moved:.2g}")
    assert worst < 1e-4 and moved < 1e-4
    assert gpu["pushed"] == cpu["pushed"] and gpu["saved"] == cpu["saved"]
