# Qwen/Qwen2.5-32B on Hugging Face, in Megatron-LM's architecture flags.
# A launch script sources this and passes "${MODEL_ARGS[@]}" to train.py, which checks each
# value against --hf-checkpoint's config.json before it starts anything (so does --dry-run).
MODEL_ARGS=(
   # decoder stack: 64 layers, SiLU-gated MLP
   --num-layers 64
   --hidden-size 5120
   --ffn-hidden-size 27648
   --swiglu
   # attention: 40 query heads sharing 8 key/value heads, 128 channels each
   --num-attention-heads 40
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   # linear layers without bias, except the q/k/v projections
   --disable-bias-linear
   --add-qkv-bias
   # rotary positions
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 131072   # Qwen2.5-32B-Instruct: 32768
   # norms and vocabulary
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 152064
   # separate input embedding and output layer (tie_word_embeddings false)
   --untie-embeddings-and-output-weights
)
