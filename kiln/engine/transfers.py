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


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values in host memory, once the device has computed them: on CUDA one copy into pinned
    memory and a wait on an event recorded after it (not on work queued later)."""
    if Platform.of(tensor.device).on_host:
        return tensor
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))
    copied.synchronize()
    return host
