"""Build a decoder from a Hugging Face checkpoint folder (config.json + safetensors).

The module is built on the meta device (no memory, no random init), its weights' bytes
checked against what the device has free (modeling/weight_memory.py), materialised empty
on the target device in the target dtype, then every parameter is filled from the
safetensors files (or made random: --load-format dummy, modeling/dummy_weights.py);
`load_weights` refuses a checkpoint that leaves anything unfilled.
On the CPU the linear layers' weights are then packed for oneDNN (layers.PackedLinear).

Which files: those `model.safetensors.index.json` names (sharded checkpoints), else
`model.safetensors`, else every `*.safetensors` in the folder. (Some repositories carry a
second copy of the weights in another layout next to the shards, e.g. Mistral's
`consolidated.safetensors`: the index keeps it out.) Each file's progress is logged.
"""

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.backend import AttentionBackend
from kernels.cpu_features import CpuFeatures, cpu_features
from modeling.config import DTYPES, DecoderConfig
from modeling.decoder import DecoderForCausalLM
from modeling.dummy_weights import check_load_format, fill_dummy
from modeling.int8_linear import QUANTIZATIONS, quantize_linears
from modeling.layers import can_pack_linears, pack_linears
from modeling.weight_memory import check_fits

INDEX_FILE = "model.safetensors.index.json"
log = logging.getLogger(__name__)


def resolve_dtype(name: str, cfg: DecoderConfig, device: torch.device | str = "cpu",
                  cpu: CpuFeatures | None = None) -> tuple[torch.dtype, str]:
    """(the dtype to serve in, why). "auto" is the checkpoint's dtype where the device
    computes it natively -- any CUDA device; a CPU with bf16 (AVX512-BF16, AMX) or fp16
    instructions (kernels/cpu_features.py) -- and fp32 otherwise, where a bf16 matmul is
    an fp32 one plus conversions. Any other name is taken as asked."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose 'auto' or one of {sorted(DTYPES)}")
        return DTYPES[name], f"--dtype {name}"
    own = cfg.dtype
    short = str(own).removeprefix("torch.")
    if own == torch.float32 or torch.device(device).type != "cpu":
        return own, f"auto: the checkpoint's {short}"
    cpu = cpu or cpu_features()
    native = cpu.native_bf16 if own == torch.bfloat16 else cpu.native_fp16
    if native:
        return own, f"auto: the checkpoint's {short}, native on this CPU ({cpu.describe()})"
    return torch.float32, (f"auto: float32, as the checkpoint's {short} is not native on this CPU "
                           f"({cpu.describe()}); --dtype {short} forces it")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files that hold the checkpoint's weights, in load order."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise FileNotFoundError(f"{index} names {len(missing)} files that are not there, "
                                    f"e.g. {missing[0]}")
        return [model_dir / n for n in names]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir} (--load-format dummy runs "
                                f"without them: random weights of config.json's shapes)")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, logging each file as it is read."""
    files = weight_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    done, start = 0, time.monotonic()
    for i, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        done += path.stat().st_size
        log.info("loading weights: %d/%d files, %.2f of %.2f GiB, %.1f s", i, len(files),
                 done / 2**30, total / 2**30, time.monotonic() - start)


def load_model(model_dir: str | Path, cfg: DecoderConfig, backend: AttentionBackend,
               max_positions: int, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, load_format: str = "auto") -> DecoderForCausalLM:
    """The model in `dtype` on `device`; with quantization "int8" its linear layers but the
    LM head hold int8 weights (modeling/int8_linear.py). `load_format` "dummy":
    random weights made on the device, no file read (modeling/dummy_weights.py)."""
    check_load_format(load_format)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, backend, max_positions, dtype, device)
    check_fits(model, dtype, device, "the decoder")
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each parameter its own memory: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    if load_format == "dummy":
        fill_dummy(model)
    else:
        model.load_weights(iter_safetensors(model_dir))
    if quantization == "int8":
        quantize_linears(model, torch.device(device))
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    if can_pack_linears(device, dtype):
        pack_linears(model)
    return model.eval()
