"""The CPU kernels' build: a C kernel and its cffi binding compiled into one Python
extension module, cached per machine, and imported.

A kernel's one declaration (its .h: kernels/cpu_attention.h, kernels/cpu_sampling.h) is
included by its C source, and cffi generates the Python binding from the same text, so the
two are compiled against each other: a kernel that disagrees with its declaration does not
build. Both are compiled once per machine with the system C compiler (`cc`, or $CC) into
one extension module in a cache folder ($PAGEDSERVE_KERNEL_CACHE, default
~/.cache/pagedserve) keyed by the source, declaration, flags, interpreter and CPU; it
links the OpenMP runtime torch already loaded. The module is named after the source,
`_pagedserve_<stem>` (its PyInit_ symbol), so each kernel has its own.

Used by kernels/cpu_attention.py (the paged attention kernel, which also checks its
argument struct at load) and kernels/cpu_sampling.py (the sampler's exponential race).
"""

import contextlib
import hashlib
import importlib.util
import io
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import cffi

from kernels.cpu_features import cpu_features

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pagedserve")


def module_name(source: Path) -> str:
    """The extension module's name for kernel `source` (its PyInit_ symbol)."""
    return f"_pagedserve_{source.stem}"


def import_library(path: Path, source: Path):
    """The compiled module at `path` (built from `source`): its `ffi` and `lib`."""
    spec = importlib.util.spec_from_file_location(module_name(source), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_library(compiler: str | None = None, *, source: Path, header: Path,
                    extra_flags: tuple[str, ...] = ()) -> Path:
    """The kernel and its cffi binding as one Python extension module, for this source,
    declaration, flags, interpreter and CPU: built once (atomically: several workers may
    start at the same time), then reused. The binding is generated from `header` and
    compiled with the kernel, so a kernel that disagrees with its declaration fails here.
    RuntimeError if it cannot be built. (kernels/cpu_attention.py and kernels/cpu_sampling.py
    each build their kernel here: the module is named after the source, `_pagedserve_<stem>`.)"""
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC, or install gcc)")
    declaration, kernel = header.read_text(), source.read_text()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    flags = (*_FLAGS, *extra_flags)  # extra_flags: e.g. -mno-avx512f, to test the portable loops
    key = hashlib.sha256("\0".join([kernel, declaration, compiler, *flags, cffi.__version__, suffix,
                                    platform.machine(), cpu_features().flags_line]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}{suffix}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for path, text in ((header, declaration), (source, kernel)):  # side by side, for the include
            (Path(tmp) / path.name).write_text(text)
        binding = Path(tmp) / "binding.c"
        ffi = cffi.FFI()
        ffi.cdef(declaration)
        ffi.set_source(module_name(source), f'#include <stdint.h>\n#include "{header.name}"\n')
        with contextlib.redirect_stdout(io.StringIO()):  # cffi prints the file's name
            ffi.emit_c_code(str(binding))
        built = Path(tmp) / target.name
        proc = subprocess.run([compiler, *flags, f"-I{sysconfig.get_paths()['include']}", f"-I{tmp}",
                               str(binding), str(Path(tmp) / source.name), "-o", str(built), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the cpu kernel {source.name} failed (it needs Python's headers "
                               f"too: Debian's python3-dev):\n{proc.stderr[-2000:]}")
        os.replace(built, target)
    return target
