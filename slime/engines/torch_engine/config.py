"""The settings of one torch engine process (`EngineConfig`), filled from its command line
(slime.engines.torch_engine.cli) or given in process (tests)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one torch engine process."""

    model_path: str
    """Local Hugging Face checkpoint directory."""
    device: str = "cpu"
    """'cpu' or 'cuda' (or 'cuda:N')."""
    dtype: str = "float32"
    """Parameter dtype: 'float32' (recommended on CPU) or 'bfloat16'."""
    max_running_requests: int = 64
    """Most sequences decoding at once; the rest wait in a queue."""
    max_prefill_tokens: int = 8192
    """Token budget (padded) of one prefill step."""
    context_length: int | None = None
    """Prompt + output limit; default: the model's max_position_embeddings."""
    random_seed: int = 0
    """Seed of the generator used by requests without their own sampling_seed."""
    weight_version: str = "default"
    """Initial weight_version reported before any update (SGLang's default)."""
    num_threads: int | None = None
    """torch intra-op threads; default: torch's choice."""
    max_top_logprobs_num: int = 20
    """Largest `top_logprobs_num` a request may ask for (top-k runs per step for each such row)."""
    enable_return_routed_experts: bool = False
    """`--enable-return-routed-experts` (SGLang's flag): requests may ask for the experts each of
    their tokens was routed to (`return_routed_experts`)."""
    enable_lora: bool = False
    """`--enable-lora` (SGLang's): serve LoRA adapters (/load_lora_adapter, `lora_path`)."""
    max_loaded_loras: int | None = None
    """`--max-loaded-loras` (SGLang's): most adapters loaded at once (None: no limit)."""
    lora_paths: tuple[tuple[str, str], ...] = ()
    """`--lora-paths NAME=PATH ...` (SGLang's): adapters loaded at start."""
    deterministic: bool = False
    """`--enable-deterministic-inference`: batch-invariant forwards and deterministic kernels, so
    a request with a `sampling_seed` gets the same tokens and log-probs whatever else runs."""
    disable_cuda_graph: bool = False
    """`--disable-cuda-graph` (SGLang's): on CUDA, run every decode step eagerly."""
    cuda_graph_max_bs: int | None = None
    """`--cuda-graph-max-bs` (SGLang's): the largest decode batch replayed as a CUDA graph
    (default: --max-running-requests)."""
    overlap_schedule: bool | None = None
    """Launch each decode round before booking the previous one (slime.engines.torch_engine.rounds);
    None: on CUDA with the batched runner, unless deterministic (`--disable-overlap-schedule`,
    SGLang's flag, turns it off)."""
    enable_torch_compile: bool = False
    """`--enable-torch-compile` (SGLang's): decode steps of the batched runner's dense models run
    through torch.compile (slime.engines.torch_engine.compiled_decode), inside the CUDA graphs."""
    torch_compile_max_bs: int = 32
    """`--torch-compile-max-bs` (SGLang's, and its default): the largest decode batch compiled."""
    attention_backend: str = "auto"
    """`--attention-backend` (SGLang's flag, our choices): decode attention over each row's live
    keys with torch's flash kernel (`flash`), over keys padded to the batch's longest (`torch_native`),
    or the first where it runs (`auto`: CUDA, half precision, Ampere or newer)."""
    num_continuous_decode_steps: int = 1
    """`--num-continuous-decode-steps` (SGLang's): the most decode steps launched per host round
    trip, their tokens brought down in one copy (slime.engines.torch_engine.rounds); requests that
    arrive meanwhile wait for the round's end."""
