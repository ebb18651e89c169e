"""Image requests for the worker's tests: an image as the gateway stores it (a MediaItem) and
as transformers' processor gets it, random prompts with images, and the processor's inputs
for them (the reference's), with the images put in a media source."""

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from tests.support.media_helpers import file_bytes
from proto.messages import MediaItem
from tests.support.runner_helpers import FakeMediaSource

IMAGE = 7  # the tiny tokenizer's <image_soft_token>


@dataclass
class Stored:
    """An image as the gateway stores it, and as transformers' processor gets it (the same
    file decoded by PIL)."""

    item: MediaItem
    decoded: Image.Image


def stored(image: Image.Image, fmt: str) -> Stored:
    data = file_bytes(image, fmt)
    return Stored(MediaItem("encoded", image.width, image.height, data, f"image/{fmt.lower()}"),
                  Image.open(io.BytesIO(data)))


def frame(image: Image.Image) -> Stored:
    rgb = image.convert("RGB")
    return Stored(MediaItem("rgb8", rgb.width, rgb.height, rgb.tobytes()), rgb)


def random_text(processor, seed: int, num_parts: int, lengths=(3, 30)) -> list[str]:
    rs = np.random.RandomState(seed)
    return [processor.tokenizer.decode(rs.randint(9, 1536, rs.randint(*lengths)).tolist())
            for _ in range(num_parts)]


def prompt_text(processor, seed: int, num_images: int, lengths=(3, 30)) -> str:
    """<bos>, random text with a <start_of_image> between its parts (the processor expands each)."""
    return "<bos>" + "<start_of_image>".join(random_text(processor, seed, num_images + 1, lengths))


@dataclass
class Case:
    ids: list[int]
    inputs: dict  # the processor's tensors
    hashes: list[str]


def make_case(processor, media: FakeMediaSource, text: str, images: list[Stored]) -> Case:
    inputs = processor(text=text, images=[s.decoded for s in images] or None, add_special_tokens=False,
                       return_tensors="pt")
    hashes = [media.put(s.item) for s in images]
    return Case(inputs["input_ids"][0].tolist(), dict(inputs), hashes)
