# Qwen/Qwen3.5-35B-A3B on Hugging Face, its text model (config.json's text_config, model_type
# qwen3_5_moe_text; 35B parameters, 3B active), in Megatron-LM's architecture flags: 40 layers,
# every fourth a full-attention layer (gated output, RMSNorm on queries and keys, a quarter of
# each head rotated) and the others gated delta-net linear attention, all norms zero-centred
# (1 + weight); every layer routes to 8 of 256 experts (softmax, renormalised top-k) beside one
# gated shared expert. The delta-net layers' own sizes (linear_* in text_config) have no
# Megatron-LM flag: the Megatron backend reads them from --hf-checkpoint.
#
# The released checkpoint is the vision-language model (model_type qwen3_5_moe, the text model
# under text_config and model.language_model): the Megatron backend refuses it by name; train it
# with --train-backend fsdp, or point --hf-checkpoint at the text model (a config.json holding
# text_config's keys, as tests/fixtures/hf_configs.py does). train.py checks every value against
# --hf-checkpoint's config.json (so does --dry-run).

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-40}"
# every layer is a MoE layer (text_config has no dense MLP)
MOE_LAYER_FREQ="[1]*${NUM_LAYERS}"

MODEL_ARGS=(
   # decoder stack; text_config has no intermediate_size (no dense MLP), so the expert width
   # stands here and is not compared
   --num-layers "$NUM_LAYERS"
   --hidden-size 2048
   --ffn-hidden-size 512
   --swiglu
   # full attention: 16 query heads over 2 key/value heads of 256 channels, output gate
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 2
   --kv-channels 256
   --qk-layernorm
   --attention-output-gate
   --use-gated-attention
   --disable-bias-linear
   # rotary positions on a quarter of each head (the vision model's 3-D sections: plain RoPE for text)
   --position-embedding-type rope
   --rotary-base 10000000
   --rotary-percent 0.25
   --max-position-embeddings 262144
   # zero-centred norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --apply-layernorm-1p
   --norm-epsilon 1e-6
   --vocab-size 248320
   --untie-embeddings-and-output-weights
   # experts: 256 of width 512, softmax router picking 8; a shared expert of width 512 with its
   # sigmoid gate
   --num-experts 256
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 512
   --moe-shared-expert-intermediate-size 512
   --moe-shared-expert-gate
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-router-dtype fp32
   # RL runs without the load-balancing loss
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
