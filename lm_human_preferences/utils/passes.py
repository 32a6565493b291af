"""Ours: how a model pass runs: on microbatches of at most run.microbatch_size rows, one after another, and
under bf16 autocast where run.bf16 turns it on (training/execution.py resolves both once)."""

import torch

from lm_human_preferences.utils import core


def microbatches(n, size):
    """Ours: slices [0, size), [size, 2 size), ... covering range(n), the pieces of a batch of n rows that
    a model pass of at most `size` rows takes one after another (run.microbatch_size); None: one piece."""
    if size is None or size >= n:
        return [slice(0, n)]
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def cat_pieces(pieces):
    """torch.cat of a list of tensors, or of dicts of tensors key by key; a single piece as it is."""
    if len(pieces) == 1:
        return pieces[0]
    if isinstance(pieces[0], dict):
        return {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}
    return torch.cat(pieces)


def microbatched(fn, size, *tensors):
    """Ours: fn(*tensors) computed on microbatches of at most `size` rows (microbatches) and concatenated;
    fn returns a tensor or a dict of tensors, rows first."""
    return cat_pieces([fn(*(t[piece] for t in tensors)) for piece in microbatches(len(tensors[0]), size)])


def autocast(enabled, device=None):
    """Ours, the one autocast helper: bf16 autocast on `device` (default: ours, core.get_device()) where enabled; a
    no-op block elsewhere (the original ran fp32; run.bf16 turns it on: training/execution.py)."""
    return torch.autocast(device_type=(device or core.get_device()).type, dtype=torch.bfloat16, enabled=enabled)
