"""`--quantization int8`: the decoder's linear layers with int8 weights, quantized at load.

Per output channel, symmetric: row r of W [out, in] is stored as round(W[r] / s[r]) in
[-127, 127] with s[r] = max|W[r]| / 127, so W ~ q * s[:, None], the error of each weight at
most s[r] / 2. The LM head and the embedding keep the model's dtype (the logits' precision
is what sampling and logprobs read).

How the matmul runs, fastest first where it can:
  dynamic   torch's dynamic quantized linear (the ops behind torch.ao.nn.quantized.dynamic.
            Linear: quantized.linear_prepack once, quantized.linear_dynamic per call): the
            activations are quantized to uint8 per tensor (scale from their range), multiplied
            with the int8 weights in int32 by fbgemm/oneDNN (VNNI or AMX-INT8 dot products),
            and rescaled to fp32. Needs a quantized CPU engine ("x86", "fbgemm", "onednn")
            and int8 dot products (VNNI, AMX-INT8): without them the engine's int16 sums
            saturate.
  dequant   F.linear(x, q.to(x.dtype) * s): the weights live in int8 (half of bf16's
            memory) and are widened for each call; anywhere torch runs (CUDA, a CPU
            without int8 dot products or without the quantized engine).
Measured on a 2-core AMD EPYC (AVX512-VNNI, AVX512-BF16), `small` preset shapes, 32 rows:
gate_up [2752 x 512] dynamic 0.15 ms, bf16 (oneDNN, packed) 0.22, fp32 packed 0.44,
`torch._weight_int8pack_mm` (bf16 activations) 0.65, dequant 0.52 ms; so `dynamic` is the
CPU path and `dequant` the fallback (torch._weight_int8pack_mm, private, was slower too).
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_features import cpu_features

log = logging.getLogger(__name__)
QUANTIZATIONS = ("int8",)
QUANT_ENGINES = ("x86", "fbgemm", "onednn")  # torch's quantized CPU engines with int8 dot products
# On AMX-INT8 oneDNN's tiles beat fbgemm's VNNI (which "x86" picks for these shapes): gate_up
# [2752 x 512] at 64 rows took 0.16 ms on onednn against 0.27 on x86 (2-core Xeon, AMX).
AMX_QUANT_ENGINES = ("onednn", "x86", "fbgemm")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], fp32 scales [out]): per-output-channel symmetric quantization."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantized_engine(amx_int8: bool = False) -> str | None:
    """The quantized CPU engine the dynamic path runs on, or None where torch has none."""
    engines = torch.backends.quantized.supported_engines
    return next((e for e in (AMX_QUANT_ENGINES if amx_int8 else QUANT_ENGINES) if e in engines), None)


class Int8Linear(nn.Module):
    """An inference-only nn.Linear with int8 weights; the output has the input's dtype."""

    def __init__(self, linear: nn.Linear, dynamic: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.dynamic = dynamic
        if dynamic:
            qweight = torch.quantize_per_channel(q.float() * scale[:, None], scale.double(),
                                                 torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        else:  # not parameters: nothing trains, loads or saves these
            self.weight_int8, self.scale = q.to(linear.weight.device), scale.to(linear.weight.device)
            self.bias = None if bias is None else bias.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic:
            rows = x.reshape(-1, self.in_features).float()
            out = torch.ops.quantized.linear_dynamic(rows, self.packed, False)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        weight = self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def weight_bytes(self) -> int:
        return self.in_features * self.out_features  # one byte a weight (+ a scale per row)


def quantize_linears(model: nn.Module, device: torch.device, keep: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every nn.Linear of `model` but those named in `keep` by an Int8Linear (after
    the weights are loaded); returns how many. The dynamic path on a CPU with int8 dot
    products and a quantized engine, the dequant path elsewhere (logged)."""
    features = cpu_features()
    # Without int8 dot products (VNNI, AMX-INT8) the engine multiplies uint8 x int8 pairs
    # into int16 sums that saturate, and activations kept to 7 bits against it (torch's
    # reduce_range) put the tiny models' mean logit error at 0.29-0.30, over the 0.25 this
    # path states (AVX2-only EPYC): such CPUs take the weight-only dequant path.
    engine = None
    if device.type == "cpu" and features.int8_dot:
        engine = quantized_engine("amx_int8" in features.flags)
    if engine is not None:
        torch.backends.quantized.engine = engine
    names = [name for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rpartition(".")[2] not in keep]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8Linear(getattr(parent, attr), dynamic=engine is not None))
    log.info("int8 weights: %d linear layers, matmuls on %s", len(names),
             f"torch's quantized engine {engine!r} (int8 dot products)" if engine
             else "the model's dtype after widening the weights (no int8 dot products or "
                  "quantized engine here)")
    return len(names)
