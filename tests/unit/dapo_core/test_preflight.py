"""The bfloat16 note: a bf16 rollout or bf16 actor compute on a CPU without bf16 instructions gets a note
before the run, naming the keys and the fix; CPUs with them, float32 settings and GPUs get none."""

from pathlib import Path

from dapo_core.compute.numerics import cpu_has_bf16
from dapo_core.config import load_config
from dapo_core.preflight import bf16_on_plain_cpu

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
SAPPHIRE = "flags\t\t: avx512f amx_bf16 amx_tile\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "smollm2_cpu.yaml"


def test_cpu_has_bf16_reads_the_flags():
    assert cpu_has_bf16(ZEN4) and cpu_has_bf16(SAPPHIRE) and cpu_has_bf16(GRAVITON3)
    assert cpu_has_bf16(SKYLAKE) is False
    assert cpu_has_bf16("model name: something\n") is None  # no flags line: unknown, no note


def _cfg(*over: str):
    return load_config(str(CONFIG), ["trainer.device=cpu", *over])


def test_bf16_rollout_on_a_cpu_without_bf16_gets_a_note_naming_the_key():
    note = bf16_on_plain_cpu(_cfg(), SKYLAKE)
    assert note is not None and "actor_rollout_ref.rollout.dtype=float32" in note
    assert bf16_on_plain_cpu(_cfg(), ZEN4) is None
    mp = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
    assert f"{mp}=float32" in note  # the config's actor computes in bf16 too
    rollout_only = bf16_on_plain_cpu(_cfg(f"{mp}=fp32"), SKYLAKE)
    assert rollout_only is not None and mp not in rollout_only
    assert bf16_on_plain_cpu(_cfg("actor_rollout_ref.rollout.dtype=float32", f"{mp}=fp32"), SKYLAKE) is None
    assert bf16_on_plain_cpu(_cfg("trainer.device=cuda"), SKYLAKE) is None
