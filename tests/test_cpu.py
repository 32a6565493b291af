"""What a run runs on (utils/cpu.py): native bf16 products only where the chip has them and neither oneDNN nor ATen
is held below them (the AVX2 stand-in for a CPU without native bf16), or LMHP_CPU_BF16=off; the line the commands
print. (torch's own probes read the chip: under the stand-in they said yes, and the miniature's pretraining ran its
bf16 products emulated, 40x slower than fp32's.)"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lm_human_preferences import sentiment_mini
from lm_human_preferences.language import bf16
from lm_human_preferences.offline import pretrain
from lm_human_preferences.utils import cpu

REPO_ROOT = Path(__file__).resolve().parents[1]
CHIP_BF16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
STAND_IN = dict(ATEN_CPU_CAPABILITY='avx2', ONEDNN_MAX_CPU_ISA='AVX2', MKL_ENABLE_INSTRUCTIONS='AVX2')


@pytest.fixture(autouse=True)
def _no_limits(monkeypatch):
    for name in ('LMHP_CPU_BF16', 'ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA'):
        monkeypatch.delenv(name, raising=False)


def bf16_products_dtype():
    """The dtype here of the miniature's pretraining products, were it to ask for bf16 products."""
    asked = dataclasses.replace(sentiment_mini.EXPERIMENT.pretrain, seed=1, bf16_products=True)
    return pretrain.pretraining_products_dtype(asked)


@pytest.mark.skipif(not CHIP_BF16 or not cpu.kernels().startswith('AVX512'),
                    reason='this CPU has no native bf16 (AVX512-BF16 or AMX)')
def test_native_where_the_chip_has_it_and_nothing_holds_it_back():
    assert bf16.native_bf16_cpu() and cpu.bf16_off_reason() is None
    assert bf16_products_dtype() == torch.bfloat16
    assert cpu.describe('cpu') == f'CPU ({torch.get_num_threads()} thread{"s" * (torch.get_num_threads() > 1)}, ' \
                                  f'AVX512 kernels, bf16 native)'


@pytest.mark.parametrize('name, value', [('LMHP_CPU_BF16', 'off'), ('ONEDNN_MAX_CPU_ISA', 'AVX2'),
                                         ('ONEDNN_MAX_CPU_ISA', 'avx512_core'), ('DNNL_MAX_CPU_ISA', 'AVX2')])
def test_a_limit_or_the_setting_turns_bf16_products_off(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not bf16.native_bf16_cpu() and bf16_products_dtype() == torch.float32
    if CHIP_BF16:  # the limit is the reason, and the line names it
        reason = f'{name.replace("DNNL", "ONEDNN")}={value if name == "LMHP_CPU_BF16" else value.upper()}'
        assert cpu.bf16_off_reason() == reason
        assert cpu.describe('cpu').endswith(f'bf16 not native: {reason})')


@pytest.mark.parametrize('value', ['AVX512_CORE_BF16', 'avx512_core_amx', 'ALL'])
def test_a_limit_that_keeps_bf16_keeps_it(monkeypatch, value):
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', value)
    assert cpu.bf16_off_reason() != f'ONEDNN_MAX_CPU_ISA={value.upper()}'


def test_the_avx2_stand_in_is_a_cpu_without_native_bf16():
    """The three limits at torch's start (ATEN_CPU_CAPABILITY is read then): AVX2 kernels, no native bf16, fp32
    products in the pretraining, the line saying so."""
    code = ('from lm_human_preferences.utils import cpu; from lm_human_preferences.language import bf16; '
            'print(cpu.kernels(), bf16.native_bf16_cpu(), cpu.describe("cpu"), sep="|")')
    proc = subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **STAND_IN, 'OMP_NUM_THREADS': '1'})
    assert proc.returncode == 0, proc.stderr
    kernels, native, line = proc.stdout.strip().split('|')
    assert kernels == 'AVX2' and native == 'False'
    assert line.startswith('CPU (1 thread, AVX2 kernels, bf16 not native: ')



def _model_results(threads):
    """A small model's logits, value and every gradient after one forward and backward, and the logits of two
    tokens decoded after it over its KV cache, at `threads` threads."""
    from lm_human_preferences.language import model
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        lm = model.Model(model.HParams(n_vocab=27, n_ctx=64, n_embd=128, n_head=4, n_layer=2), scalar_heads=['value'])
        X = torch.randint(0, 26, (16, 54), generator=torch.Generator().manual_seed(1))
        out = lm(X, padding_token=26, room=2)
        (out['lm_logits'].logsumexp(-1).mean() + out['value'].square().mean()).backward()
        results = dict(logits=out['lm_logits'], value=out['value'], **{n: p.grad for n, p in lm.named_parameters()})
        with torch.no_grad():
            for i in range(2):
                step = lm(X[:, -1:], past=out['present'], padding_token=26, check_inputs=False)
                results[f'decoded {i}'] = step['lm_logits']
        return results
    finally:
        torch.set_num_threads(saved)


def test_results_threads_give_one_threads_bits_on_two():
    """The demo runs on 2 threads with the results of 1 (cpu.results_threads): the layer norms' backward (ATen
    sums the gain's and bias's gradients per thread: ~1e-8 apart) and a decoded token's attention over the cache
    (~1e-7) on one thread, the forward and every gradient and decoded logit are 1 thread's bit for bit."""
    one = _model_results(1)
    with cpu.results_threads(1):
        two = _model_results(2)
    assert cpu._results_threads is None  # closed: torch's threads for every op again
    assert one.keys() == two.keys()
    different = [name for name in one if not torch.equal(one[name], two[name])]
    assert not different, different
