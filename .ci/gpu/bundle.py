"""`make gpu-bundle`: everything the GPU check needs that the lent GPU machine lacks, fetched
here (where there is network) into one folder that travels with the working tree.

    python .ci/gpu/bundle.py [--dest .gpu-bundle] [--python-version 3.12]

The lent machine has no network, Python 3.12 with torch 2.11 (CUDA 13) and the packages
listed in .ci/gpu/image-packages.txt, and takes at most 64 MiB of carried files. So:

1. wheels/: the stack's requirements (pyproject.toml's dependencies, plus what the check's
   steps import) resolved with pip for CPython `--python-version` on manylinux x86-64,
   with constraints.txt's pins, minus what the image already has -- except `CARRY_ANYWAY`,
   whose version there the generated code in proto/ refuses. Each
   wheel is fetched exactly (no dependencies resolved on the machine: the resolution is
   done here, once). `LEFT_OUT` names what the check never imports, with the reason.
2. debs/: Debian's redis-server and the shared libraries it links beyond glibc, to be
   unpacked with `dpkg -x` (no root install, no apt there).
3. tokenizers/<arch>-<preset>/: the checkpoint tokenizers the serving step needs
   (tokenizer.json gzipped), trained here so that nothing is trained there: the `1b`
   preset's tokenizer takes a minute of BPE training on the whole standard library.
4. manifest.json: what is where, each file's size, the total (refused over `--max-mib`).

For the CPU dry run (`make gpu-check DEVICE=cpu` in a venv with only the image's
packages: .ci/gpu/image_venv.py) make a bundle for this machine's Python:
`make gpu-bundle GPU_PYTHON_VERSION=3.11 GPU_BUNDLE=.gpu-bundle-3.11`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

IMAGE_PACKAGES = Path(__file__).with_name("image-packages.txt")
# In the image, but at a version the stack cannot run with: proto/worker_pb2_grpc.py refuses
# a grpcio older than the one it was generated with.
CARRY_ANYWAY = {"grpcio": "the image's 1.84.0 is older than the 1.85.1 proto/worker_pb2_grpc.py "
                          "was generated with, which it refuses"}
# Requirements of the stack the check never imports, left out of the bundle.
LEFT_OUT = {"av": "video decoding (36 MB): the gateway imports it only for a video part, and "
                  "the check sends none"}
# What the check's steps import beyond the stack's own dependencies (pytest and xdist for
# the GPU-marked tests; httpx for bench/stack/serve.py). Those the image has are not carried.
CHECK_EXTRAS = ["pytest", "pytest-xdist", "hypothesis", "httpx"]
# Debian packages: redis-server's binary (in redis-tools) and the libraries it links that a
# Python image may lack; glibc, libstdc++ and libgcc are taken as given.
REDIS_DEBS = ["redis-server", "redis-tools", "liblzf1", "libjemalloc2", "libatomic1", "libssl3",
              "libsystemd0", "libcap2", "libgcrypt20", "libgpg-error0", "liblz4-1", "liblzma5",
              "libzstd1"]
# (arch, preset) of the checkpoints the serving step makes there: 1b on a GPU, tiny on the CPU.
TOKENIZERS = [("llama", "1b"), ("llama", "tiny")]
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(17, 40)]
             + ["manylinux2014_x86_64", "manylinux1_x86_64"])


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return canonical(re.split(r"[\s<>=!~\[;(]", spec.strip(), maxsplit=1)[0])


def image_packages(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """name -> version where known (None: in the image, version unread)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version or None
    return out


def stack_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [*deps, *CHECK_EXTRAS]


def to_carry(requirements: list[str], image: dict[str, str | None]) -> list[str]:
    """The top-level requirements to resolve for the bundle: what the image lacks, plus
    CARRY_ANYWAY, minus LEFT_OUT."""
    keep = []
    for req in requirements:
        name = requirement_name(req)
        if name in LEFT_OUT:
            continue
        if name not in image or name in CARRY_ANYWAY:
            keep.append(req)
    return keep


