"""Shared fixtures: tiny models built locally, torch engines started the way users start them."""

from __future__ import annotations

import os

import pytest

# Several processes share two cores in these tests: keep each one single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)

ENGINE_ARGS = ["--num-threads", "1"]


def make_model(out: str, seed: int = 0, *extra: str) -> str:
    from slime.tools.make_tiny_model import main

    assert main(["--out", out, "--seed", str(seed), *extra]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The default tiny Qwen3 checkpoint (seed 0)."""
    return make_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"), 0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> str:
    """Same architecture, other weights (seed 1): a weight update target."""
    return make_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3-b"), 1)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE checkpoint (4 experts, top-2, 2 layers of width 64; seed 0)."""
    path = str(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")
    return make_model(path, 0, "--arch", "qwen3_moe", "--hidden-size", "64", "--num-layers", "2")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> str:
    """A tiny Qwen3-VL checkpoint (a 2-block vision tower, 2 language-model layers of width 64; seed 0)."""
    path = str(tmp_path_factory.mktemp("models") / "tiny-qwen3-vl")
    return make_model(path, 0, "--arch", "qwen3_vl", "--hidden-size", "64", "--num-layers", "2")


@pytest.fixture(scope="session")
def dot_images():
    """Four 64 x 64 images of the vision task (1 to 4 dots), RGB PIL."""
    import random

    from slime.tools.make_vision_task import draw_dots

    rng = random.Random(0)
    return [draw_dots(n, 64, rng) for n in (1, 2, 3, 4)]


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def start_engine(model_path: str, log_dir, *extra: str, env: dict[str, str] | None = None):
    from slime.engines.torch_engine.launcher import start_torch_engine

    log = os.path.join(str(log_dir), f"engine-{len(os.listdir(str(log_dir)))}.log")
    return start_torch_engine(model_path, [*ENGINE_ARGS, *extra], log_path=log, env=env)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    """A torch engine shared by one test module (tests must leave its weights as they found them)."""
    proc = start_engine(tiny_model, tmp_path_factory.mktemp("engine-logs"))
    yield proc
    assert proc.stop() in (0, -15), "engine did not exit cleanly"


def pytest_sessionfinish(session, exitstatus):
    from tests.ray_cluster import stop_shared

    stop_shared()


PLAIN_JOBS = {
    "test_loop_e2e",
    "test_deterministic",
    "test_debug_modes",
    "test_continuous_e2e",
    "test_check_precision_e2e",
    "test_moe_e2e",
}
"""The modules of the second group of end-to-end jobs (see below)."""


def pytest_addoption(parser):
    parser.addoption(
        "--slow-shard",
        default=None,
        metavar="K/N",
        help="run only shard K (0-based) of N of the slow tests (tests/slow_shards.py; CI runs one)",
    )


def _slow_shard(config, items):
    """--slow-shard K/N: the slow tests of other shards deselected (tests/slow_shards.py)."""
    from tests.slow_shards import assign, load, parse_shard

    k, n = parse_shard(config.getoption("--slow-shard"))
    _, seconds = load()
    shard = assign([i.nodeid for i in items if "slow" in i.keywords], n, seconds)
    other = [i for i in items if shard.get(i.nodeid, k) != k]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [i for i in items if shard.get(i.nodeid, k) == k]


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the group marks into node ids
def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow-shard"):
        _slow_shard(config, items)
    # With pytest-xdist (`-n 2 --dist loadgroup`, the README's command) the end-to-end jobs run
    # in two groups, each one job after another on one worker (a worker's jobs share one Ray
    # cluster): the jobs that time faults (kills, hangs, health checks, restarts) in one, the
    # plain runs of the loop in the other, so both workers run jobs (one group alone was most of
    # the suite's wall time, with the other worker idle at the end).
    # Every other module's tests run on one worker together, so a module's fixtures (an engine,
    # a model, a multi-rank run) are built once, not once on each worker.
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("e2e-loop" if module in PLAIN_JOBS else "e2e"))
        else:
            item.add_marker(pytest.mark.xdist_group(module))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tiny checkpoints of the families beyond Qwen2/Qwen3 (slime.tools.tiny_families), two layers each.
FAMILY_SIZE = (
    "--hidden-size",
    "64",
    "--num-layers",
    "2",
)  # two layers: a linear and a full one, a dense and a MoE one


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from slime.tools.tiny_families import NEW_FAMILIES

    root = tmp_path_factory.mktemp("families")
    return {arch: make_model(str(root / arch), 0, "--arch", arch, *FAMILY_SIZE) for arch in NEW_FAMILIES}
