# deepseek-ai/DeepSeek-V3 (and DeepSeek-R1, the same architecture) on Hugging Face, in Megatron-LM's
# architecture flags: 61 layers of multi-latent attention, the first 3 with a dense MLP and the
# other 58 with 256 routed experts (8 per token, sigmoid scores with an expert bias, 8 groups of
# which 4 are kept) beside one shared expert. train.py checks every value against
# --hf-checkpoint's config.json (so does --dry-run). The released weights are FP8: convert them to
# bfloat16 first (the Megatron conversion refuses quantized checkpoints; docs/models.md).

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-61}"
DENSE_LAYERS=3
MOE_LAYER_FREQ="[0]*${DENSE_LAYERS}+[1]*$((NUM_LAYERS - DENSE_LAYERS))"

MODEL_ARGS=(
   # decoder stack; the dense layers' MLP size is config.json's intermediate_size
   --num-layers "$NUM_LAYERS"
   --hidden-size 7168
   --ffn-hidden-size 18432
   --swiglu
   # multi-latent attention: 128 heads reading one compressed key/value latent of 512 (queries
   # through a latent of 1536); per head 128 channels without rotation, 64 rotated, 128 of value
   --num-attention-heads 128
   --kv-channels 128
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --disable-bias-linear
   # rotary positions: YaRN, 40 x the original 4096
   --position-embedding-type rope
   --rotary-base 10000
   --rotary-scaling-factor 40
   --mscale 1.0
   --mscale-all-dim 1.0
   --max-position-embeddings 163840
   # norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 129280
   --untie-embeddings-and-output-weights
   # experts
   --num-experts 256
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-num-groups 8
   --moe-router-group-topk 4
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
