"""A rollout's samples turned into what leaves the process that made them: the metrics and the
typed summary the driver sees (slime.utils.rollout_batch.Rollout), and one train part per data-parallel
replica, put where the train ranks fetch it."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from typing import Any

from slime.config.eval_sets import EvalDataset
from slime.config.records import RolloutConfig
from slime.utils.errors import UsageError
from slime.utils.rollout_batch import Rollout, split_rollout
from slime.utils.sample import Sample, Status, samples_to_batch


def rollout_metrics(
    samples: list[Sample], reward_key: str | None, prefix: str = "rollout"
) -> dict[str, float]:
    lengths = [s.response_length for s in samples]
    lps = [lp for s in samples for lp in (s.rollout_log_probs or [])]
    out = {
        f"{prefix}/response_length_mean": statistics.fmean(lengths),
        f"{prefix}/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        f"{prefix}/num_samples": float(len(samples)),
    }
    # A dict reward without --reward-key has no mean (slime's OPD recipe: the teacher's answer,
    # which --custom-reward-post-process-path turns into the rewards trained on).
    if reward_key is not None or not any(isinstance(s.reward, dict) for s in samples):
        rewards = [s.scalar_reward(reward_key) for s in samples]
        out[f"{prefix}/reward_mean"] = statistics.fmean(rewards)
        if all(r in (0.0, 1.0) for r in rewards):
            out[f"{prefix}/accuracy"] = statistics.fmean(rewards)
    if lps and prefix != "rollout":  # a rollout's are reported by the trainer, over its loss mask
        out[f"{prefix}/rollout_log_probs"] = statistics.fmean(lps)
    return out


def compute_statistics(values: list[float]) -> dict[str, float]:
    """slime's statistics of a metric series (metric_utils.compute_statistics), by its names."""
    return {
        "mean": statistics.fmean(values),
        "median": float(statistics.median(values)),
        "max": float(max(values)),
        "min": float(min(values)),
    }


REQUEST_PERF_FIELDS = (
    ("request/e2e_latency", "e2e_latency"),
    ("request/queue_time", "queue_time"),
    ("decode/throughput", "decode_throughput"),
)
"""slime's perf/<metric> series and the `sglang_generate` end attr (SGLang's meta_info) each reads."""


def request_perf_metrics(samples: list[Sample]) -> dict[str, float]:
    """slime's perf/request/e2e_latency/*, perf/request/queue_time/* and perf/decode/throughput/*
    (mean, median, max, min over the engine requests) from the `sglang_generate` spans that ended
    in the samples' traces; {} when none did. Each span counts once (the samples split out of one
    execution share its trace); a sample continued from an earlier rollout (--partial-rollout)
    brings its earlier requests too, as in slime."""
    series: dict[str, list[float]] = {metric: [] for metric, _ in REQUEST_PERF_FIELDS}
    seen: set[Any] = set()
    for sample in samples:
        events = sample.trace.get("events") if isinstance(sample.trace, dict) else None
        for event in events or ():
            if event.get("type") != "span_end" or event.get("name") != "sglang_generate":
                continue
            if event.get("span_id") in seen:
                continue
            seen.add(event.get("span_id"))
            attrs = event.get("attrs") or {}
            for metric, key in REQUEST_PERF_FIELDS:
                value = attrs.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    series[metric].append(float(value))
    return {
        f"perf/{metric}/{name}": stat
        for metric, values in series.items()
        if values
        for name, stat in compute_statistics(values).items()
    }


POST_PROCESS_FLAG = "--custom-reward-post-process-path"


