"""How many CPU threads the reference engine's PyTorch uses."""

from __future__ import annotations

import os


def apply_threads(threads: int | None) -> int:
    """Set PyTorch's intra-op threads (default: every core) and return the count."""
    import torch

    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count
