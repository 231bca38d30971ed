"""The model room: the maths of one step. ``llama.py`` is the decoder (RMSNorm, RoPE, SwiGLU,
grouped KV heads) over the paged KV cache of ``attention.py``, whose C++ kernels are in
``kernels/``; ``packed_linear.py`` runs the linear layers on oneDNN, ``runner.py`` turns a
scheduled batch into tensors and logits, ``shape.py`` describes a model, ``cpu.py`` picks the
dtype and ``memory.py`` keeps freed memory mapped."""
