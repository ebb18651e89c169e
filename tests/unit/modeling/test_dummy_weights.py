"""`--load-format dummy`: a checkpoint folder with its config.json and tokenizer files but no
weight file serves (random weights of the config's shapes and dtype, made on the device);
without the flag its missing weights, and with it a missing config.json, are errors that
name the flag. Text (the tiny llama) and vision (the tiny gemma3-vision: decoder and
encoder, the encoder service's path too). A model too large for the device's memory is
refused before any of it is made (modeling/weight_memory.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from compose.cli import build_parser
from compose.commands import _runner_config
from tests.support.runner_helpers import FakeMediaSource, MiniScheduler, make_runner
from worker_svc.config import RunnerConfig
from vision.media_encoder import MediaEncoder
from modeling.dummy_weights import DUMMY_RANGE
from modeling.loader import resolve_dtype
from modeling.registry import load_config, load_vision_config
from modeling.weight_memory import check_fits, free_bytes, weights_bytes
from worker_svc.model_runner import ModelRunner


def config_only(model_dir: Path, dest: Path) -> Path:
    """`model_dir` without its weight files."""
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not list(dest.glob("*.safetensors")) and (dest / "config.json").is_file()
    return dest


def test_a_folder_without_weights_serves_with_dummy_weights(tiny_model_dir, tmp_path):
    folder = config_only(tiny_model_dir, tmp_path / "no-weights")
    runner = make_runner(folder, load_format="dummy")
    loaded = make_runner(tiny_model_dir)
    dummy_params, real_params = dict(runner.model.named_parameters()), dict(loaded.model.named_parameters())
    assert {n: (p.shape, p.dtype) for n, p in dummy_params.items()} == {
        n: (p.shape, p.dtype) for n, p in real_params.items()}
    for p in dummy_params.values():
        assert p.abs().max() <= DUMMY_RANGE and p.std() > DUMMY_RANGE / 4  # filled, not left empty
    sched = MiniScheduler(runner, block_size=4, num_blocks=96, token_budget=16)
    sched.add("r", [5, 6, 7, 8, 9], 6)
    sched.run()
    assert len(sched.outputs("r")) == 6
    again = MiniScheduler(make_runner(folder, load_format="dummy"), block_size=4, num_blocks=96, token_budget=16)
    again.add("r", [5, 6, 7, 8, 9], 6)
    again.run()
    assert again.outputs("r") == sched.outputs("r")  # the same weights each time (seeded)


def test_missing_weights_or_config_name_the_flag(tiny_model_dir, tmp_path):
    folder = config_only(tiny_model_dir, tmp_path / "no-weights")
    with pytest.raises(FileNotFoundError, match="--load-format dummy runs without them"):
        make_runner(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json: --load-format dummy"):
        ModelRunner(RunnerConfig(model=str(folder), num_blocks=32, load_format="dummy"))
    with pytest.raises(ValueError, match="unknown load format"):
        make_runner(tiny_model_dir, load_format="npz")


def test_the_vision_encoder_with_dummy_weights(vision_dir, tmp_path):
    folder = config_only(vision_dir, tmp_path / "vision-no-weights")
    cfg = load_vision_config(folder)
    dtype, _ = resolve_dtype("float32", load_config(folder), torch.device("cpu"))
    # the encoder service's path (encoder_svc/service.py): MediaEncoder.load
    encoder = MediaEncoder.load(folder, cfg, dtype, torch.device("cpu"), FakeMediaSource(), "dummy")
    pixels = torch.randn(2, 3, cfg.image_size, cfg.image_size)
    with torch.no_grad():
        out = encoder.encoder(pixels)
    assert out.shape == (2, cfg.mm_tokens_per_image, cfg.text_hidden_size) and out.isfinite().all()
    again = MediaEncoder.load(folder, cfg, dtype, torch.device("cpu"), FakeMediaSource(), "dummy")
    with torch.no_grad():
        assert torch.equal(again.encoder(pixels), out)  # a worker's and an encoder service's agree
    # the worker's path: the runner's decoder and its encoder
    runner = make_runner(folder, media=FakeMediaSource(), load_format="dummy")
    assert runner.vision is not None and runner.vision.encoder.encoder.dtype == runner.dtype


@pytest.mark.parametrize("command", ["worker", "engine", "encoder"])
def test_the_flag(command):
    args = build_parser().parse_args([command, "--model", "m", "--load-format", "dummy"])
    assert args.load_format == "dummy"
    if command != "encoder":
        assert _runner_config(args).load_format == "dummy"
    assert build_parser().parse_args([command, "--model", "m"]).load_format == "auto"


def test_a_model_too_large_for_the_memory_is_refused_with_the_numbers(tiny_model_dir, tmp_path):
    folder = config_only(tiny_model_dir, tmp_path / "huge")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 100_000_000  # 3 layers x 3 x 64 x 1e8 fp32 weights: ~215 GiB
    (folder / "config.json").write_text(json.dumps(config))
    assert free_bytes(torch.device("cpu")) > 0  # this host's MemAvailable, read
    with pytest.raises(MemoryError, match=r"the decoder's weights need 2\d\d\.\d\d GiB in float32 on cpu, which has "
                                          r"\d+\.\d\d GiB free"):
        make_runner(folder, load_format="dummy")
    layer = torch.nn.Linear(4, 8, device="meta")
    assert weights_bytes(layer, torch.bfloat16) == (32 + 8) * 2
    check_fits(layer, torch.bfloat16, "cpu", "a layer", free=80)
    with pytest.raises(MemoryError,
                       match="a layer's weights need 0.00 GiB in bfloat16 on cpu, which has 0.00 GiB free"):
        check_fits(layer, torch.bfloat16, "cpu", "a layer", free=79)
