"""Checkpoint tensors copied into a module's parameters where some checkpoint tensors are
slices of one stacked parameter (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`): one
matmul instead of three. Shared by the decoder (modeling/decoder.py) and the vision
tower (modeling/siglip.py).

    loader = StackedWeights(dict(module.named_parameters()), STACKED, slice_of, owner="the vision tower")
    for name, tensor in checkpoint: loader.copy(name, tensor)
    loader.unfilled   # parameters (or `name#i` slices of stacked ones) no tensor filled

`STACKED` rows are (stacked parameter, checkpoint name, slice index); `slice_of(param,
stacked name, index)` gives the slice of `param` that checkpoint tensor fills.
"""

from collections.abc import Callable

import torch

Stacked = tuple[tuple[str, str, int], ...]


class StackedWeights:
    def __init__(self, params: dict[str, torch.Tensor], stacked: Stacked,
                 slice_of: Callable[[torch.Tensor, str, int], torch.Tensor], owner: str):
        self.params, self.stacked, self.slice_of = params, stacked, slice_of
        self.owner = owner  # the model the parameters are of, for the errors
        self.unfilled: set[str] = set()
        for name in params:
            parts = [i for s, _, i in stacked if f".{s}." in name]
            self.unfilled.update([f"{name}#{i}" for i in parts] if parts else [name])

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        """Copy `tensor` into its parameter (or slice); KeyError when it has no place,
        ValueError when the shapes differ."""
        key, target = name, None
        for stacked, original, index in self.stacked:
            if f".{original}." in name:
                name = name.replace(f".{original}.", f".{stacked}.")
                key = f"{name}#{index}"
                if name in self.params:
                    target = self.slice_of(self.params[name].data, stacked, index)
                break
        else:
            target = self.params[name].data if name in self.params else None
        if target is None:
            raise KeyError(f"checkpoint tensor {name!r} matches no parameter of {self.owner}")
        if target.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                             f"model expects {tuple(target.shape)}")
        target.copy_(tensor)
        self.unfilled.discard(key)
