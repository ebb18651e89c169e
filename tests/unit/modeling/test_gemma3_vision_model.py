"""Gemma 3 vision (Gemma3ForConditionalGeneration) on the worker side, against transformers
on the `gemma3-vision` `tiny` checkpoint, fp32: make-model's folder loads in transformers
with its processor and chat template; the vision encoder equals `get_image_features`;
loading is strict and takes both weight layouts; text-only greedy decoding equals
`generate()`; image embeddings placed over the soft tokens give transformers' logits."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from tests.support.runner_helpers import (MiniScheduler, flat_batch, grouped_block_ids, hf_greedy, make_runner,
                                          runner_state)
from safetensors.torch import save_file

from kernels.backend import TORCH_BACKEND
from proto import worker_pb2
from vision.image_preprocess import ImagePreprocessConfig, preprocess_image
from tools.make_model import make_model
from modeling.decoder import DecoderForCausalLM
from modeling.gemma3_vision import Gemma3VisionEncoder, load_vision_encoder
from modeling.image_placement import (
    PlaceholderRange,
    image_slices,
    place_image_embeddings,
    splice_rows,
)
from modeling.loader import iter_safetensors
from modeling.registry import load_config, load_vision_config, read_config

BOI, IMAGE, EOI = 6, 7, 8  # the tiny tokenizer's ids of the three image tokens
MM_TOKENS, IMAGE_SIZE = 4, 56


@pytest.fixture(scope="session")
def encoder(vision_dir):
    return load_vision_encoder(vision_dir, load_vision_config(vision_dir), torch.float32, "cpu")


def images(seed: int, sizes: list[tuple[int, int]]) -> list[Image.Image]:
    rs = np.random.RandomState(seed)
    return [Image.fromarray(rs.randint(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def expand(text: str, num_crops: list[int] | None = None) -> str:
    """Gemma3Processor's prompt expansion, as tools/make_vision_model.py states it."""
    full = "\n\n<start_of_image>" + "<image_soft_token>" * MM_TOKENS + "<end_of_image>\n\n"
    parts = text.split("<start_of_image>")
    crops = num_crops or [0] * (len(parts) - 1)
    out = parts[0]
    for k, part in zip(crops, parts[1:]):
        out += full if not k else (f"Here is the original image {full} and here are some crops to "
                                   f"help you see better " + " ".join([full] * k))
        out += part
    return out


