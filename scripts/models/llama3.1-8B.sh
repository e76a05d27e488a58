# meta-llama/Llama-3.1-8B on Hugging Face (and its -Instruct model), in Megatron-LM's architecture flags.
# A launch script sources this and passes "${MODEL_ARGS[@]}" to train.py, which checks each
# value against --hf-checkpoint's config.json before it starts anything (so does --dry-run).
MODEL_ARGS=(
   # decoder stack: 32 layers, SiLU-gated MLP
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --swiglu
   # attention: 32 query heads sharing 8 key/value heads, 128 channels each
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   # no bias in any linear layer
   --disable-bias-linear
   # rotary positions; Llama 3 frequency scaling (factor 8, from an 8192-token original)
   --position-embedding-type rope
   --rotary-base 500000
   --use-rope-scaling
   --rope-scaling-factor 8.0
   --max-position-embeddings 131072
   # norms and vocabulary
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 128256
   # separate input embedding and output layer (tie_word_embeddings false)
   --untie-embeddings-and-output-weights
)
