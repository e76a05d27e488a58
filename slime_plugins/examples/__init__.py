"""Examples of slime's plugin API, each run by a test on CPU with the tiny model
(tests/test_plugin_examples.py). Copy one and change it; each module says which flag takes it.

- calculator_tool: a multi-turn --custom-generate-function-path with a tool whose output is
  masked out of the loss.
- group_rewards: a --custom-rm-path for --group-rm (rewards that compare a group's answers).
- filters: a --dynamic-sampling-filter-path that says why it drops a group.
- rollout_fn: a --rollout-function-path that runs its own asynchronous loop on slime's
  GenerateState and returns RolloutFnTrainOutput with metrics of its own.
"""
