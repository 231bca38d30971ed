"""How close to the machine (``bench/roofline.py``): the counts it divides by are the model's
own, and its clock and bandwidth are read, not assumed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench import roofline
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.checkpoints.shape import ModelShape
from replica.model.llama import LlamaDecoderLayer


def test_the_linear_weights_counted_are_the_decoders_own() -> None:
    shape = ModelShape()
    layer = LlamaDecoderLayer(shape)
    counted = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
    assert roofline.linear_weights(shape) == shape.num_layers * counted


def test_smollm2_reads_269_mb_a_decode_token_in_bfloat16() -> None:
    """The issue's figure: 269 MB of weights a token (106M in the linears, 28M in the
    vocabulary's rows), and its keys and values on top."""
    shape = checkpoint_for(SMOLLM2).shape
    weights = roofline.decode_bytes_per_token(shape, torch.bfloat16, context=0)
    assert weights == pytest.approx(269e6, rel=0.01)
    with_kv = roofline.decode_bytes_per_token(shape, torch.bfloat16, context=100)
    assert with_kv - weights == 2 * 30 * 3 * 64 * 100 * 2


def test_a_prefill_tokens_flops_are_its_linears_and_its_share_of_attention() -> None:
    shape = ModelShape()
    one = roofline.prefill_flops_per_token(shape, 1)
    assert one == 2 * roofline.linear_weights(shape) + 8 * 2 * 2 * 8 * 32 * 1 + 2 * 258 * 256
    longer = roofline.prefill_flops_per_token(shape, 1001)
    attention = 8 * 2 * 2 * 8 * 32 * 501
    logits = 2 * 258 * 256 / 1001  # the last token's, shared by the prompt
    assert longer == pytest.approx(2 * roofline.linear_weights(shape) + attention + logits)


def test_the_clock_is_the_highest_cpuinfo_reports() -> None:
    text = "processor\t: 0\ncpu MHz\t\t: 2450.000\nprocessor\t: 1\ncpu MHz\t\t: 3100.5\n"
    assert roofline.clock_hz(text) == 3100.5e6
    with pytest.raises(ValueError):
        roofline.clock_hz("flags: avx2\n")
    assert roofline.peak_flops("amx", 2, 2e9) == 1024 * 2 * 2e9


def test_the_bandwidth_is_measured_here() -> None:
    assert 1e8 < roofline.read_bandwidth(threads=1, mib=64, repeats=2) < 1e12
