"""benchmarks/roofline.py end to end on the demo's shapes: every phase asked for is counted, timed and profiled,
and the kind of CPU it ran on is written. Only that it works and what it writes: no test asserts a time."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm_human_preferences import demo

pytestmark = pytest.mark.slow  # an end-to-end run: the full suite only

ROOT = Path(__file__).resolve().parents[1]


def test_roofline_counts_times_and_profiles_each_phase(tmp_path):
    out = tmp_path / 'roofline.json'
    phases = ['pretrain_step', 'reward_step', 'ppo_sampling', 'ppo_scoring']
    proc = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'roofline.py'), '--experiments', 'demo',
                           '--phases', *phases, '--repeats', '1', '--no-peak', '--json', str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result['kind']['kernels'] and 'CPU (' in result['kind']['describe']
    rows = result['experiments']['demo']['phases']
    assert list(rows) == phases
    for phase, row in rows.items():
        # FlopCounterMode's count (attention counted whole) is at least the analytic one (causal halves), and
        # within a third of it: the products are most of both
        assert row['model_flops'] <= row['counted_flops'] <= 1.35 * row['model_flops'], phase
        assert row['gflops'] == pytest.approx(row['counted_flops'] / row['best_s'] / 1e9)
        kinds = row['profile']['kinds_s']
        assert 'block products' in kinds and 'Python, dispatch (wall - ops)' in kinds
        assert sum(kinds.values()) == pytest.approx(row['profile']['wall_s'], rel=0.05)
    assert f'| demo | ppo_scoring | {demo.EXPERIMENT.cpu_threads} |' in proc.stdout  # the demo's threads
