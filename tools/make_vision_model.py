"""The vision-language parts of a `gemma3-vision` checkpoint for `pagedserve make-model`
(tools/make_model.py trains the tokenizer, scales the LM head, perturbs the text norms
and saves; this file builds the model around the text config and writes the processor).

What the folder holds after `make_model(DIR, preset, arch="gemma3-vision")`:
  config.json             Gemma3Config: `text_config` (the `gemma3` preset's text part),
                          `vision_config` (SigLIP, model_presets.VISION_SHAPES),
                          `mm_tokens_per_image`, `boi_token_index` / `image_token_index` /
                          `eoi_token_index` (the tokenizer's ids of the three image tokens)
  model.safetensors       as transformers saves Gemma3ForConditionalGeneration: names
                          `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`
                          (the tied LM head is not stored)
  generation_config.json  EOS ids (<eos>, <end_of_turn>), greedy by default
  processor_config.json   Gemma3Processor: `image_seq_length` (= mm_tokens_per_image) and
                          the image processor's parameters under "image_processor"
  tokenizer.json, tokenizer_config.json (boi_token, image_token, eoi_token named),
  chat_template.jinja     Google's Gemma 3 template (model_presets.GEMMA3_TEMPLATE)
`AutoProcessor.from_pretrained(DIR)` gives a Gemma3Processor over `Gemma3ImageProcessorPil`
(the image processor transformers picks where torchvision is absent, and the one written here).

Prompt expansion (Gemma3Processor, transformers 5): the chat template renders each image as
`<start_of_image>`; before tokenizing, every `<start_of_image>` of the rendered text becomes

    "\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\\n\\n"

and the whole text is then tokenized, so the two "\\n\\n" merge with the text around them as
the tokenizer's merges say (the expansion is textual, not a fixed run of token ids). With
pan-and-scan and k > 0 crops, the image's `<start_of_image>` becomes instead
`"Here is the original image " + S + " and here are some crops to help you see better " +
" ".join([S] * k)` where S is the string above, and the k crops follow the image in the
pixel batch (vision/image_preprocess.py). The image's soft tokens are the prompt
positions holding `image_token_index`; the vision encoder's output rows replace their
embeddings in order (modeling/image_placement.py).

Weights: transformers' own init, seeded by the caller, then made to matter -- LayerNorm
weights 1 + N(0, 0.1) and biases N(0, 0.1) (init 1 and 0), Gemma's projector norm
N(0, 0.1) (an offset from 1, init 0), and the projection (initialised to zeros by
transformers, which would make every image the same) N(0, s) with s chosen so image
embeddings come out as loud as the scaled text embeddings they sit among.
"""

from pathlib import Path

import torch

from tools.model_presets import GEMMA3_IMAGE_TOKENS, VisionShape, vision_shape

IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)  # Gemma 3's preprocessor_config.json
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, as Gemma 3's configs name it


def gemma3_vision_config(text_config, preset: str, token_ids: dict[str, int]):
    """The Gemma3Config around `text_config` (a Gemma3TextConfig); `token_ids`: the
    tokenizer's id of each image token by its name (boi_token, image_token, eoi_token)."""
    from transformers import AutoConfig, Gemma3Config

    v = vision_shape(preset)
    vision = AutoConfig.for_model(
        "siglip_vision_model", hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_hidden_layers, num_attention_heads=v.num_attention_heads,
        image_size=v.image_size, patch_size=v.patch_size, vision_use_head=False,
        hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    return Gemma3Config(
        text_config=text_config, vision_config=vision, mm_tokens_per_image=v.mm_tokens_per_image,
        boi_token_index=token_ids["boi_token"], image_token_index=token_ids["image_token"],
        eoi_token_index=token_ids["eoi_token"], tie_word_embeddings=True)


def image_token_ids(tokenizer) -> dict[str, int]:
    """{boi_token: id, image_token: id, eoi_token: id} of a tokenizer holding Gemma 3's image tokens."""
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_IMAGE_TOKENS}


@torch.no_grad()
def perturb_vision_weights(model, v: VisionShape) -> None:
    """Make the vision tower's norms and the projector matter (see the module docstring).
    Call after the LM head was rescaled: the projection's scale follows the text embeddings."""
    for name, param in model.named_parameters():
        if "vision_tower" in name and "norm" in name:  # LayerNorms: weight 1, bias 0 at init
            if name.endswith(".weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    projector = model.model.multi_modal_projector
    projector.mm_soft_emb_norm.weight.normal_(0.0, 0.1)
    embed = model.get_input_embeddings()
    text_rms = (embed.weight.float().pow(2).mean() ** 0.5) * embed.embed_scale.float()
    # normed (unit RMS) x W with W ~ N(0, s): RMS of the output ~ s * sqrt(vision hidden)
    projector.mm_input_projection_weight.normal_(0.0, float(text_rms) / v.hidden_size**0.5)


def save_gemma3_processor(out: Path, tokenizer, preset: str) -> None:
    """processor_config.json (Gemma3Processor + Gemma3ImageProcessorPil) and the tokenizer
    files, through the processor's own save_pretrained."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    v = vision_shape(preset)
    image_processor = Gemma3ImageProcessorPil(
        size={"height": v.image_size, "width": v.image_size}, resample=BILINEAR,
        image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD), rescale_factor=1 / 255,
        do_convert_rgb=True, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=tokenizer.chat_template,
                                image_seq_length=v.mm_tokens_per_image)
    processor.save_pretrained(out)
