"""slime's own flags for features this project does not have, or has under another flag, each
with an explicit effect (slime.config.surface). Flags with a full implementation here live in
slime.config.arguments / slime.config.train beside the rest."""

from __future__ import annotations

from typing import Any

from slime.config.surface import APPLIED, NO_EFFECT, REFUSED, Spec, store_true

CRITIC = "slime has no such flag either (its docs name it): the critic is on with --advantage-estimator ppo"


def _refused(flag: str, kwargs: dict[str, Any], why: str, neutral: Any = None) -> Spec:
    return Spec(flag, kwargs, REFUSED, REFUSED, why, neutral, group="slime")


def _same(flag: str, kwargs: dict[str, Any], effect: str, note: str) -> Spec:
    return Spec(flag, kwargs, effect, effect, note, group="slime")


SPECS: tuple[Spec, ...] = (
    _same(
        "--num-gpus-per-node",
        {"type": int, "default": None},
        NO_EFFECT,
        "GPUs per node of the cluster: Ray places the processes; --dry-run uses it to draw the plan "
        "(default: --actor-num-gpus-per-node)",
    ),
    _same(
        "--balance-data",
        store_true(),
        APPLIED,
        "always on here: each step's samples go to the data-parallel ranks in equal counts with balanced "
        "tokens (the loss is normalised over the whole step, so the split does not change results)",
    ),
    _same(
        "--sglang-router-request-timeout-secs",
        {"type": int, "default": None},
        NO_EFFECT,
        "every engine request is bounded by --distributed-timeout-minutes here",
    ),
    _same(
        "--data-pad-size-multiplier",
        {"type": int, "default": None},
        NO_EFFECT,
        "padding of a packed micro-batch for slime's kernels; here a packed micro-batch is padded only where "
        "sequence parallelism needs it (to a multiple of the TP size), which changes no result",
    ),
    _same(
        "--model-name",
        {"default": None},
        NO_EFFECT,
        "picks slime's Megatron -> HF conversion; here the conversion follows config.json's model_type",
    ),
    _same(
        "--offload-train",
        {"action": "store_true", "default": False},
        APPLIED,
        "the trainer gives its memory up while engines generate (the default with --colocate)",
    ),
    _same(
        "--no-offload-train",
        store_true(),
        APPLIED,
        "the trainer keeps its memory while engines generate (the default without --colocate)",
    ),
    _same(
        "--offload-rollout",
        store_true(),
        APPLIED,
        "engines give their memory back while the trainer trains (the default with --colocate)",
    ),
    _same(
        "--no-offload-rollout",
        store_true(),
        APPLIED,
        "colocated engines keep their memory while the trainer trains (engines and trainer must fit "
        "together)",
    ),
    _refused(
        "--opd-teacher-ckpt-step",
        {"type": int, "default": None},
        "it picks a step of a Megatron teacher checkpoint; --opd-teacher-load is a Hugging Face directory "
        "here (convert a Megatron teacher with slime.tools.convert_megatron_to_hf)",
    ),
    _refused("--use-critic", store_true(), CRITIC),
    _refused(
        "--megatron-config-path",
        {"default": None},
        "per-role Megatron overrides (actor / critic YAML) are not supported",
    ),
    _refused(
        "--prefill-num-servers",
        {"type": int, "default": None},
        "prefill/decode disaggregated engines are not supported",
    ),
    _refused(
        "--sglang-config",
        {"default": None},
        "slime's multi-model engine YAML is not supported: one model, --rollout-num-gpus engines",
    ),
    _same(
        "--allgather-cp",
        store_true(),
        NO_EFFECT,
        "slime's all-gather context parallelism: the Megatron actor's context parallelism always all-gathers "
        "the keys and values over the CP ranks (docs/megatron.md)",
    ),
    _same(
        "--rollout-sample-filter-path",
        {"default": None},
        APPLIED,
        "f(args, groups) after each built-in rollout; it sets Sample.remove_sample (no loss, still in the "
        "advantage normalisation)",
    ),
    _same(
        "--loss-mask-type",
        {"default": "qwen"},
        APPLIED,
        "multi-turn loss masks of slime.rollout.sft_rollout (slime.utils.mask_utils): qwen, qwen3",
    ),
    Spec(
        "--use-routing-replay",
        store_true(),
        APPLIED,
        APPLIED,
        "R2: the training steps route each token to the experts the rollout's log-prob pass chose "
        "(mixture-of-experts models)",
        group="slime",
    ),
    Spec(
        "--use-rollout-routing-replay",
        store_true(),
        APPLIED,
        APPLIED,
        "R3: the log-prob and training passes route each token to the experts the engine chose "
        "(engines report them: return_routed_experts; mixture-of-experts models)",
        group="slime",
    ),
    _refused("--enable-experimental", store_true(), "slime's experimental code paths do not exist here"),
    _same(
        "--rm-url",
        {"default": None},
        APPLIED,
        "--rm-type remote_rm: the reward server's URL (POST {prompt, response, label} as JSON)",
    ),
    # slime's other function hooks: no launch script passes them; known, so a user gets the reason.
    *(
        _refused(flag, {"default": None}, f"slime's {what} hook is not built yet ({where})")
        for flag, what, where in (
            (
                "--custom-loss-function-path",
                "custom loss (--loss-type custom_loss)",
                "open an issue if you need it",
            ),
            ("--custom-advantage-function-path", "advantage", "open an issue if you need it"),
            (
                "--custom-convert-samples-to-train-data-path",
                "samples-to-train-data",
                "open an issue if you need it",
            ),
            ("--rollout-all-samples-process-path", "all-samples process", "open an issue if you need it"),
            ("--rollout-data-postprocess-path", "rollout-data post-process", "open an issue if you need it"),
            ("--buffer-filter-path", "buffer filter", "open an issue if you need it"),
            ("--custom-rollout-log-function-path", "rollout log", "open an issue if you need it"),
            ("--custom-eval-rollout-log-function-path", "eval rollout log", "open an issue if you need it"),
            ("--eval-function-path", "eval generation", "open an issue if you need it"),
            (
                "--custom-model-provider-path",
                "Megatron model provider",
                "the model comes from --hf-checkpoint",
            ),
            ("--custom-megatron-init-path", "Megatron init", "open an issue if you need it"),
            (
                "--custom-megatron-before-log-prob-hook-path",
                "Megatron before-log-prob",
                "open an issue if you need it",
            ),
            (
                "--custom-megatron-before-train-step-hook-path",
                "Megatron before-train-step",
                "open an issue if you need it",
            ),
            (
                "--custom-update-weight-post-write-path",
                "disk weight-sync post-write",
                "open an issue if you need it",
            ),
        )
    ),
    _refused(
        "--rollout-sample-hook-path",
        {"action": "append", "default": []},
        "slime's per-sample rollout hook is not built yet",
    ),
    _refused(
        "--data-source-path",
        {"default": None},
        "slime's data source classes are not built: prompts come from --prompt-data",
        neutral="slime.rollout.data_source.RolloutDataSourceWithBuffer",
    ),
)

