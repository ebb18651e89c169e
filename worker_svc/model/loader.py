"""Build a decoder from a Hugging Face checkpoint folder (config.json + *.safetensors).

The module is built on the meta device (no memory, no random init), materialised empty
on the target device in the target dtype, then every parameter is filled from the
safetensors files; `load_weights` refuses a checkpoint that leaves anything unfilled.
On the CPU the linear layers' weights are then packed for oneDNN (layers.PackedLinear).
"""

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.backend import AttentionBackend
from worker_svc.model.config import DTYPES, DecoderConfig
from worker_svc.model.layers import can_pack_linears, pack_linears
from worker_svc.model.llama import LlamaForCausalLM

ARCHITECTURES = {"LlamaForCausalLM": LlamaForCausalLM}


def resolve_dtype(name: str, cfg: DecoderConfig) -> torch.dtype:
    """"auto" → the checkpoint's dtype; otherwise a name from DTYPES."""
    if name == "auto":
        return cfg.dtype
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[name]


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file, files in name order."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, cfg: DecoderConfig, backend: AttentionBackend,
               max_positions: int, dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {sorted(ARCHITECTURES)}")
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture](cfg, backend, max_positions, dtype, device)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each parameter its own memory: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(iter_safetensors(model_dir))
    if can_pack_linears(device, dtype):
        pack_linears(model)
    return model.eval()
