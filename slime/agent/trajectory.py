"""A session's turns → the training samples of its trajectory (slime's TrajectoryManager).

An adapter records every turn of a session: the chat messages of the prompt, the token ids the
engine was given and the ids, log-probs and weight versions it produced (`TurnRecord`), and the
assistant message the reply carried. `get_trajectory` turns the session into samples:

- Turns are mounted in a tree of messages (matched by role and equality, from the root), so a
  sub-agent or a compacted history that starts a new message list grows a branch of its own:
  every leaf is a chain of turns, and a chain gives one sample or more.
- Along a chain, a turn whose prompt ids extend the tokens held so far is appended: its new prompt
  tokens with loss mask 0, its output with loss mask 1 and the engine's log-probs (CLEAN). A
  prompt that differs from the held tokens inside the last response, for a turn of fewer than
  `fork_threshold_tokens` output tokens, replaces that response's span with the prompt's tokens at
  loss mask 0 (REALIGN: the model is not trained on tokens it did not see); any other
  difference closes the sample and starts a new one (FORK).
- A response two leaves share is trained on once: the first chain trains it, the others carry it
  at loss mask 0.
- Every sample gets the session's reward.

The adapters of slime.agent.adapters reuse the token ids of an unchanged history, so an agent
that only appends to its messages never drifts; REALIGN and FORK are for agents that rewrite it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from slime.utils.sample import Sample

logger = logging.getLogger(__name__)

DEFAULT_FORK_THRESHOLD = 1024
"""slime's: a drifted response of this many output tokens or more forks rather than realigns."""


@dataclass(frozen=True)
class TurnRecord:
    """One /generate of a session: the prompt ids the engine got, the ids it produced, their
    log-probs and why it stopped. `weight_versions`: the weight version of every output token
    (ours; empty when the engine reported none)."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float] = field(default_factory=list)
    ill_formed: bool = False
    weight_versions: list[str | None] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    """A vision-language prompt's images, in order (ours): each with `image` (RGB PIL), `inputs`
    (its processor tensors: `pixel_values`, `image_grid_thw`), `num_tokens` and `token_id` (its run
    of placeholder tokens in `prompt_ids`); shared with the session's other turns, not copied."""


class DriftKind(enum.Enum):
    CLEAN = "clean"
    """The prompt ids extend the held tokens exactly."""
    REALIGN = "realign"
    """They differ inside the last response, which was short: that span is taken from the prompt."""
    FORK = "fork"
    """Anything else: the sample is closed and a new one starts."""


