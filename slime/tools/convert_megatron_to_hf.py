"""Convert a Megatron checkpoint written by slime back to a Hugging Face checkpoint.

    python -m slime.tools.convert_megatron_to_hf --load-dir OUT --hf-checkpoint DIR --save-dir HF_OUT

Config and tokenizer come from --hf-checkpoint, whose config must describe the same model as the
checkpoint (an error naming the differing fields otherwise, before anything is written). The
vocabulary padding is removed; TP shards are merged, pipeline stages joined and a
mixture-of-experts model's experts gathered from their EP and ETP ranks.
"""

from __future__ import annotations

import argparse
import sys

from slime.backends.megatron.convert import ConversionError, megatron_to_hf
from slime.backends.megatron.rank_files import merge_ranks


def main(argv: list[str] | None = None) -> int:
    from slime.backends.megatron.checkpoint import (
        check_no_adapters,
        check_target,
        is_vision_language,
        load_megatron,
        save_hf,
        stored_layout,
        stored_parallel,
        vision_language_state,
    )
    from slime.tools.convert_hf_to_megatron import describe, hf_layout

    p = argparse.ArgumentParser(
        prog="python -m slime.tools.convert_megatron_to_hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--load-dir", required=True, help="Megatron checkpoint directory (slime's layout)")
    p.add_argument(
        "--hf-checkpoint", required=True, help="HF directory whose config and tokenizer describe the model"
    )
    p.add_argument("--save-dir", required=True, help="new directory for the HF checkpoint")
    ns = p.parse_args(argv)
    try:
        check_target(ns.save_dir)
        parts, args = load_megatron(ns.load_dir)
        check_no_adapters(parts, ns.load_dir)
        layout = stored_layout(args, ns.load_dir)
        # the pipeline stages are the checkpoint's layout, not the model's: taken from it
        expected = hf_layout(
            ns.hf_checkpoint,
            layout.make_vocab_size_divisible_by,
            layout.fold_norms,
            layout.first_stage_layers,
            layout.last_stage_layers,
            layout.mtp_layers,
        )
        # (a checkpoint written before layouts named their model_type stores "")
        differ = [
            f"{k}: checkpoint {v}, --hf-checkpoint config {getattr(expected, k)}"
            for k, v in layout.__dict__.items()
            if getattr(expected, k) != v and not (k == "model_type" and v == "")
        ]
        if differ:
            raise ConversionError(
                "--hf-checkpoint describes another model than --load-dir: " + "; ".join(differ)
            )
        source = stored_parallel(args)
        state = megatron_to_hf(merge_ranks(parts, layout, source), layout)
        if is_vision_language(ns.hf_checkpoint):  # the released Qwen3.5 again: its names, its vision tower
            state = vision_language_state(state, ns.hf_checkpoint)
    except ConversionError as e:
        p.error(str(e))
    save_hf(state, ns.hf_checkpoint, ns.save_dir)
    print(
        f"wrote {ns.save_dir}: {len(state)} tensors from {describe(source, layout)}, vocabulary "
        f"{layout.vocab_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
