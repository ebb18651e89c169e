"""PNG plots from bench/stack/serve.py JSON results.

    python bench/common/plot.py RESULT.json [RESULT.json ...] --out-dir docs/img

Groups results by label (one line per server) and draws, against concurrency (or request
rate for Poisson runs): output token throughput, and TTFT / TPOT p50 and p90.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_by_label(paths: list[str]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        result = json.loads(Path(path).read_text())
        if "ttft_s" in result:  # a serving result, not a compare summary
            groups[result["label"]].append(result)
    return groups


def x_of(result: dict) -> float:
    rate = result.get("request_rate")
    return rate if rate not in (None, float("inf"), "Infinity") and rate != float("inf") else result["concurrency"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--out-dir", default="docs/img")
    p.add_argument("--prefix", default="serve")
    args = p.parse_args(argv)
    groups = load_by_label(args.results)
    if not groups:
        print("no serving results among the files", file=sys.stderr)
        return 1
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    xlabel = "concurrency (or request rate, req/s)"

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, results in sorted(groups.items()):
        results.sort(key=x_of)
        ax.plot([x_of(r) for r in results], [r["output_throughput"] for r in results], marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel="output tokens/s", title="Throughput vs load")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{args.prefix}-throughput.png", dpi=120)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for metric, ax in zip(("ttft_s", "tpot_s"), axes):
        for label, results in sorted(groups.items()):
            results.sort(key=x_of)
            xs = [x_of(r) for r in results]
            for q, style in (("p50", "-o"), ("p90", "--x")):
                ax.plot(xs, [r[metric].get(q, float("nan")) * 1000 for r in results], style, label=f"{label} {q}")
        ax.set(xlabel=xlabel, ylabel=f"{metric[:-2].upper()} (ms)", title=f"{metric[:-2].upper()} vs load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{args.prefix}-latency.png", dpi=120)
    print(f"wrote {out / (args.prefix + '-throughput.png')} and {out / (args.prefix + '-latency.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
