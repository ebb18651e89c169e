"""Image requests through ModelRunner on the tiny `gemma3-vision` checkpoint, fp32, against
transformers' Gemma3ForConditionalGeneration on the processor's inputs (pixel_values and
token_type_ids, so transformers applies its bidirectional image mask): greedy tokens equal
`generate()`, and every sampled token's and prompt token's logprobs equal its logits
(the tiny model soon repeats one token, so the logprobs are what tells runs apart). Also:
continuous batching with chunked prefill, a prompt past the 48-token sliding window and a
preemption; pan-and-scan (an image and its crops, each over its own soft tokens); a video
frame (rgb8) equal to the same pixels as a PNG; spans that matter; a
request whose media cannot be had fails alone (the media over Redis and the metrics:
test_worker_media.py)."""

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
from tests.support.image_cases import IMAGE, Case, frame, make_case, prompt_text, random_text, stored
from tests.support.media_helpers import picture
from tests.support.runner_helpers import FakeMediaSource, MiniScheduler, make_runner, mm_inputs

from proto import worker_pb2
from proto.messages import NO_TOKEN_ID as NO_TOKEN
from proto.messages import MediaItem
from proto.pan_and_scan import PanAndScan
from worker_svc import input_batch as input_batch_module
from worker_svc.input_batch import InputBatch
from vision.media_source import MISSING
from worker_svc.request_state import RequestState, split_groups

TOL = 2e-4  # logprobs, fp32


# ---- images, prompts, the reference -----------------------------------------------------

@dataclass
class Reference:
    tokens: list[int]
    steps: list[torch.Tensor]  # log_softmax of each generated position's logits [vocab]
    prompt: torch.Tensor  # log_softmax of the prompt's logits [n, vocab]


def reference(hf_vlm, case: Case, max_new_tokens: int, causal: bool = False) -> Reference:
    """transformers on the processor's inputs; `causal`: without token_type_ids (no image mask)."""
    kwargs = {k: v for k, v in case.inputs.items() if not (causal and k == "token_type_ids")}
    with torch.no_grad():
        out = hf_vlm.generate(**kwargs, do_sample=False, max_new_tokens=max_new_tokens,
                              output_logits=True, return_dict_in_generate=True)
        prompt = hf_vlm(**kwargs).logits[0].log_softmax(-1)
    return Reference(out.sequences[0, len(case.ids):].tolist(),
                     [step[0].float().log_softmax(-1) for step in out.logits], prompt)


def prompt_error(sched: MiniScheduler, rid: str, ids: list[int], ref: Reference) -> float:
    """The largest gap between the runner's prompt logprobs and the reference's."""
    got = sched.prompt_logprobs[rid]
    assert sorted(got) == list(range(1, len(ids)))
    return max(abs(lp.logprob - ref.prompt[p - 1, ids[p]].item()) for p, lp in got.items())


def assert_matches(sched: MiniScheduler, rid: str, case: Case, ref: Reference) -> None:
    assert sched.reqs[rid]["done"] in ("stop", "length"), sched.errors.get(rid)
    assert sched.outputs(rid) == ref.tokens
    got = sched.logprobs[rid]
    assert len(got) == len(ref.tokens)
    for lp, token, want in zip(got, ref.tokens, ref.steps):
        assert abs(lp.logprob - want[token].item()) < TOL
        assert max(abs(v - want[i].item()) for i, v in zip(lp.top_ids, lp.top_logprobs)) < TOL
    if sched.prompt_logprobs[rid]:
        assert prompt_error(sched, rid, case.ids, ref) < TOL


LOGPROBS = {"logprobs": 3, "prompt_logprobs": 1}


# ---- generations equal transformers' ------------------------------------------------------

