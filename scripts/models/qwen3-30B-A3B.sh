# Qwen/Qwen3-30B-A3B on Hugging Face (a mixture of experts: 128 experts, 8 per token, 3B active),
# in Megatron-LM's architecture flags. Sourced by a launch script like the dense ones; train.py
# checks every value against --hf-checkpoint's config.json (so does --dry-run).
# Both train backends build it (docs/moe.md).

# Every one of the 48 layers is a MoE layer (config.json: decoder_sparse_step 1, no mlp_only_layers).
MOE_LAYERS=48
MOE_LAYER_FREQ="[$(printf '1,%.0s' $(seq 2 "$MOE_LAYERS"))1]"

MODEL_ARGS=(
   # decoder stack: 48 layers; the dense MLP size is config.json's intermediate_size
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --swiglu
   # attention: 32 query heads sharing 4 key/value heads, 128 channels each, RMSNorm on queries and keys
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --qk-layernorm
   --disable-bias-linear
   # rotary positions
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 40960
   # norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 151936
   --untie-embeddings-and-output-weights
   # experts: 128 of width 768, softmax router picking 8 and renormalising their weights
   --num-experts 128
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 768
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-router-dtype fp32
   # RL runs without the load-balancing loss
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
   --moe-token-drop-policy probs
)
