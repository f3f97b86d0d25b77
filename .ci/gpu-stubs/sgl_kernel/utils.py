"""``sgl_kernel.utils`` stand-in: the one query SGLang's Triton attention backend makes at start-up, answered from the
device (programmatic dependent launch exists from compute capability 9.0, Hopper, on)."""

import torch


def is_arch_support_pdl() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
