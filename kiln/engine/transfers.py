"""Copies between host and device that do not stall a step.

A plain `.to(device)` of a host tensor, or `torch.tensor(list, device=...)`, copies from pageable memory and
waits for the device's stream: everything queued before it, the step's forward included. Sampling runs while
the device still computes that forward, so its small host-made tensors (grammar masks, logit biases, token
ids, per-row parameters) go through `to_device` instead, and what a step reads back goes through `to_host`,
its one device-to-host copy. On the host both are the identity.
"""

from __future__ import annotations

import torch

from kiln.platform import Platform


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host `tensor` on `device`, queued behind the device's work rather than waiting for it: staged in
    pinned memory on CUDA (which keeps the staging buffer until the copy has run)."""
    if Platform.of(device).on_host:
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to host memory: the copy is queued now, behind the work that
    computes them, and `wait` waits for it alone (on CUDA a copy into pinned memory and an event recorded after
    it, not on work queued later). On the host there is nothing to copy."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if Platform.of(tensor.device).on_host:
            self._host = tensor
        elif tensor.device.type != "cuda":
            self._host = tensor.to("cpu")
        else:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tensor.device))

    def wait(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values in host memory, once the device has computed them (HostCopy, waited for at once)."""
    return HostCopy(tensor).wait()
