"""Alec's transformer model (GPT-2): a PyTorch port of the original language/model.py.

Parameters keep the original TF variable names, with '/' -> '.' and 'h<i>' -> 'h.<i>', and the TF
layouts, except that the 1x1-convolution weights lose their leading axis of size 1:

    TF  model/wte                 [n_vocab, n_embd]  ->  wte
    TF  model/h3/attn/c_attn/w    [1, nx, nf]        ->  h.3.attn.c_attn.w   [nx, nf]   (x @ w + b)
    TF  model/heads/value/w, /b   [n_embd], []       ->  heads.value.w, heads.value.b

so converting a TF checkpoint (language/convert_tf.py) is a rename plus a squeeze.

Ours, for speed on a GPU, where every op dispatched costs some microseconds whatever its size: a block is
about a dozen ops (one fused layer norm, one matmul with its bias per projection, SDPA, GELU, the residual
adds), the blocks work on rows of tokens [b*s, e] so that no reshape is needed between projections, and the
attention mask is built once per call for all layers. The KV cache is preallocated with all its bookkeeping
on the device, so that a decoding step has fixed shapes and reads nothing on the host: a CUDA graph can
capture it (language/sample.py).

Shapes in comments: b = batch, s = new tokens in this call, c = the KV cache's capacity (positions),
e = n_embd, nh = n_head, d = e // nh.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lm_human_preferences.language import bf16
from lm_human_preferences.utils import cpu, hyperparams


@dataclass
class HParams(hyperparams.HParams):
    # Encoding (set during loading process)
    n_vocab: int = 0

    # Model parameters
    n_ctx: int = 512
    n_embd: int = 768
    n_head: int = 12
    n_layer: int = 12

    # Accepted for compatibility with the original's hparams files. The original applied dropout only
    # with do_dropout=True, which none of its callers ever passed, so dropout is never applied here.
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    head_pdrop: float = 0.1


def gelu(x):
    # The tanh approximation, as the original: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))).
    return F.gelu(x, approximate='tanh')


def norm(x, g, b, *, epsilon=1e-5):
    """Normalize to mean = 0, std = 1, then do a diagonal affine transform.

    Ours: F.layer_norm, one fused op where the original's formula is eleven. It computes the variance as
    E[(x - E[x])^2]; the original computed E[x^2] - E[x]^2, which rounds differently in fp32 (a few 1e-7
    relative; tests/test_parity.py holds at its 1e-5 against the original's equations in float64).
    """
    if x.device.type == 'cpu' and torch.is_grad_enabled() and cpu.fewer_results_threads() is not None:
        return _LayerNormBackwardOnResultsThreads.apply(x, g, b, epsilon)
    return F.layer_norm(x, x.shape[-1:], g, b, epsilon)


class _LayerNormBackwardOnResultsThreads(torch.autograd.Function):
    """Ours: F.layer_norm with its backward on cpu.results_threads' threads: its gradients depend on the thread
    count (utils/cpu.py). The same kernels: the forward bit for bit, the backward as on that many threads."""

    @staticmethod
    def forward(ctx, x, g, b, epsilon):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, x.shape[-1:], g, b, epsilon)
        ctx.save_for_backward(x, mean, rstd, g, b)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, mean, rstd, g, b = ctx.saved_tensors
        with cpu.on_results_threads():
            grad_x, grad_g, grad_b = torch.ops.aten.native_layer_norm_backward(
                grad_y, x, x.shape[-1:], mean, rstd, g, b, ctx.needs_input_grad[:3])
        return grad_x, grad_g, grad_b, None


def attention_mask(nd, ns, *, device=None):
    """1's (True) in the lower triangle, counting from the lower right corner: query i of the last nd
    positions may attend to key j of all ns positions iff j <= i + ns - nd."""
    i = torch.arange(nd, device=device)[:, None]
    j = torch.arange(ns, device=device)
    return i >= j - ns + nd


# The original's masked-out attention logit: w * b - 1e10 * (1 - b). Added to the scores of masked keys, it
# leaves exp(score - max) exactly 0 in fp32, as the original's product did.
MASKED = -1e10


class LayerNorm(nn.Module):
    def __init__(self, n_state):
        super().__init__()
        self.g = nn.Parameter(torch.ones(n_state))
        self.b = nn.Parameter(torch.zeros(n_state))

    def forward(self, x):
        return norm(x, self.g, self.b)


class Conv1x1(nn.Module):
    """The original's conv1x1: x @ w + b with w stored [nx, nf] (TF's [1, nx, nf] squeezed)."""

    def __init__(self, nx, nf, *, w_init_stdev):
        super().__init__()
        self.w = nn.Parameter(torch.randn(nx, nf) * w_init_stdev)
        self.b = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        # x [n, nx] -> [n, nf]: one op on the TF layout (x @ w + b is addmm's own form), no transpose. In bf16
        # mode the weights' bf16 copies are made once per update, not by autocast in every call (bf16.py).
        return torch.addmm(bf16.cast_once(self.b), x, bf16.cast_once(self.w))


class KVCache:
    """Keys and values of every layer for the positions seen so far (the original's `past`), in buffers
    preallocated for `capacity` positions, written in place.

    The original returned only each call's keys and values (`present`) and its sampler concatenated them
    onto `past` every step, copying the whole cache per token, and took the past tokens again (past_tokens)
    to find the pads in it. Here `present` is the cache itself, and it keeps, on the device, everything a
    later call needs: which positions hold a real token, how many real tokens there are (the next position
    id) and how many positions are written (where the next keys go). A call that extends it therefore has
    fixed shapes and reads nothing on the host. Extending one cache twice overwrites the first extension.
    """

    def __init__(self, keys: List[torch.Tensor], values: List[torch.Tensor], real, n_real, length):
        self.keys = keys      # n_layer x [b, nh, c, d] in attention's dtype; unwritten positions are 0
        self.values = values  # n_layer x [b, nh, c, d]
        self.real = real      # [b, c] bool: True where a real token's keys are (False: a pad, or not written)
        self.n_real = n_real  # [b] long: real tokens so far, the position id of the next one
        self.length = length  # [1] long: positions written, where the next call's keys go

    @property
    def capacity(self):
        return self.real.shape[1]

    @classmethod
    def empty(cls, hparams: HParams, batch, capacity, *, device, dtype=torch.float32):
        d = hparams.n_embd // hparams.n_head
        # Zeros, not empty: a masked key's score must be finite (0 * -1e10 terms), its value 0 (weight 0).
        buffers = [torch.zeros(batch, hparams.n_head, capacity, d, device=device, dtype=dtype)
                   for _ in range(2 * hparams.n_layer)]
        return cls(buffers[0::2], buffers[1::2], torch.zeros(batch, capacity, dtype=torch.bool, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device))

    @classmethod
    def from_stacked(cls, past, *, past_tokens=None, padding_token=None, room=0):
        """From the original's layout past_shape(): [b, n_layer, 2 (k, v), nh, p, d], with room for `room`
        more positions. past_tokens: the tokens of those p positions, whose pads (padding_token) are then
        never attended to (the original passed them with every call)."""
        b, n_layer, _, nh, p, d = past.shape
        hparams = HParams(n_vocab=1, n_embd=nh * d, n_head=nh, n_layer=n_layer)
        cache = cls.empty(hparams, b, p + room, device=past.device, dtype=past.dtype)
        for layer in range(n_layer):
            cache.keys[layer][:, :, :p] = past[:, layer, 0]
            cache.values[layer][:, :, :p] = past[:, layer, 1]
        real = torch.ones(b, p, dtype=torch.bool, device=past.device) if past_tokens is None \
            else past_tokens != padding_token
        cache.real[:, :p] = real
        cache.n_real += real.sum(dim=1)
        cache.length += p
        return cache


class Attention(nn.Module):
    def __init__(self, hparams: HParams):
        super().__init__()
        n_state = hparams.n_embd
        if n_state % hparams.n_head != 0:
            raise ValueError(f'n_embd {n_state} is not a multiple of n_head {hparams.n_head}')
        self.n_head = hparams.n_head
        self.c_attn = Conv1x1(n_state, 3 * n_state, w_init_stdev=1 / math.sqrt(n_state))
        self.c_proj = Conv1x1(n_state, n_state, w_init_stdev=1 / math.sqrt(n_state * hparams.n_layer))

    def forward(self, x, *, batch, cache, write_at, attend_cache, bias, dtype=torch.float32):
        """x [b*s, e]. cache: this layer's (keys, values) buffers [b, nh, c, d] or None; this call's keys
        and values are written at positions write_at [s] of it. attend_cache: attend over the whole cache
        (a call that extends one) instead of this call's keys only. bias: [b, 1, s, s or c] additive mask
        (0 or MASKED), None for plain causal attention. dtype: attention's (bf16.attention_dtype)."""
        rows, e = x.shape
        s = rows // batch
        # SDPA with the additive mask is the original's softmax(w*b - 1e10*(1-b)), w = q k^T / sqrt(d). The
        # original computed it in fp32 (it cast q, k, v); ours: in bf16 mode on CUDA, bf16 (bf16.py). One cast of
        # all three (a no-op in fp32), and autocast switched off: it would pick bf16 itself.
        qkv = self.c_attn(x).to(dtype).view(batch, s, 3, self.n_head, e // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [b, nh, s, d] each
        with torch.autocast(device_type=x.device.type, enabled=False):
            if cache is not None:
                cache[0].index_copy_(2, write_at, k)
                cache[1].index_copy_(2, write_at, v)
                if attend_cache:
                    k, v = cache  # [b, nh, c, d]
            # Ours: on a CPU a single new token's attention over the cache depends on the thread count (utils/cpu.py)
            one_thread_bound = x.device.type == 'cpu' and s == 1 and attend_cache
            with cpu.on_results_threads() if one_thread_bound else contextlib.nullcontext():
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None)
        return self.c_proj(a.transpose(1, 2).reshape(rows, e))  # [b*s, e]


class MLP(nn.Module):
    def __init__(self, hparams: HParams):
        super().__init__()
        nx, n_hidden = hparams.n_embd, 4 * hparams.n_embd
        self.c_fc = Conv1x1(nx, n_hidden, w_init_stdev=1 / math.sqrt(nx))
        self.c_proj = Conv1x1(n_hidden, nx, w_init_stdev=1 / math.sqrt(n_hidden * hparams.n_layer))

    def forward(self, x):
        return self.c_proj(gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, hparams: HParams):
        super().__init__()
        self.ln_1 = LayerNorm(hparams.n_embd)
        self.attn = Attention(hparams)
        self.ln_2 = LayerNorm(hparams.n_embd)
        self.mlp = MLP(hparams)

    def forward(self, x, **attention):
        x = x + self.attn(self.ln_1(x), **attention)
        return x + self.mlp(self.ln_2(x))


class ScalarHead(nn.Module):
    """The original's fc_layer with an empty output shape: h @ w + b, w [n_embd], b a scalar."""

    def __init__(self, n_embd, *, w_init_stdev):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_embd) * w_init_stdev)
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, h):
        return torch.addmv(self.b, h, self.w)  # h [n, e] -> [n]


