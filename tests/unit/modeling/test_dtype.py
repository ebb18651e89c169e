"""Which dtype a worker serves in: `--dtype auto` is the checkpoint's where the CPU computes
it natively (its /proc/cpuinfo flags), fp32 elsewhere; a dtype named is taken as asked."""

import dataclasses
import logging

import pytest
import torch
from tests.support.runner_helpers import make_runner

from kernels.cpu_features import cpu_features, parse_cpuinfo
from modeling.loader import resolve_dtype
from modeling.registry import load_config

XEON = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8488C
flags		: fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8488C
flags		: fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
OLD_X86 = "processor	: 0\nmodel name	: Intel(R) Xeon(R) CPU E5-2680 v4\nflags		: fpu sse4_2 avx2\n"
GRAVITON = "processor	: 0\nFeatures	: fp asimd asimddp bf16 i8mm\nCPU implementer	: 0x41\n"


def test_cpuinfo_is_read_for_model_flags_and_cpus():
    xeon = parse_cpuinfo(XEON)
    assert xeon.model == "Intel(R) Xeon(R) Platinum 8488C" and xeon.num_cpus == 2
    assert xeon.native_bf16 and xeon.int8_dot and not xeon.native_fp16
    assert xeon.describe() == ("Intel(R) Xeon(R) Platinum 8488C, 2 CPUs, flags: avx2 avx512f "
                               "avx512_vnni avx512_bf16 amx_bf16 amx_int8")
    old = parse_cpuinfo(OLD_X86)
    assert not old.native_bf16 and not old.int8_dot and "none of" not in old.describe()
    arm = parse_cpuinfo(GRAVITON)
    assert arm.native_bf16 and arm.int8_dot and arm.model  # no model name line: the platform's
    assert parse_cpuinfo("").describe().endswith("flags: none of " + " ".join(
        ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8",
         "amx_fp16", "asimddp", "bf16")))


def test_this_machine_is_read():
    here = cpu_features()
    assert here.num_cpus >= 1 and here.model


@pytest.fixture
def bf16_config(family_model_dir):
    return dataclasses.replace(load_config(family_model_dir("llama")), dtype=torch.bfloat16)


def test_auto_serves_a_bf16_checkpoint_in_bf16_only_where_the_cpu_has_bf16(bf16_config):
    dtype, why = resolve_dtype("auto", bf16_config, "cpu", parse_cpuinfo(XEON))
    assert dtype == torch.bfloat16 and "native" in why and "amx_bf16" in why
    dtype, why = resolve_dtype("auto", bf16_config, "cpu", parse_cpuinfo(OLD_X86))
    assert dtype == torch.float32 and "not native" in why and "--dtype bfloat16" in why
    assert resolve_dtype("auto", bf16_config, "cpu", parse_cpuinfo(GRAVITON))[0] == torch.bfloat16
    fp16 = dataclasses.replace(bf16_config, dtype=torch.float16)
    assert resolve_dtype("auto", fp16, "cpu", parse_cpuinfo(XEON))[0] == torch.float32
    # an accelerator computes its checkpoint's dtype; an fp32 checkpoint stays fp32 anywhere
    assert resolve_dtype("auto", bf16_config, "cuda", parse_cpuinfo(OLD_X86))[0] == torch.bfloat16
    fp32 = dataclasses.replace(bf16_config, dtype=torch.float32)
    assert resolve_dtype("auto", fp32, "cpu", parse_cpuinfo(XEON))[0] == torch.float32


def test_a_named_dtype_is_taken_as_asked(bf16_config):
    assert resolve_dtype("bfloat16", bf16_config, "cpu", parse_cpuinfo(OLD_X86)) == (
        torch.bfloat16, "--dtype bfloat16")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", bf16_config)


def test_the_runner_logs_its_choice(family_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="worker_svc.model_runner"):
        runner = make_runner(family_model_dir("llama"), block_size=8, num_blocks=10, dtype="bfloat16")
    assert runner.dtype == torch.bfloat16
    assert "serving in bfloat16 (--dtype bfloat16)" in caplog.text
