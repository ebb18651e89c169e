"""The requirements of one image, from pyproject.toml's dependencies (the one list of them):
`light` (gateway, scheduler) leaves out what only the worker runs (torch, triton and the CPU
kernel's cffi); `worker` leaves out torch and triton: the Dockerfile installs torch first
from the index its TORCH_INDEX build argument names, and a CUDA torch brings the triton it
was built with (a CPU worker runs no Triton kernel). Stdlib only: it runs before anything is
installed. Usage: python3 compose/image_deps.py light|worker [pyproject.toml]"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

WORKER_ONLY = frozenset({"torch", "triton", "cffi"})
FROM_TORCH_INDEX = frozenset({"torch", "triton"})


def requirement_name(spec: str) -> str:
    return re.split(r"[\s<>=!~\[;]", spec, maxsplit=1)[0].lower().replace("_", "-")


def image_requirements(pyproject: dict, image: str) -> list[str]:
    if image not in ("light", "worker"):
        raise ValueError(f"image {image!r}: expected light or worker")
    deps = pyproject["project"]["dependencies"]
    if image == "light":
        return [d for d in deps if requirement_name(d) not in WORKER_ONLY]
    return [d for d in deps if requirement_name(d) not in FROM_TORCH_INDEX]


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[1] if len(argv) == 2 else "pyproject.toml")
    print("\n".join(image_requirements(tomllib.loads(path.read_text()), argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