class Model(nn.Module):
    def __init__(self, hparams: HParams, scalar_heads=()):
        super().__init__()
        if hparams.n_vocab <= 0:
            raise ValueError(f'model hparams need n_vocab > 0, got {hparams.n_vocab}')
        self.hparams = hparams
        self.scalar_heads = list(scalar_heads)
        self.wpe = nn.Parameter(torch.randn(hparams.n_ctx, hparams.n_embd) * 0.01)
        self.wte = nn.Parameter(torch.randn(hparams.n_vocab, hparams.n_embd) * 0.02)
        self.h = nn.ModuleList([Block(hparams) for _ in range(hparams.n_layer)])
        self.ln_f = LayerNorm(hparams.n_embd)
        # The value head starts at zero (the original's scale=0), other heads at std 1/sqrt(n_embd + 1).
        self.heads = nn.ModuleDict({
            name: ScalarHead(hparams.n_embd, w_init_stdev=0 if name == 'value' else 1 / math.sqrt(hparams.n_embd + 1))
            for name in self.scalar_heads})
        # Ours: made once, sliced by every call (not part of the state dict).
        self.register_buffer('position_ids', torch.arange(hparams.n_ctx), persistent=False)
        self.register_buffer('causal', attention_mask(hparams.n_ctx, hparams.n_ctx), persistent=False)

    def forward(self, X, past: Optional[KVCache] = None, padding_token=None, output_positions=slice(None),
                lm_logits=True, return_present=True, room=0, check_inputs=True):
        """X: token ids [b, s]. past: the `present` of an earlier call on the preceding tokens, which this
        call extends in place (it must have room for s more positions).
        output_positions: the positions (a slice of the s new ones) that get logits and head outputs.
        lm_logits: False skips the n_vocab projection (a reward model reads only its head; TF's graph
        pruning skipped the unused logits the same way).
        return_present: False keeps no KV cache, for callers that will not extend the sequence (a cache is
        every layer's keys and values: 0.6 GB for a reward model's forward at batch 64, which TF's pruning
        also never kept). room: positions the returned cache keeps free for later calls (without past).
        check_inputs: False skips the checks that read values on the host (positions beyond n_ctx or the
        cache's room, rows starting with a pad): each would make a decoding step wait for the device.
        Policy.respond checks its contexts once before its loop instead.

        Returns lm_logits [b, o, n_vocab] fp32 (unless lm_logits=False), present (the KVCache, unless
        return_present=False and past is None), h [b, o, e] (the final hidden states the outputs read) and
        one [b, o] fp32 entry per scalar head, o being the number of output_positions (all s by default).
        """
        hp = self.hparams
        batch, sequence = X.shape
        if past is not None and len(past.keys) != hp.n_layer:
            raise ValueError(f'past has {len(past.keys)} layers, the model has {hp.n_layer}')
        X, real, positions = self._pads_and_positions(X, past, padding_token)  # real: [b, s] or None (no pads)
        if check_inputs:
            self._check_inputs(past, real, positions, sequence, padding_token)
        h = (F.embedding(X, self.wte) + F.embedding(positions, self.wpe)).view(batch * sequence, hp.n_embd)

        # Attention, the KV cache and the mask in attention's dtype (fp32; in bf16 mode on CUDA, bf16).
        dtype = bf16.attention_dtype(X.device.type)
        cache = past if past is not None or not return_present else \
            KVCache.empty(hp, batch, sequence + room, device=X.device, dtype=dtype)
        write_at = None if cache is None else self._extend(cache, real, sequence)  # [s]
        bias = self._attention_bias(past, real, write_at, sequence, dtype)  # [b, 1, s, keys] or None

        # Transformer
        for layer, block in enumerate(self.h):
            h = block(h, batch=batch, cache=None if cache is None else (cache.keys[layer], cache.values[layer]),
                      write_at=write_at, attend_cache=past is not None, bias=bias, dtype=dtype)
        results = {}
        if cache is not None:
            cache.length += sequence  # after the layers: write_at may be cache.length itself
            results['present'] = cache

        h = self._final_hidden(self.ln_f(h).view(batch, sequence, hp.n_embd), real, output_positions)
        results['h'] = h  # [b, o, e]
        results.update(self._outputs(h, lm_logits))
        return results

    def _pads_and_positions(self, X, past, padding_token):
        """Padding: pads are embedded as token 0, masked out as attention keys, do not count as positions, and
        take the final hidden state of the last real token before them. Returns (X with pads as 0, real [b, s]
        or None without a padding token, the position ids: [s] or [b, s])."""
        real = None
        if padding_token is not None:
            real = X != padding_token
            X = X * real
        # exclusive cumulative count of real tokens (after the cache's, if any)
        positions = self._arange(X.shape[1]) if real is None else torch.cumsum(real, dim=1) - real.long()
        if past is not None:
            positions = past.n_real[:, None] + positions  # [b, s]
        return X, real, positions

    def _extend(self, cache, real, sequence):
        """Record this call's tokens in the cache's bookkeeping; returns the positions write_at [s] where their
        keys and values go."""
        write_at = cache.length if sequence == 1 else cache.length + self._arange(sequence)
        cache.real.index_copy_(1, write_at, torch.ones_like(cache.real[:, :sequence]) if real is None else real)
        cache.n_real += sequence if real is None else real.sum(dim=1)
        return write_at

    def _attention_bias(self, past, real, write_at, sequence, dtype):
        """The additive mask [b, 1, s, keys] (0 or MASKED), made once for every layer: causal, and pads are never
        attended to. Extending a cache, the keys are all its positions, of which the unwritten ones are not real;
        then a single new token may see every real one. Without pads and cache: None (SDPA's is_causal).

        Ours: its rows are allocated for a multiple of 8 keys, the extra ones MASKED, and sliced to `keys`: CUDA's
        memory-efficient SDPA reads a mask whose strides (but the last) are multiples of 8 as it is, and pads any
        other (books' decoding steps attend over 87 keys, tldr's training pass 575) in every layer, keeping each
        padded copy for the backward. The same values: fp32 mode's results are unchanged, bit for bit."""
        visible = None
        if past is not None:
            visible = past.real[:, None, None, :]  # [b, 1, 1, c]
            if sequence > 1:
                visible = visible & (self._arange(past.capacity) <= write_at[:, None])  # [b, 1, s, c]
        elif real is not None:
            n_ctx = self.hparams.n_ctx
            causal = self.causal[:sequence, :sequence] if sequence <= n_ctx else \
                attention_mask(sequence, sequence, device=real.device)
            visible = causal & real[:, None, None, :]  # [b, 1, s, s]
        if visible is None:
            return None
        *rows, keys = visible.shape
        bias = visible.new_full((*rows, -(-keys // 8) * 8), MASKED, dtype=dtype)[..., :keys]
        return bias.masked_fill_(visible, 0.0)

    def _final_hidden(self, h, real, output_positions):
        """h [b, s, e] at output_positions [b, o, e]: for non-present tokens, the output from the last present
        token instead (only at the positions read). A single new token has no earlier one in this call: it is its
        own."""
        sequence = h.shape[1]
        if real is None or sequence == 1:
            return h[:, output_positions]
        last_real = torch.cummax(real * self._arange(sequence), dim=1).values[:, output_positions]  # [b, o]
        return h.gather(1, last_real[:, :, None].expand(-1, -1, h.shape[2]))

    def _outputs(self, h, lm_logits):
        """The logits [b, o, n_vocab] and each head's [b, o], in fp32 even under bf16 autocast: bf16 would round
        logits of size ~100 to steps of 0.5."""
        results = {}
        batch, outputs, e = h.shape
        # Only the positions the caller uses: the original computed the logits everywhere and sliced
        # them afterwards (same numbers), but the n_vocab projection is a large share of the FLOPs.
        # contiguous(): a matmul on a strided slice falls back to a batched matmul, 1.5-3.5x slower on CPU.
        h = h.float().contiguous().view(batch * outputs, e)
        if lm_logits:
            # Language model logits: the output embedding is wte (tied), no bias. Outside the block below: in
            # bf16 mode vocab_logits runs the product at the fast fp32 precision (TF32 or oneDNN's bf16 mode,
            # fp32 logits; bf16.py), and it reads the mode from autocast, which the block switches off.
            results['lm_logits'] = bf16.vocab_logits(h, self.wte).view(batch, outputs, self.hparams.n_vocab)
        with torch.autocast(device_type=h.device.type, enabled=False):
            for name, head in self.heads.items():
                results[name] = head(h).view(batch, outputs)
        return results

    def _arange(self, n):
        """arange(n) on the model's device, sliced from a buffer made once (more than n_ctx tokens can come
        with pads, which take no position)."""
        ids = self.position_ids
        return ids[:n] if n <= len(ids) else torch.arange(n, device=ids.device)

    def _check_inputs(self, past, real, positions, sequence, padding_token):
        """The checks that read values on the host (see forward's check_inputs)."""
        hp = self.hparams
        length = 0 if past is None else int(past.length)
        if past is not None and length + sequence > past.capacity:
            raise ValueError(f'past has room for {past.capacity - length} more positions, not {sequence}')
        if length + sequence > hp.n_ctx and (real is None or int(positions.max()) >= hp.n_ctx):
            raise ValueError(f'{length + sequence} tokens need positions beyond n_ctx = {hp.n_ctx}')
        if real is not None and not bool(real[:, 0].all()):
            rows = torch.nonzero(~real[:, 0]).flatten().tolist()
            raise ValueError(f'rows {rows} of X start with the padding token {padding_token}: a pad takes the '
                             f'hidden state of an earlier real token of the same call, so X[:, 0] must be real')
