"""The Triton attention's tile choice (kernels/triton_tiles.py) without a GPU: the tuned file
that bench/compute/tune_attention.py writes is read and checked, its entries are what a launch
on that architecture gets, and every other case keeps the untuned defaults. (That each tuned
entry compiles without spills: tests/unit/kernels/test_triton_compile.py.)"""

import json

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_tiles  # noqa: E402  (after the importorskip)

ENTRY = {"BLOCK_M": 128, "TILE_N": 32, "num_warps": 8, "num_stages": 3}


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    """A tuned file for sm_90 with one prefill entry (d128-g4), made the module's table."""
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"_about": "x", "sm_90": {"prefill": {"d128-g4": ENTRY}},
                                "_measured": {"sm_90": {"device": "NVIDIA H200"}}}))
    monkeypatch.setattr(triton_tiles, "TUNED", triton_tiles.read_tuned(path))
    triton_tiles._launch_config.cache_clear()
    yield path
    triton_tiles._launch_config.cache_clear()


def test_the_committed_file_reads():
    table = triton_tiles.read_tuned()
    for (arch, phase, layout), tiles in table.items():
        assert arch.startswith("sm_") and phase in ("decode", "prefill") and layout.startswith("d")
        assert len(tiles) == len(triton_tiles.TILE_KEYS)


def test_a_tuned_entry_is_what_a_launch_on_its_architecture_gets(tuned):
    cfg = triton_tiles.launch_config(300, 2, 4, 128, torch.bfloat16, "sm_90")
    assert cfg == dict(ENTRY, BLOCK_Q=32)
    assert triton_tiles.launch_config(300, 2, 4, 128, torch.float16, "sm_90") == cfg


@pytest.mark.parametrize("call", [
    (300, 2, 4, 128, torch.bfloat16, "sm_80"),  # another architecture
    (300, 2, 4, 128, torch.bfloat16, None),  # the interpreter
    (64, 64, 4, 128, torch.bfloat16, "sm_90"),  # decode: no entry
    (300, 2, 2, 128, torch.bfloat16, "sm_90"),  # another group
    (300, 2, 4, 128, torch.float32, "sm_90"),  # fp32: its own small tiles
], ids=["arch", "interpreter", "decode", "group", "fp32"])
def test_every_other_case_keeps_the_defaults(tuned, call):
    cfg = triton_tiles.launch_config(*call)
    assert cfg != dict(ENTRY, BLOCK_Q=32)
    triton_tiles._launch_config.cache_clear()
    untuned = triton_tiles.TUNED
    try:
        triton_tiles.TUNED = triton_tiles.read_tuned(tuned.parent / "absent.json")
        assert triton_tiles.launch_config(*call) == cfg
    finally:
        triton_tiles.TUNED = untuned


def test_a_tuned_entry_smaller_than_its_group_is_refused(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"sm_90": {"decode": {"d128-g32": {**ENTRY, "BLOCK_M": 16}}}}))
    with pytest.raises(ValueError, match="BLOCK_M >= 32"):
        triton_tiles.read_tuned(path)


@pytest.mark.parametrize("entry", [{"BLOCK_M": 64, "TILE_N": 32, "num_warps": 4},
                                   {**ENTRY, "num_stages": 2.5}, {**ENTRY, "extra": 1},
                                   {**ENTRY, "BLOCK_M": 8}, {**ENTRY, "TILE_N": 48}])
def test_a_malformed_entry_is_refused(tmp_path, entry):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"sm_90": {"decode": {"d128-g4": entry}}}))
    with pytest.raises(ValueError, match="sm_90/decode/d128-g4"):
        triton_tiles.read_tuned(path)


def test_no_file_is_no_table(tmp_path):
    assert dict(triton_tiles.read_tuned(tmp_path / "none.json")) == {}


def test_custom_tiles_keep_the_group_whole():
    assert triton_tiles.custom_config(ENTRY, 2) == dict(ENTRY, BLOCK_Q=64)
    with pytest.raises(ValueError, match="BLOCK_M >= 16"):
        triton_tiles.custom_config({**ENTRY, "BLOCK_M": 4}, 5)
