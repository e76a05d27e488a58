"""The rules between settings read the typed records (slime.config.checks, model_checks): a
record changed in place, with no command line behind it, is judged the same way."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os

import pytest

from slime.config.arguments import parse
from slime.config.checks import config_problems
from slime.config.model_checks import model_problems


@pytest.fixture
def config(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    argv = ["--hf-checkpoint", "/m", "--prompt-data", str(prompts), "--rollout-batch-size", "4"]
    parsed = parse([*argv, "--n-samples-per-prompt", "2", "--num-rollout", "3", "--rm-type", "exact"])
    assert parsed.problems == [] and parsed.config is not None
    # No namespace behind it: a rule that read the command line would fail here.
    return dataclasses.replace(parsed.config, args=argparse.Namespace())


def test_a_valid_config_has_no_problem(config):
    assert list(config_problems(config)) == [] and list(model_problems(config)) == []


def _first(config, **records):
    return next(iter(config_problems(dataclasses.replace(config, **records))), None)


def test_each_rule_reads_the_record_it_names(config):
    c = config
    assert "is not a multiple of --rollout-num-gpus-per-engine 2" in _first(
        c, cluster=dataclasses.replace(c.cluster, rollout_num_gpus=3, rollout_num_gpus_per_engine=2)
    )
    colocated = dataclasses.replace(c.cluster, colocate=True, actor_num_gpus_per_node=2)
    assert "--colocate puts engines on the trainer's 2 devices, but --rollout-num-gpus is 1" in _first(
        c, cluster=colocated
    )
    batch = dataclasses.replace(c.train.batch, global_batch_size=3)
    assert "= 8 samples per rollout, not a multiple of --global-batch-size 3" in _first(
        c, train=dataclasses.replace(c.train, batch=batch)
    )
    fully_async = dataclasses.replace(c.rollout.asynchrony, fully_async=True)
    rollout = dataclasses.replace(c.rollout, asynchrony=fully_async, rollout_function_path="m.f")
    assert "--rollout-function-path replaces it" in _first(c, rollout=rollout)
    bridge = dataclasses.replace(c.bridge, mode="delta", transport="disk", disk_dir="/d")
    assert "needs --update-weight-local-checkpoint-dir" in _first(c, bridge=bridge)
    assert "--save-interval needs --save DIR" in _first(
        c, checkpoint=dataclasses.replace(c.checkpoint, save_interval=2)
    )
    debug = dataclasses.replace(c.debug, rollout_only=True, check_weight_sync=True)
    assert "--check-weight-sync checks the weight push" in _first(c, debug=debug)
    megatron = dataclasses.replace(c.train.megatron, tensor_model_parallel_size=2)
    assert "--tensor-model-parallel-size configure --train-backend megatron" in _first(
        c, train=dataclasses.replace(c.train, megatron=megatron)
    )


def test_model_rules_read_the_train_record(config, tiny_model):
    lora = dataclasses.replace(config.train.lora, rank=8)
    train = dataclasses.replace(config.train, hf_checkpoint=tiny_model, lora=lora)
    assert list(model_problems(dataclasses.replace(config, train=train))) == []  # Qwen3 takes LoRA
    moe = dataclasses.replace(config.train.moe, moe_router_bias_update_rate=1e-3)
    train = dataclasses.replace(train, moe=moe)
    (problem,) = model_problems(dataclasses.replace(config, train=train))
    assert problem.startswith("--moe-router-bias-update-rate 0.001 needs routers with an expert bias")


def test_no_rule_between_settings_reads_the_namespace():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slime", "config")
    for name in ("checks.py", "model_checks.py"):
        tree = ast.parse(open(os.path.join(root, name)).read())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "argparse" not in imported and "args" not in read and "ns" not in names, name
