"""The OpenAI-compatible HTTP surface: request bodies (``models.py``), errors in OpenAI's shape
(``errors.py``), the OpenAPI document (``openapi.py``), API keys (``auth.py``), the replies
built from engine outputs (``responses.py``, ``choice.py``, ``textstream.py``,
``logprob_format.py``) and the HTTP metrics (``metrics.py``)."""