def pip_target_args(python_version: str) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *(a for p in PLATFORMS for a in ("--platform", p))]


def resolve_all(requirements: list[str], python_version: str) -> list[tuple[str, str]]:
    """(name, version) of every distribution the requirements need on CPython
    `python_version` (manylinux x86-64 wheels), resolved by pip with constraints.txt."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "--target", str(Path(tmp) / "target"),
                        "-c", str(ROOT / "constraints.txt"), *pip_target_args(python_version), *requirements],
                       check=True)
        installs = json.loads(report.read_text())["install"]
    return sorted((canonical(i["metadata"]["name"]), i["metadata"]["version"]) for i in installs)


def bundle_pins(pins: list[tuple[str, str]], image: dict[str, str | None]) -> list[tuple[str, str]]:
    """The resolved distributions the image does not provide (CARRY_ANYWAY always travels)."""
    return [(n, v) for n, v in pins if (n not in image or n in CARRY_ANYWAY) and n not in LEFT_OUT]


def download_wheels(pins: list[tuple[str, str]], python_version: str, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest),
                    *pip_target_args(python_version), *(f"{n}=={v}" for n, v in pins)], check=True)
    wheels = sorted(dest.glob("*.whl"))
    found = {canonical(w.name.split("-")[0]) for w in wheels}
    missing = sorted({n for n, _ in pins} - found)
    if missing:
        raise SystemExit(f"pip download gave no wheel for: {', '.join(missing)}")
    return wheels


def download_debs(dest: Path) -> list[Path]:
    """Debian's packages with `apt-get download` (this machine is Debian 12, as the stack's
    base image is)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", "-q", *REDIS_DEBS], cwd=dest, check=True,
                   stdout=subprocess.DEVNULL)
    return sorted(dest.glob("*.deb"))


def save_tokenizers(dest: Path) -> list[Path]:
    """Each (arch, preset)'s tokenizer files, tokenizer.json gzipped (a 1b vocabulary is
    10 MB of JSON, 1.8 MB gzipped)."""
    from tools.local_tokenizer import train_tokenizer
    from tools.model_presets import flavour, shape

    files = []
    for arch, preset in TOKENIZERS:
        folder = dest / f"{arch}-{preset}"
        folder.mkdir(parents=True, exist_ok=True)
        s = shape(arch, preset)
        train_tokenizer(s.vocab_size, s.corpus_chars, flavour(arch)).save_pretrained(folder)
        raw = folder / "tokenizer.json"
        with raw.open("rb") as src, gzip.open(folder / "tokenizer.json.gz", "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        files += sorted(folder.iterdir())
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu-bundle")
    p.add_argument("--python-version", default="3.12", help="the GPU image's Python (major.minor)")
    p.add_argument("--max-mib", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.dest.exists():
        shutil.rmtree(args.dest)
    image = image_packages()
    top = to_carry(stack_requirements(), image)
    pins = bundle_pins(resolve_all(top, args.python_version), image)
    wheels = download_wheels(pins, args.python_version, args.dest / "wheels")
    debs = download_debs(args.dest / "debs")
    tokenizers = save_tokenizers(args.dest / "tokenizers")
    files = [*wheels, *debs, *tokenizers]
    total = sum(f.stat().st_size for f in files)
    manifest = {
        "python_version": args.python_version, "platforms": PLATFORMS,
        "requirements": top, "carried_anyway": CARRY_ANYWAY, "left_out": LEFT_OUT,
        "files": {str(f.relative_to(args.dest)): f.stat().st_size for f in files},
        "total_bytes": total,
    }
    (args.dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for f in files:
        print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.relative_to(args.dest)}")
    print(f"{total / 2**20:8.2f} MiB  in all, in {args.dest} ({len(wheels)} wheels for CPython "
          f"{args.python_version}, {len(debs)} Debian packages, {len(TOKENIZERS)} tokenizers)")
    if total > args.max_mib * 2**20:
        print(f"over the {args.max_mib:g} MiB the lent machine can take with the working tree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
