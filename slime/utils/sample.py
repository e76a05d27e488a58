"""The Sample record: one response to one prompt, with slime's field names and methods.

Samples travel between the rollout manager, reward, generate and rollout functions, dumps and
the train side. This is the one Sample class of the project; `slime.utils.types.Sample` is the
same class, at the path slime's plugins import it from. It has every field of slime's Sample
(many stay at their defaults here: the multimodal inputs, the top-p replay, the routed experts,
the teacher log-probs), so a plugin that reads or sets them works and a dump keeps them.

`to_dict` gives plain values (numbers, strings, lists, dicts, tensors) so a dump loads with
`torch.load(weights_only=True)`; `from_dict` reads ours and slime's, keeping unknown keys as
attributes as slime does.
"""

from __future__ import annotations

import base64
import copy
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from slime.utils.rollout_batch import RolloutBatch


def int32_meta_array(meta_info: dict[str, Any], keys: str | Iterable[str]) -> Any:
    """The first of `keys` in an engine's meta_info as a flat int32 tensor, or None. SGLang
    sends these arrays base64-encoded (routed experts, top-p replay ids); lists and tensors are
    taken as they are."""
    import torch

    for key in (keys,) if isinstance(keys, str) else keys:
        if key in meta_info:
            value = meta_info[key]
            break
    else:
        return None
    if value is None:
        return None
    if isinstance(value, str):
        value = base64.b64decode(value.encode("ascii"))
    if isinstance(value, bytes | bytearray | memoryview):
        return torch.frombuffer(bytearray(value), dtype=torch.int32)
    return torch.as_tensor(value, dtype=torch.int32).reshape(-1)


def _images_as(inputs: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """`multimodal_inputs` with its decoded images as uint8 pixel tensors [H, W, 3] (`kind` "tensor":
    a dump's, read with weights_only=True) or RGB PIL images ("image": a sample's). A reference (a
    path, URL, base64, bytes) stays as given, as in slime: a dump loads where the images are not."""
    if not inputs or not inputs.get("images"):
        return inputs
    from slime.utils.processing_utils import image_to_tensor, tensor_to_image

    def convert(image: Any) -> Any:
        if kind == "tensor":  # a decoded image is PIL's (not imported here: a dump may hold none)
            return image_to_tensor(image) if type(image).__module__.startswith("PIL.") else image
        is_pixels = hasattr(image, "numpy") and getattr(image, "dim", lambda: 0)() == 3
        return tensor_to_image(image) if is_pixels else image

    return {**inputs, "images": [convert(image) for image in inputs["images"]]}


def _ints(values: Any) -> list[int]:
    if values is None:
        return []
    if hasattr(values, "tolist"):
        values = values.reshape(-1).tolist()
    return [int(v) for v in values]


def _floats(values: Any) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.reshape(-1).tolist()
    return [float(v) for v in values]


class _Counts:
    """Integer counters summed over a sample's /generate calls: `_META` maps the engine's
    meta_info keys to the fields; to_dict/from_dict as slime's SpecInfo and PrefixCacheInfo."""

    _META: ClassVar[dict[str, str]] = {}

    def add(self, meta_info: dict[str, Any]) -> None:
        for key, name in self._META.items():
            setattr(self, name, getattr(self, name) + int(meta_info.get(key, 0)))

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Any:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: int(v) for k, v in (data or {}).items() if k in names})


_FINISH = {"length": "truncated", "abort": "aborted", "stop": "completed"}


