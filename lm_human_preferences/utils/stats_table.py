"""Ours: the table of stats core.record_stats prints every log_interval (the original's log_stats printed a
`k =  ..., v =  ...` line per stat)."""

import torch


def to_float(v):
    if isinstance(v, torch.Tensor):
        return v.detach().float().item()
    return float(v)


def format_table(means, step):
    """The stats table record_stats prints: one row a metric, sorted by name, after the step."""
    rows = [('step', str(step))] + [(k, f'{v:.6g}') for k, v in sorted(means.items())]
    kw = max(len(k) for k, _ in rows)
    vw = max(len(v) for _, v in rows)
    line = '-' * (kw + vw + 7)
    return '\n'.join([line] + [f'| {k:<{kw}} | {v:>{vw}} |' for k, v in rows] + [line])
