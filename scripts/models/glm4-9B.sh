# THUDM/GLM-4-9B-0414 on Hugging Face (model_type glm4), in Megatron-LM's architecture flags: a
# dense 40-layer model whose layers carry GLM-4's two extra norms (one on the attention output,
# one on the MLP output, each before its residual add) and rotate only half of every head, with
# adjacent channels paired. train.py checks every value against --hf-checkpoint's config.json
# (so does --dry-run). The Megatron backend builds these layers itself: no --spec is needed.

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-40}"

MODEL_ARGS=(
   # decoder stack, SiLU-gated MLP
   --num-layers "$NUM_LAYERS"
   --hidden-size 4096
   --ffn-hidden-size 13696
   --swiglu
   # GLM-4's sandwich norms
   --post-self-attn-layernorm
   --post-mlp-layernorm
   # attention: 32 query heads over 2 key/value heads of 128 channels; biases on q/k/v only
   # (config.json's attention_bias), none on the output projection or the MLP
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --disable-bias-linear
   --add-qkv-bias
   # rotary positions on the first half of each head (partial_rotary_factor 0.5), interleaved pairs
   --position-embedding-type rope
   --rotary-base 10000
   --rotary-percent 0.5
   --rotary-interleaved
   --max-position-embeddings 32768
   # norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 151552
   --untie-embeddings-and-output-weights
)
