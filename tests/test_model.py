"""Transformer model tests: the original's test_model.py cases, plus padding, KV cache and autocast."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lm_human_preferences.language import model


def _model(seed=7, scalar_heads=(), **hparams):
    torch.manual_seed(seed)
    hp = model.HParams()
    hp.override_from_dict(hparams)
    return model.Model(hparams=hp, scalar_heads=list(scalar_heads))


def test_incremental():
    """Decoding one token at a time from the cache gives the full forward's logits (original test)."""
    m = _model(n_vocab=10, n_ctx=5, n_embd=9, n_head=3, n_layer=2)
    batch_size, steps = 2, 5
    ids = torch.from_numpy(np.random.RandomState(7).randint(10, size=[batch_size, steps]))
    past = None
    for step in range(steps):
        logits = m(ids[:, :step + 1])['lm_logits']
        # Ours: the first call's cache keeps room for the later tokens (it is extended in place).
        past_lm = m(ids[:, step:step + 1], past=past, room=steps - 1 if past is None else 0)
        past = past_lm['present']
        assert past.length.item() == step + 1 and past.capacity == steps
        torch.testing.assert_close(logits[:, -1:], past_lm['lm_logits'], atol=1e-5, rtol=0)


def test_mask():
    """Pads inserted at random into the cached past and the new tokens change nothing (original test;
    the original passed an explicit mask, which our padding_token computes)."""
    rng = np.random.RandomState(7)
    m = _model(n_vocab=10, n_ctx=8, n_embd=3, n_head=3, n_layer=2)
    hp = m.hparams
    pad = 12
    batch_size = 4
    d_head = hp.n_embd // hp.n_head

    def past_shape(sequence):
        return [batch_size, hp.n_layer, 2, hp.n_head, sequence, d_head]

    # Random pasts and tokens
    past_length, length = 4, 3
    past = rng.randn(*past_shape(past_length)).astype(np.float32)
    X = rng.randint(hp.n_vocab, size=[batch_size, length])

    # Run model without gaps
    logits = m(torch.from_numpy(X), past=model.KVCache.from_stacked(torch.from_numpy(past), room=length))['lm_logits']

    # Run the same thing, but with gaps (pads) randomly inserted
    gap_past_length, gap_length = 7, 5

    def random_subsequence(*, n, size):
        # Always make the first token be present, since the model fills gaps with the previous states
        sub = [np.concatenate(([0], rng.choice(np.arange(1, n), size=size - 1, replace=False)))
               for _ in range(batch_size)]
        return np.sort(sub, axis=-1)
    past_sub = random_subsequence(n=gap_past_length, size=past_length)
    X_sub = random_subsequence(n=gap_length, size=length)
    past_gap = rng.randn(*past_shape(gap_past_length)).astype(np.float32)
    past_tokens_gap = np.full([batch_size, gap_past_length], pad)
    X_gap = np.full([batch_size, gap_length], pad)
    for b in range(batch_size):
        for i in range(past_length):
            past_gap[b, :, :, :, past_sub[b, i]] = past[b, :, :, :, i]
            past_tokens_gap[b, past_sub[b, i]] = rng.randint(hp.n_vocab)
        for i in range(length):
            X_gap[b, X_sub[b, i]] = X[b, i]
    # 7 + 5 tokens exceed n_ctx = 8, but only 7 are real: positions stay below n_ctx.
    # The original passed past_tokens with the call; our cache takes them once (from_stacked).
    past_gap = model.KVCache.from_stacked(torch.from_numpy(past_gap), past_tokens=torch.from_numpy(past_tokens_gap),
                                          padding_token=pad, room=gap_length)
    gap_logits = m(torch.from_numpy(X_gap), past=past_gap, padding_token=pad)['lm_logits']
    sub_logits = gap_logits[torch.arange(batch_size)[:, None], torch.from_numpy(X_sub)]
    assert logits.shape == sub_logits.shape
    torch.testing.assert_close(logits, sub_logits, atol=1e-5, rtol=0)


def test_attention_mask():
    """Same as tf.matrix_band_part(ones([nd, ns]), -1, ns - nd) (original test)."""
    for nd in 1, 2, 3:
        for ns in range(nd, 4):
            ours = model.attention_mask(nd, ns)
            theirs = torch.ones(nd, ns, dtype=torch.bool).tril(diagonal=ns - nd)
            assert torch.equal(ours, theirs), (nd, ns)


