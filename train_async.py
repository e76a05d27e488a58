"""One-step-off-policy RL training: rollout k+1 is generated while rollout k trains.

Same flags as train.py; samples are at most one weight version stale (checked).
"""

import sys

from slime.ray.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], off_policy=True))
