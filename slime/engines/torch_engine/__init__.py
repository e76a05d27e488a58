"""The built-in torch engine: an SGLang-protocol HTTP server over a Hugging Face causal LM.

Start it with `python -m slime.engines.torch_engine --model-path DIR [--port 0]`.
"""