class MessageNode:
    """A message of a session's tree. A node with a `turn` is an assistant message the model
    generated (its tokens train); every other node only routes: system, user and tool messages,
    and assistant messages the client wrote or rewrote."""

    def __init__(self, role: str | None = None, message: dict[str, Any] | None = None) -> None:
        self.role = role
        self.message = message
        self.parent: MessageNode | None = None
        self.children: list[MessageNode] = []
        self.turn: TurnRecord | None = None
        self.turn_index: int | None = None
        self.metadata: dict[str, Any] = {}
        self.trained = False
        """Set when a chain has trained this response, so the next chain sharing it does not."""

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def add(self, child: MessageNode) -> MessageNode:
        child.parent = self
        self.children.append(child)
        return child

    def chain(self) -> list[MessageNode]:
        """The nodes from the first below the root down to this one."""
        nodes: list[MessageNode] = []
        node: MessageNode | None = self
        while node is not None and not node.is_root:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def leaves(self) -> Iterator[MessageNode]:
        if not self.children:
            yield self
        for child in self.children:
            yield from child.leaves()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _SampleTokens:
    """The tokens of one sample being built from a chain's turns."""

    def __init__(self, fork_threshold: int) -> None:
        self.fork_threshold = fork_threshold
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[str | None] = []
        self.prompt_len = 0
        """The first turn's prompt: the sample's prompt; everything after it is its response."""
        self.last_response: int | None = None
        """Where the last response starts in `ids`."""
        self.realigned = 0
        self.images: list[Any] = []
        """The images of the last turn added (its prompt holds every earlier image's tokens)."""

    def drift(self, turn: TurnRecord) -> DriftKind:
        agree = common_prefix_len(self.ids, turn.prompt_ids)
        if agree == len(self.ids):
            return DriftKind.CLEAN
        start = self.last_response
        if start is not None and agree >= start and len(turn.output_ids) < self.fork_threshold:
            return DriftKind.REALIGN
        return DriftKind.FORK

    def add(self, turn: TurnRecord, kind: DriftKind, trained: bool) -> None:
        if self.last_response is None:
            self.prompt_len = len(turn.prompt_ids)
        if kind is DriftKind.REALIGN:  # the drifted response is dropped from training
            del self.ids[self.last_response :], self.mask[self.last_response :]
            del self.log_probs[self.last_response :], self.versions[self.last_response :]
            self.realigned += 1
        self._extend(turn.prompt_ids[len(self.ids) :], 0, None, None)
        self.images = list(turn.images)
        self.last_response = len(self.ids)
        self._extend(
            turn.output_ids,
            int(trained),
            turn.output_log_probs if trained else None,
            turn.weight_versions if trained else None,
        )

    def _extend(
        self, ids: list[int], mask: int, log_probs: list[float] | None, versions: list[str | None] | None
    ) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.log_probs += log_probs if log_probs else [0.0] * len(ids)
        self.versions += versions if versions else [None] * len(ids)

    def trains(self) -> bool:
        return any(self.mask[self.prompt_len :])

    def sample(self, base: Sample, metadata: dict[str, Any], max_tokens: int) -> Sample:
        end = min(len(self.ids), max_tokens) if max_tokens else len(self.ids)
        images, end = _whole_images(self.ids, self.images, end)
        start = min(self.prompt_len, end)
        spans: list[list[Any]] = []
        for version in self.versions[start:end]:
            if spans and spans[-1][0] == version:
                spans[-1][1] += 1
            else:
                spans.append([version, 1])
        return Sample(
            group_index=base.group_index,
            index=base.index,
            rollout_id=base.rollout_id if base.rollout_id is not None else base.index,
            prompt=base.prompt,
            label=base.label,
            tokens=self.ids[:end],
            response_length=end - start,
            loss_mask=self.mask[start:end],
            rollout_log_probs=self.log_probs[start:end],
            weight_versions=sorted(
                {v for v in self.versions[start:end] if v is not None}, key=_version_order
            ),
            weight_version_spans=spans,
            reward=0.0,
            status=Sample.Status.COMPLETED,
            metadata={**metadata, "realigned_turns": self.realigned},
            session_id=base.session_id,
            trace=base.trace,  # one execution's trace, shared by the samples split out of it
            multimodal_inputs={"images": [im.image for im in images]} if images else None,
            multimodal_train_inputs=_train_inputs(images),
        )


def _whole_images(ids: list[int], images: list[Any], end: int) -> tuple[list[Any], int]:
    """The images whose placeholder runs lie whole before `end` (a sample cut at max_sample_tokens),
    and `end` moved back to the start of a run it would split."""
    if not images or end >= len(ids):
        return images, end
    kept: list[Any] = []
    at = 0
    for image in images:
        start = ids.index(image.token_id, at)  # the runs appear in order
        if start + image.num_tokens > end:
            return kept, min(end, start)
        kept.append(image)
        at = start + image.num_tokens
    return kept, end


def _train_inputs(images: list[Any]) -> dict[str, Any] | None:
    """The processor tensors of `images` together, as a sample carries them."""
    if not images:
        return None
    import torch

    return {key: torch.cat([im.inputs[key] for im in images]) for key in ("pixel_values", "image_grid_thw")}


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (1 << 62, version)


