"""The chunked sampler (language/vocab_sampling.py) against the plain one (categorical.sample_from_logits_unchecked): the
same distribution from the hidden states, the logits never written whole."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lm_human_preferences.language import vocab_sampling
from lm_human_preferences.utils import categorical, cpu


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks and blocks small enough that a 1,000-token vocabulary spans several, the last of each partial."""
    monkeypatch.setattr(vocab_sampling, 'CHUNK', 256)
    monkeypatch.setattr(vocab_sampling, 'BLOCK', 32)


def _plain(h, w, uniform, beta):
    logits = (h @ w.T) * beta
    samples, has_finite = categorical.sample_from_logits_unchecked(logits, uniform=uniform)
    return samples, has_finite, torch.log_softmax(logits, dim=-1)


@pytest.fixture
def fp32_products(monkeypatch):
    """The sampler's products in fp32, as the plain sampler's: where the CPU multiplies bf16 natively they run at
    'medium' (on AMX oneDNN rounds their inputs to bf16: other logits than the plain sampler's fp32 ones), which
    test_products_at_the_fast_fp32_precision holds against the plain sampler at that precision."""
    monkeypatch.setenv('LMHP_CPU_BF16', 'off')


@pytest.mark.parametrize('n_vocab', [1000, 50257])
def test_fp32_products_draw_the_plain_samplers_tokens(n_vocab, fp32_products):
    """With fp32 products and the same uniforms, the plain sampler's tokens (to the rescaled exps' rounding: a
    draw within ~1e-7 of a boundary may fall on the neighbour, which 512 random rows do not hit), and its
    logprobs to float rounding."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(512, 64, generator=g) * 0.3, torch.randn(n_vocab, 64, generator=g)
    uniform = torch.rand(512, dtype=torch.float64, generator=g)
    expected, _, log_softmax = _plain(h, w, uniform, 1 / 0.7)
    samples, has_finite, logprobs = vocab_sampling.sample_from_hidden(h, w, uniform, beta=1 / 0.7, logprobs=True)
    assert torch.equal(samples, expected) and bool(has_finite.all())
    torch.testing.assert_close(logprobs, log_softmax.gather(1, samples[:, None])[:, 0], atol=3e-5, rtol=1e-5)


def test_every_chunk_and_block_boundary(small_chunks, fp32_products):
    """Uniforms on a fine grid over one row: every token of the plain sampler's choice, across chunk and block
    boundaries and the partial last chunk and block (1,000 = 3 x 256 + 232 = ... x 32 + 8)."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(1, 16, generator=g), torch.randn(1000, 16, generator=g) * 0.2  # a flat distribution
    uniform = torch.linspace(0.0005, 0.9995, 4000, dtype=torch.float64)
    rows = h.expand(len(uniform), -1)
    expected, _, _ = _plain(rows, w, uniform, 1.0)
    samples, has_finite, _ = vocab_sampling.sample_from_hidden(rows, w, uniform)
    assert bool(has_finite.all())
    differ = (samples != expected).sum().item()
    assert differ <= 2, f'{differ} of 4000 draws differ'  # only draws on a boundary, to ~1e-7
    assert len(set(samples.tolist())) > 900  # the grid reaches nearly every token, the last chunk's included


def test_the_distribution_is_the_softmax(small_chunks):
    """Many draws of one row of a peaked distribution: the frequencies are the softmax's (chi-square)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1000, 8, generator=g)
    h = torch.randn(1, 8, generator=g)
    probs = torch.softmax((h @ w.T)[0] * 1.5, dim=0)
    draws = 200_000
    uniform = torch.rand(draws, dtype=torch.float64, generator=g)
    samples, _, _ = vocab_sampling.sample_from_hidden(h.expand(draws, -1), w, uniform, beta=1.5)
    counts = torch.bincount(samples, minlength=1000).double()
    expected = probs.double() * draws
    big = expected > 20
    chi2 = (((counts - expected) ** 2) / expected)[big].sum().item()
    dof = int(big.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)
    assert counts[~big].sum() < 5 * max(1.0, expected[~big].sum().item())


def test_non_finite_logits_take_no_part_and_rows_without_finite_logits_are_flagged(small_chunks):
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(4, 8, generator=g), torch.randn(1000, 8, generator=g)
    w[0:300] = math.inf  # the first chunk and a part of the second: +-inf logits
    w[500] = math.nan
    h[2] = math.nan  # a row of NaN logits only
    uniform = torch.rand(4, dtype=torch.float64, generator=g)
    samples, has_finite, _ = vocab_sampling.sample_from_hidden(h, w, uniform)
    assert has_finite.tolist() == [True, True, False, True]
    kept = samples[has_finite]
    assert bool(((kept >= 300) & (kept != 500)).all()), kept


class _Products(TorchDispatchMode):
    """(input dtype, float32 matmul precision) of every matrix product dispatched."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.seen.append((args[0].dtype, torch.get_float32_matmul_precision()))
        return func(*args, **(kwargs or {}))


def test_products_at_the_fast_fp32_precision(monkeypatch):
    """Every product runs at products_precision ('medium' where the CPU multiplies bf16 natively: oneDNN's bf16
    mode where it takes the product), the caller's precision given back after; the samples are the plain
    sampler's of the logits that precision gives, and LMHP_CPU_BF16=off keeps the products at 'highest'."""
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(256, 64, generator=g) * 0.2, torch.randn(5000, 64, generator=g)
    uniform = torch.rand(256, dtype=torch.float64, generator=g)
    for setting in ('on', 'off'):
        monkeypatch.setenv('LMHP_CPU_BF16', setting)
        precision = vocab_sampling.products_precision()
        assert precision == ('medium' if setting == 'on' and cpu.native_bf16() else 'highest')
        before = torch.get_float32_matmul_precision()
        with _Products() as products:
            samples, has_finite, logprobs = vocab_sampling.sample_from_hidden(h, w, uniform, logprobs=True)
        assert products.seen and set(products.seen) == {(torch.float32, precision)}
        assert torch.get_float32_matmul_precision() == before
        torch.set_float32_matmul_precision(precision)
        try:
            expected, _, log_softmax = _plain(h, w, uniform, 1.0)
        finally:
            torch.set_float32_matmul_precision(before)
        assert torch.equal(samples, expected) and bool(has_finite.all())
        torch.testing.assert_close(logprobs, log_softmax.gather(1, samples[:, None])[:, 0], atol=3e-5, rtol=1e-5)


def test_chunked_on_a_cpu_only():
    assert vocab_sampling.chunked_on('cpu') and not vocab_sampling.chunked_on('cuda')
