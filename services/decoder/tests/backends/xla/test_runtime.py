"""The XLA runtime's environment: set once, before torch_xla starts, and never over the user's own."""

from __future__ import annotations

import importlib.util

import pytest

from tandem.decoder.backends.xla import runtime

HAS_NEURON_SDK = importlib.util.find_spec("torch_neuronx") is not None


@pytest.mark.skipif(HAS_NEURON_SDK, reason="the Neuron SDK is installed here")
def test_without_the_neuron_sdk_the_graphs_run_on_xlas_cpu_device_with_one_virtual_device_each() -> None:
    environ: dict[str, str] = {}
    assert runtime.configure(4, environ) == "CPU"
    assert environ == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}


def test_the_users_own_device_and_device_count_are_kept() -> None:
    environ = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}
    assert runtime.configure(2, environ) == "CPU"
    assert environ["CPU_NUM_DEVICES"] == "8"  # the runtime then refuses the mismatch, naming both
    neuron = {"PJRT_DEVICE": "NEURON"}
    assert runtime.configure(2, neuron) == "NEURON"
    assert neuron == {"PJRT_DEVICE": "NEURON", "NEURON_RT_NUM_CORES": "2"}


@pytest.mark.skipif(runtime.is_installed(), reason="torch_xla is installed here")
def test_without_torch_xla_starting_says_what_to_install() -> None:
    with pytest.raises(runtime.XlaUnavailable, match=r"make setup-xla"):
        runtime.start(1, {"PJRT_DEVICE": "CPU"})
