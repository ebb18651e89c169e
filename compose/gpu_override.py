"""`pagedserve compose-gpu`: a compose override file giving each worker its own GPU.

`--scale worker=N` cannot pin replicas to distinct GPUs (every replica gets the same device
reservation), so this writes one service per GPU, `worker-gpu<id>`, each the base file's
`worker` with `device_ids: [<id>]`, `--device cuda` and its KV cache sized from the GPU's
memory (`--gpu-memory-utilization`), built from the CUDA torch index and answering to the
name `worker` on the network (Prometheus's DNS discovery finds them all). The base file's
CPU `worker` is scaled to 0.

    pagedserve compose-gpu --gpus 4 > compose/docker-compose.gpu.yml
    docker compose -f compose/docker-compose.yml -f compose/docker-compose.gpu.yml up -d --scale worker=0
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

BASE_FILE = Path(__file__).resolve().parent / "docker-compose.yml"
CUDA_TORCH_INDEX = "https://download.pytorch.org/whl/cu128"


class _Dumper(yaml.SafeDumper):
    """Writes every service out in full: no `&id001` anchors for the shared build."""

    def ignore_aliases(self, data) -> bool:
        return True


def gpu_ids(text: str) -> list[str]:
    """'4' → the first four GPUs; '0,2,3' → those ids."""
    text = text.strip()
    ids = [str(i) for i in range(int(text))] if text.isdigit() else [i.strip() for i in text.split(",")]
    if not ids or any(not i.isdigit() for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: a count or distinct ids like 0,1,3")
    return ids


def gpu_command(command: list[str], utilization: float) -> list[str]:
    """The CPU worker's command on CUDA, its KV cache a share of the GPU."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
            continue
        if arg in ("--device", "--kv-cache-memory"):
            skip = True  # drop the flag and its value
            continue
        out.append(arg)
    return [*out, "--device", "cuda", "--gpu-memory-utilization", str(utilization)]


def gpu_override(base: dict, ids: list[str], utilization: float) -> dict:
    worker = base["services"]["worker"]
    build = copy.deepcopy(worker["build"])
    build["args"]["TORCH_INDEX"] = f"${{TORCH_INDEX:-{CUDA_TORCH_INDEX}}}"
    image = "pagedserve-worker-cuda:${TAG:-latest}"
    services: dict = {
        "worker": {"deploy": {"replicas": 0}},  # v1 ignores it: pass --scale worker=0
        "make-model": {"image": image, "build": build},  # one worker image to build, the CUDA one
    }
    for gpu in ids:
        service = copy.deepcopy(worker)
        service.update(
            image=image, build=build, command=gpu_command(worker["command"], utilization),
            deploy={"resources": {"reservations": {"devices": [
                {"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]}}},
            networks={"default": {"aliases": ["worker"]}},
        )
        services[f"worker-gpu{gpu}"] = service
    return {"services": services}


def write_override(ids: list[str], utilization: float, out=None, base_file: Path = BASE_FILE) -> None:
    out = out or sys.stdout
    base = yaml.safe_load(base_file.read_text())
    out.write(f"# Written by `pagedserve compose-gpu --gpus {','.join(ids)} --gpu-memory-utilization "
              f"{utilization}`; use with\n#   docker compose -f compose/docker-compose.yml "
              "-f compose/docker-compose.gpu.yml up -d --scale worker=0\n")
    yaml.dump(gpu_override(base, ids, utilization), out, Dumper=_Dumper, sort_keys=False, width=1000)
