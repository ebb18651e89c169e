"""Which family module reads a checkpoint: chosen by `config.json`'s `architectures`.

A family module (modeling/<family>.py) has `ARCHITECTURES`, the names it serves,
and `read_config(raw, generation) -> DecoderConfig`, which turns its config keys into the
shared decoder's switches (modeling/decoder.py). Adding a family is one such file,
listed here, plus its parity test against transformers (tests/unit/modeling/test_model_families.py).

A vision-language checkpoint (Gemma3ForConditionalGeneration) is served by its text
family (gemma3.py reads `text_config`); `load_vision_config` reads its vision part
(modeling/gemma3_vision.py), None for a text-only checkpoint.
"""

import json
from pathlib import Path
from types import MappingProxyType, ModuleType

from modeling import gemma3, gemma3_vision, llama, mistral, qwen2, qwen3
from modeling.config import DecoderConfig, architecture_of
from modeling.gemma3_vision import Gemma3VisionConfig

FAMILIES = MappingProxyType({arch: module for module in (llama, qwen2, qwen3, mistral, gemma3)
                             for arch in module.ARCHITECTURES})


def family_of(raw: dict) -> ModuleType:
    """The family module for a config.json dict; ValueError naming the supported ones."""
    arch = architecture_of(raw)
    if arch not in FAMILIES:
        hint = ""
        if "text_config" in raw:
            hint = (" (a vision-language checkpoint: of those only Gemma3ForConditionalGeneration "
                    "is served)")
        raise ValueError(f"unsupported architecture {arch!r}{hint}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[arch]


def read_config(raw: dict, generation: dict | None = None) -> DecoderConfig:
    """A config.json dict (and generation_config.json's, for the EOS ids), read by its family."""
    return family_of(raw).read_config(raw, generation)


def load_config(model_dir: str | Path) -> DecoderConfig:
    """config.json of a checkpoint folder, with EOS ids from generation_config.json when it has them."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    return read_config(raw, json.loads(gen_path.read_text()) if gen_path.exists() else None)


def load_vision_config(model_dir: str | Path) -> Gemma3VisionConfig | None:
    """The vision encoder's config of a checkpoint folder, None when it has none (text only)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if architecture_of(raw) not in gemma3_vision.ARCHITECTURES:
        return None
    return gemma3_vision.read_vision_config(raw)
