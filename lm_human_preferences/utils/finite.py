"""Ours: the non-finite guards. The original asserted np.isfinite on the normalization statistics only; a NaN
loss or gradient went into Adam and every later weight. The trainers check their losses, gradient norms and
rewards right where they are computed, before an update is applied or a state saved."""

import torch

from lm_human_preferences.utils import ranks


class NonFiniteError(FloatingPointError):
    """A loss, reward or gradient is NaN or infinite."""


def grad_norm(params):
    """The global L2 norm of the .grad of params (those with one), as a 0-d fp32 tensor (every tensor's norm
    in one multi-tensor op, then theirs)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())


def per_rank(name, values):
    """{name: value} for check_finite from one value per rank this process carries, each named for its
    rank where there are several ranks ('loss of rank 3')."""
    if ranks.get_world_size() == 1:
        return {name: values[0]}
    return {f'{name} of rank {r}': v for r, v in zip(ranks.local_ranks(), values)}


def check_finite(step, **metrics):
    """Raise NonFiniteError naming the step and the metric if any value (a number or a tensor) is NaN or
    infinite. Called before the optimizer step and before any save, so no bad state is ever applied or
    written: the last checkpoint stays the last good one."""
    for name, value in metrics.items():
        t = torch.as_tensor(value).detach()
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = t[~finite].flatten()
            where = '' if t.dim() == 0 else f' ({bad.numel()} of {t.numel()} values, e.g. {bad[0].item()})'
            value_str = f'{t.item()}' if t.dim() == 0 else 'non-finite'
            raise NonFiniteError(f'non-finite {name} at step {step}: {value_str}{where}; training stopped '
                                 f'(the checkpoints already written are kept)')
