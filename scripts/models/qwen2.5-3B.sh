# Qwen/Qwen2.5-3B on Hugging Face (and its -Instruct model), in Megatron-LM's architecture flags.
# A launch script sources this and passes "${MODEL_ARGS[@]}" to train.py, which checks each
# value against --hf-checkpoint's config.json before it starts anything (so does --dry-run).
MODEL_ARGS=(
   # decoder stack: 36 layers, SiLU-gated MLP
   --num-layers 36
   --hidden-size 2048
   --ffn-hidden-size 11008
   --swiglu
   # attention: 16 query heads sharing 2 key/value heads, 128 channels each
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
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
