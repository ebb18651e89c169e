"""What `pagedserve make-model --arch A --preset P` writes: sizes per preset, and per family
the transformers config with that family's distinctive parts switched on, and its chat
flavour (special tokens, EOS ids, chat template in the family's own format).

Sizes (`SHAPES`): `tiny` is for tests (3 layers, hidden 64), `small` for CPU benchmarks
(8 layers, hidden 512, vocab 32,000), `1b` the shapes of a real ~1B model of the family.
At `tiny`, each family shows what makes it different at sizes the tests reach: a 48-token
window (shorter than the test prompts) on Qwen2's upper layers, on every Mistral layer and
on Gemma 3's sliding layers; head_dim 32 where hidden / heads is 16 (Qwen3, Gemma 3); tied
embeddings (Qwen2, Qwen3, Gemma 3); two RoPE bases with linear scaling on the global layers,
`query_pre_attn_scalar` and a final logit soft-cap (Gemma 3).

`gemma3-vision` is `Gemma3ForConditionalGeneration`: the `gemma3` text part of the preset
plus a SigLIP vision tower and Gemma 3's projector (`VISION_SHAPES`): `tiny` sees 56x56
images as 4x4 patches of 14 pixels, average-pooled 2x2 to 4 soft tokens an image; `small`
224x224 images as 16x16 patches pooled to 64 soft tokens (Gemma 3 itself: 896x896, 64x64
patches, 256 soft tokens). Its tokenizer holds Gemma's image tokens and its chat template is
Google's Gemma 3 template (`GEMMA3_TEMPLATE`).
"""

from dataclasses import dataclass, field
from types import MappingProxyType

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma3-vision")
VISION_ARCHS = ("gemma3-vision",)  # Gemma3ForConditionalGeneration: tools/make_vision_model.py


@dataclass(frozen=True)
class Shape:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    corpus_chars: int | None  # tokenizer training text; None: the whole stdlib, recursively
    initializer_range: float = 0.02
    logit_std: float = 3.0  # the LM head is rescaled to give roughly this logit spread


SHAPES = MappingProxyType({
    "tiny": Shape(num_hidden_layers=3, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1536, max_position_embeddings=1024,
                  dtype=torch.float32, corpus_chars=600_000, initializer_range=0.1),
    "small": Shape(num_hidden_layers=8, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                   dtype=torch.float32, corpus_chars=5_000_000, initializer_range=0.04),
})

# The `1b` preset of each family: a real checkpoint's shapes (random weights).
REAL_1B = MappingProxyType({
    # Llama-3.2-1B (tied embeddings, rope_theta 5e5 with llama3 scaling)
    "llama": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    # Qwen2.5-1.5B
    "qwen2": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768),
    # Qwen3-1.7B (head_dim 128)
    "qwen3": dict(num_hidden_layers=28, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=151936, max_position_embeddings=40960),
    # Mistral 7B v0.1's proportions at 1B (GQA, 4096-token window)
    "mistral": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=7168, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768),
    # gemma-3-1b (head_dim 256, one kv head, 512-token window)
    "gemma3": dict(num_hidden_layers=26, hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                   num_key_value_heads=1, vocab_size=262144, max_position_embeddings=32768),
})