def post_processed_rewards(fn: Callable[..., Any], args: Any, samples: list[Sample]) -> list[float]:
    """slime's reward post-process `fn(args, samples) -> (raw_rewards, rewards)`: the rewards the
    advantages start from (in place of the group normalisation), one float per sample."""
    result = fn(args, samples)
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise ValueError(
            f"{POST_PROCESS_FLAG} must return (raw_rewards, rewards), got {type(result).__name__}"
        )
    rewards = result[1]
    rewards = rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)
    if len(rewards) != len(samples):
        raise ValueError(
            f"{POST_PROCESS_FLAG} returned {len(rewards)} rewards for {len(samples)} samples: give one "
            "per sample"
        )
    try:
        return [float(r) for r in rewards]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{POST_PROCESS_FLAG}: every reward it returns must be a number ({e})") from e


def reward_post_process(path: str | None, args: Any) -> Callable[[list[Sample]], list[float]] | None:
    """The loaded --custom-reward-post-process-path as package_rollout's `post_process`."""
    if path is None:
        return None
    from slime.utils.misc import load_function

    return functools.partial(post_processed_rewards, load_function(path, POST_PROCESS_FLAG), args)


def package_rollout(
    rollout_id: int,
    samples: list[Sample],
    reward_key: str | None,
    split: tuple[Any, int] | None,
    put: Callable[[Any], Any],
    metrics: dict[str, float],
    post_process: Callable[[list[Sample]], list[float]] | None = None,
    need_teacher: bool = False,
    **summary: Any,
) -> Rollout:
    """The summary of a rollout whose parts went through `put` (ray.put in a job).

    Args:
        split: (the train config's BatchConfig, data-parallel size), or None when nothing trains.
        metrics: rollout_metrics and the producer's timings.
        post_process: the rewards to train on, when --custom-reward-post-process-path is given.
        need_teacher: --use-opd --opd-type sglang: every sample must carry `teacher_log_probs`
            once post-processed (refused naming the first that does not).
        summary: the remaining Rollout fields (data_state, dump_path, replayed).
    """
    parts: tuple[Any, ...] = ()
    if split is not None:
        batch_cfg, dp_size = split
        rewards = post_process(samples) if post_process is not None else None
        if rewards is not None:
            metrics["rollout/post_processed_reward_mean"] = statistics.fmean(rewards)
        lacking = next((s for s in samples if s.teacher_log_probs is None), None) if need_teacher else None
        if lacking is not None:
            raise UsageError(
                f"--use-opd --opd-type sglang: sample {lacking.index} (group {lacking.group_index}) "
                "carries no 'teacher_log_probs': the teacher engine (--opd-teacher-load / "
                "--opd-teacher-url) scores every sample; without one a custom rollout, reward or "
                "post-process function must set them, and a replayed dump must have been made with OPD"
            )
        batch = samples_to_batch(samples, reward_key, rewards)
        parts = tuple(put(p) for p in split_rollout(batch, batch_cfg, dp_size))
    # Every version that produced a token (None: a sample the engine gave no version for).
    versions = tuple(dict.fromkeys(v for s in samples for v in (s.weight_versions or (None,))))
    return Rollout(rollout_id, metrics, len(samples), versions, parts=parts, **summary)


def pass_at_k(samples: list[Sample], reward_key: str | None) -> dict[str, float]:
    """--log-passrate: the unbiased pass@k estimate (1 - C(n-c, k) / C(n, k)), averaged over the
    prompt groups, for k = 1, 2, 4, ... up to the group size; a sample passes when its reward is
    exactly 1, as slime counts. Keys `pass@{k}`; {} for groups of one."""
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s.scalar_reward(reward_key))
    n = min((len(g) for g in groups.values()), default=1)
    if n < 2:
        return {}
    out = {}
    for k in (2**i for i in range(n.bit_length()) if 2**i <= n):
        estimates = []
        for rewards in groups.values():
            size, correct = len(rewards), sum(r == 1.0 for r in rewards)
            fail = 1.0
            for m in range(size - correct + 1, size + 1):  # prod(1 - k / m): C(n-c, k) / C(n, k)
                fail *= 1.0 - k / m
            estimates.append(1.0 if size - correct < k else 1.0 - fail)
        out[f"pass@{k}"] = statistics.fmean(estimates)
    return out


