"""Ours: what the bf16 mode (`run.bf16`, bf16 autocast) runs differently from fp32, for speed. The original ran
fp32 only; fp32 mode never reaches the code below (every function here returns its input unchanged when autocast
is off), so its outputs stay bit-identical to the TF-parity-tested path.

- Weights cast once: a weight's bf16 copy is made when the weight changes (an optimizer step, a load), not by
  autocast in every forward and microbatch; the gradient still reaches the fp32 weight (`cast_once`).
- Attention in bf16 on CUDA, where it is faster (attention_dtype: q, k, v, the mask and the KV cache).
- The n_vocab projection and its backward at tensor-core speed with fp32 logits: fp32 matmuls in TF32 on CUDA,
  in oneDNN's bf16 mode on a CPU that multiplies bf16 natively (`fast_fp32_matmuls`); bf16 logits would round
  logits of size ~100 to steps of 0.5.
- The policy's logprobs and entropies from the logits in one pass, a chunk of rows at a time, with no
  [tokens, n_vocab] tensor written but the logits and their gradient (`logprobs_and_entropies`).
"""

import contextlib

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lm_human_preferences.utils import cpu


def autocast_dtype(device_type):
    """The dtype autocast runs matmuls in on this device type, or None where it is off (fp32 mode)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


# Attention's dtype in bf16 mode where bf16 attention is the faster (measured: PORTING.md): on CUDA. On a CPU
# torch's bf16 attention is the slower, and attention stays fp32, as the original's.
ATTENTION_DTYPES = dict(cuda=torch.bfloat16)


def attention_dtype(device_type):
    """The dtype of attention, its KV cache and its mask on this device type: fp32, and in bf16 mode where bf16
    attention is faster (ATTENTION_DTYPES), bf16."""
    if autocast_dtype(device_type) is None:
        return torch.float32
    return ATTENTION_DTYPES.get(device_type, torch.float32)


def native_bf16_cpu():
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), as the libraries are allowed to (oneDNN's
    and ATen's instruction-set limits, LMHP_CPU_BF16=off: utils/cpu.py). Elsewhere oneDNN emulates it, slower
    than fp32."""
    return cpu.native_bf16()


# ---------------------------------------------------------------------------------------------------
# Weights cast once

# weight -> (its storage and version when cast, its copy in the autocast dtype). Weak and by identity: a model's
# copies go with it.
_casts = WeakIdKeyDictionary()


class _CastGradient(torch.autograd.Function):
    """Returns the copy; its gradient flows to the weight, in the weight's dtype (as autocast's cast does)."""

    @staticmethod
    def forward(ctx, weight, copy):
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def _cast_key(weight):
    """What a weight's copy was made from: its storage (device and address) and version. An in-place update (an
    optimizer step, load_state_dict) bumps the version; Module.to() / .cuda() and `param.data = ...` give the
    parameter new storage and keep its version."""
    return weight.device, weight.data_ptr(), weight._version


def cast_once(weight):
    """weight in autocast's dtype, from a copy made when the weight last changed (_cast_key), and only then cast
    again. Autocast casts a weight in every forward (it caches only within one autocast block, and only weights
    that require grad), so a PPO step cast the policy's weights once per microbatch and the frozen models' once
    per forward."""
    dtype = autocast_dtype(weight.device.type)
    if dtype is None or weight.dtype == dtype:
        return weight
    key, copy = _casts.get(weight, (None, None))
    if key != _cast_key(weight) or copy.dtype != dtype:
        with torch.no_grad():
            copy = weight.to(dtype)
        _casts[weight] = (_cast_key(weight), copy)
    if weight.requires_grad and torch.is_grad_enabled():
        return _CastGradient.apply(weight, copy)
    return copy


# ---------------------------------------------------------------------------------------------------
# fp32 matmuls at tensor-core speed

def _fast_fp32_precision(device_type):
    """torch's float32 matmul precision that runs fp32 matmuls faster on this device, or None: 'high' on CUDA
    (TF32: 10 mantissa bits in, fp32 accumulation); 'medium' on a CPU with native bf16 (oneDNN's bf16 mode: fp32
    in and out). torch.set_float32_matmul_precision keeps its old per-backend flags and its new ones in step
    (setting a backend's new flag alone makes cuBLAS refuse every matmul as a mix of the two)."""
    if device_type == 'cuda':
        return 'high'
    if device_type == 'cpu' and native_bf16_cpu():
        return 'medium'
    return None


@contextlib.contextmanager
def fast_fp32_matmuls(device_type):
    """fp32 matmuls in the block run at the device's faster precision (none: unchanged)."""
    fast = _fast_fp32_precision(device_type)
    if fast is None:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(fast)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class _FastLinear(torch.autograd.Function):
    """F.linear(h, w) (no bias) with the forward's and both backward products in fast_fp32_matmuls: the
    autograd engine runs a backward outside the caller's context manager, so the precision goes with the op."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        with torch.autocast(h.device.type, enabled=False), fast_fp32_matmuls(h.device.type):
            return h @ w.t()

    @staticmethod
    def backward(ctx, grad):
        h, w = ctx.saved_tensors
        with torch.autocast(h.device.type, enabled=False), fast_fp32_matmuls(h.device.type):
            grad_h = grad @ w if ctx.needs_input_grad[0] else None
            grad_w = grad.t() @ h if ctx.needs_input_grad[1] else None
        return grad_h, grad_w


def vocab_logits(h, wte):
    """The n_vocab projection h [n, e] @ wte.T, fp32 logits [n, n_vocab]: in fp32 mode exactly F.linear, in
    bf16 mode at the device's fast fp32 precision. It tells the modes apart by autocast: call it where the
    caller's autocast is in force, not inside a block that switches autocast off."""
    if autocast_dtype(h.device.type) is None:
        return torch.nn.functional.linear(h, wte)
    return _FastLinear.apply(h.float(), wte)


