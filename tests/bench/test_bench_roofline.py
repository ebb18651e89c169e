"""bench/compute/roofline.py's step cost model, against numbers worked out by hand."""

import json

import pytest

from modeling.registry import read_config
from tests.bench.test_bench_compare import bench_module


def _roofline():
    return bench_module("compute.roofline")


def test_step_cost_counts_weights_attention_and_kv():
    roofline = _roofline()
    cfg = read_config({"vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
                                   "num_hidden_layers": 2, "num_attention_heads": 2,
                                   "num_key_value_heads": 1})
    # head_dim 4: q = 8, kv = 4 -> per layer 8*(8+8) + 8*8 + 3*8*16 = 576 weights; head 800
    # one decode (3 cached tokens + 1 new, samples) and one prefill chunk (0 cached, 2 new)
    cost = roofline.step_cost(cfg, 4, [(3, 1, True), (0, 2, False)])
    attended = 4 + (1 + 2)  # the decode sees 4 keys; the chunk's rows see 1 and 2
    assert cost.flops == 2 * 576 * 3 * 2 + 2 * 800 * 1 + 4 * 2 * 4 * attended * 2
    kv_read = (4 + 2) * 2 * 4 * 4 * 2  # tokens in context x (K and V) x kv width x bytes x layers
    kv_written = 3 * 2 * 4 * 4 * 2
    assert cost.bytes == (576 * 2 + 800) * 4 + kv_read + kv_written
    # the phases: the linears' FLOPs and weights, the attention's FLOPs and K/V
    assert cost.linears.flops == 2 * 576 * 3 * 2 + 2 * 800 * 1
    assert cost.linears.bytes == (576 * 2 + 800) * 4
    assert cost.attention.bytes == kv_read + kv_written
    # at 1 FLOP/s and 1 byte/s the linears' FLOPs and the attention's bytes set each phase
    assert cost.linears.flops > cost.linears.bytes and cost.attention.bytes > cost.attention.flops
    assert cost.phases_floor(1.0, 1.0) == cost.linears.flops + cost.attention.bytes
    assert cost.floor(1.0, 1.0) == max(cost.flops, cost.bytes) < cost.phases_floor(1.0, 1.0)


def test_decode_roofline_runs_and_reports_its_bandwidth_share(tiny_model_dir, tmp_path):
    roofline = _roofline()
    out = tmp_path / "roofline.json"
    assert roofline.main(["--model-dir", str(tiny_model_dir), "--batch", "4", "2", "--context", "16",
                          "--steps", "3", "--warmup", "1", "--threads", "1", "--host-split", "--count-kernels",
                          "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["bandwidth_kind"] == "memory read" and result["read_gbps"] > 0
    d = result["decode"]
    assert d["batch"] == 4 and d["floor_ms"] == max(d["compute_ms"], d["memory_ms"])
    slack = 1e-9 * d["floor_ms"]  # the sums of floats differ in the last digit
    assert d["floor_ms"] - slack <= d["phases_floor_ms"] <= d["compute_ms"] + d["memory_ms"] + slack
    share = d["bytes"] / (d["step_ms"] / 1e3) / (result["read_gbps"] * 1e9)
    assert d["bandwidth_utilisation"] == pytest.approx(share)
    assert [d["batch"] for d in result["decodes"]] == [4, 2]  # one runner, both batch sizes
    for d in result["decodes"]:
        assert 0 < d["host_ms"] and 0 < d["sampling_ms"] and 0 < d["forward_ms"] < d["step_ms"]
        assert d["kernels"]["kind"] == "aten operators doing work" and d["kernels"]["count"] > 20
        assert d["cuda_graphs"] is False
        assert d["pipelined_step_ms"] > 0 and d["pipelined_ratio"] == pytest.approx(
            d["pipelined_step_ms"] / d["floor_ms"])
