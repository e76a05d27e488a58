# Qwen/Qwen2.5-0.5B on Hugging Face (and its -Instruct model), in Megatron-LM's architecture flags.
# A launch script sources this and passes "${MODEL_ARGS[@]}" to train.py, which checks each
# value against --hf-checkpoint's config.json before it starts anything (so does --dry-run).
MODEL_ARGS=(
   # decoder stack: 24 layers, SiLU-gated MLP
   --num-layers 24
   --hidden-size 896
   --ffn-hidden-size 4864
   --swiglu
   # attention: 14 query heads sharing 2 key/value heads, 64 channels each
   --num-attention-heads 14
   --group-query-attention
   --num-query-groups 2
   --kv-channels 64
   # linear layers without bias, except the q/k/v projections
   --disable-bias-linear
   --add-qkv-bias
   # rotary positions
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 32768
   # norms and vocabulary
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 151936
   # tied input embedding and output layer: Megatron-LM's default, so no flag
)
