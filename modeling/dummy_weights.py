"""`--load-format dummy` (vLLM's flag): a model's parameters made on the device, random, in
the checkpoint's shapes and dtype, no weight file read. It runs, and benchmarks, a model
that was never downloaded: its folder needs `config.json` (and the tokenizer's files for
the gateway), not the weights.

Every parameter is uniform in [-1e-3, 1e-3] (vLLM's range), so activations stay finite
through any depth; what the model says is noise, its speed and memory are the real ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

LOAD_FORMATS = ("auto", "dummy")  # auto: the checkpoint's safetensors files
DUMMY_RANGE = 1e-3


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")


def check_config(model_dir: str | Path, load_format: str) -> None:
    """FileNotFoundError, naming the flag, when dummy weights have no config.json to follow."""
    check_load_format(load_format)
    if load_format == "dummy" and not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: --load-format dummy makes the weights from "
                                f"it (their shapes and dtype); give a folder with the checkpoint's config.json "
                                f"and tokenizer files")


def fill_dummy(module: nn.Module, seed: int = 0) -> None:
    """Every parameter of `module` (on its own device, once however often it is tied)
    uniform in [-DUMMY_RANGE, DUMMY_RANGE], from `seed`."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in module.parameters():
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device)
                gen.manual_seed(seed)
            param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
