# zai-org/GLM-4.5-Air on Hugging Face (model_type glm4_moe; 106B parameters, 12B active), in
# Megatron-LM's architecture flags: GLM-4.5's layout at 46 layers, the first with a dense MLP and
# the other 45 with 128 routed experts (8 per token, sigmoid scores with an expert bias, routed
# weights not rescaled) beside one shared expert. Unlike GLM-4.5 it has no q/k norms
# (use_qk_norm false). train.py checks every value against --hf-checkpoint's config.json (so does
# --dry-run). The multi-token prediction layer (num_nextn_predict_layers 1) is left to
# --mtp-num-layers (docs/megatron.md).

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-46}"
DENSE_LAYERS=1
MOE_LAYER_FREQ="[0]*${DENSE_LAYERS}+[1]*$((NUM_LAYERS - DENSE_LAYERS))"

MODEL_ARGS=(
   # decoder stack; the dense layer's MLP size is config.json's intermediate_size
   --num-layers "$NUM_LAYERS"
   --hidden-size 4096
   --ffn-hidden-size 10944
   --swiglu
   # attention: 96 query heads over 8 key/value heads of 128 channels, biases on q/k/v only
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --disable-bias-linear
   --add-qkv-bias
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
   # experts: 128 of width 1408 and one shared expert of the same width (routed_scaling_factor
   # 1.0: Megatron-LM's default, no --moe-router-topk-scaling-factor)
   --num-experts 128
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 1408
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-dtype fp32
   # RL keeps the expert bias and runs without a load-balancing loss
   --moe-router-bias-update-rate 0
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
