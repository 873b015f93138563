"""Peer benchmark: servelab's engine against vLLM, llama.cpp, CTranslate2 and onnxruntime-genai.

`python -m bench.peers` runs every engine on the same prompt token ids, lengths, precision and thread
count, interleaved in one run. Each peer lives in its own venv (bench/peers/setup.sh) and is driven as a
subprocess speaking JSON lines (bench/peers/protocol.py), so no peer package is imported here.
"""
