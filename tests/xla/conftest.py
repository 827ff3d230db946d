"""The Neuron backend's tests, on XLA's CPU device: they run in .venv-xla (torch 2.9.0 + torch-xla
2.9.0), which `make test` creates and runs them in; elsewhere tests/conftest.py leaves them out.

The process's own engines span one XLA device; the servers these tests start choose their own count
(`--world-size`). XLA's CPU compiler runs at optimization level 0: the graphs are the same HLO, each
compiled in a fraction of the time (a test's cost is mostly compiling its buckets).
"""

from __future__ import annotations

import os

# Before torch_xla starts its runtime, which reads them once.
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
