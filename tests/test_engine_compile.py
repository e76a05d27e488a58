"""--enable-torch-compile in the torch engine's batched runner, on CPU (Inductor's C++ kernels):
the eager answers, the compiles made at the runner's start, a failed compile that falls back, and
SGLang's flags. The CUDA case (Triton kernels inside CUDA graphs) is tests/test_engine_gpu.py's."""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_engine_shapes import _assert_same, _serve, poisoning_flash_contract


@torch.library.custom_op("slime_test::flash_contract", mutates_args=())
def flash_contract(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    seqused_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The flash varlen kernel's contract as an operator that torch.compile keeps whole, as it
    keeps torch's flash operator (`poisoning_flash_contract`'s loop over rows would not trace)."""
    return poisoning_flash_contract(q, k.clone(), v.clone(), cu_q, cu_k, max_q, max_k, seqused_k, scale)


@flash_contract.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, scale):
    return torch.empty_like(q)


@pytest.mark.slow
@pytest.mark.parametrize("live", [False, True], ids=["padded-keys", "live-keys"])
def test_compiled_decoding_gives_the_same_answers_from_one_compile(tiny_model, live):
    """--enable-torch-compile (the runner's torch_compile_max_bs), with the CUDA path's bucketed
    shapes: every request gets the eager run's tokens and log-probs, through batches that shrink
    as requests finish and a KV cache that grows; the batch's rows and the cache's sizes are
    dynamic, so the compiles made at the runner's start serve every bucket, the batch as wide as
    the cache's rows included; a batch of one row decodes eagerly."""
    from torch._dynamo.utils import counters

    rng = random.Random(7)  # contexts up to 160 tokens: the cache grows from 128 rows to 256
    reqs = [
        ([rng.randrange(4, 90) for _ in range(rng.randint(3, 100))], rng.randint(2, 60)) for _ in range(24)
    ]
    kernel = flash_contract if live else None
    eager, _, _, _ = _serve(tiny_model, True, reqs, live_keys=kernel)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled, runner, _, _ = _serve(tiny_model, True, reqs, live_keys=kernel, compile_max_bs=16)
    _assert_same(compiled, eager)
    stats = runner.stats()
    assert "torch_compile_failed" not in stats, stats
    assert stats["torch_compile_calls"] > 20
    steps = runner.decode_shapes  # decode steps per (rows, key length) bucket
    assert {1, 16} <= {rows for rows, _ in steps}  # 1: eager; 16: the cache's rows
    assert runner.compiled is not None and not runner.compiled.covers(1) and not runner.compiled.covers(17)
    assert stats["torch_compile_calls"] == sum(n for (rows, _), n in steps.items() if rows >= 2)
    compiled_shapes = {shape for shape in steps if shape[0] >= 2}
    assert len(compiled_shapes) >= 5 and len({keys for _, keys in compiled_shapes}) >= 2
    assert runner.cache.length == 256
    # All at the runner's start: one compile for live keys; padded keys take the key length as a
    # Python int, specialised at 1, dynamic from its first change, and apart where the view is
    # the whole cache (three). Nothing compiles while serving. (Exact counts: torch is pinned.)
    assert counters["stats"]["unique_graphs"] - before == (1 if live else 3)


def test_a_compile_that_fails_decodes_eagerly_and_says_why(monkeypatch):
    """A backend that cannot compile (Inductor without a C compiler, say): the step runs eagerly
    with the same result, compiling stays off, and the stats say why."""
    import functools

    from slime.engines.torch_engine import compiled_decode

    def no_compiler(graph, example_inputs):
        raise RuntimeError("no C compiler found")

    monkeypatch.setattr(
        compiled_decode.torch, "compile", functools.partial(torch.compile, backend=no_compiler)
    )
    eager_calls = []

    def forward(inputs: torch.Tensor, key_len: int) -> torch.Tensor:
        eager_calls.append(inputs.shape[1])
        return inputs.float() * key_len

    torch._dynamo.reset()
    compiled = compiled_decode.CompiledDecode(forward, max_bs=8)
    inputs = torch.arange(8).view(2, 4)
    assert torch.equal(compiled(inputs, 3), inputs.float() * 3)
    stats = compiled.stats()
    assert "no C compiler found" in stats["torch_compile_failed"] and stats["torch_compile_calls"] == 0
    assert not compiled.covers(4) and torch.equal(compiled(inputs, 2), inputs.float() * 2)
    assert eager_calls[-1] == 4 and compiled.stats()["torch_compile_calls"] == 0


def test_the_compile_flags_are_sglangs(tiny_model, capsys):
    """`--enable-torch-compile` and `--torch-compile-max-bs` (SGLang's names and default, 32); a
    limit below 1 is a usage error that names the flag."""
    from slime.engines.torch_engine.cli import build_parser, validate

    parser = build_parser()
    args = parser.parse_args(["--model-path", tiny_model])
    assert (args.enable_torch_compile, args.torch_compile_max_bs) == (False, 32)
    args = parser.parse_args(
        ["--model-path", tiny_model, "--enable-torch-compile", "--torch-compile-max-bs", "64"]
    )
    validate(args, parser)
    assert (args.enable_torch_compile, args.torch_compile_max_bs) == (True, 64)
    with pytest.raises(SystemExit) as e:
        validate(parser.parse_args(["--model-path", tiny_model, "--torch-compile-max-bs", "0"]), parser)
    assert e.value.code == 2 and "--torch-compile-max-bs 0 must be >= 1" in capsys.readouterr().err


def test_a_graph_of_the_compiled_step_that_fails_to_capture_turns_compiling_off_not_graphs():
    """(CUDA graphs cannot be captured here: the decision alone.) The graphs' failure is taken
    back so that they capture the eager step from the next one on; compiling is off and says why.
    If the eager capture fails too, the failure is the graphs' own and compiling comes back."""
    from types import SimpleNamespace

    from slime.engines.torch_engine.compiled_decode import CompiledDecode
    from slime.engines.torch_engine.model_runner import BatchedRunner

    compiled = CompiledDecode(lambda inputs, key_len: inputs, max_bs=8)
    runner = SimpleNamespace(graphs=SimpleNamespace(failed="RuntimeError: capture"), compiled=compiled)
    BatchedRunner._graphs_without_compile(runner)  # type: ignore[arg-type]
    assert runner.graphs.failed is None and not compiled.covers(4)
    assert "failed to capture (RuntimeError: capture)" in compiled.stats()["torch_compile_failed"]
    # The eager step fails to capture too: compiling was not the cause; it comes back on.
    runner.graphs.failed = "RuntimeError: again"
    BatchedRunner._graphs_without_compile(runner)  # type: ignore[arg-type]
    assert runner.graphs.failed == "RuntimeError: again" and compiled.covers(4)
    BatchedRunner._graphs_without_compile(runner)  # type: ignore[arg-type]  (stays so)
    assert runner.graphs.failed == "RuntimeError: again" and compiled.covers(4)


def test_an_engine_of_one_request_at_a_time_compiles_nothing(tiny_model):
    """--max-running-requests 1: every batch is one row, which decodes eagerly; the engine starts
    (it used to ask its cache for the two rows of the warm-up compile, over its limit)."""
    from slime.engines.torch_engine.model_runner import BatchedRunner, load_model

    model = load_model(tiny_model, torch.float32, torch.device("cpu"))
    assert BatchedRunner(model, 1, 256, torch_compile_max_bs=32).compiled is None
    assert BatchedRunner(model, 4, 256, torch_compile_max_bs=1).compiled is None
