"""train.py on a real two-node Ray cluster on this machine (nodes on loopback addresses), attached
with RAY_ADDRESS: the train ranks sit on both nodes and rendezvous on rank 0's node, engines
bind their node's address, and every push of each transport is checked by fingerprints."""

from __future__ import annotations

import json
import re

import pytest

from tests.ray_cluster import HEAD_IP, RayCluster
from tests.test_loop_e2e import prompts, run_job  # noqa: F401

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster():
    # One CPU per node and colocated layouts: each node holds one bundle (train rank and engine).
    c = RayCluster(head_cpus=1, nodes={"127.0.0.2": 1})
    yield c
    c.stop()


def _job(cluster, tiny_model, prompts, tmp_path, transport):
    return run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--colocate",
        "--actor-num-gpus-per-node",
        "2",
        "--update-weight-transport",
        transport,
        "--check-weight-sync",
        env={"RAY_ADDRESS": cluster.address},
    )


# ~35 s, and the one default job that timed out under load; the refusals below stay in the default
# run on the same two-node cluster, the rendezvous and the group's addresses are tested in process
# (tests/test_distributed_topology.py)
@pytest.mark.slow
def test_two_nodes_train_and_push_over_a_distributed_group(cluster, tiny_model, prompts, tmp_path):
    proc = _job(cluster, tiny_model, prompts, tmp_path, "distributed")
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = proc.stderr
    address, _, nodes = re.search(
        r"train ranks rendezvous at ([\d.]+):(\d+) \(rank nodes: ([^)]*)\)", err
    ).groups()
    rank_nodes = nodes.split(", ")
    assert sorted(rank_nodes) == sorted([HEAD_IP, "127.0.0.2"])  # one rank on each node
    assert address == rank_nodes[0]  # rank 0's node as Ray knows it, not loopback's default
    engine_nodes = re.search(r"engine nodes: (.*)", err).group(1).split(", ")
    assert engine_nodes == rank_nodes  # colocated: engine j on train rank j's node
    for url, node in zip(re.search(r"engines: (.*)", err).group(1).split(", "), engine_nodes, strict=True):
        assert url.startswith(f"http://{node}:")  # an engine on a cluster binds its node's address
    for j in range(2):  # engines on node addresses take requests that carry the job's key only
        assert "API key required" in (tmp_path / "logs" / f"engine{j}.log").read_text()
    # 1 + the engines' TP sizes; the store on train rank 0's node, which the far engine reaches.
    assert f"a group of 3 with its master on {address}" in err
    # After each push (a log line Ray forwards twice under load still names its version once).
    assert set(
        re.findall(r"--check-weight-sync: 46 tensors match on every engine, weight version (\d+)", err)
    ) == {
        "1",
        "2",
    }
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["push/transport"] for r in records] == ["distributed_gloo", "distributed_gloo"]


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_node_local_transports_refuse_a_far_engine(cluster, tiny_model, prompts, tmp_path, transport):
    # Engine 1 sits with train rank 1 on the other node: shared-memory files and the temporary
    # directory of train rank 0's node do not reach it. One line, exit 2, naming the fix, before
    # any engine or train rank starts (the placement group's nodes tell).
    proc = _job(cluster, tiny_model, prompts, tmp_path, transport)
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert (
        "not on train rank 0's node" in errors[0] and "use --update-weight-transport distributed" in errors[0]
    )
    assert "slime job" not in proc.stderr and not list((tmp_path / "logs").glob("engine*.log"))


# In -m slow (21 s and 12 s; the default suite keeps 10 min): the tensor transport on one node is
# what most end-to-end jobs push with, and the two-node placement is run by the test above.
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_node_local_transports_work_on_one_node(cluster, tiny_model, prompts, tmp_path, transport):
    # One train rank and its colocated engine share one bundle, so one node (either): shared
    # memory and the temporary directory reach the engine, at its node address, with the key.
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--colocate",
        "--update-weight-transport",
        transport,
        "--check-weight-sync",
        env={"RAY_ADDRESS": cluster.address},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    node = re.search(r"rank nodes: ([\d.]+)\)", proc.stderr).group(1)
    assert node in (HEAD_IP, "127.0.0.2") and re.search(r"engine nodes: (.*)", proc.stderr).group(1) == node
    assert re.search(r"engines: (.*)", proc.stderr).group(1).startswith(f"http://{node}:")
    versions = re.findall(
        r"--check-weight-sync: 46 tensors match on every engine, weight version (\d+)", proc.stderr
    )
    assert set(versions) == {"1", "2"}
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    label = {"tensor": "shared_memory", "disk": "disk"}[transport]
    assert [r["push/transport"] for r in records] == [label, label]
