# Qwen/Qwen3-Next-80B-A3B-Instruct on Hugging Face (model_type qwen3_next; 80B parameters, 3B
# active), in Megatron-LM's architecture flags: 48 layers, every fourth a full-attention layer
# (gated output, RMSNorm on queries and keys, a quarter of each head rotated) and the others gated
# delta-net linear attention, all norms zero-centred (1 + weight); every layer routes to 10 of 512
# experts (softmax, renormalised top-k) beside one gated shared expert. The delta-net layers' own
# sizes (linear_* in config.json) have no Megatron-LM flag: the Megatron backend reads them from
# --hf-checkpoint. train.py checks every value against --hf-checkpoint's config.json (so does
# --dry-run).

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-48}"
# config.json: decoder_sparse_step 1 and no mlp_only_layers, so every layer is a MoE layer
MOE_LAYER_FREQ="[1]*${NUM_LAYERS}"

MODEL_ARGS=(
   # decoder stack; config.json's intermediate_size (no layer uses a dense MLP)
   --num-layers "$NUM_LAYERS"
   --hidden-size 2048
   --ffn-hidden-size 5120
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
   # rotary positions on a quarter of each head
   --position-embedding-type rope
   --rotary-base 10000000
   --rotary-percent 0.25
   --max-position-embeddings 262144
   # zero-centred norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --apply-layernorm-1p
   --norm-epsilon 1e-6
   --vocab-size 151936
   --untie-embeddings-and-output-weights
   # experts: 512 of width 512, softmax router picking 10; a shared expert of width 512 with its
   # sigmoid gate
   --num-experts 512
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --moe-ffn-hidden-size 512
   --moe-shared-expert-intermediate-size 512
   --moe-shared-expert-gate
   --moe-router-topk 10
   --moe-router-score-function softmax
   --moe-router-dtype fp32
   # RL runs without the load-balancing loss
   --moe-aux-loss-coeff 0
   # megatron-core speed knobs (no effect with FSDP)
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
