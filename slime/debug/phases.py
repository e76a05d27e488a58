"""--debug-phase-hook MODULE.FUNCTION: a user function called as `FUNCTION(phase, info)` at named
moments of a step, in the process that runs them, so that a test can act (kill an engine, a rank,
the router) at exactly that moment instead of after a sleep. Off unless the flag is given.

| phase | process | info |
|---|---|---|
| `group_generated` | rollout manager | rollout_id, evaluation, groups (so far), engine, engines, router |
| `rollout_done` | driver | rollout_id, engines |
| `release` / `resume` | driver | version, engines, tags (resume) |
| `push` | driver | version, engines |
| `push_bucket` | train rank 0 | version, bucket (index), engines, transport |
| `admitted` | driver | engine (address), index: a restarted engine has the weights and takes requests |
| `train` / `save` | every train rank | rank, rollout_id |

`engines` are the addresses of the engines up at that moment; `router` is the router's address,
or None. What the function raises fails
that phase, as any other error there would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PhaseHook = Callable[..., None]
"""hook(phase, **info)"""


def no_hook(phase: str, **info: Any) -> None:
    return None


def load_phase_hook(path: str | None) -> PhaseHook:
    """The hook `--debug-phase-hook` names, or one that does nothing."""
    if path is None:
        return no_hook
    from slime.utils.misc import load_function

    fn = load_function(path, "--debug-phase-hook")

    def hook(phase: str, **info: Any) -> None:
        fn(phase, info)

    return hook
