"""``dtype`` as the engine resolves it: ``auto`` by the CPU, and an explicit bfloat16 on a CPU
without native bfloat16 said once in the log (it is emulated there)."""

from __future__ import annotations

import logging

import pytest
import torch

from replica.model import cpu


@pytest.fixture
def fresh_warning() -> None:
    cpu._warn_emulated_bfloat16.cache_clear()


def test_explicit_bfloat16_without_native_bfloat16_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warning: None
) -> None:
    monkeypatch.setattr(cpu, "native_bfloat16", lambda: False)
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        assert cpu.resolve_dtype("auto") == torch.float32
        assert cpu.resolve_dtype("float32") == torch.float32
        assert not caplog.records  # only an explicit bfloat16 is emulated
        for _ in range(3):
            assert cpu.resolve_dtype("bfloat16") == torch.bfloat16
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "emulated" in record.message and "dtype: auto picks float32" in record.message


def test_native_bfloat16_is_not_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warning: None
) -> None:
    monkeypatch.setattr(cpu, "native_bfloat16", lambda: True)
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        assert cpu.resolve_dtype("bfloat16") == torch.bfloat16
        assert cpu.resolve_dtype("auto") == torch.bfloat16
    assert not caplog.records
