# zai-org/GLM-4.5 on Hugging Face (model_type glm4_moe; 355B parameters, 32B active), in
# Megatron-LM's architecture flags: 92 layers of grouped-query attention (RMSNorm on each head's
# queries and keys: config.json's use_qk_norm), the first 3 with a dense MLP and the other 89
# with 160 routed experts (8 per token, sigmoid scores with an expert bias) beside one shared
# expert. train.py checks every value against --hf-checkpoint's config.json (so does --dry-run).
# The checkpoint's multi-token prediction layer (num_nextn_predict_layers 1) is not described
# here: --mtp-num-layers builds it (docs/megatron.md).

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-92}"
DENSE_LAYERS=3
MOE_LAYER_FREQ="[0]*${DENSE_LAYERS}+[1]*$((NUM_LAYERS - DENSE_LAYERS))"

MODEL_ARGS=(
   # decoder stack; the dense layers' MLP size is config.json's intermediate_size
   --num-layers "$NUM_LAYERS"
   --hidden-size 5120
   --ffn-hidden-size 12288
   --swiglu
   # attention: 96 query heads over 8 key/value heads of 128 channels (wider than hidden / heads),
   # biases on q/k/v only, per-head q/k norms
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --disable-bias-linear
   --add-qkv-bias
   --qk-layernorm
   # rotary positions on half of each head
   --position-embedding-type rope
   --rotary-base 1000000
   --rotary-percent 0.5
   --max-position-embeddings 131072
   # norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   # experts: 160 of width 1536 and one shared expert of the same width; routed weights x 2.5
   --num-experts 160
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.5
   --moe-router-dtype fp32
   # RL keeps the expert bias and runs without a load-balancing loss
   --moe-router-bias-update-rate 0
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
