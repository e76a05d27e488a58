"""A reward for whole prompt groups.

    --group-rm --custom-rm-path slime_plugins.examples.group_rewards.shortest_correct

A correct answer (the response, stripped, equals the label) scores 1; the shortest correct
answers of the group score 1.5. A reward like this needs the whole group at once, which is what
`--group-rm` gives: `f(args, samples) -> one reward per sample`, called once per group after
every sample of it is generated.
"""

from __future__ import annotations

from typing import Any

from slime.utils.types import Sample

BONUS = 0.5


async def shortest_correct(args: Any, samples: list[Sample]) -> list[float]:
    correct = [s.response.strip() == str(s.label).strip() for s in samples]
    lengths = [s.response_length for s, ok in zip(samples, correct) if ok]
    shortest = min(lengths) if lengths else None
    return [
        (1.0 + (BONUS if s.response_length == shortest else 0.0)) if ok else 0.0
        for s, ok in zip(samples, correct)
    ]
