"""Convert a Hugging Face checkpoint to a Megatron (megatron-core GPTModel) checkpoint.

    python -m slime.tools.convert_hf_to_megatron --hf-checkpoint DIR --save-dir OUT \\
        --tensor-model-parallel-size N --pipeline-model-parallel-size M [--make-vocab-size-divisible-by K] \\
        [--expert-model-parallel-size E --expert-tensor-parallel-size X]

Qwen2, Qwen3, Llama and Qwen3-MoE families. A mixture-of-experts model's experts are split over
E expert-parallel ranks and each expert over X (default: N) ranks, with one file per (TP rank,
stage, EP rank) (slime.backends.megatron.rank_files). The vocabulary is padded with zero rows to a multiple of
K x N (Megatron's rule). Model arguments given (--num-layers, --hidden-size, ...) must agree with
the HF config: a mismatch is an error before any weights are written. Layout on disk:
slime.backends.megatron.checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from slime.backends.megatron.convert import ConversionError, Layout, hf_to_megatron
from slime.backends.megatron.rank_files import Parallel, split_ranks

MODEL_ARGS = {  # Megatron argument -> Layout field
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "head_dim",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m slime.tools.convert_hf_to_megatron",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--hf-checkpoint", required=True, help="HF checkpoint directory (config.json + safetensors)"
    )
    p.add_argument("--save-dir", required=True, help="new directory for the Megatron checkpoint")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1, help="mixture-of-experts models")
    p.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="mixture-of-experts models (default: the tensor-parallel size, as in Megatron-LM)",
    )
    p.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="the first pipeline stage's layers (uneven stages; default: an even split)",
    )
    p.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="the last pipeline stage's layers (uneven stages; default: an even split)",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument(
        "--mtp-num-layers",
        type=int,
        default=0,
        help="the checkpoint's multi-token prediction modules to convert (as the job's --mtp-num-layers)",
    )
    p.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="the layer spec the checkpoint is for (transformer_engine folds the norms into linear_qkv / "
        "linear_fc1)",
    )
    g = p.add_argument_group("model arguments, checked against the HF config when given")
    for arg in MODEL_ARGS:
        g.add_argument("--" + arg.replace("_", "-"), type=int, default=None)
    return p


def hf_layout(
    hf_checkpoint: str,
    divisible_by: int,
    fold_norms: bool,
    first: int | None = None,
    last: int | None = None,
    mtp_layers: int = 0,
) -> Layout:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(hf_checkpoint)
    except (OSError, ValueError) as e:
        raise ConversionError(
            f"--hf-checkpoint {hf_checkpoint!r}: cannot read its config.json ({e})"
        ) from None
    return Layout.from_hf_config(config, divisible_by, fold_norms, (first, last), mtp_layers)


def check_model_args(ns: argparse.Namespace, layout: Layout) -> None:
    wrong = [
        f"--{arg.replace('_', '-')} {getattr(ns, arg)} (the HF config has {getattr(layout, field)})"
        for arg, field in MODEL_ARGS.items()
        if getattr(ns, arg) is not None and getattr(ns, arg) != getattr(layout, field)
    ]
    if wrong:
        raise ConversionError("the model arguments disagree with the HF config: " + "; ".join(wrong))


def describe(par: Parallel, layout: Layout) -> str:
    experts = f" x EP {par.ep} (ETP {par.expert_tp})" if layout.num_experts else ""
    return f"TP {par.tp} x PP {par.pp}{experts}"


def main(argv: list[str] | None = None) -> int:
    from slime.backends.megatron.checkpoint import check_target, load_hf_state, save_megatron

    parser = build_parser()
    ns = parser.parse_args(argv)
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    par = Parallel(tp, pp, ns.expert_model_parallel_size, ns.expert_tensor_parallel_size)
    if pp < 2 and (ns.decoder_first_pipeline_num_layers or ns.decoder_last_pipeline_num_layers):
        parser.error(
            "--decoder-first/last-pipeline-num-layers set a pipeline stage's layers: give "
            "--pipeline-model-parallel-size > 1 (or drop them)"
        )
    try:
        layout = hf_layout(
            ns.hf_checkpoint,
            ns.make_vocab_size_divisible_by,
            ns.transformer_impl == "transformer_engine",
            ns.decoder_first_pipeline_num_layers,
            ns.decoder_last_pipeline_num_layers,
            ns.mtp_num_layers,
        )
        check_model_args(ns, layout)
        par.check(layout)
        check_target(ns.save_dir)
        parts = split_ranks(hf_to_megatron(load_hf_state(ns.hf_checkpoint), layout, tp), layout, par)
    except ConversionError as e:
        parser.error(str(e))
    save_megatron(parts, layout, ns.save_dir, par)
    print(
        f"wrote {ns.save_dir}: {describe(par, layout)}, vocabulary {layout.vocab_size} padded to "
        f"{layout.padded_vocab_size(tp)} ({layout.padded_vocab_size(tp) // tp} rows per TP rank)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
