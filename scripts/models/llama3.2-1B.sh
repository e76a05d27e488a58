# meta-llama/Llama-3.2-1B on Hugging Face (and its -Instruct model), in Megatron-LM's architecture flags.
# A launch script sources this and passes "${MODEL_ARGS[@]}" to train.py, which checks each
# value against --hf-checkpoint's config.json before it starts anything (so does --dry-run).
MODEL_ARGS=(
   # decoder stack: 16 layers, SiLU-gated MLP
   --num-layers 16
   --hidden-size 2048
   --ffn-hidden-size 8192
   --swiglu
   # attention: 32 query heads sharing 8 key/value heads, 64 channels each
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 64
   # no bias in any linear layer
   --disable-bias-linear
   # rotary positions; Llama 3 frequency scaling (factor 32, from an 8192-token original)
   --position-embedding-type rope
   --rotary-base 500000
   --use-rope-scaling
   --rope-scaling-factor 32.0
   --max-position-embeddings 131072
   # norms and vocabulary
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 128256
   # tied input embedding and output layer: Megatron-LM's default, so no flag
)