def test_padding_equals_compacted_sequence():
    """Pads (mid-sequence and trailing) are invisible: real positions get exactly the outputs of the
    sequence without its pads (pads masked as keys, positions count real tokens only); each pad position
    gets the outputs of the last real token before it."""
    m = _model(n_vocab=11, n_ctx=16, n_embd=8, n_head=2, n_layer=2, scalar_heads=['value', 'reward'])
    pad = 13
    rows = [[3, 4, pad, pad, 5, 6, pad], [7, pad, 8, 9, 10, pad, pad], [1, 2, 3, 4, 5, 6, 7]]
    X = torch.tensor(rows)
    out = m(X, padding_token=pad)
    for b, row in enumerate(rows):
        real = [i for i, t in enumerate(row) if t != pad]
        compact = m(torch.tensor([[row[i] for i in real]]))
        last_real = [max(j for j in real if j <= i) for i in range(len(row))]
        for key in ('lm_logits', 'value', 'reward', 'h'):
            expanded = compact[key][0, [real.index(j) for j in last_real]]
            torch.testing.assert_close(out[key][b], expanded, atol=1e-5, rtol=0, msg=f'row {b} {key}')


@pytest.mark.parametrize('positions', [slice(-1, None), slice(2, -1), slice(0, 3), slice(6, None)])
def test_output_positions_equal_slicing_all_outputs(positions):
    """Logits and heads computed only at output_positions equal those positions of the full outputs."""
    m = _model(n_vocab=11, n_ctx=16, n_embd=8, n_head=2, n_layer=2, scalar_heads=['value', 'reward'])
    X = torch.tensor([[3, 4, 13, 13, 5, 6, 13], [7, 13, 8, 9, 10, 13, 13]])
    full = m(X, padding_token=13)
    part = m(X, padding_token=13, output_positions=positions)
    for key in ('lm_logits', 'value', 'reward'):
        assert part[key].shape[1] == len(range(X.shape[1])[positions])
        torch.testing.assert_close(part[key], full[key][:, positions], atol=1e-6, rtol=0, msg=key)
    torch.testing.assert_close(part['h'], full['h'][:, positions], atol=0, rtol=0)


def test_lm_logits_and_present_off_skip_only_those():
    """A reward model reads only its head: lm_logits=False and return_present=False leave out the logits
    and the KV cache, nothing else changes."""
    m = _model(n_vocab=11, n_ctx=16, n_embd=8, n_head=2, n_layer=2, scalar_heads=['reward'])
    X = torch.tensor([[3, 4, 13, 5], [7, 8, 9, 13]])
    full = m(X, padding_token=13, output_positions=slice(-1, None))
    heads_only = m(X, padding_token=13, output_positions=slice(-1, None), lm_logits=False, return_present=False)
    assert set(full) - set(heads_only) == {'lm_logits', 'present'}
    torch.testing.assert_close(heads_only['reward'], full['reward'], atol=0, rtol=0)
    torch.testing.assert_close(heads_only['h'], full['h'], atol=0, rtol=0)


def test_first_token_pad_raises():
    m = _model(n_vocab=10, n_ctx=8, n_embd=4, n_head=2, n_layer=1)
    with pytest.raises(ValueError, match=r'rows \[1\] of X start with the padding token 11'):
        m(torch.tensor([[1, 2, 11], [11, 3, 4]]), padding_token=11)
    past = m(torch.tensor([[1, 2]]), room=1)['present']
    m(torch.tensor([[3]]), past=past, padding_token=11)
    with pytest.raises(ValueError, match='past has room for 0 more positions, not 1'):
        m(torch.tensor([[4]]), past=past, padding_token=11)


