"""The OPD teacher engine's side of the rollout (--use-opd --opd-type sglang): each finished
sample's prompt + response goes to the teacher as input ids with no generation, and the teacher's
log-prob of every response token lands on the sample (`teacher_log_probs`, slime's field), at
the rollout temperature. A teacher may have another architecture, never another vocabulary: the
tokenizers are compared before the job starts (`check_same_tokenizer`) and the engine is asked
what its token ids mean at connection (`TeacherScorer.check`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from slime.engines.client import EngineClient, EngineError
from slime.utils.errors import UsageError
from slime.utils.sample import Sample

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PROBE_IDS = 256
"""Token ids the engine is asked to name at connection (spread over the vocabulary)."""


def check_same_tokenizer(student: str, teacher: str, flag: str = "--opd-teacher-load") -> None:
    """Refuse a teacher directory whose tokenizer maps ids to other tokens than --hf-checkpoint's
    (UsageError naming both). A teacher directory without tokenizer files is left to the
    engine's check at connection."""
    from transformers import AutoTokenizer

    if not any(os.path.exists(os.path.join(teacher, f)) for f in TOKENIZER_FILES):
        return
    mine, theirs = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    a, b = mine.get_vocab(), theirs.get_vocab()
    if a == b:
        return
    by_id_a, by_id_b = {i: t for t, i in a.items()}, {i: t for t, i in b.items()}
    differ = next((i for i in sorted(by_id_a) if by_id_a[i] != by_id_b.get(i)), None)
    example = (
        f"; id {differ} is {by_id_a[differ]!r} in the student's and {by_id_b.get(differ)!r} in the teacher's"
        if differ is not None
        else ""
    )
    raise UsageError(
        f"{flag} {teacher!r}: its tokenizer ({len(b)} tokens) is not --hf-checkpoint {student!r}'s ({len(a)} "
        f"tokens){example}. The teacher scores the student's token ids, so both need one vocabulary"
    )


class TeacherScorer:
    """Asks a teacher engine (SGLang's /generate protocol) for the log-probs of samples."""

    def __init__(self, url: str, client: EngineClient, temperature: float):
        self.url = url
        self.client = client
        self.temperature = temperature

    def _payload(self, ids: list[list[int]], starts: list[int], with_text: bool = False) -> dict[str, Any]:
        # slime's reward_func asks from token 0; starting at the last prompt token keeps the answer
        # (and the engine's work) to the response. SGLang's first entry is always None, so the
        # start is the token before the first response token.
        return {
            "input_ids": ids,
            "sampling_params": {
                "temperature": self.temperature,
                "max_new_tokens": 0,
                "skip_special_tokens": False,
            },
            "return_logprob": True,
            "logprob_start_len": starts,
            "return_text_in_logprobs": with_text,
        }

    async def check(self, tokenizer: Any, student: str) -> None:
        """Refuse a teacher whose token ids mean other tokens (UsageError naming both): it is
        asked to name ids spread over the student's vocabulary and its special tokens."""
        # SGLang reports ids >= its vocab_size - 1 as 0: probe below len(tokenizer) - 1 only.
        size = len(tokenizer)
        step = max(1, size // PROBE_IDS)
        ids = sorted({*range(0, size - 1, step), *(i for i in tokenizer.all_special_ids if i < size - 1)})
        try:
            answer = await self.client.request("POST", "/generate", self._payload([ids], [0], True))
        except EngineError as e:
            raise UsageError(
                f"the OPD teacher at {self.url} cannot score the student's token ids 0..{size - 1} "
                f"({e.message}): is its vocabulary --hf-checkpoint {student!r}'s?"
            ) from e
        entries = _entries(answer[0] if isinstance(answer, list) else answer)
        texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
        for (_, token, text), mine, expected in zip(entries, ids, texts, strict=False):
            if token == 0 and mine != 0:  # SGLang's clip of an id past its vocab_size - 1
                continue
            if token != mine or (text is not None and text != expected):
                raise UsageError(
                    f"the OPD teacher at {self.url} has another tokenizer than --hf-checkpoint "
                    f"{student!r}: token id {mine} is {text!r} there and {expected!r} here. The teacher "
                    "scores the student's token ids, so both need one vocabulary"
                )
        if len(entries) != len(ids):
            raise UsageError(
                f"the OPD teacher at {self.url} answered {len(entries)} input log-probs for {len(ids)} "
                "tokens: it does not speak SGLang's logprob_start_len"
            )

    async def score(self, samples: list[Sample]) -> int:
        """Set `teacher_log_probs` on every sample that has none (one request for all of them);
        returns how many it scored."""
        for s in samples:
            if s.teacher_log_probs is None and s.response_length == 0:
                s.teacher_log_probs = []
        todo = [s for s in samples if s.teacher_log_probs is None]
        if not todo:
            return 0
        if any((s.multimodal_inputs or {}).get("images") for s in todo):
            from slime.utils.errors import UsageError

            raise UsageError(
                "--use-opd --opd-type sglang with images (--multimodal-keys) is not built: the teacher "
                "engine scores input-token log-probs, which the engines do not give for prompts with "
                "images; use --opd-type megatron (the teacher's weights in the train pass)"
            )
        ids = [list(s.tokens) for s in todo]
        starts = [len(s.tokens) - s.response_length - 1 for s in todo]
        answer = await self.client.request("POST", "/generate", self._payload(ids, starts))
        answers = answer if isinstance(answer, list) else [answer]
        for sample, one in zip(todo, answers, strict=True):
            sample.teacher_log_probs = response_log_probs(one, sample, f"the OPD teacher at {self.url}")
        return len(todo)

    async def score_all(self, samples: list[Sample], per_request: int = 16) -> int:
        """`score` in requests of at most `per_request` samples, all in flight at once; returns
        how many it scored."""
        chunks = [samples[i : i + per_request] for i in range(0, len(samples), per_request)]
        return sum(await asyncio.gather(*(self.score(c) for c in chunks)))


def response_log_probs(answer: Any, sample: Sample, teacher: str) -> list[float]:
    """The sample's response log-probs from a /generate answer's input_token_logprobs: its last
    `response_length` entries (SGLang's layout: the first entry None, whatever logprob_start_len)."""
    entries = _entries(answer)
    n = sample.response_length
    values = [lp for lp, _, _ in entries][len(entries) - n :] if len(entries) >= n else []
    if len(values) != n or any(v is None for v in values):
        raise RuntimeError(
            f"{teacher} gave {sum(v is not None for v in values)} log-probs for sample {sample.index}'s "
            f"{n} response tokens (input_token_logprobs from logprob_start_len, the first entry None, as "
            "SGLang answers)"
        )
    return [float(v) for v in values]


def _entries(answer: Any) -> list[tuple[Any, int, Any]]:
    meta = answer.get("meta_info", {}) if isinstance(answer, dict) else {}
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list):
        raise RuntimeError("the OPD teacher's answer has no meta_info.input_token_logprobs")
    return [(e[0], int(e[1]), e[2] if len(e) > 2 else None) for e in entries]
