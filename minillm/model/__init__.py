"""The model: a Llama-family decoder that reads and writes the paged KV cache (``llama.py``), the families it
covers (``families.py``), loading (``loader.py``) and tensor parallelism's shards (``parallel.py``)."""
