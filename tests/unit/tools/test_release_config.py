"""`make-model --preset gemma-3-{4b,12b,27b}-it --config-only` (tools/model_presets.py's
RELEASES, tools/release_tokenizer.py): the files of Google's Gemma 3 releases without
their weights, read back by transformers; the special tokens at the real ids; and the
gateway's prompt for a chat with one 896-px image equal to what transformers' processor,
built from the written files, makes of it: 256 soft tokens, every special token at the id a
real checkpoint's tokenizer gives it."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tests.support.gateway_helpers import make_config, register_worker
from tests.support.gateway_image_helpers import submitted
from tests.support.media_helpers import data_url
from tools.make_model import make_model

# The ids of Gemma 3's tokenizer (google/gemma-3-*-it's tokenizer_config.json)
REAL_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106,
            "<start_of_image>": 255999, "<end_of_image>": 256000, "<image_soft_token>": 262144}
# (layers, hidden, intermediate, query heads, kv heads, head_dim, query_pre_attn_scalar)
TEXT = {"gemma-3-4b-it": (34, 2560, 10240, 8, 4, 256, 256),
        "gemma-3-12b-it": (48, 3840, 15360, 16, 8, 256, 256),
        "gemma-3-27b-it": (62, 5376, 21504, 32, 16, 128, 168)}


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gemma-3-4b-it"), preset="gemma-3-4b-it", arch="gemma3-vision",
                      config_only=True)


@pytest.fixture(scope="module")
def release_processor(release_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(release_dir)


@pytest.mark.parametrize("preset", list(TEXT))
def test_the_written_config_is_the_release(release_dir, tmp_path, preset):
    from transformers import AutoConfig, GenerationConfig

    out = release_dir if preset == "gemma-3-4b-it" else make_model(
        tmp_path, preset=preset, arch="gemma3-vision", config_only=True, tokenizer_dir=release_dir)
    assert not list(out.glob("*.safetensors")), "config only: no weights"
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["Gemma3ForConditionalGeneration"]
    t = config.text_config
    assert (t.num_hidden_layers, t.hidden_size, t.intermediate_size, t.num_attention_heads,
            t.num_key_value_heads, t.head_dim, t.query_pre_attn_scalar) == TEXT[preset]
    assert (t.vocab_size, t.sliding_window, t.max_position_embeddings) == (262208, 1024, 131072)
    assert t.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert t.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert t.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert t.final_logit_softcapping is None and t.attn_logit_softcapping is None
    v = config.vision_config
    assert (v.image_size, v.patch_size, v.num_hidden_layers, v.hidden_size, v.intermediate_size,
            v.num_attention_heads) == (896, 14, 27, 1152, 4304, 16)
    assert (config.mm_tokens_per_image, config.boi_token_index, config.eoi_token_index,
            config.image_token_index) == (256, 255999, 256000, 262144)
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (2, [1, 106], 0)
    assert (generation.do_sample, generation.top_k, generation.top_p) == (True, 64, 0.95)


def test_special_tokens_sit_at_the_real_ids(release_processor):
    tokenizer = release_processor.tokenizer
    assert len(tokenizer) == 262145
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in REAL_IDS} == REAL_IDS
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)
    assert (tokenizer.boi_token, tokenizer.image_token, tokenizer.eoi_token) == (
        "<start_of_image>", "<image_soft_token>", "<end_of_image>")
    # text never encodes to a special or placeholder id; the placeholders decode as themselves
    ids = tokenizer("What is <start_of_image> here?", add_special_tokens=False)["input_ids"]
    assert 255999 in ids and all(107 <= i < 8192 for i in ids if i != 255999)
    assert tokenizer.decode([200000]) == "<token_200000>"


def test_unknown_or_misused_presets_are_refused(tmp_path):
    with pytest.raises(ValueError, match="gemma-3-4b-it.*gemma-3-27b-it"):
        make_model(tmp_path, preset="gemma-3-9b-it", arch="gemma3-vision", config_only=True)
    with pytest.raises(ValueError, match="--config-only"):
        make_model(tmp_path, preset="gemma-3-4b-it", arch="gemma3-vision")
    with pytest.raises(ValueError, match="gemma3-vision"):
        make_model(tmp_path, preset="gemma-3-4b-it", arch="llama", config_only=True)


@pytest.mark.anyio
async def test_an_image_prompt_has_the_real_special_ids(release_dir, release_processor, redis_url):
    image = Image.new("RGB", (1280, 720), (30, 140, 200))
    png = io.BytesIO()
    image.save(png, "PNG")
    config = make_config(release_dir, redis_url, request_timeout_s=5.0)
    register_worker(config, max_model_len=1024)
    content = [{"type": "text", "text": "What is in front of the robot?"},
               {"type": "image_url", "image_url": {"url": data_url(png.getvalue(), "image/png")}}]
    request, _ = await submitted(config, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": content}]})
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": "What is in front of the robot?"},
                                                {"type": "image"}]}]
    text = release_processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    reference = list(release_processor(text=text, images=[image], add_special_tokens=False)["input_ids"][0])
    assert request.prompt_token_ids == reference
    ids = request.prompt_token_ids
    assert ids.count(REAL_IDS["<image_soft_token>"]) == 256
    assert [m.length for m in request.mm_inputs] == [256]
    offset = request.mm_inputs[0].offset
    assert ids[offset - 1] == REAL_IDS["<start_of_image>"] and ids[offset + 256] == REAL_IDS["<end_of_image>"]
    assert ids[:2] == [REAL_IDS["<bos>"], REAL_IDS["<start_of_turn>"]]
    assert ids.count(REAL_IDS["<end_of_turn>"]) == 1


def test_the_cli_names_the_same_presets():
    from compose.flags import MAKE_MODEL_PRESETS
    from tools.model_presets import PRESETS

    assert MAKE_MODEL_PRESETS == list(PRESETS)