def text_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random token ids, none of them an image token."""
    g = np.random.RandomState(seed)
    return [[int(t) for t in g.randint(9, 1536, n)] for n in lengths]


def test_make_model_writes_what_transformers_loads(vision_dir, hf_vlm, processor):
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    assert sorted(p.name for p in vision_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "processor_config.json", "tokenizer.json", "tokenizer_config.json"]
    cfg = hf_vlm.config
    assert (cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id) == (BOI, IMAGE, EOI)
    assert cfg.mm_tokens_per_image == MM_TOKENS and cfg.vision_config.image_size == IMAGE_SIZE
    assert cfg.vision_config.patch_size == 14 and cfg.vision_config.num_hidden_layers == 2
    assert cfg.text_config.sliding_window == 48 and cfg.text_config.vocab_size == 1536
    assert isinstance(processor, Gemma3Processor) and processor.image_seq_length == MM_TOKENS
    assert type(processor.image_processor) is Gemma3ImageProcessorPil  # no torchvision here
    assert processor.image_processor.size == {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    tokenizer = AutoTokenizer.from_pretrained(vision_dir)
    assert (tokenizer.boi_token, tokenizer.image_token, tokenizer.eoi_token) == (
        "<start_of_image>", "<image_soft_token>", "<end_of_image>")
    assert tokenizer.convert_tokens_to_ids(["<start_of_image>", "<image_soft_token>", "<end_of_image>"]) == [
        BOI, IMAGE, EOI]
    assert json.loads((vision_dir / "generation_config.json").read_text())["eos_token_id"] == [1, 5]
    with torch.no_grad():  # the projection is not transformers' zero init: images differ
        features = hf_vlm.get_image_features(
            processor.image_processor(images(0, [(30, 40), (40, 30)]), return_tensors="pt")["pixel_values"])
    out = features.pooler_output
    assert out.shape == (2, MM_TOKENS, 64) and (out[0] - out[1]).abs().mean() > 0.5


def test_make_model_is_deterministic_for_a_seed(tmp_path, vision_dir):
    """Same seed, same files, whatever the process drew from torch's global RNG before."""
    torch.rand(7)
    again = make_model(tmp_path / "again", preset="tiny", arch="gemma3-vision", tokenizer_dir=vision_dir)
    other = make_model(tmp_path / "other", preset="tiny", arch="gemma3-vision", seed=1,
                       tokenizer_dir=vision_dir)
    for name in ("model.safetensors", "config.json", "processor_config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (vision_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_chat_template_renders_and_the_processor_expands_images(vision_dir, processor):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is it? "},
                                             {"type": "image"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>What is it?<start_of_image>"
                    "<end_of_turn>\n<start_of_turn>model\n")
    tokenizer = AutoTokenizer.from_pretrained(vision_dir)
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    pictures = images(1, [(90, 37), (20, 80)])
    got = processor(text=text, images=pictures, add_special_tokens=False, return_tensors="pt")
    ids = got["input_ids"][0].tolist()
    assert ids == tokenizer(expand(text), add_special_tokens=False)["input_ids"]
    soft = [i for i, t in enumerate(ids) if t == IMAGE]
    assert len(soft) == 2 * MM_TOKENS and got["token_type_ids"][0].nonzero().flatten().tolist() == soft
    assert [ids[soft[0] - 1], ids[soft[MM_TOKENS - 1] + 1]] == [BOI, EOI]
    # pan-and-scan: the crops' own soft tokens, and the text around them
    crops = processor(text=text, images=pictures, add_special_tokens=False, return_tensors="pt",
                      do_pan_and_scan=True, pan_and_scan_min_crop_size=10)
    cfg = ImagePreprocessConfig.from_checkpoint(vision_dir)
    cfg = replace(cfg, pan_and_scan=replace(cfg.pan_and_scan, min_crop_size=10))
    pixels = [preprocess_image(p, cfg, do_pan_and_scan=True) for p in pictures]
    assert torch.equal(torch.cat(pixels), crops["pixel_values"])
    num_crops = [len(p) - 1 for p in pixels]
    assert num_crops == [2, 4]
    expanded = tokenizer(expand(text, num_crops), add_special_tokens=False)["input_ids"]
    assert crops["input_ids"][0].tolist() == expanded