# ---------------------------------------------------------------------------------------------------
# Logprobs and entropies in one pass over the logits

# Rows per product and rows per pass, as bytes of their fp32 logits. Products of many rows: on a CPU oneDNN's bf16
# mode converts the whole embedding for each. Passes (max, exp, sums) of few rows on a CPU, so that their chunk
# stays in cache; on a GPU the product's rows (smaller chunks would cost more launches than they save).
PRODUCT_BYTES = dict(cpu=1 << 28, cuda=1 << 30)
PASS_BYTES = dict(cpu=1 << 23)


def _chunks(rows, n_vocab, chunk_bytes, device_type, start=0):
    step = max(1, chunk_bytes.get(device_type, PRODUCT_BYTES['cuda']) // (4 * n_vocab))
    return [slice(i, min(i + step, rows)) for i in range(start, rows, step)]


class _LogprobsEntropies(torch.autograd.Function):
    """(logprobs of labels, entropies) of the logits h @ w.T * beta: the logits are written once (kept for the
    backward), a product of many rows at a time; each pass over them (max, exp, sums) runs on a few rows while they
    are in cache; the backward writes d logits once, a pass's rows at a time, and multiplies it into d h and d w a
    product's rows at a time. The entropy has no gradient (no loss of the original differentiates one)."""

    @staticmethod
    def forward(ctx, h, w, labels, beta):
        rows, n_vocab, device = h.shape[0], w.shape[0], h.device.type
        logits = h.new_empty(rows, n_vocab)
        lse = h.new_empty(rows)  # logsumexp of the scaled logits
        logprobs, entropies = h.new_empty(rows), h.new_empty(rows)
        with torch.autocast(device, enabled=False), fast_fp32_matmuls(device):
            for product in _chunks(rows, n_vocab, PRODUCT_BYTES, device):
                torch.mm(h[product], w.t(), out=logits[product])
                for r in _chunks(product.stop, n_vocab, PASS_BYTES, device, start=product.start):
                    z = logits[r]  # [c, n_vocab]
                    top = z.amax(dim=1, keepdim=True)
                    p = torch.sub(z, top).mul_(beta).exp_()  # exp(beta (z - max)), unnormalized
                    total = p.sum(dim=1)
                    lse[r] = top[:, 0] * beta + total.log()
                    pz = p.mul_(z).sum(dim=1)  # in place: p is not needed again
                    entropies[r] = lse[r] - beta * pz / total
                    logprobs[r] = beta * z.gather(1, labels[r, None])[:, 0] - lse[r]
        ctx.save_for_backward(h, w, labels, logits, lse)
        ctx.beta = beta
        ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    def backward(ctx, grad_logprobs, _):
        h, w, labels, logits, lse = ctx.saved_tensors
        beta, device, n_vocab = ctx.beta, h.device.type, w.shape[0]
        grad_h, grad_w = torch.empty_like(h), torch.empty_like(w)
        products = _chunks(h.shape[0], n_vocab, PRODUCT_BYTES, device)
        grad_z = logits.new_empty(products[0].stop - products[0].start, n_vocab)
        with torch.autocast(device, enabled=False), fast_fp32_matmuls(device):
            for product in products:
                for r in _chunks(product.stop, n_vocab, PASS_BYTES, device, start=product.start):
                    # d logprob / d z = beta (one-hot(label) - softmax(beta z))
                    g = grad_logprobs[r, None] * beta  # [c, 1]
                    out = grad_z[r.start - product.start:r.stop - product.start]
                    torch.mul(logits[r], beta, out=out).sub_(lse[r, None]).exp_().mul_(-g)
                    out.scatter_add_(1, labels[r, None], g)
                    del out
                rows = grad_z[:product.stop - product.start]
                torch.mm(rows, w, out=grad_h[product])
                if product.start == 0:
                    torch.mm(rows.t(), h[product], out=grad_w)  # no zero-fill of the [n_vocab, e] gradient
                else:
                    grad_w.addmm_(rows.t(), h[product])
        return grad_h, grad_w, None, None


def logprobs_and_entropies(h, wte, labels, temperature):
    """The policy's logprobs of labels [n] and entropies [n] under the logits h [n, e] @ wte.T / temperature,
    in bf16 mode: the fp32 logits from the fast projection, never divided, log-softmaxed or exponentiated as
    whole [n, n_vocab] tensors (categorical.logprobs_and_entropies_from_logits, which fp32 mode keeps, writes each)."""
    return _LogprobsEntropies.apply(h.float().contiguous(), wte, labels.long(), 1.0 / temperature)
