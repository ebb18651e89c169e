"""Tile sizes for the Triton paged attention (kernels/triton_attention.py): the measured
fastest per GPU architecture, kept in kernels/triton_tuned.json by
bench/compute/tune_attention.py, and untuned defaults for every other case.

A launch's tiles: BLOCK_M query rows (BLOCK_Q = BLOCK_M // group tokens times the group's
heads), TILE_N keys a step, and Triton's num_warps and num_stages. They depend on shapes,
dtype and the device's architecture alone, so a launch never syncs with the host.
"""

import functools
import json
from pathlib import Path
from types import MappingProxyType

import torch
import triton

TUNED_FILE = Path(__file__).with_name("triton_tuned.json")
TILE_KEYS = ("BLOCK_M", "TILE_N", "num_warps", "num_stages")


def tile_problem(tiles: dict, group: int) -> str | None:
    """What makes `tiles` unusable for a launch whose group is `group` (None: nothing): exactly
    TILE_KEYS, ints, powers of two but num_stages (>= 1), BLOCK_M >= 16 (tl.dot's least) and
    >= the group rounded up to a power of two, TILE_N >= 16."""
    min_rows = max(16, triton.next_power_of_2(group))
    if sorted(tiles) != sorted(TILE_KEYS) or not all(type(v) is int for v in tiles.values()):
        return f"must give exactly {TILE_KEYS} as ints, got {tiles}"
    if any(v < 1 or v & (v - 1) for k, v in tiles.items() if k != "num_stages") or tiles["num_stages"] < 1:
        return f"BLOCK_M, TILE_N and num_warps must be powers of two and num_stages >= 1, got {tiles}"
    if tiles["BLOCK_M"] < min_rows or tiles["TILE_N"] < 16:
        return f"needs BLOCK_M >= {min_rows} and TILE_N >= 16, got {tiles}"
    return None


def read_tuned(path: Path = TUNED_FILE) -> MappingProxyType:
    """The tile sizes bench/compute/tune_attention.py measured fastest, per GPU architecture
    ("sm_90"), phase ("decode": every request one token; "prefill": any other batch) and
    layout ("d128-g4": head_dim 128, 4 query heads per KV head); {} when the file is absent.
    ValueError for an entry that is not a valid tile set (`tile_problem`)."""
    if not path.exists():
        return MappingProxyType({})
    table = {}
    for arch, phases in json.loads(path.read_text()).items():
        if arch.startswith("_"):  # "_about", "_measured": for readers
            continue
        for phase, layouts in phases.items():
            for layout, cfg in layouts.items():
                if problem := tile_problem(cfg, int(layout.split("-g")[-1])):
                    raise ValueError(f"{path}: {arch}/{phase}/{layout}: {problem}")
                table[(arch, phase, layout)] = tuple(cfg[k] for k in TILE_KEYS)
    return MappingProxyType(table)


TUNED = read_tuned()


def layout_key(head_dim: int, group: int) -> str:
    return f"d{head_dim}-g{group}"


@functools.lru_cache(maxsize=8)
def device_arch(device: torch.device) -> str | None:
    """"sm_90" for a compute capability 9.0 device; None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def launch_config(num_tokens: int, num_seqs: int, group: int, head_dim: int,
                  dtype: torch.dtype, arch: str | None = None) -> dict:
    """Tile sizes from shapes alone: `arch`'s tuned entry (TUNED) for fp16/bf16 where it has
    one, else the untuned defaults. Decode-only batches use 16-row tiles (one token per
    request fills `group` rows); other batches 64 rows (32 for head_dim 256). fp32 takes
    16 x 16 tiles: its IEEE dots are FMA loops that spill registers on larger tiles.
    Every default and tuned entry compiles for sm_80/sm_90 without spills (checked by
    tests/unit/kernels/test_triton_compile.py without a GPU)."""
    return dict(_launch_config(num_tokens == num_seqs, group, head_dim, dtype, arch))


# Cached per argument tuple: it reads TUNED, so whoever replaces TUNED (tests) calls cache_clear().
@functools.lru_cache(maxsize=256)
def _launch_config(decode_only: bool, group: int, head_dim: int, dtype: torch.dtype,
                   arch: str | None) -> tuple:
    min_rows = triton.next_power_of_2(group)
    tuned = TUNED.get((arch, "decode" if decode_only else "prefill", layout_key(head_dim, group)))
    if tuned is not None and dtype != torch.float32 and tuned[0] >= min_rows:
        block_m, tile_n, warps, stages = tuned
    else:
        if dtype == torch.float32:
            rows, tile_n = 16, 16
        elif decode_only:
            rows, tile_n = 16, 32
        else:
            rows, tile_n = (32, 32) if head_dim > 128 else (64, 64)
        block_m = max(rows, min_rows)
        warps, stages = 8 if block_m >= 64 else 4, 2
    return tuple(dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n,
                      num_warps=warps, num_stages=stages).items())


def custom_config(tiles: dict, group: int) -> dict:
    """launch_config's form of `tiles`; ValueError with `tile_problem`'s reason."""
    if problem := tile_problem(tiles, group):
        raise ValueError(f"tiles {problem}")
    return dict(BLOCK_M=tiles["BLOCK_M"], BLOCK_Q=tiles["BLOCK_M"] // group, TILE_N=tiles["TILE_N"],
                num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
