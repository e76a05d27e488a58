"""slime.debug.breakpoint with two real gloo ranks, pdb driven from the test (stdin, then a socket)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import datetime, logging, os, torch, torch.distributed as dist
import slime.debug
logging.basicConfig(level=logging.INFO, format="%(message)s")
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2, init_method=os.environ["INIT"],
                        timeout=datetime.timedelta(seconds=5))
rank = dist.get_rank()
secret = 41 + rank
x = torch.tensor([rank + 1.0])
slime.debug.breakpoint(rank=int(os.environ["STOP_RANK"]))
dist.all_reduce(x)
print(f"rank {rank} after breakpoint: {x.item()}", flush=True)
dist.destroy_process_group()
"""


def _start(tmp_path, stop_rank, **env):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "INIT": f"tcp://127.0.0.1:{port}",
        "STOP_RANK": str(stop_rank),
        **env,
    }
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return [
        subprocess.Popen([sys.executable, str(script)], env={**base, "RANK": str(r)}, **pipes) for r in (0, 1)
    ]


def test_one_rank_in_pdb_while_the_other_waits_past_the_collective_timeout(tmp_path):
    ranks = _start(tmp_path, 0)
    # Inspect, then stay in the debugger longer than the group's 5 s collective timeout.
    out0, err0 = ranks[0].communicate("p secret\np x\n!import time; time.sleep(8)\nc\n", timeout=120)
    out1, err1 = ranks[1].communicate(timeout=120)
    assert ranks[0].returncode == 0 and ranks[1].returncode == 0, (err0, err1)
    assert "(Pdb rank 0)" in out0 and "\n41\n" in out0.replace("(Pdb rank 0) ", "\n")
    assert "tensor([1.])" in out0
    assert "rank 1 waiting at slime.debug.breakpoint while rank 0 is in pdb" in err1
    # Released together: the collective after the breakpoint completes on both ranks.
    assert "rank 0 after breakpoint: 3.0" in out0 and "rank 1 after breakpoint: 3.0" in out1


def test_pdb_over_a_socket_and_quit_ends_every_rank(tmp_path):
    ranks = _start(tmp_path, 1, SLIME_PDB_PORT="0")
    for line in ranks[1].stderr:
        match = re.search(r"attach with: nc (\S+) (\d+)", line)
        if match:
            break
    else:
        raise AssertionError("rank 1 never offered a pdb port")
    assert "rank 1 stopped in pdb at" in line and "job.py" in line
    with socket.create_connection((match[1], int(match[2])), timeout=60) as conn:
        conn.sendall(b"p secret\nq\n")
        received = b""
        while chunk := conn.recv(4096):
            received += chunk
    assert b"(Pdb rank 1)" in received and b"42" in received
    _, err0 = ranks[0].communicate(timeout=120)
    _, err1 = ranks[1].communicate(timeout=120)
    assert ranks[0].returncode != 0 and ranks[1].returncode != 0
    assert "BdbQuit: rank 1 quit the debugger" in err0 and "BdbQuit" in err1
