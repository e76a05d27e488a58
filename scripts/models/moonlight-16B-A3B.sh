# moonshotai/Moonlight-16B-A3B on Hugging Face (DeepSeek-V3's architecture at 16B, 3B active), in
# Megatron-LM's architecture flags: 27 layers of multi-latent attention (queries projected
# directly, no query latent; plain RoPE), the first with a dense MLP and the other 26 with 64
# routed experts (6 per token, sigmoid scores with an expert bias) beside two shared ones.
# train.py checks every value against --hf-checkpoint's config.json (so does --dry-run).

NUM_LAYERS=27
DENSE_LAYERS=1
MOE_LAYER_FREQ="[0]*${DENSE_LAYERS}+[1]*$((NUM_LAYERS - DENSE_LAYERS))"

MODEL_ARGS=(
   # decoder stack; the dense layer's MLP size is config.json's intermediate_size
   --num-layers "$NUM_LAYERS"
   --hidden-size 2048
   --ffn-hidden-size 11264
   --swiglu
   # multi-latent attention: 16 heads reading one key/value latent of 512; per head 128 channels
   # without rotation, 64 rotated, 128 of value
   --num-attention-heads 16
   --kv-channels 128
   --multi-latent-attention
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --disable-bias-linear
   # rotary positions
   --position-embedding-type rope
   --rotary-base 50000
   --max-position-embeddings 8192
   # norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 163840
   --untie-embeddings-and-output-weights
   # experts: two shared experts of 1408 each
   --num-experts 64
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 2816
   --moe-router-topk 6
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.446
   --moe-router-dtype fp32
   # RL keeps the expert bias and runs without a load-balancing loss
   --moe-router-bias-update-rate 0
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
