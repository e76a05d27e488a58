"""Convert a Megatron checkpoint written by slime to another tensor/pipeline/expert-parallel layout.

    python -m slime.tools.convert_checkpoint --load-dir A --save-dir B \\
        --target-tensor-parallel-size N --target-pipeline-parallel-size M \\
        [--make-vocab-size-divisible-by K] \\
        [--target-expert-model-parallel-size E --target-expert-tensor-parallel-size X]

A mixture-of-experts checkpoint is read with the EP and ETP it was written with and split for
E and X (default: 1 and N; slime.backends.megatron.rank_files).
The vocabulary is re-padded for the target TP (K defaults to the checkpoint's), so loading the
result with N-way TP never meets a VocabParallelEmbedding size mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from slime.backends.megatron.convert import ConversionError
from slime.backends.megatron.rank_files import Parallel, merge_ranks, split_ranks
from slime.backends.megatron.sharding import repad_vocab


def main(argv: list[str] | None = None) -> int:
    from slime.backends.megatron.checkpoint import (
        check_no_adapters,
        check_target,
        load_megatron,
        save_megatron,
        stored_layout,
        stored_parallel,
    )
    from slime.tools.convert_hf_to_megatron import describe

    p = argparse.ArgumentParser(
        prog="python -m slime.tools.convert_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, required=True)
    p.add_argument("--target-pipeline-parallel-size", type=int, required=True)
    p.add_argument(
        "--target-expert-model-parallel-size", type=int, default=1, help="mixture-of-experts models"
    )
    p.add_argument(
        "--target-expert-tensor-parallel-size",
        type=int,
        default=None,
        help="mixture-of-experts models (default: the target tensor-parallel size)",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, help="default: the checkpoint's")
    for end in ("first", "last"):
        p.add_argument(
            f"--target-decoder-{end}-pipeline-num-layers",
            type=int,
            default=None,
            help=f"the target's {end} pipeline stage's layers (uneven stages; default: an even split)",
        )
    ns = p.parse_args(argv)
    tp, pp = ns.target_tensor_parallel_size, ns.target_pipeline_parallel_size
    target = Parallel(tp, pp, ns.target_expert_model_parallel_size, ns.target_expert_tensor_parallel_size)
    if pp < 2 and (ns.target_decoder_first_pipeline_num_layers or ns.target_decoder_last_pipeline_num_layers):
        p.error(
            "--target-decoder-first/last-pipeline-num-layers set a pipeline stage's layers: give "
            "--target-pipeline-parallel-size > 1 (or drop them)"
        )
    try:
        check_target(ns.save_dir)
        parts, args = load_megatron(ns.load_dir)
        check_no_adapters(parts, ns.load_dir)
        layout = stored_layout(args, ns.load_dir)
        if ns.make_vocab_size_divisible_by is not None:
            layout = dataclasses.replace(layout, make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by)
        # The source's stages are the checkpoint's; the target's, the flags'.
        target_layout = dataclasses.replace(
            layout,
            first_stage_layers=ns.target_decoder_first_pipeline_num_layers,
            last_stage_layers=ns.target_decoder_last_pipeline_num_layers,
        )
        target.check(target_layout)
        source = stored_parallel(args)
        merged = repad_vocab(merge_ranks(parts, layout, source), layout, tp)
        out = split_ranks(merged, target_layout, target)
    except ConversionError as e:
        p.error(str(e))
    save_megatron(out, target_layout, ns.save_dir, target)
    print(
        f"wrote {ns.save_dir}: {describe(source, layout)} -> {describe(target, layout)}, vocabulary padded "
        f"to {layout.padded_vocab_size(tp)} ({layout.padded_vocab_size(tp) // tp} rows per TP rank)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