@pytest.mark.parametrize("count", [1, 3])
def test_encoder_equals_get_image_features(count, vision_dir, hf_vlm, processor, encoder):
    pictures = images(2 + count, [(91, 37), (56, 56), (13, 200)][:count])
    pixels = processor.image_processor(pictures, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = hf_vlm.get_image_features(pixels).pooler_output
        got = encoder(pixels)
    assert got.shape == (count, MM_TOKENS, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    with torch.no_grad():  # one image at a time gives the same rows
        alone = torch.cat([encoder(pixels[i:i + 1]) for i in range(count)])
    torch.testing.assert_close(alone, got, rtol=1e-5, atol=1e-6)


def test_encoder_in_bf16_close_to_transformers_bf16(vision_dir, processor, hf_vlm):
    from transformers import Gemma3ForConditionalGeneration

    pixels = processor.image_processor(images(7, [(64, 48), (33, 99)]), return_tensors="pt")["pixel_values"]
    hf_bf16 = Gemma3ForConditionalGeneration.from_pretrained(vision_dir, dtype=torch.bfloat16).eval()
    encoder = load_vision_encoder(vision_dir, load_vision_config(vision_dir), torch.bfloat16, "cpu")
    with torch.no_grad():
        fp32 = hf_vlm.get_image_features(pixels).pooler_output
        expected = hf_bf16.get_image_features(pixels.bfloat16()).pooler_output.float()
        got = encoder(pixels)  # float32 pixels, cast to the encoder's dtype
    assert got.dtype == torch.bfloat16
    scale = fp32.abs().max()
    assert (got.float() - expected).abs().max() <= 0.03 * scale
    assert (got.float() - fp32).abs().max() <= 2 * (expected - fp32).abs().max() + 1e-3 * scale


def test_loading_is_strict(vision_dir, encoder):
    weights = list(iter_safetensors(vision_dir))
    fresh = lambda: Gemma3VisionEncoder(load_vision_config(vision_dir))  # noqa: E731
    loaded = fresh()
    loaded.load_weights(weights)  # the language model's tensors are passed over
    for (name, ours), theirs in zip(loaded.state_dict().items(), encoder.state_dict().values()):
        assert torch.equal(ours, theirs), name
    missing = [(n, t) for n, t in weights if n != "vision_tower.encoder.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match="lacks 1 vision tensors.*layers.1.self_attn.qkv_proj.bias#1"):
        fresh().load_weights(missing)
    with pytest.raises(ValueError, match="mm_soft_emb_norm"):
        fresh().load_weights([(n, t) for n, t in weights if "mm_soft_emb_norm" not in n])
    extra_tower = weights + [("vision_tower.encoder.layers.2.mlp.fc1.bias", torch.zeros(64))]
    with pytest.raises(KeyError, match="layers.2.mlp.fc1.bias"):
        fresh().load_weights(extra_tower)
    with pytest.raises(KeyError, match="mm_extra"):
        fresh().load_weights(weights + [("multi_modal_projector.mm_extra", torch.zeros(1))])
    shaped = [(n, t[:-1] if n == "vision_tower.post_layernorm.weight" else t) for n, t in weights]
    with pytest.raises(ValueError, match="post_layernorm.weight: checkpoint shape"):
        fresh().load_weights(shaped)
    # and the text decoder takes its own tensors only, in any layout
    cfg = load_config(vision_dir)
    decoder = lambda cfg: DecoderForCausalLM(cfg, TORCH_BACKEND, 64, torch.float32, torch.device("cpu"))  # noqa: E731
    decoder(cfg).load_weights(weights)
    with pytest.raises(KeyError, match="model.layers.3.mlp.gate_up_proj"):
        decoder(cfg).load_weights(weights + [("model.language_model.layers.3.mlp.up_proj.weight",
                                              torch.zeros(176, 64))])
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        decoder(cfg).load_weights([(n, t) for n, t in weights if n != "language_model.model.norm.weight"])
    with pytest.raises(KeyError, match="is a (vision|projector) weight, but Gemma3ForCausalLM is a text"):
        decoder(replace(cfg, architecture="Gemma3ForCausalLM")).load_weights(weights)


def test_text_only_greedy_matches_generate(vision_dir, hf_vlm):
    """Three requests, one longer than the 48-token window, a 40-token budget chunking
    the long prompts, and a preemption."""
    runner = make_runner(vision_dir, block_size=8, num_blocks=64)
    sched = MiniScheduler(runner, block_size=8, num_blocks=64, token_budget=40)
    ps = text_prompts(5, [70, 9, 33])
    max_tokens = [12, 16, 10]
    for i, p in enumerate(ps):
        sched.add(f"r{i}", p, max_tokens[i])
    for step in range(80):
        if step == 4:
            sched.preempt("r1")
        if step == 6:
            sched.resume("r1")
        sched.step()
        if all(r["done"] for r in sched.reqs.values()):
            break
    for i, p in enumerate(ps):
        out = sched.outputs(f"r{i}")
        assert out == hf_greedy(hf_vlm, p, max_tokens[i])[:len(out)] and sched.reqs[f"r{i}"]["done"], i


def run_with_images(runner, encoder, prompt, ranges, pixels, chunks, blocks) -> torch.Tensor:
    """All-row logits of `prompt` prefilled in `chunks`, each chunk's image soft tokens
    replaced by the encoder's embeddings, the way the runner will do it."""
    with torch.no_grad():
        embeds = encoder(pixels)
    state = runner_state(runner, worker_pb2.NewRequestData(
        request_id="x", token_ids=prompt, num_prompt_tokens=len(prompt),
        block_ids=grouped_block_ids(runner, blocks)))
    got = []
    for n in chunks:
        batch = flat_batch(runner, [(state, n)])
        slices = image_slices(ranges, state.num_computed_tokens, n, first_row=0)
        with torch.inference_mode():
            h = runner.model.embed(batch.input_ids)
            if slices:
                place_image_embeddings(h, *splice_rows(slices, embeds, runner.device))
            got.append(runner.model(batch.input_ids, batch.positions, batch.attn,
                                    (runner.kv_cache.k_caches, runner.kv_cache.v_caches),
                                    torch.arange(n), inputs_embeds=h))
        state.num_computed_tokens += n
    return torch.cat(got)


def test_image_embeddings_placed_as_transformers_places_them(vision_dir, hf_vlm, processor, encoder):
    """Two images in a 70-token prompt, the second cut by a chunk boundary: with causal
    attention everywhere (transformers without token_type_ids; the bidirectional image mask
    is the attention kernels' part), every row's logits equal transformers'."""
    text = expand("<bos><start_of_turn>user\nLook: <start_of_image> and <start_of_image> what now?"
                  "<end_of_turn>\n<start_of_turn>model\n")
    prompt = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    pictures = images(9, [(120, 45), (33, 70)])
    preprocess = ImagePreprocessConfig.from_checkpoint(vision_dir)
    pixels = torch.cat([preprocess_image(p, preprocess) for p in pictures])
    starts = [i for i, t in enumerate(prompt) if t == IMAGE and prompt[i - 1] == BOI]
    ranges = [PlaceholderRange(offset=s, length=MM_TOKENS) for s in starts]
    with torch.no_grad():
        expected = hf_vlm(input_ids=torch.tensor([prompt]), pixel_values=pixels).logits[0]
        text_only = hf_vlm(input_ids=torch.tensor([prompt])).logits[0]
    cut = starts[1] + 2  # the second image's first two soft tokens in one chunk, two in the next
    runner = make_runner(vision_dir, block_size=8, num_blocks=32)
    got = run_with_images(runner, encoder, prompt, ranges, pixels, [cut, len(prompt) - cut],
                          [9, 3, 14, 0, 22, 5, 17, 30, 1, 11])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got[starts[0]:] - text_only[starts[0]:]).abs().max() > 0.1  # the images matter


def test_image_slices_of_a_chunk():
    ranges = [PlaceholderRange(3, 4), PlaceholderRange(10, 4)]
    assert image_slices(ranges, 0, 3, first_row=5) == []
    assert [(s.image, s.start, s.end, s.row) for s in image_slices(ranges, 0, 12, first_row=5)] == [
        (0, 0, 4, 8), (1, 0, 2, 15)]
    assert [(s.image, s.start, s.end, s.row) for s in image_slices(ranges, 12, 1, first_row=0)] == [
        (1, 2, 3, 0)]
    embeds = [torch.arange(8.0).view(4, 2), 10 + torch.arange(8.0).view(4, 2)]
    rows, values = splice_rows(image_slices(ranges, 5, 7, first_row=1), embeds, "cpu")
    assert rows.tolist() == [1, 2, 6, 7] and values[:, 0].tolist() == [4.0, 6.0, 10.0, 12.0]
    h = torch.zeros(8, 2, dtype=torch.bfloat16)
    place_image_embeddings(h, rows, values)
    assert h.dtype == torch.bfloat16 and h[:, 0].tolist() == [0, 4, 6, 0, 0, 0, 10, 12]


def resave(src, dst, rename, dtype=None, shards: int = 1) -> None:
    """src's tensors under new names (and dtype), in `shards` files with an index, as
    transformers shards; the other files copied."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {rename(n): (t.to(dtype) if dtype else t).contiguous() for n, t in iter_safetensors(src)}
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if dtype is not None:
        config = json.loads((dst / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (dst / "config.json").write_text(json.dumps(config))


def in_memory_names(name: str) -> str:
    """transformers 5's names in memory: model.language_model.*, model.vision_tower.*, ..."""
    for old, new in (("language_model.model.", "model.language_model."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def google_names(name: str) -> str:
    """Google's releases: language_model.model.*, vision_tower.vision_model.*, ..."""
    prefix = "vision_tower."
    return "vision_tower.vision_model." + name[len(prefix):] if name.startswith(prefix) else name


@pytest.mark.parametrize("layout", ["in_memory", "google"])
def test_loads_both_weight_layouts_sharded(layout, tmp_path, vision_dir, hf_vlm, encoder):
    """The same weights under transformers 5's in-memory names (sharded, fp32, the LM head
    stored) or Google's (sharded, bf16): the decoder and the encoder load them; fp32 gives
    the same logits and image embeddings, bf16 the checkpoint's dtype."""
    dst = tmp_path / layout
    if layout == "in_memory":
        resave(vision_dir, dst, in_memory_names, shards=3)
        head = dict(iter_safetensors(dst))["model.language_model.embed_tokens.weight"]
        save_file({"lm_head.weight": head.clone()}, str(dst / "lm_head.safetensors"))
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        index["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        resave(vision_dir, dst, google_names, dtype=torch.bfloat16, shards=2)
    assert load_vision_config(dst) == replace(load_vision_config(vision_dir), dtype=load_config(dst).dtype)
    from transformers import Gemma3ForConditionalGeneration

    theirs = Gemma3ForConditionalGeneration.from_pretrained(dst, dtype=torch.float32).state_dict()
    for name, tensor in hf_vlm.state_dict().items():  # a layout transformers reads as well
        assert torch.equal(theirs[name], tensor if layout == "in_memory" else tensor.bfloat16().float()), name
    runner = make_runner(dst, block_size=8, num_blocks=16, dtype="float32")
    loaded = load_vision_encoder(dst, load_vision_config(dst), torch.float32, "cpu")
    prompt = text_prompts(11, [30])[0]
    if layout == "in_memory":
        assert load_config(dst).dtype == torch.float32
        for ours, theirs in zip(loaded.state_dict().values(), encoder.state_dict().values()):
            assert torch.equal(ours, theirs)
        sched = MiniScheduler(runner, block_size=8, num_blocks=16, token_budget=64)
        sched.add("r0", prompt, 8)
        while not sched.reqs["r0"]["done"]:
            sched.step()
        assert sched.outputs("r0") == hf_greedy(hf_vlm, prompt, 8)
    else:
        assert load_config(dst).dtype == torch.bfloat16
        for ours, theirs in zip(loaded.state_dict().values(), encoder.state_dict().values()):
            assert torch.equal(ours, theirs.bfloat16().float())
        embed = runner.model.model.embed_tokens.weight
        assert torch.equal(embed, hf_vlm.get_input_embeddings().weight.bfloat16().float())


def test_reads_a_sparse_config_as_transformers_does():
    """A config.json as Google's gemma-3-4b-it has it: text_config and vision_config keep
    only what differs from transformers' defaults."""
    from transformers import Gemma3Config

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
           "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
           "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "torch_dtype": "bfloat16",
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    hf = Gemma3Config.from_dict(raw)
    text, vision = hf.text_config, hf.vision_config
    cfg = read_config(raw)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.max_position_embeddings)
    assert cfg.sliding_windows == tuple(1024 if t == "sliding_attention" else None for t in text.layer_types)
    assert [r.theta for r in cfg.rope] == [text.rope_parameters[t]["rope_theta"] for t in text.layer_types]
    assert cfg.rope[5].scaling == {"factor": 8.0, "rope_type": "linear"} and cfg.rope[0].scaling is None
    assert cfg.scale == text.query_pre_attn_scalar**-0.5 and cfg.embedding_scale == text.hidden_size**0.5
    assert cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.final_logit_softcap is None
    from modeling.gemma3_vision import read_vision_config

    v = read_vision_config(raw)
    assert (v.tower.hidden_size, v.tower.intermediate_size, v.tower.num_layers, v.tower.num_heads) == (
        vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers, vision.num_attention_heads)
    assert (v.image_size, v.tower.patch_size, v.tower.layer_norm_eps, v.tower.hidden_act) == (
        vision.image_size, vision.patch_size, vision.layer_norm_eps, vision.hidden_act)
    assert (v.mm_tokens_per_image, v.boi_token_id, v.image_token_id, v.eoi_token_id) == (
        256, hf.boi_token_id, hf.image_token_id, hf.eoi_token_id)
    assert v.text_hidden_size == 2560 and v.tower.num_patches == 4096 and v.dtype == torch.bfloat16