def test_too_long_raises():
    m = _model(n_vocab=10, n_ctx=4, n_embd=4, n_head=2, n_layer=1)
    with pytest.raises(ValueError, match='n_ctx = 4'):
        m(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize('grad', [False, True])
def test_kv_cache_with_pads_in_context(grad):
    """Chunked decoding (a padded context, a 3-token chunk with a pad inside, then single tokens) equals
    the full forward, with pads inside the cached context; the cache made by the first call with room for
    the rest is extended in place (no copy per token)."""
    m = _model(n_vocab=10, n_ctx=24, n_embd=12, n_head=3, n_layer=2, scalar_heads=['value'])
    pad = 10
    X = torch.from_numpy(np.random.RandomState(0).randint(10, size=[3, 14]))
    X[0, 2:4] = pad
    X[1, 5:7] = pad  # trailing pads of the first chunk
    X[2, 8] = pad  # inside the second chunk
    full = m(X, padding_token=pad)
    bounds = [0, 7, 10] + list(range(11, 15))
    with torch.set_grad_enabled(grad):
        past, logits, values, ptrs = None, [], [], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            out = m(X[:, lo:hi], past=past, padding_token=pad, room=14 - hi if past is None else 0)
            past = out['present']
            logits.append(out['lm_logits'])
            values.append(out['value'])
            ptrs.append(past.keys[0].data_ptr())
    torch.testing.assert_close(torch.cat(logits, 1), full['lm_logits'], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(values, 1), full['value'], atol=1e-5, rtol=0)
    assert len(set(ptrs)) == 1 and past.capacity == 14
    assert past.n_real.tolist() == (X != pad).sum(1).tolist() and torch.equal(past.real, X != pad)


def test_decoding_step_has_fixed_shapes():
    """A one-token call on a cache (a decoding step) attends over the cache's whole capacity, unwritten
    positions masked: the same logits as the full forward whatever room is left, and the shapes of its
    tensors do not depend on how far decoding is (what a CUDA graph replays)."""
    m = _model(n_vocab=10, n_ctx=24, n_embd=12, n_head=3, n_layer=2)
    pad = 10
    X = torch.from_numpy(np.random.RandomState(1).randint(10, size=[2, 9]))
    X[1, 2:4] = pad
    full = m(X, padding_token=pad)['lm_logits']
    with torch.no_grad():
        past = m(X[:, :5], padding_token=pad, room=10)['present']  # room for more than the 4 steps below
        steps = [m(X[:, i:i + 1], past=past, padding_token=pad, check_inputs=False)['lm_logits'] for i in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 5:], atol=1e-5, rtol=0)
    assert past.length.item() == 9 and past.capacity == 15


