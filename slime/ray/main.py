"""Entry point shared by train.py and train_async.py: parse, run, turn failures into exit codes."""

from __future__ import annotations

import logging
import sys

from slime.config.profile import log_directory
from slime.ray.cli import parse_args
from slime.utils.logging_utils import configure_logging

logger = logging.getLogger("slime")


def main(argv: list[str] | None = None, off_policy: bool = False) -> int:
    import faulthandler

    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's Python stack
    configure_logging("driver")
    config = parse_args(argv)  # exits 2 on bad flags
    log_dir = log_directory(config.checkpoint.save)
    from slime.ray.driver import run
    from slime.utils.errors import UsageError

    try:
        return run(config, off_policy=off_policy, log_dir=log_dir)
    except UsageError as e:  # a bad input, found in the driver or inside an actor: its message only
        logger.error("%s", getattr(e, "cause", None) or e)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130
    except Exception as e:  # an actor's error arrives here with its remote traceback
        # Imported on failure only: the weight check's module loads torch, which the driver
        # otherwise never needs.
        from slime.bridge.verify import WeightSyncError
        from slime.debug.hang import HangError
        from slime.debug.precision import PrecisionError
        from slime.loop.parts import TrainRankDied

        if isinstance(
            e, PrecisionError | HangError | WeightSyncError | TrainRankDied
        ):  # the message says what failed
            logger.error(
                "%s", getattr(e, "cause", None) or e
            )  # from an actor: its message, not its traceback
            return 1
        cause = getattr(e, "cause", None)  # a RayTaskError's original exception
        headline = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
        logger.error("job failed: %s\n%s", headline, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
