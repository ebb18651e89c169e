"""bench/stack/compare.py on one checkpoint of each model family, the families interleaved round by
round (llama, qwen2, ..., then again), with what each family costs per token beside it.

    for a in llama qwen2 qwen3 mistral gemma3; do
        pagedserve make-model models/$a-small --arch $a --preset small; done
    python bench/stack/families.py --runs 3 --num-requests 32 --concurrency 16 --input-mean 128 \
        --output-mean 64 --out-dir bench/results/families

Each round runs compare.py once per family (its contenders, default stack, engine and
`transformers serve`, one after the other). The table gives per family the median output
throughput of every contender, the stack's ratio to each, and the cost of a token: matmul
parameters (≈ FLOPs / 2 per token: every linear, the LM head included, embeddings excluded)
and bytes of KV per token — what may explain one family being slower than another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

HERE = Path(__file__).resolve().parent  # bench/stack/: compare.py
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def token_cost(model_dir: Path) -> tuple[float, int]:
    """(matmul parameters in millions, KV bytes per token) of a checkpoint."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    params, has_head = 0, False
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                has_head |= "lm_head" in name
                if len(shape) == 2 and "embed_tokens" not in name:
                    params += shape[0] * shape[1]
    if not has_head:  # tied embeddings: the head still runs
        params += cfg["vocab_size"] * cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = 2 if cfg.get("torch_dtype", cfg.get("dtype")) in ("bfloat16", "float16") else 4
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    return params / 1e6, kv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="models", help="folder holding <family>-small checkpoints")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--contenders", nargs="+", default=["stack", "engine", "hf-serve"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out-dir", default="bench/results/families")
    args, compare_args = p.parse_known_args(argv)  # the rest goes to compare.py as is
    out = Path(args.out_dir)
    runs: dict[str, dict[str, list[float]]] = {f: {c: [] for c in args.contenders} for f in args.families}
    for round_no in range(args.runs):
        for family in args.families:
            print(f"== round {round_no + 1}/{args.runs}: {family}", file=sys.stderr, flush=True)
            run_dir = out / family / f"round-{round_no}"
            subprocess.run([sys.executable, str(HERE / "compare.py"), "--model-dir",
                            str(Path(args.models) / f"{family}-small"), "--runs", "1",
                            "--contenders", *args.contenders, "--out-dir", str(run_dir), *compare_args],
                           check=True, stdout=subprocess.DEVNULL)
            summary = json.loads((run_dir / "summary.json").read_text())
            for contender, row in summary["contenders"].items():
                runs[family][contender] += row["output_throughput_runs"]
    medians = {f: {c: statistics.median(v) for c, v in rows.items()} for f, rows in runs.items()}
    (out / "summary.json").write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))
    others = [c for c in args.contenders if c != "stack"]
    print(f"\nmedians of {args.runs} interleaved rounds, output tok/s\n")
    print("| family | matmul params | KV bytes / token | " + " | ".join(args.contenders)
          + " | " + " | ".join(f"stack ÷ {c}" for c in others) + " |")
    print("|---" * (3 + len(args.contenders) + len(others)) + "|")
    for family in args.families:
        params, kv = token_cost(Path(args.models) / f"{family}-small")
        m = medians[family]
        print(f"| {family} | {params:.1f} M | {kv} | " + " | ".join(f"{m[c]:.1f}" for c in args.contenders)
              + " | " + " | ".join(f"{m['stack'] / m[c]:.2f}×" for c in others) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
