"""The model: a Llama-family decoder that reads and writes the paged KV cache (`llama.py`), its
checkpoints (`loader.py`) and its tensor-parallel layers (`parallel.py`)."""
