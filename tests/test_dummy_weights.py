"""`--load-format dummy`: a checkpoint folder with its config.json and tokenizer files but no
weight file serves (random weights of the config's shapes and dtype, made on the device);
without the flag its missing weights, and with it a missing config.json, are errors that
name the flag. Text (the tiny llama) and vision (the tiny gemma3-vision: decoder and
encoder, the encoder service's path too)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from compose.cli import build_parser
from compose.commands import _runner_config
from runner_helpers import FakeMediaSource, MiniScheduler, make_runner
from worker_svc.config import RunnerConfig
from worker_svc.media_encoder import MediaEncoder
from worker_svc.model.dummy_weights import DUMMY_RANGE
from worker_svc.model.loader import resolve_dtype
from worker_svc.model.registry import load_config, load_vision_config
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
