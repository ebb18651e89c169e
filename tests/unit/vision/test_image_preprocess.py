"""vision/image_preprocess.py against the processor `AutoProcessor` loads for a Gemma 3
checkpoint here (Gemma3Processor over Gemma3ImageProcessorPil): the same pixel_values, bit
for bit, for PNG, JPEG, RGBA, grayscale, palette (with and without transparency), LA, CMYK
and raw-RGB-bytes images of odd sizes and aspect ratios, with pan-and-scan, and under the
processor layouts of make-model (transformers 5) and of Google's releases."""

import io
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from proto.pan_and_scan import CropBox, PanAndScan
from vision.image_preprocess import ImagePreprocessConfig, preprocess_image, preprocess_piece, rgb_array
from tools.local_tokenizer import train_tokenizer
from tools.make_vision_model import save_gemma3_processor
from tools.model_presets import flavour

# Google's gemma-3-*-it preprocessor_config.json: the processor's defaults fill the nulls
GOOGLE_PREPROCESSOR = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896}}


@pytest.fixture(scope="session")
def processor_dirs(tmp_path_factory):
    """{layout: folder}: make-model's processor for the tiny (56 px) and small (224 px)
    presets, and Google's layout (preprocessor_config.json, 896 px)."""
    tokenizer = train_tokenizer(300, 20_000, flavour("gemma3-vision"))
    dirs = {}
    for preset in ("tiny", "small"):
        dirs[preset] = tmp_path_factory.mktemp(f"processor-{preset}")
        save_gemma3_processor(dirs[preset], tokenizer, preset)
    google = dirs["google"] = tmp_path_factory.mktemp("processor-google")
    save_gemma3_processor(google, tokenizer, "tiny")
    (google / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": 256, "processor_class": "Gemma3Processor"}))
    (google / "preprocessor_config.json").write_text(json.dumps(GOOGLE_PREPROCESSOR))
    return dirs


@pytest.fixture(scope="session")
def processors(processor_dirs):
    from transformers import AutoProcessor

    return {name: AutoProcessor.from_pretrained(d) for name, d in processor_dirs.items()}


def encoded(image: Image.Image, fmt: str, **options) -> Image.Image:
    """`image` written as `fmt` and opened again, as a decoded upload is."""
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    buffer.seek(0)
    return Image.open(buffer)


def pixels(rs: np.random.RandomState, h: int, w: int, c: int = 3) -> np.ndarray:
    """Smooth gradients plus noise: resampling filters see both edges and flat areas."""
    y, x = np.mgrid[0:h, 0:w]
    base = (x * 255 / max(w - 1, 1) + y * 128 / max(h - 1, 1))[..., None] * np.linspace(0.3, 1.0, c)
    return np.clip(base + rs.randint(-40, 40, (h, w, c)), 0, 255).astype(np.uint8)


def sample_images(seed: int = 0) -> dict[str, Image.Image]:
    rs = np.random.RandomState(seed)
    rgba = pixels(rs, 50, 77, 4)
    rgba[..., 3] = rs.choice([0, 90, 255], (50, 77))  # transparent, half, opaque
    frame = pixels(rs, 48, 64)
    return {
        "png": encoded(Image.fromarray(pixels(rs, 37, 91)), "PNG"),
        "jpeg": encoded(Image.fromarray(pixels(rs, 123, 45)), "JPEG", quality=85),
        "rgba": encoded(Image.fromarray(rgba, "RGBA"), "PNG"),
        "grayscale": encoded(Image.fromarray(pixels(rs, 61, 19, 1)[..., 0], "L"), "PNG"),
        "palette": encoded(Image.fromarray(pixels(rs, 33, 200)).convert("P"), "PNG"),
        "palette_transparent": encoded(Image.fromarray(pixels(rs, 40, 33)).convert("P"), "PNG",
                                       transparency=3),
        "grayscale_alpha": Image.fromarray(pixels(rs, 20, 30, 2), "LA"),
        "cmyk": encoded(Image.fromarray(pixels(rs, 25, 35, 4), "CMYK"), "JPEG"),
        "raw_rgb_bytes": Image.frombytes("RGB", (64, 48), frame.tobytes()),
        "one_pixel": Image.fromarray(pixels(rs, 1, 1)),
        "thin": Image.fromarray(pixels(rs, 3, 500)),
        "large": Image.fromarray(pixels(rs, 700, 1100)),
    }


def reference(processor, images: list[Image.Image], **kwargs) -> torch.Tensor:
    text = "<start_of_image>" * len(images)
    return processor(text=text, images=images, return_tensors="pt", **kwargs)["pixel_values"]


@pytest.mark.parametrize("layout", ["tiny", "small", "google"])
def test_pixel_values_equal_the_processors(layout, processor_dirs, processors):
    cfg = ImagePreprocessConfig.from_checkpoint(processor_dirs[layout])
    side = {"tiny": 56, "small": 224, "google": 896}[layout]
    assert (cfg.height, cfg.width, cfg.pan_and_scan.enabled, cfg.do_convert_rgb) == (side, side, False, True)
    images = sample_images()
    if layout == "google":  # 896 x 896 outputs: a few kinds are enough
        images = {k: images[k] for k in ("jpeg", "rgba", "palette_transparent", "large")}
    for name, image in images.items():
        got = preprocess_image(image, cfg)
        expected = reference(processors[layout], [image])
        assert got.dtype == torch.float32 and got.shape == (1, 3, side, side), name
        assert torch.equal(got, expected), (name, (got - expected).abs().max())
    batch = list(images.values())
    got = torch.cat([preprocess_image(i, cfg) for i in batch])
    assert torch.equal(got, reference(processors[layout], batch))


def test_rgb_conversion_composites_transparency_over_white():
    cfg = ImagePreprocessConfig.from_dict({"size": {"height": 2, "width": 2}})
    clear = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert torch.equal(preprocess_image(clear, cfg), torch.ones(1, 3, 2, 2))  # white, normalized


@pytest.mark.parametrize("min_crop", [10, 40])
def test_pan_and_scan_equals_the_processors(min_crop, processor_dirs, processors):
    cfg = ImagePreprocessConfig.from_checkpoint(processor_dirs["tiny"])
    cfg = replace(cfg, pan_and_scan=replace(cfg.pan_and_scan, min_crop_size=min_crop))
    images = sample_images(1)
    for name, image in images.items():
        got = preprocess_image(image, cfg, do_pan_and_scan=True)
        expected = reference(processors["tiny"], [image], do_pan_and_scan=True,
                             pan_and_scan_min_crop_size=min_crop)
        assert torch.equal(got, expected), name
    crops = {name: len(preprocess_image(image, cfg, do_pan_and_scan=True)) - 1
             for name, image in images.items()}
    if min_crop == 10:  # 4 at most; none where a crop would be thinner than 10 px or the image too square
        counts = (crops["palette"], crops["jpeg"], crops["png"], crops["thin"], crops["one_pixel"])
        assert counts == (4, 3, 2, 0, 0)
    else:
        assert {name for name, k in crops.items() if k} == {"jpeg", "large"}
    # from the config; a request may turn it off
    on = replace(cfg, pan_and_scan=replace(cfg.pan_and_scan, enabled=True))
    with_crops = preprocess_image(images["large"], cfg, do_pan_and_scan=True)
    assert len(with_crops) == 3 and torch.equal(preprocess_image(images["large"], on), with_crops)
    assert len(preprocess_image(images["large"], on, do_pan_and_scan=False)) == 1
    # piece by piece, as a worker encodes them: the image whole, then each crop box
    for name, image in images.items():
        boxes = on.pan_and_scan.boxes(image.height, image.width)
        rgb = rgb_array(image, on)  # converted once
        pieces = torch.stack([preprocess_piece(rgb, on, crop) for crop in (None, *boxes)])
        assert torch.equal(pieces, preprocess_image(image, on)), name


def test_a_crop_box_outside_the_image_is_refused():
    cfg = ImagePreprocessConfig.from_dict({"size": {"height": 4, "width": 4}})
    image = Image.new("RGB", (30, 10))
    # past the edge: cut short
    assert preprocess_piece(rgb_array(image, cfg), cfg, CropBox(0, 20, 10, 15)).shape == (3, 4, 4)
    for box in (CropBox(10, 0, 5, 5), CropBox(0, 30, 5, 5), CropBox(0, 0, 0, 5), CropBox(-1, 0, 5, 5)):
        with pytest.raises(ValueError, match=r"crop box .* is not inside the 30x10 image"):
            preprocess_piece(rgb_array(image, cfg), cfg, box)


def test_pan_and_scan_boxes():
    cfg = PanAndScan(enabled=True)
    assert cfg.boxes(1000, 1100) == []  # ratio 1.1 < 1.2
    assert cfg.boxes(600, 1300) == [(0, 0, 600, 650), (0, 650, 600, 650)]
    assert cfg.boxes(1001, 300) == [(0, 0, 334, 300), (334, 0, 334, 300), (668, 0, 334, 300)]
    assert cfg.boxes(300, 5000)[-1] == (0, 3750, 300, 1250)  # at most 4 crops
    assert cfg.boxes(200, 900) == []  # crops under 256 pixels
    assert PanAndScan().boxes(600, 1300) == []  # off


def test_config_refusals_and_defaults():
    cfg = ImagePreprocessConfig.from_dict(GOOGLE_PREPROCESSOR)
    assert cfg.pan_and_scan == PanAndScan(enabled=False, min_crop_size=256, max_num_crops=4, min_ratio_to_activate=1.2)
    assert cfg.resample == Image.Resampling.BILINEAR
    on = ImagePreprocessConfig.from_dict({**GOOGLE_PREPROCESSOR, "do_pan_and_scan": True,
                                          "pan_and_scan_max_num_crops": 2})
    assert on.pan_and_scan == PanAndScan(enabled=True, max_num_crops=2)
    with pytest.raises(ValueError, match="'pan_and_scan_min_crop_size' must be an integer of at least 1, not 0"):
        ImagePreprocessConfig.from_dict({"pan_and_scan_min_crop_size": 0})
    with pytest.raises(ValueError, match="only Gemma 3's"):
        ImagePreprocessConfig.from_dict({"image_processor_type": "SiglipImageProcessor"})
    with pytest.raises(ValueError, match="only a fixed"):
        ImagePreprocessConfig.from_dict({"size": {"shortest_edge": 224}})
    off = replace(cfg, do_convert_rgb=False)
    with pytest.raises(ValueError, match="only RGB images"):
        preprocess_image(Image.new("L", (4, 4)), off)
