"""Sampling defaults a request falls back to for the parameters it leaves out, read from the
checkpoint's `generation_config.json` as vLLM's `--generation-config` does:

    auto     the model folder's generation_config.json (the default)
    vllm     none: OpenAI's defaults (temperature 1, top_p 1, no top_k, ...)
    FOLDER   the generation_config.json in that folder

Only the keys that mean the same thing in a request are taken: temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens (the default max_tokens). `do_sample` is not
read (vLLM does not either): a checkpoint that ships `temperature: 0.6` samples at 0.6 unless
the request says otherwise; a request's own values always win.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingDefaults field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def load(cls, source: str, model_dir: Path) -> SamplingDefaults:
        """The defaults `--generation-config SOURCE` names (see the module docstring)."""
        if source == "vllm":
            return cls()
        folder = model_dir if source == "auto" else Path(source).expanduser()
        if source != "auto" and not folder.is_dir():
            raise ValueError(f"--generation-config {source!r}: expected 'auto', 'vllm' or a folder")
        path = folder / "generation_config.json"
        if not path.is_file():
            if source != "auto":
                raise ValueError(f"--generation-config {source!r}: no generation_config.json there")
            return cls()
        raw = json.loads(path.read_text())
        values = {field: raw[key] for key, field in _KEYS.items() if raw.get(key) is not None}
        defaults = cls(**values)
        if values:
            log.warning("Default sampling parameters from %s (a request's own values win; "
                        "--generation-config vllm ignores them): %s", path, values)
        return defaults
