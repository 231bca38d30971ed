"""From logits to tokens: ``params.py`` (what a request asks), ``logits_processing.py``
(penalties, bias, ``min_tokens``), ``sampler.py`` (greedy, temperature and top-p, seeded by
request and position)."""
