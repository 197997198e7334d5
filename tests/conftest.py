"""Suite-wide: the report header names the torch thread count and the CPU's vector ISA.

Both change which BLAS kernels run (and so the rounding of products of different shapes); the
suite must pass with any of them (``OMP_NUM_THREADS=1 make test`` and ``OMP_NUM_THREADS=2 make
test``), which is why cross-shape comparisons use tests/_tolerance.py and never bit-equality.
"""

from __future__ import annotations

from pathlib import Path


def _isa() -> str:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "pre-avx2"


def pytest_report_header(config) -> str:  # noqa: ANN001 - pytest hook signature
    import torch

    return f"torch {torch.__version__}: {torch.get_num_threads()} intra-op threads, CPU ISA {_isa()}"


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook signature
    """Ctrl-C as a terminal delivers it, whatever the runner: a runner started in the background of a
    non-interactive shell (``nohup ... &``) inherits SIGINT ignored, and then neither this process nor the
    ``posttrain train`` children the interrupt tests start would see one (posttrain installs no handler for an
    ignored SIGINT: posttrain/loop/interrupt.py). Python's own handler is restored so those tests test Ctrl-C."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
