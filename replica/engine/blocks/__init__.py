"""The engine's paged KV block accounting: ``allocator`` (reference-counted physical blocks
with an LRU pool of cached ones), ``prefix_cache`` (published full blocks, found by hash and
verified by tokens), ``manager`` (a sequence's blocks: its cached prefix first, new blocks
for the rest) and ``audit`` (all of it counted again from scratch)."""
