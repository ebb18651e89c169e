"""What this CPU computes natively, read from /proc/cpuinfo (no torch: the benchmark prints
it too): the flags that decide which dtype a worker serves in and which matmul path
oneDNN takes.

    bf16 natively   x86 `avx512_bf16` (AVX512-BF16 dot products) or `amx_bf16` (AMX tiles);
                    Arm `bf16`
    fp16 natively   x86 `avx512_fp16` or `amx_fp16`; Arm `asimdhp`
    int8 dot        x86 `avx512_vnni` / `avx_vnni` (VNNI) or `amx_int8`; Arm `asimddp`

Elsewhere a bf16 or fp16 matmul is emulated in fp32 and is slower than fp32 itself, so
`--dtype auto` serves fp32 there (modeling/loader.py: resolve_dtype).
"""

import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16", "asimdhp"})
INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})
# The flags a benchmark table names, in this order, when the CPU has them.
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
               "amx_int8", "amx_fp16", "asimddp", "bf16")


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # "Intel(R) Xeon(R) Platinum 8480+", "AMD EPYC 9R14", ...
    flags: frozenset[str]
    num_cpus: int

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & BF16_FLAGS)

    @property
    def native_fp16(self) -> bool:
        return bool(self.flags & FP16_FLAGS)

    @property
    def int8_dot(self) -> bool:
        return bool(self.flags & INT8_FLAGS)

    @property
    def flags_line(self) -> str:
        """The CPU's own flags line (what a library compiled with -march=native depends on)."""
        return " ".join(sorted(self.flags))

    def describe(self) -> str:
        """One line for logs and benchmark tables: model, CPUs, the flags that matter."""
        shown = [f for f in SHOWN_FLAGS if f in self.flags]
        return f"{self.model}, {self.num_cpus} CPUs, flags: {' '.join(shown) or 'none of ' + ' '.join(SHOWN_FLAGS)}"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """CpuFeatures of a /proc/cpuinfo text (x86 `flags`/`model name`, Arm `Features`)."""
    model, flags, num_cpus = "", frozenset(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            num_cpus += 1
        elif key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model or platform.processor() or platform.machine(), flags, max(num_cpus, 1))


def cpu_features(path: Path = CPUINFO) -> CpuFeatures:
    """This machine's CpuFeatures (no flags where /proc/cpuinfo cannot be read)."""
    try:
        return parse_cpuinfo(path.read_text())
    except OSError:
        return CpuFeatures(platform.processor() or platform.machine(), frozenset(), 1)
