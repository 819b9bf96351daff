import os

import pytest

# Comma-separated CPU flags (as /proc/cpuinfo names them) that this test run treats as absent,
# in the tests and in the backend they call alike: e.g. the AVX-512 and AMX flags, to run the
# suite as on CI's CPU from a machine that has them. Read here only, never by the package.
HIDDEN_CPU_FLAGS_ENV = "JACKFIELD_TEST_HIDE_CPU_FLAGS"


def pytest_configure(config: pytest.Config) -> None:
    hidden = frozenset(flag for flag in os.environ.get(HIDDEN_CPU_FLAGS_ENV, "").split(",") if flag)
    if not hidden:
        return
    from jackfield_cpu_amx import capabilities, native

    real_read_cpu_flags = capabilities.read_cpu_flags

    def read_cpu_flags_less_hidden(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
        """This machine's flags less the hidden ones; a file a test names is read as it is."""
        flags = real_read_cpu_flags(cpuinfo_path)
        return flags - hidden if cpuinfo_path == "/proc/cpuinfo" else flags

    patch = pytest.MonkeyPatch()
    for module in (capabilities, native):  # each imported the name
        patch.setattr(module, "read_cpu_flags", read_cpu_flags_less_hidden)
    # Answers cached before this point were computed from the real flags.
    capabilities.detected_amx_status.cache_clear()
    native.native_decode_kernel.cache_clear()
    config.add_cleanup(patch.undo)
