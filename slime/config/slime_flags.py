"""slime's own flags for features this project does not have, or has under another flag, each
with an explicit effect (slime.config.surface). Flags with a full implementation here live in
slime.config.arguments / slime.config.train beside the rest."""

from __future__ import annotations

from typing import Any

from slime.config.surface import APPLIED, NO_EFFECT, REFUSED, Spec, store_true

CRITIC = "slime has no such flag either (its docs name it): the critic is on with --advantage-estimator ppo"
MULTIMODAL = "multimodal (vision / audio) prompts are not supported: text models only"


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
        "always on here: each step's samples go to the data-parallel ranks in equal counts with balanced tokens "
        "(the loss is normalised over the whole step, so the split does not change results)",
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
        "colocated engines keep their memory while the trainer trains (engines and trainer must fit together)",
    ),
    _refused(
        "--opd-teacher-ckpt-step",
        {"type": int, "default": None},
        "it picks a step of a Megatron teacher checkpoint; --opd-teacher-load is a Hugging Face directory here "
        "(convert a Megatron teacher with slime.tools.convert_megatron_to_hf)",
    ),
    _refused("--use-critic", store_true(), CRITIC),
    _refused(
        "--megatron-config-path",
        {"default": None},
        "per-role Megatron overrides (actor / critic YAML) are not supported",
    ),
    _refused("--multimodal-keys", {"default": None}, MULTIMODAL),
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
    _refused(
        "--update-weight-mode",
        {"choices": ["full", "delta"], "default": None},
        "delta weight updates are not built: every push sends the full weights",
        neutral="full",
    ),
    _refused("--update-weight-delta-encoding", {"default": None}, "delta weight updates are not built"),
    _refused("--update-weight-delta-checksum", {"default": None}, "delta weight updates are not built"),
    _refused(
        "--update-weight-local-checkpoint-dir",
        {"default": None},
        "host-local checkpoints for weight pulls are not built",
    ),
    _refused(
        "--update-weight-disk-dir",
        {"default": None},
        "the disk transport writes into a directory of its own on the train node; a shared directory "
        "(engines on other nodes) is not built",
    ),
    _refused(
        "--update-weight-disk-keep-files", store_true(), "the disk transport removes each version once read"
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

GROUPS = {"slime": "slime features (not built here, or under another flag)"}