class TrajectoryManager:
    """The turns of every session of an adapter, and the samples they make (module docstring)."""

    def __init__(self, *, fork_threshold_tokens: int | None = None) -> None:
        self.fork_threshold = (
            DEFAULT_FORK_THRESHOLD if fork_threshold_tokens is None else fork_threshold_tokens
        )
        self._trees: dict[str, MessageNode] = {}
        self._turns: dict[str, int] = {}

    def has_session(self, sid: str) -> bool:
        return sid in self._trees

    def turn_count(self, sid: str) -> int:
        return self._turns.get(sid, 0)

    def record_turn(
        self,
        sid: str,
        *,
        turn: TurnRecord,
        prompt_messages: list[dict[str, Any]],
        response_message: dict[str, Any] | None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Mount the turn: its prompt's messages under the longest matching path of the session's
        tree, its response as a new leaf below them."""
        if not prompt_messages:
            logger.warning("session %s: a turn with no prompt messages is not recorded", sid)
            return
        for name, values in (("log-probs", turn.output_log_probs), ("weight versions", turn.weight_versions)):
            if values and len(values) != len(turn.output_ids):
                raise ValueError(
                    f"session {sid}: {len(values)} {name} for {len(turn.output_ids)} output tokens"
                )
        node = self._trees.setdefault(sid, MessageNode())
        depth = 0
        while depth < len(prompt_messages):
            message = prompt_messages[depth]
            match = next(
                (c for c in node.children if c.role == message.get("role") and c.message == message), None
            )
            if match is None:
                break
            node, depth = match, depth + 1
        node, depth = self._merge_rewrite(sid, node, prompt_messages, depth)
        for message in prompt_messages[depth:]:
            node = node.add(MessageNode(message.get("role"), message))
        leaf = node.add(MessageNode("assistant", response_message))
        leaf.turn = turn
        leaf.turn_index = self._turns[sid] = self._turns.get(sid, 0) + 1
        leaf.metadata = dict(metadata or {})

    def _merge_rewrite(
        self, sid: str, node: MessageNode, messages: list[dict[str, Any]], depth: int
    ) -> tuple[MessageNode, int]:
        """slime's rewrite merge: a client that replays our last (short) response rewritten (a
        whitespace change) would branch, and the abandoned response would train as a sample of
        its own. Where the mount point has exactly one assistant child, a generated leaf of fewer
        than `fork_threshold` tokens, the rewritten message takes its place and the response
        no longer trains (its tokens stay in the chain's prompt)."""
        if self.fork_threshold <= 0 or depth >= len(messages) or messages[depth].get("role") != "assistant":
            return node, depth
        assistants = [c for c in node.children if c.role == "assistant"]
        if len(assistants) != 1:
            if assistants:
                logger.warning(
                    "session %s: %d assistant replies where a rewritten one comes back: a new branch",
                    sid,
                    len(assistants),
                )
            return node, depth
        (old,) = assistants
        if old.children or old.turn is None or len(old.turn.output_ids) >= self.fork_threshold:
            return node, depth
        old.metadata["merged_rewrite"] = {
            "abandoned_turn_index": old.turn_index,
            "abandoned_response_tokens": len(old.turn.output_ids),
        }
        old.turn, old.turn_index, old.message = None, None, messages[depth]
        return old, depth + 1

    def get_trajectory(
        self,
        sid: str,
        *,
        base_sample: Sample,
        reward: float = 0.0,
        extra_metadata: dict[str, Any] | None = None,
        max_sample_tokens: int = 0,
    ) -> list[Sample]:
        """The session's samples, every one with `reward`; the session is gone afterwards (a
        second call returns [])."""
        root = self._trees.pop(sid, None)
        self._turns.pop(sid, None)
        if root is None:
            return []
        samples = []
        for leaf in root.leaves():
            if not leaf.is_root:
                samples += self._chain_samples(leaf.chain(), base_sample, extra_metadata, max_sample_tokens)
        for s in samples:
            s.reward = reward
        return samples

    def drop_session(self, sid: str) -> None:
        self._trees.pop(sid, None)
        self._turns.pop(sid, None)

    def _chain_samples(
        self, chain: list[MessageNode], base: Sample, extra: dict[str, Any] | None, max_tokens: int
    ) -> list[Sample]:
        generated = [n for n in chain if n.turn is not None]
        built: list[_SampleTokens] = []
        forks = 0
        for node in generated:
            assert node.turn is not None
            trained, node.trained = not node.trained, True
            kind = built[-1].drift(node.turn) if built else DriftKind.FORK
            if kind is DriftKind.FORK:
                forks += bool(built)
                built.append(_SampleTokens(self.fork_threshold))
                kind = DriftKind.CLEAN
            built[-1].add(node.turn, kind, trained)
        last = generated[-1].turn if generated else None
        metadata = {
            **(extra or {}),
            "truncated": last is not None and last.finish_reason == "length",
            "use_tool": any((n.message or {}).get("tool_calls") for n in generated),
            "ill_formed": any(n.turn.ill_formed for n in generated),  # type: ignore[union-attr]
            "forked_turns": forks,
        }
        return [b.sample(base, metadata, max_tokens) for b in built if b.trains()]


_common_prefix_len = common_prefix_len  # slime's private name, which its tests import

__all__ = ["DriftKind", "TrajectoryManager", "TurnRecord"]
