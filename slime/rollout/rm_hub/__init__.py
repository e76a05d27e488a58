"""slime's rule-based rewards (`--rm-type`), with slime's entry points `async_rm` and
`batched_async_rm`.

Types: deepscaler, dapo, math, f1, gpqa, random, remote_rm (with `--rm-url`), exact (ours: the
stripped response equals the label), and `boxed_<type>`, which first replaces the response by
the content of its last \\boxed{} ("" when none), then scores it with <type>. A sample's
`metadata["rm_type"]` wins over `--rm-type`. ifbench is refused (see IFBENCH_REFUSAL).

Importing this package is cheap: sympy, pylatexenc and aiohttp are imported when first used.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from slime.config.rollout import BOXED_PREFIX
from slime.rollout.rm_hub.boxed import last_boxed
from slime.rollout.rm_hub.dapo import dapo_reward
from slime.rollout.rm_hub.deps import require

# The names slime's rm_hub exports, which plugins import from it.
from slime.rollout.rm_hub.math_dapo_utils import compute_score as compute_score_dapo
from slime.rollout.rm_hub.math_rules import deepscaler_reward, math_reward
from slime.rollout.rm_hub.math_utils import extract_boxed_answer, grade_answer_verl
from slime.rollout.rm_hub.multiple_choice import gpqa_reward
from slime.rollout.rm_hub.remote import RemoteRewardClient, RemoteRewardError, RemoteRMConfig
from slime.rollout.rm_hub.token_f1 import f1_reward
from slime.utils.errors import UsageError

get_deepscaler_rule_based_reward = deepscaler_reward
compute_gpqa_reward = gpqa_reward

__all__ = [
    "RM_TYPES",
    "RemoteRMConfig",
    "RemoteRewardClient",
    "RemoteRewardError",
    "UnknownRewardType",
    "async_rm",
    "batched_async_rm",
    "check_rm_type",
    "compute_gpqa_reward",
    "compute_score_dapo",
    "extract_boxed_answer",
    "get_deepscaler_rule_based_reward",
    "grade_answer_verl",
    "is_remote",
    "remote_rm",
    "sample_rm_type",
    "score_locally",
    "score_samples",
    "split_rm_type",
]

REMOTE = "remote_rm"
IFBENCH_REFUSAL = (
    "--rm-type ifbench is not built here: slime's scorer clones github.com/allenai/IFBench at run "
    "time and needs its evaluation_lib with spacy, nltk, emoji, immutabledict and syllapy. Score "
    "IFBench with your own --custom-rm-path function instead"
)


def exact_reward(response: str, label: Any) -> float:
    """1.0 when the stripped response equals the stripped label (our demo's arithmetic task)."""
    return float(response.strip() == str(label).strip())


def _random_reward() -> int:
    return random.randint(0, 1)


# name -> (scorer(response, label, metadata), the optional modules it needs)
_LOCAL: dict[str, tuple[Callable[[str, Any, dict[str, Any]], Any], tuple[str, ...]]] = {
    "deepscaler": (lambda r, label, m: deepscaler_reward(r, label), ("sympy", "pylatexenc")),
    "dapo": (lambda r, label, m: dapo_reward(r, label), ()),
    "math": (lambda r, label, m: math_reward(r, label), ("sympy", "pylatexenc")),
    "f1": (lambda r, label, m: f1_reward(r, label), ()),
    "gpqa": (gpqa_reward, ()),
    "random": (lambda r, label, m: _random_reward(), ()),
    "exact": (lambda r, label, m: exact_reward(r, label), ()),
}
RM_TYPES = (*_LOCAL, REMOTE, "ifbench")


class UnknownRewardType(UsageError, NotImplementedError):
    """An rm_type that names no reward (a NotImplementedError too, as slime raises)."""


def split_rm_type(rm_type: str | None) -> tuple[str, bool]:
    """`" boxed_math "` -> ("math", True): the reward's name and whether to unbox first."""
    name = (rm_type or "").strip()
    if name.startswith(BOXED_PREFIX):
        return name[len(BOXED_PREFIX) :], True
    return name, False


def is_remote(rm_type: str | None) -> bool:
    """Whether `rm_type` (maybe `boxed_`-prefixed) scores on the reward server (`--rm-url`)."""
    return split_rm_type(rm_type)[0] == REMOTE


def _known_types() -> str:
    return ", ".join((*RM_TYPES, BOXED_PREFIX + "<type>"))


def check_rm_type(rm_type: str | None, rm_url: str | None = None) -> None:
    """Raise a UsageError naming the fix when `rm_type` cannot score here (bad name, ifbench,
    remote_rm without --rm-url, a missing optional package)."""
    name, _ = split_rm_type(rm_type)
    if name == "ifbench":
        raise UsageError(IFBENCH_REFUSAL)
    if name == REMOTE:
        RemoteRMConfig(url=rm_url or "")
        return
    if name not in _LOCAL:
        raise UnknownRewardType(
            f"--rm-type {rm_type!r} is not a reward type; known: {_known_types()} "
            "(or give --custom-rm-path package.module.function)"
        )
    try:
        require(*_LOCAL[name][1])
    except ImportError as e:
        raise UsageError(f"--rm-type {rm_type}: {e}") from e


def score_locally(rm_type: str | None, response: str, label: Any, metadata: Any = None) -> Any:
    """The reward of one response under a local (not remote_rm) `rm_type`.

    Args:
        rm_type: a name from RM_TYPES other than remote_rm, maybe `boxed_`-prefixed.
        response: the model's text.
        label: the sample's label.
        metadata: the sample's metadata (gpqa reads it; a non-dict counts as {}).
    """
    name, unbox = split_rm_type(rm_type)
    if name == "ifbench":
        raise UsageError(IFBENCH_REFUSAL)
    if name not in _LOCAL:
        what = f"reward type {rm_type!r}" if name else "no reward type"
        raise UnknownRewardType(
            f"{what} (from sample.metadata['rm_type'] or --rm-type); known: {_known_types()}"
        )
    if unbox:
        response = last_boxed(response) or ""
    scorer, _ = _LOCAL[name]
    return scorer(response, label, metadata if isinstance(metadata, dict) else {})


def sample_rm_type(sample: Any, default: str | None) -> str:
    """The sample's reward type: `metadata["rm_type"]` if set, else `default` (stripped).

    Raises:
        UsageError (a ValueError): `metadata["rm_type"]` is set to something not a string.
    """
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    own = metadata.get("rm_type")
    if own is not None and not isinstance(own, str):
        raise UsageError(
            f'sample.metadata["rm_type"] must be a string naming a reward type, got '
            f"{type(own).__name__} {own!r}; known: {_known_types()}"
        )
    return (own or default or "").strip()


async def score_samples(
    samples: list[Any],
    default_rm_type: str | None,
    remote: RemoteRMConfig | None = None,
    *,
    rm_url: str | None = None,
) -> list[Any]:
    """The built-in rewards of `samples` (each sample's own rm_type wins over `default_rm_type`).

    Samples typed remote_rm are POSTed concurrently over one HTTP session, configured by
    `remote`, else built from `rm_url` (--rm-url). The URL is read, and checked, only when some
    sample is remote_rm; a missing or bad one is then a UsageError naming --rm-url.
    """
    rm_types = [sample_rm_type(s, default_rm_type) for s in samples]
    on_server = [is_remote(t) for t in rm_types]
    if not any(on_server):
        return [score_locally(t, s.response, s.label, s.metadata) for t, s in zip(rm_types, samples)]
    async with RemoteRewardClient(remote or RemoteRMConfig(url=rm_url or "")) as client:

        async def one(rm_type: str, sample: Any, post: bool) -> Any:
            if post:
                return await client.score(sample.prompt, sample.response, sample.label)
            return score_locally(rm_type, sample.response, sample.label, sample.metadata)

        return list(await asyncio.gather(*(one(*row) for row in zip(rm_types, samples, on_server))))


def _rm_url(args: Any) -> str | None:
    # Only remote_rm reads --rm-url; an `args` built by hand without it still scores locally.
    return getattr(args, "rm_url", None)


async def remote_rm(
    args: Any, sample: Any, max_retries: int = 10, *, backoff_s: float = 1.0, timeout_s: float = 120.0
) -> Any:
    """POST one sample to `args.rm_url` (slime's signature; the keywords tune the retries)."""
    config = RemoteRMConfig(
        url=args.rm_url or "", max_retries=max_retries, backoff_s=backoff_s, timeout_s=timeout_s
    )
    async with RemoteRewardClient(config) as client:
        return await client.score(sample.prompt, sample.response, sample.label)


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The reward of one sample, as slime computes it.

    The sample's own `custom_rm_path`, else `args.custom_rm_path` (a function `f(args, sample,
    **kwargs)`, sync or async) wins; else the type is `sample.metadata["rm_type"]`, else
    `args.rm_type` (`args.rm_url` for remote_rm).
    """
    path = getattr(sample, "custom_rm_path", None) or args.custom_rm_path
    if path is not None:
        from slime.utils.async_utils import call_maybe_async
        from slime.utils.misc import load_function

        fn = load_function(path, "--custom-rm-path")
        return await call_maybe_async(fn, args, sample, **kwargs)
    return (await score_samples([sample], args.rm_type, rm_url=_rm_url(args)))[0]


async def batched_async_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[Any]:
    """The rewards of several samples: `args.custom_rm_path` scores the whole list at once (a
    group reward function); otherwise each sample is scored as `async_rm` would. Samples with
    their own `custom_rm_path` are scored one by one, as `async_rm` does."""
    if any(getattr(s, "custom_rm_path", None) for s in samples):
        return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
    if args.custom_rm_path is not None:
        from slime.utils.async_utils import call_maybe_async
        from slime.utils.misc import load_function

        fn = load_function(args.custom_rm_path, "--custom-rm-path")
        return await call_maybe_async(fn, args, samples, **kwargs)
    return await score_samples(samples, args.rm_type, rm_url=_rm_url(args))
