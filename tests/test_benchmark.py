"""The benchmark runs end to end (on a toy model) and reports both sides of every line it was asked for.

Only that it works and what it writes: no test asserts a time (speed is the benchmark's own output)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only (the fast tier is -m "not slow")

pytest.importorskip('transformers', reason='the benchmark compares against transformers (the `test-full` extra)')

ROOT = Path(__file__).resolve().parents[1]


def test_ppo_throughput_smoke(tmp_path):
    out = tmp_path / 'bench.json'
    proc = subprocess.run(
        [sys.executable, str(ROOT / 'benchmarks' / 'ppo_throughput.py'), '--preset', 'tiny', '--n-vocab', '512',
         '--batch', '8', '--dtypes', 'fp32', '--lines', 'sample', 'reward', 'ppo_update', '--memory', 'off',
         '--repeats', '1', '--warmup', '0', '--json', str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result['partial'] is False
    assert [r['line'] for r in result['rows']] == ['sample', 'reward', 'ppo_update']
    for row in result['rows']:
        assert row['ours'] > 0 and row['hf'] > 0 and row['ratio'] == pytest.approx(row['ours'] / row['hf'])
        assert 0 < row['ours_mfu'] and 0 < row['hf_mfu']
    assert [r['context'] for r in result['ctx_rows']] == [8, 64]  # the KV-cache line, both contexts
    assert '| books q16+r8 b8 | (c) reward model fwd | fp32 |' in proc.stdout


def test_dispatch_counts_by_phase_and_holds_the_target(tmp_path):
    """benchmarks/dispatch.py on the paper's books shape (8 ranks, 12 layers): its phases add up to the total,
    the decoding loop ran response_length - 1 steps, and one update stays within the op budget of a GPU
    (a count, which does not depend on the machine: the 290,000 ops of one rank after another would fail)."""
    out = tmp_path / 'dispatch.json'
    proc = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'dispatch.py'), '--shapes', 'books',
                           '--microbatch', 'none', '--json', str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    books = json.loads(out.read_text())['books']
    assert sum(books['phases'].values()) == books['ops_per_update']
    assert {'sampling', 'loss forward+backward', 'optimizer', 'scoring', 'ref logprobs'} <= set(books['phases'])
    assert books['decode_steps']['steps'] == 23 and books['decode_steps']['loops'] == 1
    assert books['cuda_graph_ops_per_update'] < books['ops_per_update'] - books['decode_steps']['ops'] / 2
    assert books['ops_per_update'] <= 15_000, books['phases']
    assert 'books: ' in proc.stdout and 'of which decoding steps' in proc.stdout


def test_memory_and_adam_smoke(tmp_path):
    """benchmarks/memory.py (tiny model): a pass's peak grows with its sequences and the fit predicts what it
    does not measure; benchmarks/adam.py: the three AdamTF paths, the multi-tensor one in a dozen ops."""
    out = tmp_path / 'memory.json'
    proc = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'memory.py'), '--preset', 'tiny', '--shapes', 'tldr',
                           '--phases', 'ppo_step', '--max-gb', '0.15', '--json', str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())['rows']
    assert [r['sequences'] for r in rows] == [1, 2, 4, 8, 16, 32]
    measured = [r for r in rows if not r.get('predicted')]
    assert len(measured) >= 2 and measured[-1]['peak_mb'] > measured[0]['peak_mb']
    assert any(r.get('predicted') for r in rows), rows  # 0.15 GB does not hold the whole 32-sequence pass
    assert '| tldr, cnndm | ppo_step | fp32 |' in proc.stdout
    proc = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'adam.py'), '--preset', 'tiny', '--repeats', '1'],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'foreach' in proc.stdout and '   14 ops dispatched' in proc.stdout


def test_train_timing_runs_the_real_command(tmp_path):
    """A tldr-shaped run of 2 updates on a tiny random GPT-2 (the GPU report times 124M and 774M)."""
    out = tmp_path / 'timing.json'
    proc = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'train_timing.py'), '--exp', 'tldr',
                           '--model', 'tiny', '--updates', '2', '--json', str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r['exp'], r['batch'], r['query_length'], r['response_length']) == ('tldr', 32, 500, 75)
    assert len(r['step_times_s']) == 2 and r['seconds_per_update'] == r['step_times_s'][1]
    assert r['run_hours'] == pytest.approx(r['seconds_per_update'] * 31_250 / 3600)
    assert r['mfu'] == pytest.approx(r['flops_per_update'] / r['seconds_per_update'] / r['matmul_peak_flops'])
    assert '[ppo_step 1]' in proc.stdout  # the trainer's own step lines, read for the times


def test_compare_runs_finds_the_largest_difference(tmp_path):
    import torch
    from safetensors.torch import save_file
    for run, shift in (('a', 0.0), ('b', 0.25)):
        (tmp_path / run / 'm' / 'checkpoints').mkdir(parents=True)
        save_file({'w': torch.zeros(3), 'g': torch.tensor([1.0, 2.0 + shift])},
                  str(tmp_path / run / 'm' / 'checkpoints' / 'model-1.safetensors'))
    script = [sys.executable, str(ROOT / 'benchmarks' / 'compare_runs.py'), str(tmp_path / 'a'), str(tmp_path / 'b')]
    ok = subprocess.run(script + ['--atol', '0.3', '--json', str(tmp_path / 'c.json')], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert 'max |a - b| = 0.25 (g; 2 tensors)' in ok.stdout
    assert json.loads((tmp_path / 'c.json').read_text())['max_abs_diff'] == 0.25
    refused = subprocess.run(script + ['--atol', '0.1'], capture_output=True, text=True)
    assert refused.returncode == 1 and 'compare_runs: 0.25 > --atol 0.1' in refused.stderr
