"""Where a vision checkpoint keeps its image processor's config, read with plain JSON (the
gateway reads its pan-and-scan settings from it, the worker all of its preprocessing): where
transformers 5 looks first, processor_config.json's "image_processor" (what it saves), else
preprocessor_config.json (Google's releases, transformers 4)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def image_processor_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The image processor's config dict of the checkpoint in `model_dir`, None when it has none."""
    model_dir = Path(model_dir)
    processor = model_dir / "processor_config.json"
    if processor.is_file():
        nested = json.loads(processor.read_text()).get("image_processor")
        if nested is not None:
            return nested
    legacy = model_dir / "preprocessor_config.json"
    return json.loads(legacy.read_text()) if legacy.is_file() else None
