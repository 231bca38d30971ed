"""Moving KV between engines, the room between the engine and what stands on it: verified
prefix export and import (``transfer.py``: what pulls and the node store both use) and the
KV pool in shared memory that same-node replicas read (``shared_pool.py``: the model's pool
lives there when pulls read it)."""