CASES = {
    "one_png": [("RGB", 91, 37, "PNG")],
    "jpeg_and_rgba": [("RGB", 120, 45, "JPEG"), ("RGBA", 33, 70, "PNG")],
    "several_mixed": [("RGB", 13, 200, "PNG"), ("L", 56, 56, "PNG"), ("RGBA", 64, 48, "PNG"),
                      ("RGB", 1, 1, "PNG"), ("P", 17, 9, "GIF"), ("RGB", 301, 77, "JPEG")],
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_with_images_equals_generate(name, vision_dir, hf_vlm, processor):
    media = FakeMediaSource()
    images = [stored(picture(i, w, h, mode), fmt) for i, (mode, w, h, fmt) in enumerate(CASES[name])]
    if name == "jpeg_and_rgba":  # built by the checkpoint's chat template
        content = [{"type": "image"}, {"type": "text", "text": " ".join(random_text(processor, 3, 2))},
                   {"type": "image"}, {"type": "text", "text": "and?"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt_text(processor, len(images), len(images))
    case = make_case(processor, media, text, images)
    ref = reference(hf_vlm, case, 10)
    runner = make_runner(vision_dir, block_size=8, num_blocks=64, media=media)
    sched = MiniScheduler(runner, block_size=8, num_blocks=64, token_budget=256)
    sched.add("r0", case.ids, 10, mm_inputs(case.ids, IMAGE, case.hashes), **LOGPROBS)
    sched.run()
    assert_matches(sched, "r0", case, ref)
    (first, *_) = [o.vision for o in sched.outputs_seen if o.vision is not None]
    assert (first.items_encoded, first.cache_hits) == (len(set(case.hashes)), 0)


def test_continuous_batching_chunks_window_and_preemption(vision_dir, hf_vlm, processor):
    """Four requests at once under a 20-token budget (chunks end at image starts): one past
    the 48-token sliding window with three images, one image request preempted by
    recompute and resumed, a text request, and one repeating another's image."""
    media = FakeMediaSource()
    shared = stored(picture(20, 70, 50), "PNG")
    requests = {
        "pre": (prompt_text(processor, 24, 1, (5, 15)), [stored(picture(25, 64, 64, "RGBA"), "PNG")]),
        "long": (prompt_text(processor, 21, 3, (10, 30)),
                 [shared, stored(picture(22, 40, 90), "JPEG"), stored(picture(23, 33, 33, "L"), "PNG")]),
        "txt": (prompt_text(processor, 26, 0, (15, 25)), []),
        "rep": (prompt_text(processor, 27, 2, (4, 12)), [stored(picture(28, 100, 20), "PNG"), shared]),
    }
    cases = {rid: make_case(processor, media, text, images) for rid, (text, images) in requests.items()}
    assert len(cases["long"].ids) > 2 * 48
    runner = make_runner(vision_dir, block_size=8, num_blocks=96, media=media)
    sched = MiniScheduler(runner, block_size=8, num_blocks=96, token_budget=20)
    for rid, case in cases.items():
        sched.add(rid, case.ids, 12, mm_inputs(case.ids, IMAGE, case.hashes), **LOGPROBS)
    preempted_at = None
    for step in range(200):
        if preempted_at is None and len(sched.outputs("pre")) == 2:  # recomputed with its outputs
            sched.preempt("pre")
            preempted_at = step
        if preempted_at is not None and step == preempted_at + 3:
            sched.resume("pre")
        if sched.done():
            break
        sched.step()
    assert preempted_at is not None
    offsets = {rid: {m.offset for m in sched.reqs[rid]["mm_inputs"]} for rid in cases}
    cut_at_image = [rid for step in sched.chunks for rid, (first, n) in step.items()
                    if first + n in offsets[rid] and n < 20]  # the budget left more
    assert cut_at_image, "no chunk was cut short at an image"
    assert any(len(step) > 1 and any(sched.reqs[rid]["mm_inputs"] for rid in step) for step in sched.chunks)
    for rid, case in cases.items():
        assert_matches(sched, rid, case, reference(hf_vlm, case, 12))
    stats = [o.vision for o in sched.outputs_seen if o.vision is not None]
    assert len(stats) > 3  # the images came in several steps
    # each distinct image encoded once, however often it came (shared; "pre" after its preemption)
    assert sum(s.items_encoded for s in stats) == 5
    assert sum(s.cache_hits for s in stats) >= 2


def test_a_video_frame_equals_the_same_pixels_as_png(vision_dir, hf_vlm, processor):
    media = FakeMediaSource()
    pixels = picture(30, 45, 29)
    text = prompt_text(processor, 31, 1)
    as_png = make_case(processor, media, text, [stored(pixels, "PNG")])
    as_frame = make_case(processor, media, text, [frame(pixels)])
    assert as_png.ids == as_frame.ids and as_png.hashes != as_frame.hashes
    runner = make_runner(vision_dir, block_size=8, num_blocks=64, media=media)
    sched = MiniScheduler(runner, block_size=8, num_blocks=64, token_budget=256)
    sched.add("png", as_png.ids, 8, mm_inputs(as_png.ids, IMAGE, as_png.hashes), **LOGPROBS)
    sched.add("frm", as_frame.ids, 8, mm_inputs(as_frame.ids, IMAGE, as_frame.hashes), **LOGPROBS)
    sched.run()
    assert sched.outputs("png") == sched.outputs("frm")
    assert sched.logprobs["png"] == sched.logprobs["frm"]  # the same bits
    assert sched.prompt_logprobs["png"] == sched.prompt_logprobs["frm"]
    assert_matches(sched, "frm", as_frame, reference(hf_vlm, as_png, 8))


def test_image_tokens_see_each_other_both_ways(vision_dir, hf_vlm, processor, monkeypatch):
    """The runner's prompt logprobs equal transformers' with its image mask, and differ from
    a causal run's; without the batch's spans the runner gives the causal run's."""
    media = FakeMediaSource()
    images = [stored(picture(40, 80, 60), "PNG"), stored(picture(41, 30, 90), "PNG")]
    case = make_case(processor, media, prompt_text(processor, 42, 2), images)
    bidir, causal = reference(hf_vlm, case, 4), reference(hf_vlm, case, 4, causal=True)

    def run() -> MiniScheduler:
        runner = make_runner(vision_dir, block_size=8, num_blocks=64, media=media)
        sched = MiniScheduler(runner, block_size=8, num_blocks=64, token_budget=256)
        sched.add("r0", case.ids, 4, mm_inputs(case.ids, IMAGE, case.hashes), **LOGPROBS)
        sched.run()
        return sched

    sched = run()
    assert prompt_error(sched, "r0", case.ids, bidir) < TOL
    assert prompt_error(sched, "r0", case.ids, causal) > 0.05
    monkeypatch.setattr(input_batch_module, "bidir_spans_of", lambda *args: None)
    unmasked = run()
    assert prompt_error(unmasked, "r0", case.ids, causal) < TOL
    assert prompt_error(unmasked, "r0", case.ids, bidir) > 0.05


# ---- the flat batch's spans ---------------------------------------------------------------

def _state(inputs: InputBatch, tokens: list[int], ranges: list[tuple[int, int]], computed: int = 0) -> RequestState:
    """A request with block tables in two KV cache groups, a row of `inputs`."""
    new = worker_pb2.NewRequestData(
        request_id="x", token_ids=tokens, num_prompt_tokens=len(tokens), block_ids=list(range(16)),
        num_computed_tokens=computed,
        mm_inputs=[worker_pb2.MultiModalInput(content_hash=f"h{i}", offset=o, length=n)
                   for i, (o, n) in enumerate(ranges)])
    return RequestState(new, row=inputs.add(new.sampling, split_groups(new.block_ids, 2)))


def test_bidir_spans_of_a_step():
    plans = []

    def plan(*args, bidir_spans=None, host=None):
        plans.append(bidir_spans)
        return None

    inputs = InputBatch(num_groups=2, block_size=4, max_blocks_per_req=8, vocab_size=100, device=torch.device("cpu"))
    windows = (None, 8)
    text = _state(inputs, list(range(20)), [])
    images = _state(inputs, list(range(30)), [(3, 4), (10, 4), (20, 4)], computed=12)  # starts inside image 1
    batch = inputs.prepare([(text, 5), (images, 12)], plan, windows)
    spans = batch.attn.bidir_spans.tolist()
    assert spans[:5] == [[0, 0]] * 5
    assert spans[5:7] == [[10, 14]] * 2  # positions 12, 13
    assert spans[7:13] == [[0, 0]] * 6 and spans[13:17] == [[20, 24]] * 4
    assert [(s.image, s.start, s.end, s.row) for _, s in batch.images] == [(1, 2, 4, 5), (2, 0, 4, 13)]
    assert len(plans) == 2 and all(p is batch.attn.bidir_spans for p in plans)
    plans.clear()
    none = inputs.prepare([(text, 5), (_state(inputs, list(range(30)), [(3, 4)], computed=8), 4)], plan, windows)
    assert none.attn.bidir_spans is None and none.images == () and plans == [None, None]
    with pytest.raises(ValueError, match="ends inside image 1"):
        inputs.prepare([(text, 5), (_state(inputs, list(range(30)), [(3, 4), (10, 4)]), 12)], plan, windows)


# ---- what cannot run fails alone ------------------------------------------------------------

def test_media_that_cannot_be_had_fails_that_request_only(vision_dir, hf_vlm, processor):
    media = FakeMediaSource()
    text = prompt_text(processor, 50, 1)
    good = make_case(processor, media, text, [stored(picture(51, 40, 40), "PNG")])
    runner = make_runner(vision_dir, block_size=8, num_blocks=96, media=media)
    sched = MiniScheduler(runner, block_size=8, num_blocks=96, token_budget=512)
    bad_items = {
        "missing": "ab" * 32,  # expired, or never stored
        "garbage": media.put(MediaItem("encoded", 10, 10, b"not an image", "image/png")),
        "short": media.put(MediaItem("rgb8", 4, 4, b"\0" * 10)),
    }
    sched.add("ok", good.ids, 6, mm_inputs(good.ids, IMAGE, good.hashes), **LOGPROBS)
    for rid, digest in bad_items.items():
        sched.add(rid, good.ids, 6, mm_inputs(good.ids, IMAGE, [digest]))
    sched.add("txt", processor.tokenizer(random_text(processor, 52, 1)[0])["input_ids"], 6)
    result = sched.step()
    failed = {s.request_id: s for s in result.sampled if s.finish_reason == "error"}
    assert set(failed) == set(bad_items) and {s.token_id for s in failed.values()} == {NO_TOKEN}
    sched.run()
    assert_matches(sched, "ok", good, reference(hf_vlm, good, 6))
    assert sched.reqs["txt"]["done"] in ("stop", "length")
    assert sched.errors["missing"] == f"image 0 (content hash {'ab' * 32}): {MISSING}"
    assert sched.errors["garbage"].startswith(f"image 0 (content hash {bad_items['garbage']}): cannot be decoded")
    assert "rgb8 frame of 4x4 holds 48 bytes, not 10" in sched.errors["short"]
    assert {rid: r["done"] for rid, r in sched.reqs.items() if rid in bad_items} == dict.fromkeys(bad_items, "error")
    assert runner.num_unfinished == 0


def test_images_a_worker_cannot_take_fail_with_a_reason(vision_dir, processor, tiny_model_dir):
    media = FakeMediaSource()
    case = make_case(processor, media, prompt_text(processor, 60, 1), [stored(picture(61, 20, 20), "PNG")])
    (run,) = mm_inputs(case.ids, IMAGE, case.hashes)

    def errors(runner, inputs) -> dict:
        sched = MiniScheduler(runner, block_size=8, num_blocks=64, token_budget=512)
        sched.add("img", case.ids, 4, inputs)
        sched.add("txt", case.ids[:3], 4)
        sched.run()
        assert sched.reqs["txt"]["done"] in ("stop", "length")
        return sched.errors

    no_media = make_runner(vision_dir, block_size=8, num_blocks=64)  # the in-process engine's
    assert no_media.vision is None
    assert errors(no_media, [run]) == {"img": "this worker reads no media store, so it serves text only"}
    runner = make_runner(vision_dir, block_size=8, num_blocks=64, media=media)
    short = worker_pb2.MultiModalInput(content_hash=run.content_hash, offset=run.offset, length=3)
    assert "3 soft tokens, the model's images have 4" in errors(runner, [short])["img"]
    moved = worker_pb2.MultiModalInput(content_hash=run.content_hash, offset=run.offset - 1, length=4)
    assert "not all of them are the image token 7" in errors(runner, [moved])["img"]
    text_model = make_runner(tiny_model_dir, block_size=8, num_blocks=64, media=media)
    assert "takes no images" in errors(text_model, [run])["img"]


def test_a_pan_and_scan_checkpoint_loads(vision_dir, tmp_path):
    """Its crops come named from the gateway (mm_inputs' crop boxes): nothing to refuse here."""
    copy = tmp_path / "pan"
    shutil.copytree(vision_dir, copy)
    config = json.loads((copy / "processor_config.json").read_text())
    config["image_processor"].update(do_pan_and_scan=True, pan_and_scan_min_crop_size=8)
    (copy / "processor_config.json").write_text(json.dumps(config))
    runner = make_runner(copy, block_size=8, num_blocks=16, media=FakeMediaSource())
    assert runner.vision.encoder.preprocess.pan_and_scan == PanAndScan(enabled=True, min_crop_size=8)


# ---- pan-and-scan ---------------------------------------------------------------------------

PAN_AND_SCAN = PanAndScan(enabled=True, min_crop_size=8)  # the tiny tower sees 56 px: small crops


def pieces_of(ids: list[int], hashes: list[str], images: list, settings: PanAndScan) -> list:
    """mm_inputs of a prompt whose images are cut by `settings`: each image whole, then its crops."""
    pieces = [(h, crop) for h, image in zip(hashes, images)
              for crop in (None, *settings.boxes(image.decoded.height, image.decoded.width))]
    runs = mm_inputs(ids, IMAGE, [h for h, _ in pieces])
    for run, (_, crop) in zip(runs, pieces):
        if crop is not None:
            run.crop.CopyFrom(worker_pb2.CropBox(**crop._asdict()))
    return runs


def test_pan_and_scan_equals_generate(vision_dir, hf_vlm, processor):
    """A square image (no crops), a 2:1 one (2 crops), a 1:3 one (3) and a 10:1 one (4, the
    most): the processor's pixel batch and prompt with do_pan_and_scan, each piece's
    embeddings over its own soft tokens; the same images without pan-and-scan after it take
    the whole images' embeddings from the cache (the same key) and none of the crops'."""
    media = FakeMediaSource()
    images = [stored(picture(70, 40, 40), "PNG"), stored(picture(71, 96, 48), "JPEG"),
              stored(picture(72, 30, 90, "RGBA"), "PNG"), stored(picture(73, 200, 20), "PNG")]
    text = prompt_text(processor, 74, len(images))
    inputs = processor(text=text, images=[s.decoded for s in images], add_special_tokens=False, return_tensors="pt",
                       do_pan_and_scan=True, pan_and_scan_min_crop_size=8)
    hashes = [media.put(s.item) for s in images]
    case = Case(inputs["input_ids"][0].tolist(), dict(inputs), hashes)
    assert [len(PAN_AND_SCAN.boxes(s.decoded.height, s.decoded.width)) for s in images] == [0, 2, 3, 4]
    assert len(inputs["pixel_values"]) == 4 + 9
    plain = make_case(processor, media, text, images)
    runner = make_runner(vision_dir, block_size=8, num_blocks=96, media=media)
    sched = MiniScheduler(runner, block_size=8, num_blocks=96, token_budget=512)
    sched.add("pas", case.ids, 10, pieces_of(case.ids, hashes, images, PAN_AND_SCAN), **LOGPROBS)
    sched.run()
    assert_matches(sched, "pas", case, reference(hf_vlm, case, 10))
    sched.add("plain", plain.ids, 10, mm_inputs(plain.ids, IMAGE, plain.hashes), **LOGPROBS)
    sched.run()
    assert_matches(sched, "plain", plain, reference(hf_vlm, plain, 10))
    first, *rest = [o.vision for o in sched.outputs_seen if o.vision is not None]
    assert (first.items_encoded, first.cache_hits) == (13, 0)  # each piece once, its image decoded once
    assert sum(s.items_encoded for s in rest) == 0 and sum(s.cache_hits for s in rest) == 4
    assert media.fetches[0] == hashes


def test_a_crop_box_outside_its_image_fails_that_request_only(vision_dir, processor):
    media = FakeMediaSource()
    image = stored(picture(80, 96, 48), "PNG")
    inputs = processor(text=prompt_text(processor, 81, 1), images=[image.decoded], add_special_tokens=False,
                       do_pan_and_scan=True, pan_and_scan_min_crop_size=8)
    ids = list(inputs["input_ids"][0])
    runs = pieces_of(ids, [media.put(image.item)], [image], PAN_AND_SCAN)
    runs[2].crop.left = 96  # the second crop's box moved past the image's right edge
    runner = make_runner(vision_dir, block_size=8, num_blocks=64, media=media)
    sched = MiniScheduler(runner, block_size=8, num_blocks=64, token_budget=512)
    sched.add("bad", ids, 4, runs)
    sched.add("txt", ids[:3], 4)
    sched.run()
    assert sched.reqs["txt"]["done"] in ("stop", "length") and sched.reqs["bad"]["done"] == "error"
    assert sched.errors["bad"].startswith(f"image 2 (content hash {runs[0].content_hash}, crop box (0, 96, 48, 48)): "
                                          "cannot be preprocessed: ValueError: crop box (0, 96, 48, 48)")
    runs[2].crop.width = 0
    sched.add("empty", ids, 4, runs)
    sched.run()
    assert "crop box (0, 96, 48, 0) (top, left, height, width) is empty or negative" in sched.errors["empty"]
