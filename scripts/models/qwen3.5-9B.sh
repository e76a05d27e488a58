# Qwen/Qwen3.5-9B on Hugging Face, its text model (config.json's text_config, model_type
# qwen3_5_text), in Megatron-LM's architecture flags: Qwen3-Next's layer mix without experts.
# 32 layers, every fourth a full-attention layer (gated output, RMSNorm on queries and keys, a
# quarter of each head rotated) and the others gated delta-net linear attention, all norms
# zero-centred (1 + weight). The delta-net layers' own sizes (linear_* in text_config) have no
# Megatron-LM flag: the Megatron backend reads them from --hf-checkpoint.
#
# The released checkpoint is the vision-language model (model_type qwen3_5, the text model under
# text_config and model.language_model): the Megatron backend refuses it by name; train it with
# --train-backend fsdp, or point --hf-checkpoint at the text model (a config.json holding
# text_config's keys, as tests/fixtures/hf_configs.py does). train.py checks every value against
# --hf-checkpoint's config.json (so does --dry-run).

NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-32}"

MODEL_ARGS=(
   # decoder stack, SiLU-gated MLP
   --num-layers "$NUM_LAYERS"
   --hidden-size 4096
   --ffn-hidden-size 12288
   --swiglu
   # full attention: 16 query heads over 4 key/value heads of 256 channels, output gate
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 4
   --kv-channels 256
   --qk-layernorm
   --attention-output-gate
   --use-gated-attention
   --disable-bias-linear
   # rotary positions on a quarter of each head (the vision model's 3-D sections: plain RoPE for text)
   --position-embedding-type rope
   --rotary-base 10000000
   --rotary-percent 0.25
   --max-position-embeddings 262144
   # zero-centred norms and vocabulary; separate input embedding and output layer
   --normalization RMSNorm
   --apply-layernorm-1p
   --norm-epsilon 1e-6
   --vocab-size 248320
   --untie-embeddings-and-output-weights
)
