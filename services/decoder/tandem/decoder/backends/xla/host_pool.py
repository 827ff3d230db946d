"""An XLA KV pool in the host's memory: checked against it before the runtime starts.

NOTE: why the devices count. Without the Neuron SDK the XLA device is the CPU (runtime.py), so the
pool is host memory, and the host check of a CPU pool (kv_pool.check_host_memory) never saw it: the
pool was mapped as the runtime asked, and the OOM killer ended the decoder. Each virtual device holds
its own share: the KV heads split over the devices where they divide (sharding.py), else every device
holds the pool whole. Measured with a model of 2 KV heads and a 1 GiB pool: peak RSS 1.97 GB at
--world-size 1, 1.98 GB at 2 (split; 3.05 GB with 2 GiB), 5.17 GB at 4 (whole on each): the runtime's
own ~0.9 GB beside 1, 1 and 4 pools. A split pool peaks at one pool only because the runner marks the
caches' sharding before it materializes them (xla_runner.py); materialized first, each device held it
whole until it was resharded (3.72 GB at 2, 6.61 GB with 2 GiB). At --world-size 64 the default
512 MiB pool took the host's 25 GB. On NeuronCores the pool is device memory, which the runtime
refuses itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from tandem.decoder.backends.xla import runtime
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.kv_pool import KvPoolUnallocated, check_host_memory


def splits_heads(model_config: ModelConfig, num_devices: int) -> bool:
    """Whether attention runs head-parallel over `num_devices`: query and KV heads divide evenly."""
    return model_config.num_heads % num_devices == 0 and model_config.num_kv_heads % num_devices == 0


def check_host_pool(
    model_config: ModelConfig, num_blocks: int, block_size: int, num_devices: int, environ: Mapping[str, str]
) -> None:
    """Refuses a pool of `num_blocks` whose copies on the XLA CPU device's `num_devices` virtual devices
    are more than the host's memory (or its cgroup's limit). Nothing where the device is not the host.
    Raises KvPoolUnallocated with the host's bytes."""
    if runtime.pjrt_device(environ) != "CPU":
        return
    c = model_config
    pool = 2 * c.num_layers * num_blocks * block_size * c.num_kv_heads * c.head_dim * c.dtype.itemsize
    is_split = splits_heads(c, num_devices)
    try:
        check_host_memory(num_blocks, pool if is_split else pool * num_devices)
    except KvPoolUnallocated as error:
        if num_devices == 1:
            held = "on its one virtual device"
        elif is_split:
            held = f"split over its {num_devices} virtual devices"
        else:
            held = (
                f"whole on each of its {num_devices} virtual devices (the model's {c.num_heads} query and "
                f"{c.num_kv_heads} KV heads do not divide over them)"
            )
        cause = f"{error.cause}: XLA's CPU device holds the pool there, {held}"
        raise KvPoolUnallocated(num_blocks, error.num_bytes, cause) from None
