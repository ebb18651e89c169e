"""What the gateway needs of a vision checkpoint to build its prompts: Gemma 3's three image
tokens and how many soft tokens stand for one image, read with plain JSON from the files
transformers saves (no torch, no worker code):

    config.json             architectures ["Gemma3ForConditionalGeneration"],
                            mm_tokens_per_image, boi_token_index, image_token_index,
                            eoi_token_index (transformers' Gemma3Config defaults when absent)
    processor_config.json   image_seq_length: Gemma3Processor's soft tokens per image; it
                            must equal mm_tokens_per_image (what the model's projector makes)
    the image processor's   its pan-and-scan settings (proto/pan_and_scan.py: the
    config                  checkpoint's non-null values over Gemma3Processor's defaults;
                            proto/image_processor_config.py says where it is)
    the tokenizer           each id's token text, which must tokenize back to that one id

`ImageTokens.read(model_dir, tokenizer)` is None for a text checkpoint (every other
architecture): such a model takes no images.

Gemma3Processor's expansion rule (tools/make_vision_model.py pins it against the
processor): each `<start_of_image>` the chat template renders becomes `expanded`,

    "\\n\\n<start_of_image>" + mm_tokens_per_image × "<image_soft_token>" + "<end_of_image>\\n\\n"

before the whole text is tokenized. An image pan-and-scan cuts into k > 0 crops becomes
`expanded_with_crops(k)` instead (Gemma3Processor.replace_image_token):

    "Here is the original image " + expanded + " and here are some crops to help you see better "
    + " ".join([expanded] * k)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.image_processor_config import image_processor_config
from proto.pan_and_scan import PanAndScan

VISION_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# transformers' Gemma3Config defaults, for a config.json that leaves them out
_DEFAULTS = {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "image_token_index": 262_144,
             "eoi_token_index": 256_000}


@dataclass(frozen=True)
class ImageTokens:
    per_image: int  # soft tokens per image (mm_tokens_per_image)
    boi: str  # "<start_of_image>": what the chat template writes for an image
    soft: str  # "<image_soft_token>": the placeholders the image's embeddings replace
    eoi: str  # "<end_of_image>"
    boi_id: int
    soft_id: int
    eoi_id: int
    pan_and_scan: PanAndScan = PanAndScan()  # the checkpoint's settings (a request may change them)

    @property
    def expanded(self) -> str:
        """What one rendered `boi` becomes before tokenizing (Gemma3Processor's rule)."""
        return f"\n\n{self.boi}{self.soft * self.per_image}{self.eoi}\n\n"

    def expanded_with_crops(self, num_crops: int) -> str:
        """What the rendered `boi` of an image with `num_crops` pan-and-scan crops becomes
        (`expanded` when it has none): the image's soft tokens, then each crop's."""
        if not num_crops:
            return self.expanded
        return (f"Here is the original image {self.expanded} and here are some crops to help you see better "
                + " ".join([self.expanded] * num_crops))

    @classmethod
    def read(cls, model_dir: str | Path, tokenizer: Any) -> ImageTokens | None:
        """The image tokens of the checkpoint in `model_dir` (`tokenizer`: its transformers
        tokenizer); None for a text-only checkpoint. ValueError for a vision checkpoint whose
        files disagree (the gateway then refuses to start rather than build wrong prompts)."""
        config_path = Path(model_dir) / "config.json"
        if not config_path.is_file():
            return None
        config = json.loads(config_path.read_text())
        if not set(config.get("architectures") or ()) & set(VISION_ARCHITECTURES):
            return None
        c = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        per_image = c["mm_tokens_per_image"]
        processor_path = Path(model_dir) / "processor_config.json"
        if processor_path.is_file():
            seq_length = json.loads(processor_path.read_text()).get("image_seq_length", per_image)
            if seq_length != per_image:
                raise ValueError(f"{model_dir}: processor_config.json's image_seq_length ({seq_length}) "
                                 f"differs from config.json's mm_tokens_per_image ({per_image})")
        ids = {name: c[f"{name}_token_index"] for name in ("boi", "image", "eoi")}
        texts = {name: tokenizer.convert_ids_to_tokens(token_id) for name, token_id in ids.items()}
        for name, text in texts.items():
            if not isinstance(text, str) or tokenizer.encode(text, add_special_tokens=False) != [ids[name]]:
                raise ValueError(f"{model_dir}: the tokenizer has no single token for config.json's "
                                 f"{name}_token_index {ids[name]} (found {text!r})")
        try:
            pan_and_scan = PanAndScan.from_image_processor(image_processor_config(model_dir))
        except ValueError as exc:
            raise ValueError(f"{model_dir}: {exc}") from None
        return cls(per_image=per_image, boi=texts["boi"], soft=texts["image"], eoi=texts["eoi"],
                   boi_id=ids["boi"], soft_id=ids["image"], eoi_id=ids["eoi"], pan_and_scan=pan_and_scan)