def test_sdpa_equals_original_attention_formula():
    """Our attention (SDPA with a boolean mask) vs the original's softmax(w*b - 1e10*(1-b)) computed
    explicitly from the same projections, with pads masked as keys: within 1e-6."""
    torch.manual_seed(0)
    hp = model.HParams(n_vocab=5, n_ctx=8, n_embd=12, n_head=3, n_layer=2)
    attn = model.Attention(hp)
    b, s, e, nh = 2, 6, 12, 3
    x = torch.randn(b, s, e)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, 2:4] = False
    keep[1, 5] = False
    causal = model.attention_mask(s, s)
    visible = causal[None, None] & keep[:, None, None, :]
    ours = attn(x.reshape(b * s, e), batch=b, cache=None, write_at=None, attend_cache=False,
                bias=torch.where(visible, 0.0, model.MASKED)).view(b, s, e)

    q, k, v = attn.c_attn(x.reshape(b * s, e)).view(b, s, 3 * e).split(e, dim=2)
    q, k, v = (t.reshape(b, s, nh, e // nh).transpose(1, 2) for t in (q, k, v))
    w = q @ k.transpose(-1, -2) * (1 / math.sqrt(e // nh))
    bm = causal.float()[None, None] * keep.float()[:, None, None, :]
    w = w * bm - 1e10 * (1 - bm)
    w = torch.exp(w - w.amax(-1, keepdim=True))
    w = w / w.sum(-1, keepdim=True)
    theirs = attn.c_proj((w @ v).transpose(1, 2).reshape(b * s, e)).view(b, s, e)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


class AttentionMasks(TorchDispatchMode):
    """The attn_mask of every SDPA op dispatched."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if 'scaled_dot_product' in func.overloadpacket.__name__ and kwargs.get('attn_mask') is not None:
            self.masks.append(kwargs['attn_mask'])
        return func(*args, **kwargs)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_attention_masks_rows_are_a_multiple_of_8(monkeypatch, dtype):
    """The additive mask's rows (its key dimension) are allocated rounded up to a multiple of 8 and sliced,
    the extra keys masked: CUDA's memory-efficient SDPA needs every stride but the last a multiple of 8, and
    otherwise pads the mask in every layer (and, training, keeps each padded copy for the backward). Seen on
    a CPU in the ops a pass dispatches: a padded forward of 13 tokens, a cache of 13 + 6 = 19 positions
    extended by 3 and decoded one token at a time. The logits are those of the same masks made contiguous,
    bit for bit, in fp32 and in bf16 attention (bf16 mode's on CUDA)."""
    from lm_human_preferences.language import bf16
    monkeypatch.setitem(bf16.ATTENTION_DTYPES, 'cpu', dtype)
    m = _model(n_vocab=10, n_ctx=32, n_embd=12, n_head=3, n_layer=2)
    pad = 10
    X = torch.from_numpy(np.random.RandomState(1).randint(10, size=[2, 17]))
    X[1, 2:4] = pad
    X[0, 11] = pad

    def run():
        with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = m(X[:, :13], padding_token=pad, room=6)
            logits = [out['lm_logits'], m(X[:, 13:16], past=out['present'], padding_token=pad)['lm_logits']]
            return logits + [m(X[:, 16:], past=out['present'], padding_token=pad)['lm_logits']]
    with AttentionMasks() as seen:
        logits = run()
    keys = [mask.shape[-1] for mask in seen.masks]
    assert keys == [13] * 2 + [19] * 4, keys  # 2 layers x 3 calls
    for mask in seen.masks:
        assert mask.dtype == dtype and mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1]), \
            (mask.shape, mask.stride())
        padded = mask.as_strided(mask.shape[:-1] + (mask.stride(-2),), mask.stride())
        assert torch.all(padded[..., mask.shape[-1]:] == model.MASKED)
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, 'scaled_dot_product_attention', lambda *a, attn_mask=None, **k: sdpa(
        *a, attn_mask=None if attn_mask is None else attn_mask.contiguous(), **k))
    for ours, contiguous in zip(logits, run()):
        assert torch.equal(ours, contiguous)


def test_parameter_layout_and_init():
    """TF names with dots, conv1x1 weights [nx, nf], scalar heads w [n_embd] and b scalar; the value
    head starts at zero, other heads at std 1/sqrt(n_embd + 1), biases at 0."""
    m = _model(n_vocab=50, n_ctx=8, n_embd=256, n_head=4, n_layer=2, scalar_heads=['value', 'reward'])
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes['wte'] == (50, 256) and shapes['wpe'] == (8, 256)
    assert shapes['h.1.attn.c_attn.w'] == (256, 768) and shapes['h.1.attn.c_attn.b'] == (768,)
    assert shapes['h.0.mlp.c_fc.w'] == (256, 1024) and shapes['h.0.mlp.c_proj.w'] == (1024, 256)
    assert shapes['h.0.ln_1.g'] == (256,) and shapes['ln_f.b'] == (256,)
    assert shapes['heads.value.w'] == (256,) and shapes['heads.value.b'] == ()
    assert len(shapes) == 2 + 12 * 2 + 2 + 4
    assert torch.all(m.heads.value.w == 0) and m.heads.value.b == 0 and m.heads.reward.b == 0
    assert abs(m.heads.reward.w.std().item() - 1 / math.sqrt(257)) < 0.015
    assert abs(m.wte.std().item() - 0.02) < 0.002 and abs(m.wpe.std().item() - 0.01) < 0.002
    assert torch.all(m.h[0].ln_1.g == 1) and torch.all(m.h[0].ln_1.b == 0)


def test_bf16_autocast_outputs_fp32():
    m = _model(n_vocab=20, n_ctx=8, n_embd=16, n_head=2, n_layer=2, scalar_heads=['reward'])
    X = torch.tensor([[1, 2, 3, 21, 4], [5, 6, 21, 21, 21]])
    ref = m(X, padding_token=21)
    with torch.autocast(device_type='cpu', dtype=torch.bfloat16):
        out = m(X, padding_token=21)
    assert out['lm_logits'].dtype == torch.float32 and out['reward'].dtype == torch.float32
    torch.testing.assert_close(out['lm_logits'], ref['lm_logits'], atol=0.05, rtol=0.05)
    torch.testing.assert_close(out['reward'], ref['reward'], atol=0.05, rtol=0.05)
