"""Alec's transformer model (GPT-2): a PyTorch port of the original language/model.py.

Parameters keep the original TF variable names, with '/' -> '.' and 'h<i>' -> 'h.<i>', and the TF
layouts, except that the 1x1-convolution weights lose their leading axis of size 1:

    TF  model/wte                 [n_vocab, n_embd]  ->  wte
    TF  model/h3/attn/c_attn/w    [1, nx, nf]        ->  h.3.attn.c_attn.w   [nx, nf]   (x @ w + b)
    TF  model/heads/value/w, /b   [n_embd], []       ->  heads.value.w, heads.value.b

so converting a TF checkpoint (language/convert_tf.py) is a rename plus a squeeze.

Shapes in comments: b = batch, s = new tokens in this call, p = tokens already in the KV cache,
t = p + s, e = n_embd, nh = n_head, d = e // nh.
"""

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import hyperparams


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

    The variance is computed as the original computes it, E[x^2] - E[x]^2 (F.layer_norm subtracts the
    mean first, which rounds differently).
    """
    s = torch.mean(torch.square(x), dim=-1, keepdim=True)
    u = torch.mean(x, dim=-1, keepdim=True)
    s = s - torch.square(u)
    x = (x - u) * torch.rsqrt(s + epsilon)
    return x * g + b


def attention_mask(nd, ns, *, device=None):
    """1's (True) in the lower triangle, counting from the lower right corner: query i of the last nd
    positions may attend to key j of all ns positions iff j <= i + ns - nd."""
    i = torch.arange(nd, device=device)[:, None]
    j = torch.arange(ns, device=device)
    return i >= j - ns + nd


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
        # F.linear (not `x @ w + b`) so that bf16 autocast casts the bias too and keeps bf16 outputs.
        w = self.w.t()  # [nf, nx], a view
        if torch.is_autocast_enabled(x.device.type):
            # Autocast would copy w to bf16 anyway, keeping the view's strides, and CPUs without native
            # bf16 (AVX2) then take a matmul path 17x slower than for a contiguous [nf, nx] weight (c_attn
            # at 576 rows: 1.8 s against 0.1 s). This is the same one copy, made contiguous.
            w = w.to(torch.get_autocast_dtype(x.device.type), memory_format=torch.contiguous_format)
        return F.linear(x, w, self.b)


class KVCache:
    """Keys and values of every layer for the first `length` positions (the original's `past`).

    The original returned only this call's keys/values (`present`) and its sampler concatenated them
    onto `past` every step, copying the whole cache per token. Here `present` is the cache itself:
    per-layer buffers with room to grow (doubling), into which new positions are written in place when
    gradients are off, so a decoding step costs no copy of the context. Extending one cache twice
    reuses the same storage: only the latest extension is valid. With gradients on (never needed by
    the trainers) buffers are extended by concatenation, which autograd can track.
    """

    def __init__(self, keys: List[torch.Tensor], values: List[torch.Tensor], length: int):
        self.keys = keys  # n_layer x [b, nh, capacity, d]; positions >= length are unused
        self.values = values
        self.length = length

    @classmethod
    def from_stacked(cls, past):
        """From the original's layout past_shape(): [b, n_layer, 2 (k, v), nh, p, d]."""
        return cls(list(past[:, :, 0].unbind(1)), list(past[:, :, 1].unbind(1)), past.shape[-2])


def _extend(buf, length, new):
    """Write new [b, nh, s, d] at positions [length, length + s) of buf [b, nh, capacity, d]; return
    a buffer (buf itself when it has room) whose first length + s positions are valid."""
    end = length + new.shape[2]
    if torch.is_grad_enabled():
        return torch.cat([buf[:, :, :length], new], dim=2)
    if end > buf.shape[2]:
        grown = buf.new_empty(buf.shape[:2] + (max(end, 2 * buf.shape[2]),) + buf.shape[3:])
        grown[:, :, :length] = buf[:, :, :length]
        buf = grown
    buf[:, :, length:end] = new
    return buf


class Attention(nn.Module):
    def __init__(self, hparams: HParams):
        super().__init__()
        n_state = hparams.n_embd
        if n_state % hparams.n_head != 0:
            raise ValueError(f'n_embd {n_state} is not a multiple of n_head {hparams.n_head}')
        self.n_head = hparams.n_head
        self.c_attn = Conv1x1(n_state, 3 * n_state, w_init_stdev=1 / math.sqrt(n_state))
        self.c_proj = Conv1x1(n_state, n_state, w_init_stdev=1 / math.sqrt(n_state * hparams.n_layer))

    def forward(self, x, *, past, past_length, mask):
        # x [b, s, e]; past: (keys, values) buffers [b, nh, >=p, d] or None; mask: bool [b, 1, s, t] or None
        b, s, e = x.shape
        q, k, v = self.c_attn(x).split(e, dim=2)  # each [b, s, e]
        q, k, v = (t.view(b, s, self.n_head, e // self.n_head).transpose(1, 2) for t in (q, k, v))  # [b, nh, s, d]
        if past is not None:
            k = _extend(past[0], past_length, k)  # [b, nh, >=t, d]
            v = _extend(past[1], past_length, v)
        present = (k, v)
        t = past_length + s
        k, v = k[:, :, :t], v[:, :, :t]  # [b, nh, t, d]

        # The original computes attention in fp32 whatever the activations' dtype (it casts q, k, v),
        # so autocast is switched off here. SDPA with a boolean mask equals the original's
        # softmax(w*b - 1e10*(1-b)) with w = q k^T / sqrt(d): exp(-1e10 - max) is exactly 0 in fp32.
        with torch.autocast(device_type=x.device.type, enabled=False):
            if mask is None and past is None:
                a = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            else:
                a = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        a = a.to(q.dtype).transpose(1, 2).reshape(b, s, e)  # [b, s, e]
        return self.c_proj(a), present


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

    def forward(self, x, *, past, past_length, mask):
        a, present = self.attn(self.ln_1(x), past=past, past_length=past_length, mask=mask)
        x = x + a
        m = self.mlp(self.ln_2(x))
        return x + m, present


class ScalarHead(nn.Module):
    """The original's fc_layer with an empty output shape: h @ w + b, w [n_embd], b a scalar."""

    def __init__(self, n_embd, *, w_init_stdev):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_embd) * w_init_stdev)
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, h):
        return h @ self.w + self.b


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

    def forward(self, X, past: Optional[KVCache] = None, past_tokens=None, padding_token=None,
                output_positions=slice(None), lm_logits=True, return_present=True, check_inputs=True):
        """X: token ids [b, s]. past: the `present` of an earlier call on the preceding tokens.
        past_tokens: those preceding tokens [b, p] (needed with padding_token, to mask pads in past).
        output_positions: the positions (a slice of the s new ones) that get logits and head outputs.
        lm_logits: False skips the n_vocab projection (a reward model reads only its head; TF's graph
        pruning skipped the unused logits the same way).
        return_present: False drops the keys and values as soon as each layer is done with them, for
        callers that will not extend the sequence (they hold every layer's c_attn output: 0.6 GB for a
        reward model's forward at batch 64, which TF's pruning also never kept).
        check_inputs: False skips the two checks that read token values on the host (positions beyond
        n_ctx with padding, rows starting with a pad): each would make a decoding step wait for the
        device. Policy.respond checks its contexts once before its loop instead.

        Returns lm_logits [b, o, n_vocab] fp32 (unless lm_logits=False), present (a KVCache of all t tokens,
        unless return_present=False), h [b, s, e] and
        one [b, o] fp32 entry per scalar head, o being the number of output_positions (all s by default).
        """
        hp = self.hparams
        batch, sequence = X.shape
        past_length = 0 if past is None else past.length
        if past is not None and len(past.keys) != hp.n_layer:
            raise ValueError(f'past has {len(past.keys)} layers, the model has {hp.n_layer}')

        # Padding: pads are embedded as token 0, masked out as attention keys, do not count as
        # positions, and take the final hidden state of the last real token before them.
        mask = None  # [b, t] True for real tokens
        if padding_token is not None:
            mask = X != padding_token
            X = torch.where(mask, X, torch.zeros_like(X))
            if past is not None:
                if past_tokens is None:
                    raise ValueError('padding_token requires past_tokens')
                if past_tokens.shape != (batch, past_length):
                    raise ValueError(f'past_tokens has shape {tuple(past_tokens.shape)}, '
                                     f'expected {(batch, past_length)} to match past')
                mask = torch.cat([past_tokens != padding_token, mask], dim=1)

        if mask is None:
            positions = past_length + torch.arange(sequence, device=X.device)[None, :]  # [1, s]
        else:
            # exclusive cumulative count of real tokens over past + current, sliced to the new ones
            positions = (torch.cumsum(mask, dim=1) - mask.long())[:, past_length:]  # [b, s]
        if past_length + sequence > hp.n_ctx and (mask is None or (check_inputs and int(positions.max()) >= hp.n_ctx)):
            raise ValueError(f'{past_length + sequence} tokens need positions beyond n_ctx = {hp.n_ctx}')
        h = F.embedding(X, self.wte) + F.embedding(positions, self.wpe)  # [b, s, e]

        # Attention mask [b, 1, s, t]: causal, and pads are never attended to. Without pads and past,
        # SDPA's is_causal is used instead; with one new token and no pads every key is visible.
        attn_mask = None
        if mask is not None:
            attn_mask = attention_mask(sequence, past_length + sequence, device=X.device)[None, None] \
                & mask[:, None, None, :]
        elif past is not None and sequence > 1:
            attn_mask = attention_mask(sequence, past_length + sequence, device=X.device)[None, None]

        # Transformer
        keys, values = [], []
        for layer, block in enumerate(self.h):
            layer_past = None if past is None else (past.keys[layer], past.values[layer])
            h, (k, v) = block(h, past=layer_past, past_length=past_length, mask=attn_mask)
            if return_present:
                keys.append(k)
                values.append(v)
        results = dict(present=KVCache(keys, values, past_length + sequence)) if return_present else {}

        h = self.ln_f(h)
        if mask is not None:
            # For non-present tokens, use the output from the last present token instead.
            present_indices = torch.where(mask[:, past_length:], torch.arange(sequence, device=X.device), -1)
            use_indices = utils.cumulative_max(present_indices)  # [b, s]
            if check_inputs and bool((use_indices[:, 0] < 0).any()):
                rows = torch.nonzero(use_indices[:, 0] < 0).flatten().tolist()
                raise ValueError(f'rows {rows} of X start with the padding token {padding_token}: a pad takes the '
                                 f'hidden state of an earlier real token of the same call, so X[:, 0] must be real')
            h = utils.index_each(h, use_indices)
        results['h'] = h

        # Output layer and heads in fp32 even under bf16 autocast: bf16 would round logits of size ~100
        # to steps of 0.5.
        with torch.autocast(device_type=h.device.type, enabled=False):
            # Only the positions the caller uses: the original computed the logits everywhere and sliced
            # them afterwards (same numbers), but the n_vocab projection is a large share of the FLOPs.
            # contiguous(): F.linear on a strided slice falls back to a batched matmul against an expanded
            # wte, 1.5-3.5x slower on CPU than one [b*o, e] x [e, n_vocab] matmul.
            h = h[:, output_positions].float().contiguous()
            if lm_logits:
                # Language model logits: the output embedding is wte (tied), no bias.
                results['lm_logits'] = F.linear(h, self.wte)  # [b, o, n_vocab]
            for name, head in self.heads.items():
                results[name] = head(h)  # [b, o]
        return results
