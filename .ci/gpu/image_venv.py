"""A virtualenv holding only what the lent GPU machine's image holds, for the GPU check's
CPU dry run (`make gpu-dry-run`).

    python .ci/gpu/image_venv.py [--dest .gpu-image-venv]

The packages: those of the stack's requirements (resolved here with constraints.txt, as
.ci/gpu/bundle.py resolves them) that the image has (.ci/gpu/image-packages.txt), at the
image's versions where they were read there (transformers 5.17, tokenizers 0.23.2, triton
3.6 ...) and at our pins otherwise -- with two exceptions the dry run cannot avoid: torch is
this machine's CPU wheel (the image's 2.11 is a CUDA build), and a version that has no
wheel for this Python is taken at our pin. Whatever they pull in must be in the image's
list too: one outside it (pulled in by a newer release than the image's) is uninstalled again,
so that what the bundle lacks shows as a failed import.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle import ROOT, canonical, image_packages, requirement_name, resolve_all, stack_requirements  # noqa: E402

TORCH = "torch==2.13.0"  # the CPU wheel on this machine's disk
NOT_FROM_IMAGE = {"pip", "setuptools", "wheel"}


def wanted(image: dict[str, str | None], python_version: str) -> list[str]:
    # torch apart: resolved for manylinux it is the CUDA build, with its nvidia-* wheels
    pins = dict(resolve_all([r for r in stack_requirements() if requirement_name(r) != "torch"],
                            python_version))
    out = []
    for name, version in sorted(pins.items()):
        if name not in image or name == "torch":
            continue
        out.append(f"{name}=={image[name] or version}")
    return [TORCH, *out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu-image-venv")
    args = p.parse_args(argv)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    image = image_packages()
    specs = wanted(image, here)
    venv.create(args.dest, with_pip=True, clear=True)
    py = str(args.dest / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    install = [py, "-m", "pip", "install", "--quiet", "--only-binary=:all:"]
    if subprocess.run([*install, *specs]).returncode != 0:
        for spec in specs:  # an image version with no wheel for this Python: ours instead
            if subprocess.run([*install, spec]).returncode != 0:
                print(f"{spec}: not installable here; taking constraints.txt's", file=sys.stderr)
                subprocess.run([*install, "-c", str(ROOT / "constraints.txt"), spec.split("==")[0]], check=True)
    listed = json.loads(subprocess.run([py, "-m", "pip", "list", "--format", "json"], check=True,
                                       capture_output=True, text=True).stdout)
    # Newer releases than the image's may need more (typer 0.29 needs pydantic; the image's
    # older typer does not): what is not in the image goes, so the bundle must bring it.
    outside = sorted(d["name"] for d in listed if canonical(d["name"]) not in image
                     and canonical(d["name"]) not in NOT_FROM_IMAGE)
    if outside:
        print(f"not in the GPU image, removed: {', '.join(outside)}")
        subprocess.run([py, "-m", "pip", "uninstall", "--quiet", "-y", *outside], check=True)
        listed = [d for d in listed if d["name"] not in outside]
    for d in listed:
        print(f"  {d['name']}=={d['version']}")
    print(f"{args.dest}: {len(listed)} packages, all in the GPU image's list")
    return 0


if __name__ == "__main__":
    sys.exit(main())
