"""torch_xla as the Neuron backend uses it: the PJRT device, SPMD, and what the runtime counts.

NOTE: Neuron is an XLA device. torch-neuronx is torch_xla's PJRT plugin for NeuronCores, so the graphs
this backend builds run with `PJRT_DEVICE=NEURON` on a Trn/Inf instance and with `PJRT_DEVICE=CPU`
anywhere else (every test here): the same program, compiled by neuronx-cc there and by XLA's CPU
compiler here. Several devices in one process are one SPMD program (sharding.py): NeuronCores there,
`CPU_NUM_DEVICES` virtual devices here.

The environment is read and set once, by `configure`, before torch_xla starts its runtime; nothing is
imported from torch_xla at import time, so the CPU and CUDA backends never load it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from types import ModuleType

from tandem.client.errors import ConfigError

log = logging.getLogger(__name__)

XLA_INSTALL = (
    "torch_xla is not installed in this environment: `make setup-xla` builds a virtual environment with "
    "torch 2.9.0 + torch-xla 2.9.0 and Tandem (then run .venv-xla/bin/tandem); on a Trn/Inf instance add "
    "the Neuron SDK's PJRT plugin: `pip install torch-neuronx neuronx-cc --extra-index-url "
    "https://pip.repos.neuron.amazonaws.com`"
)


class XlaUnavailable(RuntimeError):
    """torch_xla cannot run here; the message says what to install."""


@dataclass(frozen=True)
class XlaRuntime:
    """The started runtime: which PJRT device and how many of them the model spans."""

    pjrt_device: str  # "NEURON" or "CPU" (or another PJRT plugin the user chose)
    num_devices: int  # devices of the one SPMD program


def is_installed() -> bool:
    """Whether torch_xla can be imported, without importing it (it starts nothing)."""
    return importlib.util.find_spec("torch_xla") is not None


def pjrt_device(environ: Mapping[str, str] = os.environ) -> str:
    """The PJRT device the runtime will start on: the user's PJRT_DEVICE, else NEURON where the Neuron
    SDK is installed, else CPU (the host: XLA's CPU device). Sets nothing."""
    if "PJRT_DEVICE" in environ:
        return environ["PJRT_DEVICE"]
    return "NEURON" if importlib.util.find_spec("torch_neuronx") is not None else "CPU"


def configure(num_devices: int, environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets the PJRT environment for `num_devices` devices, unless the user set it. Returns the device.

    No PJRT_DEVICE: NEURON where the Neuron SDK is installed, else CPU (logged: nothing runs on
    Neuron hardware then). On CPU, `CPU_NUM_DEVICES` virtual devices; on Neuron, as many NeuronCores.
    """
    is_chosen = "PJRT_DEVICE" not in environ
    pjrt = environ["PJRT_DEVICE"] = pjrt_device(environ)
    if pjrt == "CPU":
        environ.setdefault("CPU_NUM_DEVICES", str(num_devices))
    elif pjrt == "NEURON":
        environ.setdefault("NEURON_RT_NUM_CORES", str(num_devices))
    if is_chosen and pjrt == "CPU":
        log.info(
            "--device neuron without the Neuron SDK: its XLA graphs run on XLA's CPU device "
            "(PJRT_DEVICE=CPU, %s virtual devices)",
            environ["CPU_NUM_DEVICES"],  # the user's, where set: start() refuses one that is not ours
        )
    return pjrt


def check_device_count(num_devices: int, environ: Mapping[str, str] = os.environ) -> None:
    """Refuses `num_devices` on XLA's CPU device where the user's own CPU_NUM_DEVICES gives it another
    count, before the runtime starts: `start` refuses it too, but only once the server listens. (On
    NeuronCores `start` counts what the runtime found, before anything is allocated: which cores a
    process gets is the Neuron runtime's to say.) Raises ConfigError naming world_size."""
    said = environ.get("CPU_NUM_DEVICES")
    if pjrt_device(environ) == "CPU" and said is not None and said != str(num_devices):
        raise ConfigError(
            "world_size",
            f"is {num_devices}, but CPU_NUM_DEVICES={said} gives XLA's CPU device that many virtual "
            "devices: set it to the world size, or unset it",
        )


def start(num_devices: int, environ: MutableMapping[str, str] = os.environ) -> XlaRuntime:
    """Configures and starts the runtime (SPMD for several devices). Raises XlaUnavailable.

    Call once per process, before any tensor is put on an XLA device.
    """
    pjrt = configure(num_devices, environ)
    xr = _import("torch_xla.runtime")
    if num_devices > 1:
        xr.use_spmd()  # before any device tensor exists: one program over every device
    found = xr.global_runtime_device_count()
    if found != num_devices:
        raise XlaUnavailable(
            f"--world-size {num_devices} needs {num_devices} {pjrt} devices, the runtime has {found} "
            f"(PJRT_DEVICE={pjrt}, CPU_NUM_DEVICES={environ.get('CPU_NUM_DEVICES', 'unset')})"
        )
    return XlaRuntime(pjrt_device=pjrt, num_devices=num_devices)


def device():  # -> torch.device
    """The XLA device tensors go to (under SPMD: the one virtual device the program spans)."""
    return _import("torch_xla").device()


def sync() -> None:
    """Ends the lazily recorded graph and runs it (compiling it the first time its shape is seen)."""
    _import("torch_xla").sync()


def wait() -> None:
    """Blocks until every transfer and graph this process started has finished: a weight sent to the
    device is not there yet when `.to()` returns, and only data that is there can be resharded."""
    _import("torch_xla.core.xla_model").wait_device_ops()


def num_compiles() -> int:
    """Graphs XLA compiled in this process so far (torch_xla's own CompileTime metric)."""
    data = _import("torch_xla.debug.metrics").metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def transferred_bytes() -> tuple[int, int]:
    """Bytes moved host -> device and device -> host so far. torch_xla names them from the host's side:
    OutboundData went to the device, InboundData came back."""
    metrics = _import("torch_xla.debug.metrics")
    to_device, from_device = metrics.metric_data("OutboundData"), metrics.metric_data("InboundData")
    return (0 if to_device is None else int(to_device[1]), 0 if from_device is None else int(from_device[1]))


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise XlaUnavailable(f"{exc}; {XLA_INSTALL}") from exc
