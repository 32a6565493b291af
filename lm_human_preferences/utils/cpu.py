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


def chip():
    """The CPU's model name and its widest products from /proc/cpuinfo ('Intel(R) Xeon(R) Processor, AMX in its
    flags'), '' where there is none: a virtual machine's name may not say the family, its flags do."""
    if not os.path.isfile('/proc/cpuinfo'):
        return ''
    with open('/proc/cpuinfo') as f:
        info = f.read().splitlines()
    name = next((line.split(':', 1)[1].strip() for line in info if line.startswith('model name')), '')
    flags = set(next((line.split(':', 1)[1].split() for line in info if line.startswith('flags')), []))
    kind = ('AMX' if 'amx_bf16' in flags else 'AVX512-BF16' if 'avx512_bf16' in flags else
            'AVX512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else '')
    return ', '.join(part for part in (name, kind and f'{kind} in its flags') if part)


def busy_cores(threads):
    """(cores, load) where `threads` intra-op threads would share this process's cores with other work already running
    (the last minute's load average, taken before ours starts), else None; None too where the platform has no load
    average. There each product's threads wait on each other at every step (libgomp's spinning workers and the other
    work's threads take turns), many times slower than one thread."""
    if threads <= 1 or not hasattr(os, 'getloadavg'):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    load = os.getloadavg()[0]
    return (cores, load) if load + threads > cores + 0.5 else None


def runs_on(device):
    """describe() and, on a CPU, the chip(): where a result was made (its kernels round it)."""
    model = chip() if torch.device(device).type == 'cpu' else ''
    return describe(device) + (f' on {model}' if model else '')
