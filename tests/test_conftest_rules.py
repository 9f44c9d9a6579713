"""tests/conftest.py's collection rule for a CUDA machine: tests that install megatron's CPU shims for the
whole process are skipped where the same run collects CUDA tests (which the shims would break)."""

from __future__ import annotations


def test_cpu_shim_tests_are_kept_apart_from_cuda_tests_in_one_run():
    from types import SimpleNamespace

    from conftest import keep_cpu_shims_apart

    def item(fixtures, marks=()):
        got = []
        return SimpleNamespace(fixturenames=fixtures, keywords=set(marks), add_marker=got.append, got=got)

    cpu, gpu, plain = item(["groups"]), item(["cuda_groups"], ["gpu"]), item([])
    keep_cpu_shims_apart([cpu, plain])
    assert not cpu.got  # no CUDA test collected: nothing to protect
    keep_cpu_shims_apart([cpu, gpu, plain])
    assert len(cpu.got) == 1 and "CPU shims" in cpu.got[0].kwargs["reason"] and not gpu.got and not plain.got