@dataclass
class Sample:
    """One response to one prompt (slime's fields, in slime's order).

    `tokens` holds prompt + response ids; the last `response_length` of them are the response,
    and `loss_mask` / `rollout_log_probs` have one entry per response token. `reward` is a float
    or, for reward functions that return several values, a dict (the train side reads
    `reward_key` from it). `weight_versions` lists the engine weight version of every /generate
    call that produced the response (several when a request was continued across a push).

    Differences from slime: `index` and `group_index` default to 0 (the rollout numbers every
    sample before it is used), and `Status` members also compare equal to their strings.
    """

    class Status(str, enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"  # stopped on EOS or a stop string/token
        TRUNCATED = "truncated"  # hit the max-new-tokens budget
        ABORTED = "aborted"  # aborted by the manager (over-sampling, shutdown)
        FAILED = "failed"  # the engine, a tool or the generate function failed for this sample

    @dataclass
    class SpecInfo(_Counts):
        """Speculative decoding counts summed over the sample's /generate calls."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0
        _META: ClassVar[dict[str, str]] = {
            "spec_accept_token_num": "spec_accept_token_num",
            "spec_draft_token_num": "spec_draft_token_num",
            "spec_verify_ct": "spec_verify_ct",
            "completion_tokens": "completion_token_num",
        }

        @property
        def spec_accept_rate(self) -> float:
            return (
                self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0
            )

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

    @dataclass
    class PrefixCacheInfo(_Counts):
        """Prompt tokens the engine found in its prefix cache, summed over /generate calls."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0
        _META: ClassVar[dict[str, str]] = {
            "cached_tokens": "cached_tokens",
            "prompt_tokens": "total_prompt_tokens",
        }

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    group_index: int = 0
    index: int = 0
    rollout_id: int | None = None  # one id for every sample split out of one rollout execution
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None  # ragged: response token i kept ids[offsets[i]:offsets[i+1]]
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None  # [tokens - 1, layers, top-k]: the engine's experts per token
    remove_sample: bool = False  # kept in the batch with its loss masked out
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None  # this sample's own --custom-generate-function-path
    custom_rm_path: str | None = None  # this sample's own --custom-rm-path
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    trace: dict[str, Any] | None = None
    """The sample's trace (slime.observability.trace_utils: spans and events of its generation,
    reward and agent turns, as plain values); None until something traces it. slime sets it as an
    attribute beyond its fields; its to_dict and from_dict carry it alike."""
    # Ours, beyond slime's fields:
    weight_version_spans: list[list[Any]] = field(default_factory=list)
    """[weight version, tokens] runs over the response tokens in order: the weights that made
    each token (None: not generated by a model, or the engine reported no version). Empty when
    nothing recorded them (a custom function that set the tokens itself, an older dump)."""

    # --- conversion -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A deep copy as plain values; attributes set on the sample beyond its fields are kept."""
        d = copy.deepcopy(self.__dict__)
        d["status"] = Sample.Status(self.status).value
        d["spec_info"] = self.spec_info.to_dict()
        d["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        d["multimodal_inputs"] = _images_as(d["multimodal_inputs"], "tensor")
        return d

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """A Sample from `to_dict` output: ours, an older dump of ours (one `weight_version`), or
        slime's. Keys that are not fields become attributes, as in slime."""
        data = dict(data)
        if "weight_version" in data and "weight_versions" not in data:
            version = data.pop("weight_version")
            data["weight_versions"] = [] if version is None else [str(version)]
        data["status"] = Sample.Status(data.get("status", "pending"))
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info"))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info"))
        data["multimodal_inputs"] = _images_as(data.get("multimodal_inputs"), "image")
        names = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    # --- what plugins call --------------------------------------------------------------------

    def get_reward_value(self, args: Any) -> Any:
        """slime's accessor: the reward, or its `args.reward_key` entry (--reward-key)."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward

    def token_weight_versions(self) -> list[str | None] | None:
        """The weight version of every response token, from `weight_version_spans` (None when
        they were not recorded)."""
        if not self.weight_version_spans:
            return None
        out: list[str | None] = []
        for version, n in self.weight_version_spans:
            out.extend([None if version is None else str(version)] * int(n))
        return out

    def _add_spans(self, count: int, meta: dict[str, Any] | None, trainable: bool) -> None:
        """Record which weights made `count` new response tokens (see weight_version_spans)."""
        if not count:
            return
        spans: list[list[Any]] = [[None, count]]
        if trainable and meta:
            given = meta.get("weight_version_spans")
            if given:
                spans = [[None if v is None else str(v), int(n)] for v, n in given]
                if sum(n for _, n in spans) != count:
                    raise ValueError(
                        f"meta_info: weight_version_spans cover {sum(n for _, n in spans)} tokens, "
                        f"the response got {count}"
                    )
            elif meta.get("weight_version") is not None:
                spans = [[str(meta["weight_version"]), count]]
        if not self.weight_version_spans and self.response_length - count:  # tokens before any record
            self.weight_version_spans = [[None, self.response_length - count]]
        for version, n in spans:
            if self.weight_version_spans and self.weight_version_spans[-1][0] == version:
                self.weight_version_spans[-1][1] += n
            else:
                self.weight_version_spans.append([version, n])

    @property
    def effective_response_length(self) -> int:
        """Response tokens that count in the loss."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Extend the response, keeping `loss_mask`, `rollout_log_probs` and the replay data one
        entry per response token (slime's method and rules).

        Tokens the model generated: `trainable=True` with their log-probs and the engine's
        `meta_info`. Tokens from a tool or an environment: `trainable=False`, no log-probs; they
        get loss-mask 0 and log-prob 0. With `update_terminal_info`, a meta_info carrying a
        finish_reason sets the status and adds the weight version and the cache counts.
        """
        new = _ints(tokens)
        lps = _floats(log_probs)
        if lps is not None and len(lps) != len(new):
            raise ValueError(f"append_response_tokens: {len(lps)} log_probs for {len(new)} tokens")
        if new and trainable and lps is None:
            raise ValueError("append_response_tokens: trainable tokens need their rollout log_probs")
        if new and not trainable:
            if lps is not None:
                raise ValueError("append_response_tokens: non-trainable tokens take no log_probs")
            lps = [0.0] * len(new)
        if text is not None:
            self.response += text
        before = self.response_length
        if new:
            self.tokens = list(self.tokens) + new
            self.response_length += len(new)
            self.loss_mask = (list(self.loss_mask) if self.loss_mask is not None else [1] * before) + [
                int(trainable)
            ] * len(new)
        if lps is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError(
                        "append_response_tokens: the sample has response tokens without rollout_log_probs; "
                        "trainable tokens cannot be appended to it"
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = list(self.rollout_log_probs) + lps
        self._add_spans(len(new), meta_info, trainable)
        if meta_info is not None or (new and not trainable):
            self._apply_meta_info(args, meta_info or {}, len(new), not trainable, update_terminal_info)
        self.check_lengths()

    def _apply_meta_info(
        self, args: Any, meta: dict[str, Any], count: int, pad_top_p: bool, terminal: bool
    ) -> None:
        import torch

        top_p = None
        if count:
            ids = int32_meta_array(meta, ("top_p_token_ids", "top_p_kept_token_ids"))
            offsets = int32_meta_array(meta, ("top_p_token_offsets", "top_p_kept_token_offsets"))
            if (ids is None) != (offsets is None):
                raise ValueError("meta_info: top-p replay needs both token ids and offsets")
            if offsets is not None:
                if offsets.numel() != count + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
                    raise ValueError(
                        f"meta_info: top-p offsets ({offsets.numel()}, from "
                        f"{int(offsets[0]) if offsets.numel() else None}"
                        f" to {int(offsets[-1]) if offsets.numel() else None}) do not fit {count} tokens "
                        f"and {ids.numel()} ids"
                    )
                top_p = (ids, offsets)
        have = self.rollout_top_p_token_offsets is not None
        if top_p is not None or (pad_top_p and count and have):
            old_ids = torch.as_tensor(_ints(self.rollout_top_p_token_ids), dtype=torch.int32)
            old_off = torch.as_tensor(_ints(self.rollout_top_p_token_offsets) or [0], dtype=torch.int32)
            end = int(old_off[-1])
            ids, offsets = (
                top_p if top_p is not None else (old_ids[:0], torch.zeros(count + 1, dtype=torch.int32))
            )
            self.rollout_top_p_token_ids = torch.cat([old_ids, ids])
            self.rollout_top_p_token_offsets = torch.cat([old_off, offsets[1:] + end])
        experts = int32_meta_array(meta, "routed_experts")
        if experts is not None:
            layers, topk = getattr(args, "num_layers", None), getattr(args, "moe_router_topk", None)
            if not layers or not topk:
                raise ValueError(
                    "meta_info has routed_experts: args.num_layers and args.moe_router_topk are needed"
                )
            start = int(meta.get("routed_experts_start_len") or 0)
            rows = max(0, len(self.tokens) - 1 - start)
            if start < 0 or experts.numel() != rows * layers * topk:
                raise ValueError(
                    f"meta_info: {experts.numel()} routed experts do not fit {rows} tokens x {layers} layers "
                    f"x top-{topk} (routed_experts_start_len {start}, {len(self.tokens)} tokens)"
                )
            experts = experts.reshape(rows, layers, topk)
            if start:
                if self.rollout_routed_experts is None or len(self.rollout_routed_experts) < start:
                    raise ValueError(
                        f"meta_info: routed_experts_start_len {start} but fewer rows recorded so far"
                    )
                experts = torch.cat(
                    [torch.as_tensor(self.rollout_routed_experts)[:start].to(experts.dtype), experts]
                )
            self.rollout_routed_experts = experts
        if not terminal or "finish_reason" not in meta:
            return
        if getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta)
        self.prefix_cache_info.add(meta)
        spans = meta.get("weight_version_spans")
        if spans:  # a request that went on across a weight update: each version that made tokens
            for version, _ in spans:
                if version is not None and (
                    not self.weight_versions or self.weight_versions[-1] != str(version)
                ):
                    self.weight_versions.append(str(version))
        elif meta.get("weight_version") is not None:
            self.weight_versions.append(str(meta["weight_version"]))
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish in _FINISH:
            self.status = Sample.Status(_FINISH[finish])

    def check_lengths(self) -> None:
        """loss_mask, rollout_log_probs, the version spans and the top-p offsets have one entry
        per response token."""
        if (
            self.weight_version_spans
            and sum(int(n) for _, n in self.weight_version_spans) != self.response_length
        ):
            raise ValueError(
                f"sample {self.index}: weight_version_spans cover "
                f"{sum(int(n) for _, n in self.weight_version_spans)} tokens, response_length is "
                f"{self.response_length}"
            )
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs"):
            value = getattr(self, name)
            if value is not None and len(value) != self.response_length:
                raise ValueError(
                    f"sample {self.index}: {name} has {len(value)} entries, response_length is "
                    f"{self.response_length}"
                )
        if (self.rollout_top_p_token_ids is None) != (self.rollout_top_p_token_offsets is None):
            raise ValueError(f"sample {self.index}: top-p replay needs both token ids and offsets")
        if self.rollout_top_p_token_offsets is not None:
            offsets = _ints(self.rollout_top_p_token_offsets)
            if len(offsets) != self.response_length + 1 or offsets[-1] != len(
                _ints(self.rollout_top_p_token_ids)
            ):
                raise ValueError(
                    f"sample {self.index}: {len(offsets)} top-p offsets for {self.response_length} "
                    "response tokens"
                )

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward the advantage estimator uses (a dict reward needs `reward_key`)."""
        if isinstance(self.reward, dict):
            if reward_key is None or reward_key not in self.reward:
                raise KeyError(
                    f"sample {self.index}: reward is a dict with keys {sorted(self.reward)}; "
                    "name the one to train on with --reward-key"
                )
            return float(self.reward[reward_key])
        if self.reward is None:
            raise ValueError(f"sample {self.index} has no reward (was the reward function run?)")
        return float(self.reward)


Status = Sample.Status


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """The samples as their prompt groups (by `group_index`, in order of first appearance)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


def _loss_mask(sample: Sample) -> list[int]:
    """One entry per response token; a sample marked `remove_sample` counts in no loss (it still
    counts in its group's advantage normalisation, as in slime)."""
    sample.check_lengths()
    if sample.remove_sample:
        return [0] * sample.response_length
    return list(sample.loss_mask) if sample.loss_mask is not None else [1] * sample.response_length


def samples_to_batch(
    samples: list[Sample], reward_key: str | None = None, post_processed: list[float] | None = None
) -> RolloutBatch:
    """The train side's view of a rollout (engine log-probs only if every sample has them).
    `post_processed`: the rewards of --custom-reward-post-process-path, trained on as they are."""
    have_lp = all(s.rollout_log_probs is not None for s in samples)
    have_routing = all(s.rollout_routed_experts is not None for s in samples)
    have_teacher = all(s.teacher_log_probs is not None for s in samples)
    return RolloutBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        rewards=post_processed
        if post_processed is not None
        else [s.scalar_reward(reward_key) for s in samples],
        rewards_normalized=post_processed is not None,
        group_indices=[s.group_index for s in samples],
        loss_masks=[_loss_mask(s) for s in samples],
        rollout_log_probs=[list(s.rollout_log_probs or []) for s in samples] if have_lp else None,
        rollout_routed_experts=[s.rollout_routed_experts for s in samples] if have_routing else None,
        teacher_log_probs=[[float(x) for x in s.teacher_log_probs or []] for s in samples]
        if have_teacher
        else None,
        sample_indices=[s.index for s in samples],
        rollout_ids=[s.rollout_id for s in samples]
        if any(s.rollout_id is not None for s in samples)
        else None,
        weight_versions=[s.weight_versions[0] if len(set(s.weight_versions)) == 1 else None for s in samples],
        multimodal_train_inputs=[s.multimodal_train_inputs for s in samples]
        if any(s.multimodal_train_inputs for s in samples)
        else None,
    )
