"""The sampler's exponential race: the torch ops (worker_svc/sampler.py's `exponential_race`,
the torch backend's) against the backend's fused kernel on the same probabilities and
seeds -- the C kernel on the CPU (kernels/cpu_sampling.py), Triton on CUDA
(kernels/triton_sampling.py).

    python bench/compute/sampling.py                                  # CPU, one thread
    python bench/compute/sampling.py --device cuda --cases 1x262208,64x128256,256x262208

Each case is rows x vocabulary: fp32 probabilities (a softmax of 3 x N(0, 1) logits) and
random int64 seeds; both contenders are first checked to draw the same ids. Then
--rounds interleaved rounds, each timing every contender as the median of --iters calls
(wall clock after a synchronize on CUDA). Reported per case: the medians over rounds in
ms, fused / torch, and the fused kernel's read rate (4 bytes per vocabulary entry / time).
`bench/compute/kernels.py` runs this on a GPU (`make gpu-check`'s kernels step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from worker_svc.sampler import exponential_race  # noqa: E402

DEFAULT_CASES = {"cpu": "64x1536,32x32000,8x151936", "cuda": "1x262208,64x128256,256x262208"}


def fused_race(device: str):
    """The backend's fused race for `device`."""
    if device == "cpu":
        from kernels.cpu_sampling import CpuRace
        return CpuRace()
    from kernels.triton_sampling import exponential_race as triton_race
    return triton_race


def _time(fn, iters: int, device: str) -> float:
    """Median seconds of one call of `fn` over `iters`."""
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_case(rows: int, vocab: int, device: str, fused, rounds: int, iters: int) -> dict:
    gen = torch.Generator().manual_seed(rows * 1_000_003 + vocab)
    probs = (3 * torch.randn(rows, vocab, generator=gen)).softmax(dim=-1).to(device)
    seeds = torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64, generator=gen).to(device)
    if not torch.equal(fused(probs, seeds), exponential_race(probs, seeds)):
        raise SystemExit(f"{rows}x{vocab}: the fused race draws other ids than the torch one")
    contenders = {"torch": lambda: exponential_race(probs, seeds), "fused": lambda: fused(probs, seeds)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(_time(fn, iters, device))
    torch_s, fused_s = statistics.median(times["torch"]), statistics.median(times["fused"])
    return {"rows": rows, "vocab": vocab, "torch_ms": 1e3 * torch_s, "fused_ms": 1e3 * fused_s,
            "fused_over_torch": fused_s / torch_s, "fused_read_gb_s": 4 * rows * vocab / fused_s / 1e9,
            "rounds_ms": {name: [round(1e3 * t, 4) for t in ts] for name, ts in times.items()}}


def run(device: str, cases: str, rounds: int, iters: int) -> list[dict]:
    fused = fused_race(device)
    shapes = [tuple(int(n) for n in case.split("x")) for case in cases.split(",")]
    return [bench_case(rows, vocab, device, fused, rounds, iters) for rows, vocab in shapes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cases", help="rows x vocabulary, comma-separated (default: by device)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--iters", type=int, default=9, help="calls per contender per round")
    p.add_argument("--threads", type=int, default=1, help="torch (and OpenMP) threads on the CPU")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows = run(args.device, args.cases or DEFAULT_CASES[args.device], args.rounds, args.iters)
    print("| rows x vocab | torch ops | fused | fused / torch | fused reads |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} x {r['vocab']} | {r['torch_ms']:.3f} ms | {r['fused_ms']:.3f} ms | "
              f"{r['fused_over_torch']:.3f} | {r['fused_read_gb_s']:.1f} GB/s |")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
