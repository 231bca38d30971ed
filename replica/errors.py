"""What a replica raises at a request (no torch, no Ray): the ingress turns each into its
HTTP answer by type, never from an exception's text."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine can never serve; nothing was changed. ``message`` is written for
    the client, ``param`` names the field at fault and ``code`` is OpenAI's error code (the
    ingress renders exactly these, never the exception's text, which Ray decorates with a
    traceback when it crosses from a replica)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def __reduce__(self) -> tuple[type, tuple[str, str | None, str | None]]:
        return (InvalidRequestError, (self.message, self.param, self.code))


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (a bug that its own numbers or state hit, say in
    sampling); the engine dropped it and served everything else. The ingress answers 500 and
    never resends it (it would fail on any replica). ``message`` is for the server's log."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (RequestFailedError, (self.message,))
