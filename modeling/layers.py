"""Building blocks shared by decoder families, written to match transformers' numerics
(same op order, fp32 where it computes in fp32) so greedy outputs agree token for token."""

import functools
import math
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import torch_layer_ops


class RMSNorm(nn.Module):
    """weight * (x / rms(x)), the normalisation done in fp32 and cast back before the
    weight multiply, as in transformers' LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_layer_ops.rms_norm(x, self.weight, self.eps, gemma=False)


class GemmaRMSNorm(nn.Module):
    """(x / rms(x)) * (1 + weight), all in fp32 and cast back at the end, as transformers'
    Gemma3RMSNorm (the weight is stored as an offset from 1)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_layer_ops.rms_norm(x, self.weight, self.eps, gemma=True)


def rms_norm(cfg, size: int) -> nn.Module:
    """The family's RMSNorm over `size` features (cfg: a DecoderConfig)."""
    return (GemmaRMSNorm if cfg.gemma_norms else RMSNorm)(size, cfg.rms_norm_eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of RoPE (fp32). `scaling["rope_type"]`: "linear" divides every
    frequency by `factor` (positions interpolated); "llama3" is Llama 3's frequency-dependent
    scaling: long wavelengths divided by `factor`, short ones kept, the band between
    interpolated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE's cos/sin tables, precomputed for every position < max_positions
    (the same fp32 `position * inv_freq` products transformers computes per call), in the
    model's dtype and full width: cos as (cos, cos), sin as (-sin, sin), so that rotating is
    x * cos[p] + (x2, x1) * sin[p] (kernels/torch_layer_ops.py `rotate`: transformers' two
    halves, bit for bit). The layer ops read the rows of a step's positions themselves."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        # Real tensors even when the model is built under the loader's meta device, and
        # plain attributes, not buffers: derived, never loaded or saved, untouched by to_empty.
        with torch.device(device):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
            self.cos = torch.cat((cos, cos), dim=-1)
            self.sin = torch.cat((-sin, sin), dim=-1)


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight is packed once, at load, into oneDNN's
    blocked layout (CPU, fp32 or bf16).

    F.linear hands the plain [out, in] weight to the BLAS, which re-packs all of it into
    its panel layout on every call: at decode batch sizes that costs more than the
    multiply itself. Packed once, the weight is only read. Measured on the 2-core VM,
    `small` preset, the 32 per-layer matmuls of a decode step at batch 32: 16.6 -> 10.4 ms,
    its lm_head: ~16-27 -> 10.7 ms; prefill-sized (512 rows) 152 -> 122 ms.
    Results equal F.linear's up to float reassociation (~1e-5 relative).
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = 32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # not parameters: nothing trains, loads or saves these
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU, oneDNN present, fp32 or a bf16 the CPU runs natively (elsewhere oneDNN's bf16
    path is a slow emulation, or refused)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear (call after the weights are
    loaded, only where can_pack_linears); returns how many were replaced. One at a time,
    so each plain weight is freed as its packed copy is made. A head tied to the embedding
    gets its own packed copy (the embedding keeps the plain one): vocab x hidden more
    memory, e.g. 65 MB for the `small` preset."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(getattr(parent, attr)))
    return len(names)


ACTIVATIONS = MappingProxyType({"silu": F.silu,
                                "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")})


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul, and the activation
    and product one call of the layer ops (`ops`: kernels/torch_layer_ops.py or its Triton
    twin); act is SiLU (Llama, Qwen, Mistral) or tanh-approximated GELU (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str, ops=torch_layer_ops):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.act, self.ops = act, ops
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_mul(self.gate_up_proj(x), self.act))