SERVER = (
    "a flag of slime's Megatron teacher server (megatron_server.py), not of train.py; that server is not "
    "built here: --opd-type megatron runs the teacher inside the trainer"
)
DEEPGEMM = (
    "DeepGEMM's block-FP8 forward in Transformer Engine linears needs Hopper GPUs with DeepGEMM and "
    "Transformer Engine, which this project does not use"
)
NOT_READ = "slime defines it and reads it nowhere (its plugins neither)"
MEMORY = (
    "configures Megatron-LM's --record-memory-history (a CUDA memory recorder), which is not built here; "
    "with --device cuda, PYTORCH_CUDA_ALLOC_CONF and torch.cuda.memory._record_memory_history in a "
    "--debug-phase-hook do the same"
)
PLUGIN = (
    "read from args by slime's rollout-buffer plugin (slime_plugins.rollout_buffer), a "
    "--rollout-function-path"
)

SPECS += (
    _same("--min-batch-collection-ratio", {"type": float, "default": None}, NO_EFFECT, NOT_READ),
    _same("--http-proxy", {"default": None}, NO_EFFECT, NOT_READ),
    _same(
        "--use-distributed-post",
        store_true(),
        NO_EFFECT,
        "spreads slime's HTTP posts over Ray actors on every node; here the rollout manager's client "
        "posts to the engines itself (a transport for requests: the same requests, the same answers)",
    ),
    _same(
        "--recompute-loss-function",
        store_true(),
        NO_EFFECT,
        "slime recomputes its loss function's activations (the [tokens, vocabulary] log-softmax) in the "
        "backward pass to save memory; here the loss takes log-probs already gathered, and the "
        "vocabulary-wide log-softmax runs in chunks with --log-probs-chunk-size",
    ),
    _same("--memory-recorder", {"default": None, "choices": ["torch", "memray"]}, NO_EFFECT, MEMORY),
    _same("--memory-snapshot-dir", {"default": None}, NO_EFFECT, MEMORY),
    _same("--memory-snapshot-num-steps", {"type": int, "default": None}, NO_EFFECT, MEMORY),
    _same(
        "--log-correct-samples",
        store_true(),
        NO_EFFECT,
        "slime computes length and entropy statistics of the samples with reward 1 and attaches them to "
        "the train data after the metrics are sent, so they are never logged",
    ),
    _same("--rollout-buffer-url", {"default": None}, APPLIED, PLUGIN),
    _same(
        "--fetch-trajectory-retry-times",
        {"type": int, "default": -1},
        APPLIED,
        PLUGIN + " (-1: retry forever)",
    ),
    _same("--rollout-task-type", {"default": "math"}, APPLIED, PLUGIN + " (the buffer server's generator)"),
    _same(
        "--eval-max-context-len",
        {"type": int, "default": None},
        APPLIED,
        "read from args by custom generate functions in evaluation (slime's own rollout reads it nowhere); "
        "default: --rollout-max-context-len",
    ),
    _same(
        "--rollout-skip-special-tokens",
        store_true(),
        APPLIED,
        "responses decoded without special tokens: the built-in rollout always decodes so (SGLang's "
        "default); slime.rollout.sglang_rollout's default_sampling_params (custom generate functions) "
        "keeps them unless this flag, as slime",
    ),
    _same(
        "--load-forge-rollout-data",
        {"default": None},
        APPLIED,
        "the dump path or {rollout_id} template that --rollout-function-path "
        "slime.rollout.forge_load.generate_rollout replays, with engines and pushes running as usual",
    ),
    _same(
        "--release-train",
        store_true(),
        APPLIED,
        "the trainer gives its device memory up while the engines generate (as --offload-train), keeping its "
        "processes: slime kills them and reloads a checkpoint, with the same results",
    ),
    _refused(
        "--rollout-data-transport",
        {"default": None, "choices": ["object-store", "nixl"]},
        "nixl moves rollout tensors with Ray's NIXL transport (RDMA NICs and the NIXL library); here "
        "rollouts go by reference through Ray's object store (object-store)",
        neutral="object-store",
    ),
    _refused(
        "--qwen-gdn-backend",
        {"default": None, "choices": ["fla", "flashqla"]},
        "flashqla is FlashQLA's Hopper-only kernel (CUDA 12.8, compute capability 9.0), not installed "
        "here; the gated delta-net layers run transformers' kernels: flash-linear-attention's where "
        "installed (fla)",
        neutral="fla",
    ),
    *(
        _refused(
            flag, {"nargs": "+", "type": int if flag.endswith("layers") else str, "default": None}, DEEPGEMM
        )
        for flag in (
            "--megatron-deepgemm-forward-layers",
            "--megatron-deepgemm-forward-modules",
            "--megatron-deepgemm-moe-forward-layers",
            "--megatron-deepgemm-moe-forward-modules",
        )
    ),
    *(
        _refused(flag, {"type": str, "default": None}, SERVER)
        for flag in (
            "--teacher-port",
            "--teacher-warmup-port",
            "--teacher-warmup-timeout-s",
            "--teacher-sample-reduction-chunk-size",
            "--teacher-label-reduction-chunk-size",
            "--megatron-server-max-length",
            "--megatron-server-update-timeout-s",
        )
    ),
    _refused("--megatron-server-warmup", {"action": "store_true", "default": False}, SERVER),
    _refused("--no-megatron-server-warmup", {"action": "store_true", "default": False}, SERVER),
    *(
        _refused(
            flag,
            {"type": int, "default": None},
            "SGLang's pipeline parallelism in the engines is not built: the weight push addresses each "
            "engine's tensor-parallel ranks (--rollout-num-gpus-per-engine)",
            neutral=1,
        )
        for flag in ("--sglang-pp-size", "--sglang-pipeline-parallel-size")
    ),
    _refused(
        "--ref-ckpt-step",
        {"type": int, "default": None},
        "it picks an iteration of a Megatron --ref-load checkpoint; --ref-load is a Hugging Face "
        "directory here (convert that iteration with slime.tools.convert_megatron_to_hf)",
    ),
    _same(
        "--balance-by-flops",
        store_true(),
        APPLIED,
        "with --use-dynamic-batch-size: each step's samples go into ceil(tokens / --max-tokens-per-gpu) "
        "micro-batches of balanced estimated FLOPs (L x (c + L), c from the model's shape) instead of packed "
        "by tokens; a micro-batch may then pass the token budget (as in slime)",
    ),
    _refused(
        "--ref-micro-batch-size",
        {"type": int, "default": None},
        "slime's parser does not define it either (one of its example scripts passes it); the reference "
        "pass uses --micro-batch-size, or --log-probs-max-tokens-per-gpu with --use-dynamic-batch-size",
    ),
)

GROUPS = {"slime": "slime features (not built here, or under another flag)"}
