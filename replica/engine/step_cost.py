"""What one more token costs a step: a line fitted online to the engine's own steps.

A step's time grows with the tokens it computes: little while the step is bound by reading
the weights (a few decodes), about linearly once it is bound by arithmetic (many). Drafts
add tokens to a step, so whether a draft pays depends on where the step is on that curve:
``StepCost`` fits ``seconds = fixed + per_token x tokens`` by least squares over the recent
steps (exponentially weighted, so the fit follows the load the engine sees), and
``draft_threshold`` turns it into the probability of being kept that a drafted token needs
to pay for itself. Adding one token to a step of ``T`` tokens that yields ``O`` outputs in
``t = fixed + per_token x T`` seconds raises the step's output rate iff the token's
expected yield ``p`` satisfies ``(O + p) / (t + per_token) > O / t``, that is
``p > O x per_token / t``. At batch 1 on a CPU that is a few percent; at batch 32 most of a
token (measured: README "Speculative decoding").
"""

from __future__ import annotations

_DECAY = 0.98  # a step's weight halves after ~35 steps
_MIN_WEIGHT = 8.0  # steps' worth of samples before the fit is trusted


class StepCost:
    """An exponentially weighted least-squares line of step seconds against step tokens."""

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` tokens in ``seconds``."""
        d = _DECAY
        self._n = d * self._n + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the recent steps cannot tell
        them apart (too few, or all of nearly one size)."""
        if self._n < _MIN_WEIGHT:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        if var < 0.25:  # the steps' sizes spread by less than a token
            return None
        per_token = max(0.0, (self._xy / self._n - mean_x * mean_y) / var)
        return mean_y - per_token * mean_x, per_token

    def draft_threshold(self, outputs: int, tokens: int) -> float:
        """The probability of being kept above which one more drafted token raises the
        output rate of a step of ``tokens`` tokens yielding ``outputs`` (module docstring);
        0 while the fit is unknown (drafts are then limited by their length alone)."""
        line = self.line()
        if line is None or outputs <= 0:
            return 0.0
        fixed, per_token = line
        seconds = fixed + per_token * tokens
        if seconds <= 0.0:
            return 0.0
        return min(1.0, outputs * per_token / seconds)
