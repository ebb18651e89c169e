"""proto/pan_and_scan.py, the crop arithmetic the gateway and the worker share, against
transformers' own (`Gemma3ImageProcessorPil.pan_and_scan`) on random sizes and settings;
its settings (the checkpoint's, a request's over them, each checked); and the keys that keep
a crop's embeddings and K/V apart from its image's and from other crops' -- the encoder
cache's, the published embeddings', the prefix cache's and the scheduler's mirror."""

import msgspec
import numpy as np
import pytest
import torch

from proto import worker_pb2
from proto.messages import MultiModalInput, NewRequest, SamplingParams, stream_encoder
from proto.pan_and_scan import CropBox, ImagePiece, PanAndScan, crop_boxes, embedding_key
from scheduler_svc.policy.encoder_budget import EncoderCacheMirror
from scheduler_svc.policy.image_ranges import block_extra_keys, to_pb_mm_inputs
from vision.encoder_cache import EncoderCache
from worker_svc.request_state import RequestState

H = "ab" * 32  # a content hash


def transformers_boxes(height: int, width: int, min_crop: int, max_crops: int, ratio: float) -> list[tuple]:
    """The boxes transformers cuts, read off the crops of an image whose pixels are their
    own (row, column)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    image = np.stack([rows, cols, rows * 0])  # channels first, as transformers holds it
    crops = Gemma3ImageProcessorPil().pan_and_scan(image, min_crop, max_crops, ratio)
    return [(int(c[0, 0, 0]), int(c[1, 0, 0]), *c.shape[1:]) for c in crops]


def test_crop_boxes_equal_transformers():
    rng = np.random.default_rng(0)
    cases = [(56, 56, 8, 4, 1.2), (48, 96, 8, 4, 1.2), (90, 30, 8, 4, 1.2), (20, 200, 8, 4, 1.2),
             (1, 1000, 1, 1000, 1.2), (7, 10, 3, 4, 1.0), (100, 7, 8, 4, 1.2)]
    cases += [(int(rng.integers(1, 300)), int(rng.integers(1, 300)), int(rng.integers(1, 60)),
               int(rng.integers(1, 7)), float(rng.choice([0.5, 1.0, 1.2, 1.5, 2.5]))) for _ in range(300)]
    cut = 0
    for height, width, min_crop, max_crops, ratio in cases:
        expected = transformers_boxes(height, width, min_crop, max_crops, ratio)
        got = crop_boxes(height, width, min_crop, max_crops, ratio)
        # transformers' crops stop at the edge; a box says where the crop starts and how big it may be
        clipped = [(t, left, min(h, height - t), min(w, width - left)) for t, left, h, w in got]
        assert clipped == expected, (height, width, min_crop, max_crops, ratio)
        assert PanAndScan(True, min_crop, max_crops, ratio).count(height, width) == len(got)
        cut += bool(got)
    assert cut > 100  # most random cases do cut


def test_crops_are_counted_without_being_made():
    # a 2**25 x 1 image cut into 1-pixel crops: the gateway checks the count against the
    # context before any of the 33.5M boxes exists
    many = PanAndScan(enabled=True, min_crop_size=1, max_num_crops=10**9)
    assert many.count(1, 2**25) == 2**25 and many.count(2**25, 1) == 2**25
    assert PanAndScan().count(1, 2**25) == 0  # off


def test_settings_from_the_checkpoint_and_the_request():
    google = {"do_pan_and_scan": None, "pan_and_scan_min_crop_size": None, "pan_and_scan_max_num_crops": None,
              "pan_and_scan_min_ratio_to_activate": None, "size": {"height": 896, "width": 896}}
    assert PanAndScan.from_image_processor(google) == PanAndScan() == PanAndScan.from_image_processor(None)
    assert PanAndScan() == PanAndScan(enabled=False, min_crop_size=256, max_num_crops=4, min_ratio_to_activate=1.2)
    on = PanAndScan.from_image_processor({**google, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 10})
    assert on == PanAndScan(enabled=True, min_crop_size=10)
    assert on.overridden({"do_pan_and_scan": False}) == PanAndScan(enabled=False, min_crop_size=10)  # turned off
    assert on.overridden({"do_pan_and_scan": None, "pan_and_scan_max_num_crops": 2}) == PanAndScan(True, 10, 2)
    assert on.overridden(None) is on and on.overridden({}) is on
    assert PanAndScan().overridden({"pan_and_scan_min_ratio_to_activate": 2}).min_ratio_to_activate == 2.0
    with pytest.raises(ValueError, match="the image processor config: 'do_pan_and_scan' must be true or false"):
        PanAndScan.from_image_processor({"do_pan_and_scan": "yes"})


@pytest.mark.parametrize("kwargs, message", [
    ({"do_pan_and_scan": 1}, "'do_pan_and_scan' must be true or false, not 1"),
    ({"pan_and_scan_min_crop_size": 0}, "'pan_and_scan_min_crop_size' must be an integer of at least 1, not 0"),
    ({"pan_and_scan_min_crop_size": True}, "'pan_and_scan_min_crop_size' must be an integer of at least 1, not True"),
    ({"pan_and_scan_max_num_crops": 1.5}, "'pan_and_scan_max_num_crops' must be an integer of at least 1, not 1.5"),
    ({"pan_and_scan_max_num_crops": "4"}, "'pan_and_scan_max_num_crops' must be an integer of at least 1, not '4'"),
    ({"pan_and_scan_min_ratio_to_activate": 0},
     "'pan_and_scan_min_ratio_to_activate' must be a finite number above 0, not 0"),
    ({"pan_and_scan_min_ratio_to_activate": float("inf")}, "must be a finite number above 0, not inf"),
    ({"pan_and_scan_min_ratio_to_activate": False}, "must be a finite number above 0, not False"),
    ({"pan_and_scan_min_ratio_to_activate": 10**400}, "must be a finite number above 0, not 1000000000000000000"),
    ({"do_pan_and_scan": True, "num_crops": 2}, "'num_crops' is not a processor setting of this model"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PanAndScan().overridden(kwargs)


def test_keys_tell_a_crop_from_its_image_and_from_other_crops():
    whole = MultiModalInput(H, 10, 4)
    crop = MultiModalInput(H, 10, 4, CropBox(0, 0, 48, 48))
    other = MultiModalInput(H, 10, 4, CropBox(0, 48, 48, 48))
    assert whole.embedding_key == H == ImagePiece(H).key == embedding_key(H, None)  # what the encoders publish
    assert len({whole.embedding_key, crop.embedding_key, other.embedding_key}) == 3
    assert crop.embedding_key == ImagePiece(H, CropBox(0, 0, 48, 48)).key == f"{H}:crop:0,0,48,48"
    # the prefix cache: the same placeholder tokens at the same offset, another piece -- another key
    keys = [block_extra_keys([m], 8) for m in (whole, crop, other)]
    assert keys[0] == {1: ((H, 10),)} and len({str(k) for k in keys}) == 3
    # the scheduler's mirror of the worker's encoder cache
    mirror = EncoderCacheMirror(8)
    mirror.touch([crop.embedding_key])
    assert mirror.holds(crop.embedding_key) and not mirror.holds(whole.embedding_key)
    assert mirror.held_tokens([whole, crop]) == 4
    # the worker's encoder cache
    cache = EncoderCache(1 << 20)
    cache.put(crop.embedding_key, torch.ones(4, 8))
    assert cache.get(whole.embedding_key) is None and cache.get(other.embedding_key) is None


def test_crops_travel_typed_to_the_worker():
    pieces = (MultiModalInput(H, 1, 4), MultiModalInput(H, 8, 4, CropBox(0, 30, 30, 30)))
    request = NewRequest("r", [2] * 20, SamplingParams(max_tokens=1), "c", 0.0, mm_inputs=pieces)
    back = msgspec.msgpack.decode(stream_encoder.encode(request), type=NewRequest)
    assert back.mm_inputs == pieces and isinstance(back.mm_inputs[1].crop, CropBox)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode([H, 1, 4]), type=MultiModalInput)  # before crops
    assert old == MultiModalInput(H, 1, 4)
    pb = to_pb_mm_inputs(pieces)
    assert not pb[0].HasField("crop") and (pb[1].crop.top, pb[1].crop.left, pb[1].crop.width) == (0, 30, 30)
    new = worker_pb2.NewRequestData(request_id="r", token_ids=[2] * 20, num_prompt_tokens=20, mm_inputs=pb)
    state = RequestState(new)
    assert state.image_pieces == (ImagePiece(H), ImagePiece(H, CropBox(0, 30, 30, 30)))
    assert state.image_keys == tuple(m.embedding_key for m in pieces)
