#!/usr/bin/env python3
"""AdamTF's ways of running TF's Adam kernel, side by side in one run: on cache-sized chunks of each tensor,
with multi-tensor ops over all parameters at once (foreach, the CUDA default), and the CPU default (foreach
for the tensors of at most a chunk, chunks for the larger ones).

Both run the same ops in the same order (bit-identical updates: tests/test_core_utils.py); they differ in
memory traffic and in the ops dispatched. The parameters are GPT-2 124M's (random values, random
gradients); each figure is the best of --repeats steps after one warm-up step, the two paths alternating
step by step so that a machine getting busier slows both alike.

    python benchmarks/adam.py               # GPT-2 124M on this machine's device
    python benchmarks/adam.py --preset tiny # smoke run
"""
import argparse
import time

import torch

from common import GPT2_124M, device, machine_info, sync
from dispatch import OpCounter

PRESETS = {'gpt2': GPT2_124M, 'tiny': dict(n_vocab=512, n_ctx=1024, n_embd=64, n_head=2, n_layer=2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--preset', choices=sorted(PRESETS), default='gpt2')
    p.add_argument('--repeats', type=int, default=5)
    args = p.parse_args(argv)

    from lm_human_preferences.language import model
    from lm_human_preferences.training.adam import AdamTF
    hp = model.HParams(**PRESETS[args.preset])
    dev = device()
    paths = dict(chunks=False, foreach=True, default=None)
    nets = {name: model.Model(hp, scalar_heads=['value']).to(dev) for name in paths}
    optimizers = {name: AdamTF(net.parameters(), lr=1e-5, foreach=paths[name]) for name, net in nets.items()}
    for name, net in nets.items():
        for p_ in net.parameters():
            p_.grad = torch.randn_like(p_) * 1e-3
    params = sum(p_.numel() for p_ in nets['chunks'].parameters())
    print(f"{machine_info()}\n{args.preset}: {params / 1e6:.1f}M parameters in {len(list(nets['chunks'].parameters()))} "
          f"tensors on {dev}")

    times = {name: [] for name in nets}
    ops = {}
    for rep in range(args.repeats + 1):
        for name in (list(paths) if rep % 2 else list(paths)[::-1]):
            counter = OpCounter()
            sync()
            started = time.perf_counter()
            with counter:
                optimizers[name].step()
            sync()
            if rep:  # the first step allocates the moments
                times[name].append(time.perf_counter() - started)
                ops[name] = sum(counter.phases.values())
    best = {name: min(t) for name, t in times.items()}
    for name in nets:
        print(f'{name:8s} {best[name] * 1e3:9.1f} ms a step (best of {args.repeats}), {ops[name]:5,} ops dispatched')
    print(f"time relative to chunks: foreach {best['foreach'] / best['chunks']:.2f}x, "
          f"default {best['default'] / best['chunks']:.2f}x")


if __name__ == '__main__':
    main()
