"""The largest differences between two save dirs of the same command (e.g. one run on CUDA, one on the
CPU): every tensor of every safetensors file (weights, Adam moments, reward normalization) that both hold,
by path relative to each dir. Prints one line per file and the maximum; --json writes them; --atol makes
it exit 1 when a difference is larger.

    python benchmarks/compare_runs.py RUN_A RUN_B [--atol 1e-5] [--json out.json]
"""
import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import load_file


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('a')
    p.add_argument('b')
    p.add_argument('--atol', type=float, default=None)
    p.add_argument('--json', default=None)
    args = p.parse_args()
    a, b = Path(args.a), Path(args.b)
    files = sorted(f.relative_to(a) for f in a.rglob('*.safetensors'))
    if not files:
        sys.exit(f'compare_runs: no .safetensors files under {a}')
    out = {}
    for rel in files:
        if not (b / rel).is_file():
            sys.exit(f'compare_runs: {b / rel} is missing (it is in {a})')
        ta, tb = load_file(a / rel), load_file(b / rel)
        if sorted(ta) != sorted(tb):
            sys.exit(f'compare_runs: {rel} holds different tensors in the two runs')
        diffs = {k: (ta[k].double() - tb[k].double()).abs().max().item() if ta[k].numel() else 0.0 for k in ta}
        worst = max(diffs, key=diffs.get)
        out[str(rel)] = dict(max_abs_diff=diffs[worst], tensor=worst, tensors=len(diffs))
        print(f'{rel}: max |a - b| = {diffs[worst]:.3g} ({worst}; {len(diffs)} tensors)')
    overall = max(v['max_abs_diff'] for v in out.values())
    print(f'all: max |a - b| = {overall:.3g}')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(a=str(a), b=str(b), max_abs_diff=overall, files=out), f, indent=1)
    if args.atol is not None and overall > args.atol:
        sys.exit(f'compare_runs: {overall:.3g} > --atol {args.atol}')


if __name__ == '__main__':
    main()
