"""slime: an RL post-training framework for LLMs.

`import slime` stays light: no torch.distributed, Ray, SGLang or Megatron at import time.
"""

__version__ = "0.1.0"
