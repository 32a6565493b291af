"""TF1's tf.train.AdamOptimizer, the original's optimizer, in torch (both trainers' and the offline pretraining's)."""

import numpy as np
import torch

_ADAM_CHUNK = 1 << 18  # values per AdamTF chunk: 1 MiB of fp32, a few of which fit in L2/L3 cache


class AdamTF(torch.optim.Optimizer):
    """Adam exactly as TF1's tf.train.AdamOptimizer (the original's optimizer, epsilon=1e-5).

    TF1 folds the bias corrections into the step size and adds epsilon to the *uncorrected* sqrt(v):
        lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
        m += (g - m) * (1 - beta1);  v += (g^2 - v) * (1 - beta2)
        var -= lr_t * m / (sqrt(v) + eps)
    torch.optim.Adam adds epsilon to the corrected sqrt(v_hat), which is a different update. The scalars
    are computed in float32 and beta^t is accumulated by repeated float32 multiplication, as TF does.

    Ours, two ways of running TF's kernel op for op (the same roundings, bit for bit):
    - foreach: each op once for a list of tensors, with torch's multi-tensor ops: a dozen kernel launches
      per step on CUDA, where one op per tensor would be 12 x 150 for GPT-2;
    - chunks: cache-sized chunks of one tensor with two reused scratch buffers. On CPU, whole-tensor
      temporaries are fresh parameter-sized buffers (wte's is 150 MiB) that every op faults in and streams
      through memory: GPT-2 124M's step takes 0.18 s in chunks, 0.54 s with foreach; a tiny model's 1 ms
      with foreach, 10 ms in chunks (benchmarks/adam.py).
    foreach=None (the default): foreach on CUDA; on CPU foreach for the tensors of at most one chunk, and
    chunks for the larger ones. True / False: foreach / chunks for every tensor.
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-5, foreach=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.foreach = foreach
        self._scratch_buffers = {}  # (device, dtype) -> [2, _ADAM_CHUNK]; not part of the state

    def _scratch(self, like):
        """Two buffers shaped like `like` for the update's temporaries."""
        if like.numel() > _ADAM_CHUNK:
            return torch.empty_like(like), torch.empty_like(like)
        key = (like.device, like.dtype)
        if key not in self._scratch_buffers:
            self._scratch_buffers[key] = torch.empty(2, _ADAM_CHUNK, dtype=like.dtype, device=like.device)
        a, b = self._scratch_buffers[key][:, :like.numel()]
        return a.view_as(like), b.view_as(like)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            f32 = np.float32
            beta1, beta2 = f32(group['betas'][0]), f32(group['betas'][1])
            # TF keeps one beta1_power/beta2_power pair per optimizer, starting at beta, multiplied by
            # beta after each step.
            beta1_power = f32(group.get('beta1_power', beta1))
            beta2_power = f32(group.get('beta2_power', beta2))
            lr_t = float(f32(group['lr']) * np.sqrt(f32(1) - beta2_power) / (f32(1) - beta1_power))
            c1, c2 = float(f32(1) - beta1), float(f32(1) - beta2)
            eps = float(f32(group['eps']))
            params = [p for p in group['params'] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state['m'] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state['v'] = torch.zeros_like(p, memory_format=torch.preserve_format)
            tensors = (params, [p.grad for p in params], [self.state[p]['m'] for p in params],
                       [self.state[p]['v'] for p in params])
            if self.foreach is None:
                foreach = [p.device.type == 'cuda' or p.numel() <= _ADAM_CHUNK for p in params]
            else:
                foreach = [self.foreach] * len(params)
            together = [[t for t, f in zip(ts, foreach) if f] for ts in tensors]
            if together[0]:
                self._update_foreach(*together, c1=c1, c2=c2, lr_t=lr_t, eps=eps)
            for var, grad, m, v, f in zip(*tensors, foreach):
                if not f:
                    self._update_chunks(var, grad, m, v, c1=c1, c2=c2, lr_t=lr_t, eps=eps)
            group['beta1_power'] = float(beta1_power * beta1)
            group['beta2_power'] = float(beta2_power * beta2)
        return loss

    @staticmethod
    def _update_foreach(params, grads, ms, vs, *, c1, c2, lr_t, eps):
        """TF's ApplyAdam kernel on all the tensors at once (lists), op for op."""
        a = torch._foreach_sub(grads, ms)  # m += (g - m) * (1 - beta1)
        torch._foreach_mul_(a, c1)
        torch._foreach_add_(ms, a)
        a = torch._foreach_mul(grads, grads)  # v += (g^2 - v) * (1 - beta2)
        torch._foreach_sub_(a, vs)
        torch._foreach_mul_(a, c2)
        torch._foreach_add_(vs, a)
        a = torch._foreach_mul(ms, lr_t)  # var -= lr_t m / (sqrt(v) + eps)
        b = torch._foreach_sqrt(vs)
        torch._foreach_add_(b, eps)
        torch._foreach_div_(a, b)
        torch._foreach_sub_(params, a)

    def _update_chunks(self, var, grad, m, v, *, c1, c2, lr_t, eps):
        """TF's ApplyAdam kernel on one tensor, op for op, on chunks of _ADAM_CHUNK values (contiguous
        tensors on CPU) with two reused scratch buffers."""
        pieces = (var, grad, m, v)
        if var.device.type == 'cpu' and all(t.is_contiguous() for t in pieces):
            pieces = [t.view(-1).split(_ADAM_CHUNK) for t in pieces]
        else:
            pieces = [(t,) for t in pieces]
        for var, grad, m, v in zip(*pieces):
            a, b = self._scratch(var)
            torch.sub(grad, m, out=a).mul_(c1)  # m += (g - m) * (1 - beta1)
            m.add_(a)
            torch.mul(grad, grad, out=a).sub_(v).mul_(c2)  # v += (g^2 - v) * (1 - beta2)
            v.add_(a)
            torch.mul(m, lr_t, out=a).div_(torch.sqrt(v, out=b).add_(eps))  # var -= lr_t m / (sqrt(v) + eps)
            var.sub_(a)
