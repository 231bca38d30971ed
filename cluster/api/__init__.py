"""The OpenAI-compatible HTTP surface: request bodies (``models.py``, their formats and tools
in ``formats.py``), errors in OpenAI's shape (``errors.py``), the OpenAPI document
(``openapi.py``), API keys and the body cap (``auth.py``, ``body_limit.py``), structured
outputs and tool calls (``structured.py``, ``tools.py``), the replies built from engine
outputs (``responses.py``, ``choice.py``, ``logprob_format.py``) and the HTTP metrics
(``metrics.py``)."""