def reward_categories(samples: list[Sample], key: str, where: str) -> dict[str, float]:
    """--log-reward-category KEY: the share of samples per value of reward[KEY] (`error_cat/{value}`)."""
    counts: dict[str, int] = {}
    for s in samples:
        if not isinstance(s.reward, dict) or key not in s.reward:
            raise UsageError(
                f"--log-reward-category {key}: {where} sample {s.index} has reward {s.reward!r}; the "
                f"reward function must return a dict with the key {key!r}"
            )
        value = str(s.reward[key])
        counts[value] = counts.get(value, 0) + 1
    return {f"error_cat/{value}": count / len(samples) for value, count in sorted(counts.items())}


def multi_turn_metrics(samples: list[Sample], max_response_len: int) -> dict[str, float]:
    """--log-multi-turn, slime's names: the response lengths with the tool and environment tokens
    (raw) and without them (loss-mask sums), and the rounds from metadata["round_number"]."""
    raw = [len(s.loss_mask) if s.loss_mask is not None else s.response_length for s in samples]
    trained = [s.effective_response_length for s in samples]
    out = {
        "raw_response_length/response_length_clip_ratio": sum(n >= max_response_len for n in raw) / len(raw)
    }
    series = {"raw_response_length/response_length": raw, "wo_obs_response_length/response_length": trained}
    rounds = [s.metadata["round_number"] for s in samples if "round_number" in (s.metadata or {})]
    if rounds:
        series["multi_turn_metric/round_number"] = rounds
    for name, values in series.items():
        out.update(
            {f"{name}_mean": statistics.fmean(values), f"{name}_max": max(values), f"{name}_min": min(values)}
        )
    return out


def flag_metrics(cfg: RolloutConfig, samples: list[Sample], prefix: str) -> dict[str, float]:
    """The metrics flags ask for: --log-passrate, --log-reward-category, --log-multi-turn
    (a rollout's; an evaluation set's with its `prefix`, and its reward key)."""
    out: dict[str, float] = {}
    key = cfg.reward_key if prefix == "rollout" else cfg.eval_reward_key or cfg.reward_key
    if cfg.log_passrate:
        head = "passrate/" if prefix == "rollout" else f"{prefix}-"
        out.update({head + k: v for k, v in pass_at_k(samples, key).items()})
    if cfg.log_reward_category:
        out.update(
            {
                f"{prefix}/{k}": v
                for k, v in reward_categories(samples, cfg.log_reward_category, prefix).items()
            }
        )
    if cfg.log_multi_turn and prefix == "rollout":
        out.update(
            {
                f"multi_turn/{k}": v
                for k, v in multi_turn_metrics(samples, cfg.sampling.max_response_len).items()
            }
        )
    return out


def eval_metrics(ds: EvalDataset, samples: list[Sample], cfg: RolloutConfig) -> dict[str, float]:
    """eval/<metric> for the unnamed set; a named set's as slime logs them: eval/<name> (mean reward),
    eval/<name>-truncated_ratio, and the rest under eval/<name>/. The reward reported: --eval-reward-key's
    entry of a dict reward (default: --reward-key's)."""
    reward_key = cfg.eval_reward_key or cfg.reward_key
    metrics = {
        **rollout_metrics(samples, reward_key, prefix=ds.prefix),
        **flag_metrics(cfg, samples, ds.prefix),
    }
    if ds.name is not None:
        if f"{ds.prefix}/reward_mean" not in metrics:  # rollout_metrics leaves it out for dict rewards
            raise ValueError(
                f"{ds.prefix}: the rewards are dicts (a reward function's raw answers); name the one "
                "to report with --reward-key"
            )
        metrics[ds.prefix] = metrics[f"{ds.prefix}/reward_mean"]
        metrics[f"{ds.prefix}-truncated_ratio"] = metrics[f"{ds.prefix}/truncated_ratio"]
    return metrics
