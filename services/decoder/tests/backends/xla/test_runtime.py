"""The XLA runtime's environment: set once, before torch_xla starts, and never over the user's own."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.backends.xla import runtime

HAS_NEURON_SDK = importlib.util.find_spec("torch_neuronx") is not None


@pytest.mark.skipif(HAS_NEURON_SDK, reason="the Neuron SDK is installed here")
def test_without_the_neuron_sdk_the_graphs_run_on_xlas_cpu_device_with_one_virtual_device_each() -> None:
    environ: dict[str, str] = {}
    assert runtime.configure(4, environ) == "CPU"
    assert environ == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}


@pytest.mark.skipif(HAS_NEURON_SDK, reason="the Neuron SDK is installed here")
def test_the_virtual_devices_logged_are_the_ones_the_runtime_gets(caplog: pytest.LogCaptureFixture) -> None:
    """With CPU_NUM_DEVICES=2 it said "4 virtual devices" for --world-size 4, then refused the 2."""
    assert runtime.pjrt_device({}) == "CPU"  # and sets nothing: the decoder asks before it listens
    with caplog.at_level(logging.INFO):
        runtime.configure(4, {"CPU_NUM_DEVICES": "2"})
    assert "(PJRT_DEVICE=CPU, 2 virtual devices)" in caplog.text


def test_a_device_count_the_users_cpu_num_devices_does_not_give_is_refused_naming_the_world_size() -> None:
    with pytest.raises(ConfigError) as refused:
        runtime.check_device_count(4, {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"})
    assert refused.value.field == "world_size"
    runtime.check_device_count(2, {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"})
    runtime.check_device_count(4, {"PJRT_DEVICE": "CPU"})  # ours to set
    runtime.check_device_count(4, {"PJRT_DEVICE": "NEURON", "CPU_NUM_DEVICES": "2"})  # not the CPU's


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
