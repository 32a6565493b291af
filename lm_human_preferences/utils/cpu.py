"""Ours: what a run runs on, in one line the commands print (a CPU's threads, kernels and bf16 products, or the
GPU), and whether this CPU multiplies bf16 natively, as the libraries are allowed to.

A CPU with AVX512-BF16 or AMX multiplies bf16 natively (oneDNN's bf16 products: ~2.5x fp32's speed here);
elsewhere oneDNN and ATen emulate bf16, many times slower than fp32 (a 256 x 512 x 256 bf16 product: 62 ms
against fp32's 1.5 ms under the AVX2 limits below). Whatever the CPU, the libraries can be held to a smaller
instruction set: ONEDNN_MAX_CPU_ISA (oneDNN), ATEN_CPU_CAPABILITY (ATen's vector kernels), MKL_ENABLE_INSTRUCTIONS
(MKL's fp32 products); `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` makes a CPU
with native bf16 stand in for one without (benchmarks/README.md says how closely). torch's own CPU probes read
the chip, not those limits, so native_bf16 reads them too; LMHP_CPU_BF16=off turns bf16 products off whatever the
CPU.
"""

import contextlib
import os

import torch

# oneDNN's instruction sets (ONEDNN_MAX_CPU_ISA) that include bf16 products: its names with BF16 or AMX in them,
# AVX10 (AVX10.1 has them) and ALL (no limit).
_ONEDNN_BF16_ISAS = ('BF16', 'AMX', 'AVX10', 'ALL')
OFF = ('0', 'off', 'false', 'no')


def kernels():
    """ATen's vector instruction set here ('AVX512', 'AVX2', 'DEFAULT', ...): ATEN_CPU_CAPABILITY or the chip's."""
    return torch.backends.cpu.get_cpu_capability()


def _onednn_limit():
    """The instruction set oneDNN is held to (ONEDNN_MAX_CPU_ISA, or its old name DNNL_MAX_CPU_ISA), upper case;
    None without a limit."""
    value = os.environ.get('ONEDNN_MAX_CPU_ISA') or os.environ.get('DNNL_MAX_CPU_ISA')
    return value.strip().upper() if value and value.strip() else None


def bf16_off_reason():
    """Why bf16 products are not native here (a few words naming the setting or the chip), or None where they
    are."""
    if os.environ.get('LMHP_CPU_BF16', '').strip().lower() in OFF:
        return f'LMHP_CPU_BF16={os.environ["LMHP_CPU_BF16"]}'
    chip = any(getattr(torch.cpu, probe, lambda: False)() for probe in ('_is_avx512_bf16_supported',
                                                                         '_is_amx_tile_supported'))
    if not chip:
        return 'the CPU has neither AVX512-BF16 nor AMX'
    limit = _onednn_limit()
    if limit is not None and not any(isa in limit for isa in _ONEDNN_BF16_ISAS):
        return f'ONEDNN_MAX_CPU_ISA={limit}'
    supported = getattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported', None)
    if not torch.backends.mkldnn.is_available() or (supported is not None and not supported()):
        return "torch's oneDNN has no bf16 products here"
    if not kernels().startswith('AVX512'):
        return f'ATEN_CPU_CAPABILITY={kernels().lower()}'
    return None


def native_bf16():
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), with none of the limits above in the way."""
    return bf16_off_reason() is None


def describe(device=None):
    """What this process runs on, for the commands' first lines: e.g. 'CPU (2 threads, AVX512 kernels, bf16
    native)', 'CPU (1 thread, AVX2 kernels, bf16 not native: ONEDNN_MAX_CPU_ISA=AVX2)', 'cuda:0 (NVIDIA H100 80GB
    HBM3)'. A CPU's timings and, where bf16 products are used, its results depend on them."""
    device = torch.device(device) if device is not None else (
        torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else torch.device('cpu'))
    if device.type == 'cuda':
        return f'{device} ({torch.cuda.get_device_name(device)})'
    threads = torch.get_num_threads()
    reason = bf16_off_reason()
    bf16 = 'bf16 native' if reason is None else f'bf16 not native: {reason}'
    return f'CPU ({threads} thread{"s" if threads != 1 else ""}, {kernels()} kernels, {bf16})'



# The threads whose results the ops that depend on the thread count give (results_threads); None: torch's.
_results_threads = None


@contextlib.contextmanager
def results_threads(threads):
    """While it is open, the few ops whose results on a CPU depend on the thread count run on `threads` threads, the
    rest on torch's: a run then gives the results of `threads` threads at the speed of more. Those ops, found by
    comparing a model's forward and backward on 1 and 2 threads bit for bit (tests/test_cpu.py): the layer norms'
    backward (ATen sums the gain's and the bias's gradients in one partial sum per thread) and the attention of a
    single new token over a KV cache (the CPU's flash-attention kernel splits it by thread); every other op of the
    model, sampling and training gave the same bits."""
    global _results_threads
    saved, _results_threads = _results_threads, threads
    try:
        yield
    finally:
        _results_threads = saved


def fewer_results_threads():
    """The threads results_threads set, where fewer than torch's; else None (nothing to do)."""
    threads = _results_threads
    return threads if threads is not None and threads < torch.get_num_threads() else None


@contextlib.contextmanager
def on_results_threads():
    """Its block on results_threads' threads (where fewer than torch's), then torch's again."""
    threads, saved = fewer_results_threads(), torch.get_num_threads()
    if threads is None:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
