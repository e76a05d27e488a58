"""Synchronous RL training: generate rollout k, train on it, push the weights, repeat.

python train.py --hf-checkpoint DIR --prompt-data FILE --rollout-batch-size N ... (--help)
"""

import sys

from slime.ray.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], off_policy=False))
