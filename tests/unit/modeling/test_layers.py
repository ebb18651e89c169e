"""modeling/layers.py: the oneDNN-packed linear against nn.Linear."""

import pytest
import torch
from torch import nn

from modeling.layers import PackedLinear, can_pack_linears, pack_linears

pytestmark = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [(1,), (7,), (33,), (2, 5)])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(len(rows) * 10 + rows[0])
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
        assert packed(x).shape == (*rows, 200)


@pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.bfloat16),
                    reason="this CPU has no native bf16")
def test_packed_linear_bf16():
    torch.manual_seed(1)
    linear = nn.Linear(64, 128).to(torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = PackedLinear(linear)(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), linear(x).float(), atol=2e-2, rtol=2e-2)


def test_pack_linears_replaces_every_linear_and_keeps_the_rest():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 32), nn.ReLU(),
                          nn.Sequential(nn.Linear(32, 16)), nn.Linear(16, 50, bias=False))
    model[4].weight = nn.Parameter(torch.randn(50, 16))
    ids = torch.tensor([1, 4, 9])
    with torch.inference_mode():
        expected = model(ids)
        assert pack_linears(model) == 3
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        assert isinstance(model[0], nn.Embedding)
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)


def test_can_pack_only_cpu_fp32_bf16():
    assert can_pack_linears(torch.device("cpu"), torch.bfloat16) == \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not can_pack_linears(torch.device("cpu"), torch.float16)
    assert not can_pack_linears(torch.device("meta"), torch.float32)