# Google's Gemma 3 releases (`--arch gemma3-vision`, config only: `make-model --config-only`,
# served with `--load-format dummy`): the text part of each release's published config.json;
# all three share vocab 262,208, a 1,024-token window on five of every six layers, RoPE
# bases 10k (sliding) and 1M linearly scaled by 8 (global), no soft-caps, and the vision
# tower `SIGLIP_SO400M`.
RELEASES = MappingProxyType({
    "gemma-3-4b-it": dict(num_hidden_layers=34, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
    "gemma-3-12b-it": dict(num_hidden_layers=48, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma-3-27b-it": dict(num_hidden_layers=62, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                           num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168),
})


@dataclass(frozen=True)
class VisionShape:
    """The SigLIP vision tower and projector of a `gemma3-vision` preset."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    mm_tokens_per_image: int  # a square; (image_size / patch_size)^2 patches pool to it


VISION_SHAPES = MappingProxyType({
    "tiny": VisionShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        image_size=56, patch_size=14, mm_tokens_per_image=4),
    "small": VisionShape(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=6, image_size=224, patch_size=14, mm_tokens_per_image=64),
})
# The releases' tower: SigLIP So400m at 896 px (64x64 patches of 14 pixels pooled 4x4 to 256
# soft tokens an image), with its vision_config's published values.
SIGLIP_SO400M = VisionShape(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                            image_size=896, patch_size=14, mm_tokens_per_image=256)


PRESETS = (*SHAPES, "1b", *RELEASES)


def vision_shape(preset: str) -> VisionShape:
    if preset in RELEASES:
        return SIGLIP_SO400M
    if preset not in VISION_SHAPES:
        raise ValueError(f"preset {preset!r} has no vision tower; gemma3-vision comes in "
                         f"{[*VISION_SHAPES, *RELEASES]}")
    return VISION_SHAPES[preset]


def shape(arch: str, preset: str) -> Shape:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    if arch in VISION_ARCHS:
        vision_shape(preset)  # refuses the presets without one (`1b`)
    if preset in RELEASES:
        if arch not in VISION_ARCHS:
            raise ValueError(f"preset {preset!r} is a Gemma 3 release: its arch is gemma3-vision, not {arch!r}")
        dims = {k: v for k, v in RELEASES[preset].items() if k not in ("head_dim", "query_pre_attn_scalar")}
        return Shape(**dims, vocab_size=262208, max_position_embeddings=131072, dtype=torch.bfloat16,
                     corpus_chars=2_000_000)
    if preset == "1b":
        return Shape(**REAL_1B[arch], dtype=torch.bfloat16, corpus_chars=None)
    return SHAPES[preset]


def family_config(arch: str, preset: str, s: Shape) -> dict:
    """The family's own config keys for this preset, beside the shared shapes."""
    tiny, big = preset == "tiny", preset == "1b"
    if arch == "llama":
        return dict(tie_word_embeddings=big, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
                    if big else {"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen2":
        window = dict(use_sliding_window=True, sliding_window=48, max_window_layers=1) if tiny else {}
        return dict(tie_word_embeddings=True, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **window)
    if arch == "qwen3":
        return dict(tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=32 if tiny else 128,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "mistral":
        return dict(tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=48 if tiny else 4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch in ("gemma3", "gemma3-vision"):
        release = RELEASES.get(preset, {})
        head_dim = 32 if tiny else 64 if preset == "small" else release.get("head_dim", 256)
        layer_types = (["sliding_attention", "sliding_attention", "full_attention"] if tiny else
                       ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(s.num_hidden_layers)])
        return dict(tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=head_dim,
                    query_pre_attn_scalar=24 if tiny else release.get("query_pre_attn_scalar", head_dim),
                    layer_types=layer_types, sliding_window=48 if tiny else 1024 if release else 512,
                    final_logit_softcapping=30.0 if tiny else None,
                    hidden_activation="gelu_pytorch_tanh",
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 4.0 if tiny else 8.0,
                                                        "rope_theta": 1000000.0}})
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


@dataclass(frozen=True)
class ChatFlavour:
    """A family's special tokens (ids 0.. in this order), its BOS (added to every encoded
    text when set), the tokens generation stops on, and its chat template."""

    specials: tuple[str, ...]
    bos: str | None
    eos: tuple[str, ...]
    pad: str
    template: str
    unk: str | None = None
    extra: tuple[str, ...] = field(default=())  # specials that are neither bos, eos nor pad
    # specials the tokenizer knows by a name, (name, token): tokenizer.<name> is the token
    named: tuple[tuple[str, str], ...] = field(default=())


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5's layout: a default system turn when the conversation has none; with tools, the
# system turn lists them and asks for Hermes-style calls (`<tool_call>{json}</tool_call>`,
# vLLM's `hermes` parser), assistant calls are written back that way and tool results come
# as user turns wrapping `<tool_response>` -- Qwen2.5's own template, shortened.
QWEN_CHATML = (
    "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' %}"
    "{% if tools %}{{ '<|im_start|>system\n' + system + '\n\n# Tools\n\nYou may call one or more functions. "
    "Function signatures within <tools></tools>:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% elif messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] "
    "+ '\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral's [INST] layout: a system message is folded into the first user turn.
MISTRAL_INST = (
    "{{ bos_token }}{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set system.text = message['content'] + '\n\n' %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + system.text + message['content'] + ' [/INST]' }}"
    "{% set system.text = '' %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
# Gemma's turns: the assistant is "model", a system message opens the first user turn.
GEMMA_TURNS = (
    "{{ bos_token }}{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set system.text = message['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + system.text + message['content'] + '<end_of_turn>\n' }}"
    "{% set system.text = '' %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Google's chat template of the Gemma 3 checkpoints (gemma-3-4b-it and up), verbatim: a
# content list renders its {"type": "image"} parts as <start_of_image>, which the processor
# then expands (the rule: tools/make_vision_model.py).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
# Gemma 3's image tokens, under the names its tokenizer gives them (Gemma3Processor reads
# tokenizer.boi_token, .image_token, .eoi_token)
GEMMA3_IMAGE_TOKENS = (("boi_token", "<start_of_image>"), ("image_token", "<image_soft_token>"),
                       ("eoi_token", "<end_of_image>"))

FLAVOURS = MappingProxyType({
    "llama": ChatFlavour(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos="<|endoftext|>",
                         eos=("<|endoftext|>", "<|im_end|>"), pad="<|endoftext|>", template=CHATML,
                         extra=("<|im_start|>", "<|im_end|>")),
    "qwen2": ChatFlavour(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None,
                         eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>", template=QWEN_CHATML,
                         extra=("<|im_start|>", "<|im_end|>")),
    "mistral": ChatFlavour(specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), bos="<s>",
                           eos=("</s>",), pad="</s>", unk="<unk>", template=MISTRAL_INST,
                           extra=("[INST]", "[/INST]")),
    "gemma3": ChatFlavour(specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
                          bos="<bos>", eos=("<eos>", "<end_of_turn>"), pad="<pad>", unk="<unk>",
                          template=GEMMA_TURNS, extra=("<start_of_turn>", "<end_of_turn>")),
    "gemma3-vision": ChatFlavour(specials=GEMMA_SPECIALS + tuple(t for _, t in GEMMA3_IMAGE_TOKENS),
                                 bos="<bos>", eos=("<eos>", "<end_of_turn>"), pad="<pad>", unk="<unk>",
                                 template=GEMMA3_TEMPLATE, extra=("<start_of_turn>", "<end_of_turn>"),
                                 named=GEMMA3_IMAGE_TOKENS),
})


def flavour(arch: str) -> ChatFlavour:
    return FLAVOURS["qwen2" if arch == "qwen3" else arch]
