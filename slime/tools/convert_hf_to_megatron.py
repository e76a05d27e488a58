"""Convert a Hugging Face checkpoint to a Megatron (megatron-core GPTModel) checkpoint.

    python -m slime.tools.convert_hf_to_megatron --hf-checkpoint DIR --save-dir OUT \\
        --tensor-model-parallel-size N --pipeline-model-parallel-size M [--make-vocab-size-divisible-by K]

Qwen2, Qwen3 and Llama families. The vocabulary is padded with zero rows to a multiple of
K x N (Megatron's rule). Model arguments given (--num-layers, --hidden-size, ...) must agree with
the HF config: a mismatch is an error before any weights are written. Layout on disk:
slime.backends.megatron.checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from slime.backends.megatron.convert import ConversionError, Layout, hf_to_megatron, shard

MODEL_ARGS = {  # Megatron argument -> Layout field
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "head_dim",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slime.tools.convert_hf_to_megatron", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--hf-checkpoint", required=True, help="HF checkpoint directory (config.json + safetensors)"
    )
    p.add_argument("--save-dir", required=True, help="new directory for the Megatron checkpoint")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="the layer spec the checkpoint is for (transformer_engine folds the norms into linear_qkv / linear_fc1)")  # fmt: skip
    g = p.add_argument_group("model arguments, checked against the HF config when given")
    for arg in MODEL_ARGS:
        g.add_argument("--" + arg.replace("_", "-"), type=int, default=None)
    return p


def hf_layout(hf_checkpoint: str, divisible_by: int, fold_norms: bool) -> Layout:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(hf_checkpoint)
    except (OSError, ValueError) as e:
        raise ConversionError(
            f"--hf-checkpoint {hf_checkpoint!r}: cannot read its config.json ({e})"
        ) from None
    return Layout.from_hf_config(config, divisible_by, fold_norms)


def check_model_args(ns: argparse.Namespace, layout: Layout) -> None:
    wrong = [
        f"--{arg.replace('_', '-')} {getattr(ns, arg)} (the HF config has {getattr(layout, field)})"
        for arg, field in MODEL_ARGS.items()
        if getattr(ns, arg) is not None and getattr(ns, arg) != getattr(layout, field)
    ]
    if wrong:
        raise ConversionError("the model arguments disagree with the HF config: " + "; ".join(wrong))


def main(argv: list[str] | None = None) -> int:
    from slime.backends.megatron.checkpoint import check_target, load_hf_state, save_megatron

    parser = build_parser()
    ns = parser.parse_args(argv)
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    try:
        layout = hf_layout(
            ns.hf_checkpoint, ns.make_vocab_size_divisible_by, ns.transformer_impl == "transformer_engine"
        )
        check_model_args(ns, layout)
        layout.check_parallel(tp, pp)
        check_target(ns.save_dir)
        parts = shard(hf_to_megatron(load_hf_state(ns.hf_checkpoint), layout, tp), layout, tp, pp)
    except ConversionError as e:
        parser.error(str(e))
    save_megatron(parts, layout, ns.save_dir)
    print(f"wrote {ns.save_dir}: TP {tp} x PP {pp}, vocabulary {layout.vocab_size} padded to "
          f"{layout.padded_vocab_size(tp)} ({layout.padded_vocab_size(tp) // tp} rows per TP rank)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
