# Qwen/Qwen3-8B on Hugging Face, in Megatron-LM's architecture flags.
# A launch script sources this and passes "${MODEL_ARGS[@]}" to train.py, which checks each
# value against --hf-checkpoint's config.json before it starts anything (so does --dry-run).
MODEL_ARGS=(
   # decoder stack: 36 layers, SiLU-gated MLP
   --num-layers 36
   --hidden-size 4096
   --ffn-hidden-size 12288
   --swiglu
   # attention: 32 query heads sharing 8 key/value heads, 128 channels each, RMSNorm on queries and keys
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   # no bias in any linear layer
   --disable-bias-linear
   # rotary positions
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 40960   # Qwen3-8B-Base: 32768
   # norms and vocabulary
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 151936
   # separate input embedding and output layer (tie_word_embeddings false)
   --untie-embeddings-and-output-weights
)
