"""Which part of a vision-language checkpoint a tensor belongs to, under each layout its
weights have been saved in, and its name inside that part.

Gemma3ForConditionalGeneration (LLaVA-style models alike) has three parts; the layouts:

  part         transformers 5, in memory                 as saved (transformers 4.50-4.51, Google's
                                                         releases, and transformers 5's save_pretrained)
  text         model.language_model.<X>                  language_model.model.<X>
  LM head      lm_head.<X>                               language_model.lm_head.<X>
  vision       model.vision_tower.[vision_model.]<X>     vision_tower.[vision_model.]<X>
  projector    model.multi_modal_projector.<X>           multi_modal_projector.<X>

(`vision_model.` is SiglipVisionModel's own prefix: Google's files have it, transformers 5
drops it.) `split_name` maps each to (part, local name): TEXT with the name a
<Family>ForCausalLM gives it (`model.<X>`, `lm_head.<X>`), VISION with the SigLIP tower's
own (`embeddings.…`, `encoder.layers.…`, `post_layernorm.…`), PROJECTOR with the
projector's (`mm_input_projection_weight`, `mm_soft_emb_norm.weight`). A text-only
checkpoint's names come back as TEXT, unchanged.
"""

TEXT, VISION, PROJECTOR = "text", "vision", "projector"
# The architectures whose checkpoints hold vision parts beside the text decoder.
MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)

_PREFIXES = (  # (checkpoint prefix, part, prefix in that part's own names); longest first
    ("model.language_model.", TEXT, "model."),
    ("language_model.model.", TEXT, "model."),
    ("language_model.lm_head.", TEXT, "lm_head."),
    ("language_model.", TEXT, "model."),
    ("model.vision_tower.vision_model.", VISION, ""),
    ("model.vision_tower.", VISION, ""),
    ("vision_tower.vision_model.", VISION, ""),
    ("vision_tower.", VISION, ""),
    ("model.multi_modal_projector.", PROJECTOR, ""),
    ("multi_modal_projector.", PROJECTOR, ""),
)


def split_name(name: str) -> tuple[str, str]:
    """(part, name within the part) of a checkpoint tensor's name."""
    for prefix, part, local in _PREFIXES:
        if name.startswith(prefix):
            return part, local + name[len(prefix):]
    return TEXT, name
