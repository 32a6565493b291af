"""The benchmark runs end to end (on a toy model) and reports both sides of every line it was asked for.

Only that it works and what it writes: no test asserts a time (speed is the benchmark's own output)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only (the fast tier is -m "not slow")

pytest.importorskip('transformers', reason='the benchmark compares against transformers (the `test` extra)')

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
