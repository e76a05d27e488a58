# moonshotai/Kimi-K2-Instruct on Hugging Face (1T parameters, 32B active: DeepSeek-V3's
# architecture with 384 experts and 64 heads), in Megatron-LM's architecture flags: 61 layers of
# multi-latent attention (YaRN, 32 x the original 4096 positions), the first with a dense MLP and
# the other 60 with 384 routed experts (8 per token, sigmoid scores with an expert bias, one
# expert group) beside one shared expert. train.py checks every value against --hf-checkpoint's
# config.json (so does --dry-run).
#
# The released config.json says model_type "kimi_k2", a name transformers does not know: it
# loads only as remote code (auto_map -> configuration_deepseek.DeepseekV3Config), which slime
# does not run, and slime's model families list Kimi-K2 under deepseek_v3. So this script
# describes the deepseek_v3 shape, as moonlight-16B-A3B.sh does: point --hf-checkpoint at a copy
# whose config.json says "model_type": "deepseek_v3" (every other key as released). The released
# weights are FP8 blocks: convert them to bfloat16 first (docs/models.md).

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-61}"
DENSE_LAYERS=1
MOE_LAYER_FREQ="[0]*${DENSE_LAYERS}+[1]*$((NUM_LAYERS - DENSE_LAYERS))"

MODEL_ARGS=(
   # decoder stack; the dense layer's MLP size is config.json's intermediate_size
   --num-layers "$NUM_LAYERS"
   --hidden-size 7168
   --ffn-hidden-size 18432
   --swiglu
   # multi-latent attention: 64 heads, queries through a latent of 1536, keys and values through
   # one of 512; per head 128 channels without rotation, 64 rotated, 128 of value
   --num-attention-heads 64
   --kv-channels 128
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --disable-bias-linear
   # rotary positions: YaRN, factor 32 (its beta_fast / beta_slow of 1 are read from config.json
   # by the Megatron backend)
   --position-embedding-type rope
   --rotary-base 50000
   --rotary-scaling-factor 32
   --mscale 1.0
   --mscale-all-dim 1.0
   --max-position-embeddings 131072
   # norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 163840
   --untie-embeddings-and-output-weights
   # experts: 384 of width 2048 and one shared expert of the same width; routed weights x 2.827
   # (n_group 1: no expert groups, Megatron-LM's default)
   --num-experts 384
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.827
   --moe-router-dtype fp32
   # RL keeps the expert bias and runs without a load-balancing loss
   --moe-router-bias-update-rate 0
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
