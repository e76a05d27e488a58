# zai-org/GLM-4.7-Flash on Hugging Face (model_type glm4_moe_lite; 30B parameters, 3B active), in
# Megatron-LM's architecture flags: DeepSeek-V3's multi-latent attention with GLM-4.5's experts.
# 47 layers, the first with a dense MLP and the other 46 with 64 routed experts (4 per token,
# sigmoid scores with an expert bias) beside one shared expert. train.py checks every value
# against --hf-checkpoint's config.json (so does --dry-run). config.json's attention_bias is
# false, so no --add-qkv-bias (with multi-latent attention the check does not compare it anyway).
# The multi-token prediction layer (num_nextn_predict_layers 1) is left to --mtp-num-layers.

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-47}"
DENSE_LAYERS=1
MOE_LAYER_FREQ="[0]*${DENSE_LAYERS}+[1]*$((NUM_LAYERS - DENSE_LAYERS))"

MODEL_ARGS=(
   # decoder stack; the dense layer's MLP size is config.json's intermediate_size
   --num-layers "$NUM_LAYERS"
   --hidden-size 2048
   --ffn-hidden-size 10240
   --swiglu
   # multi-latent attention: 20 heads, queries through a latent of 768, keys and values through
   # one of 512; per head 192 channels without rotation and 64 rotated, values 256 wide
   # (--kv-channels is the non-rotated width, as the check compares it)
   --num-attention-heads 20
   --kv-channels 192
   --multi-latent-attention
   --q-lora-rank 768
   --kv-lora-rank 512
   --qk-head-dim 192
   --qk-pos-emb-head-dim 64
   --v-head-dim 256
   --qk-layernorm
   --disable-bias-linear
   # rotary positions, no scaling
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 202752
   # norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 154880
   --untie-embeddings-and-output-weights
   # experts: 64 of width 1536 and one shared expert of the same width; routed weights x 1.8
   --num-experts 64
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 4
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 1.8
   --moe-router-dtype fp32
   # RL keeps the expert bias and runs without a load-balancing loss
   --moe-router-bias-update-rate 0
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
