"""Learning-curve plots (utils/plots.py) from the trainers' stats JSONL files."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm_human_preferences.utils import plots

REPO_ROOT = Path(__file__).resolve().parents[1]


def _write_jsonl(path, rows):
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))


def _policy_run(save_dir, *, n=30, target=6.0):
    rows = [{'step': i, 'objective/score': 0.1 * i, 'objective/kl': 0.2 * i, 'objective/kl_coef': 0.15 + 0.001 * i,
             'objective/entropy': 50 - i, 'ppo/val/var_explained': i / n, 'elapsed/time': i} for i in range(n)]
    _write_jsonl(save_dir / 'train_policy_stats.jsonl', rows)
    (save_dir / 'train_policy_hparams.json').write_text(json.dumps(
        {'rewards': {'kl_coef': 0.15, 'adaptive_kl': {'target': target, 'horizon': 10000}}}))


def _reward_run(save_dir, *, n=20):
    rows = [{'step': i, 'loss': 1.4 - 0.01 * i, 'error': 1.4 - 0.01 * i} for i in range(n)]
    rows.append({'step': n, 'eval/loss': 1.2, 'eval/accuracy': 0.55})
    _write_jsonl(save_dir / 'train_reward_stats.jsonl', rows)
    (save_dir / 'train_reward_hparams.json').write_text(json.dumps({'labels': {'type': 'best_of_4'}}))


def _is_png(path):
    return path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_both_trainers_pngs(tmp_path):
    _policy_run(tmp_path)
    _reward_run(tmp_path)
    written = plots.plot_learning_curves(str(tmp_path))
    assert sorted(Path(p).name for p in written) == ['train_policy_curves.png', 'train_reward_curves.png']
    assert all(_is_png(Path(p)) for p in written)


def test_policy_panels_and_kl_target(tmp_path, monkeypatch):
    _policy_run(tmp_path, target=4.5)
    drawn = {}
    real_draw = plots._draw

    def spy(panels, out, *, title):
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        for draw, panel_title in panels:
            fig, ax = plt.subplots()
            draw(ax)
            drawn[panel_title] = ([line.get_ydata() for line in ax.get_lines()], ax.get_legend_handles_labels()[1])
            plt.close(fig)
        return real_draw(panels, out, title=title)
    monkeypatch.setattr(plots, '_draw', spy)
    plots.plot_learning_curves(str(tmp_path))
    assert list(drawn) == [title for _, title in plots.POLICY_PANELS]
    kl_lines, kl_labels = drawn['objective/kl (nats per response)']
    assert 'adaptive target 4.5' in kl_labels
    assert any(len(set(y)) == 1 and y[0] == 4.5 for y in kl_lines)  # the horizontal target line
    # The raw curve is plotted as logged.
    score_lines, _ = drawn['objective/score (reward model)']
    assert list(score_lines[0]) == pytest.approx([0.1 * i for i in range(30)])


def test_missing_metrics_skip_their_panel(tmp_path, monkeypatch):
    # A fixed-KL run logged without value stats: no var_explained panel, and no target line.
    _write_jsonl(tmp_path / 'train_policy_stats.jsonl',
                 [{'step': i, 'objective/score': i, 'objective/kl': i, 'objective/kl_coef': 0.1} for i in range(5)])
    titles = []
    monkeypatch.setattr(plots, '_draw', lambda panels, out, *, title: titles.extend(t for _, t in panels) or out)
    plots.plot_learning_curves(str(tmp_path))
    assert titles == ['objective/score (reward model)', 'objective/kl (nats per response)', 'objective/kl_coef']


def test_resumed_run_keeps_last_value_per_step(tmp_path):
    path = tmp_path / 'train_policy_stats.jsonl'
    _write_jsonl(path, [{'step': 0, 'objective/kl': 1.0}, {'step': 1, 'objective/kl': 2.0},
                        {'step': 1, 'objective/kl': 3.0}, {'step': 2, 'objective/kl': 4.0}])
    assert plots.read_stats(str(path))['objective/kl'] == ([0, 1, 2], [1.0, 3.0, 4.0])


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='no stats to plot in .*train_reward_stats.jsonl or train_policy_stats.jsonl'):
        plots.plot_learning_curves(str(tmp_path))
    (tmp_path / 'train_reward_stats.jsonl').write_text('{"step": 0, "loss": 1}\nnot json\n')
    with pytest.raises(ValueError, match='train_reward_stats.jsonl line 2 is not valid JSON'):
        plots.plot_learning_curves(str(tmp_path))


@pytest.mark.slow
def test_cli_combined_figure(tmp_path):
    """`python sample.py plot`: the per-trainer PNGs again, or every panel in one figure."""
    _policy_run(tmp_path)
    _reward_run(tmp_path)
    out = tmp_path / 'fig' / 'combined.png'
    result = subprocess.run([sys.executable, 'sample.py', 'plot', '--save_dir', str(tmp_path), '--out', str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _is_png(out) and result.stdout == f'{out}\n'
    empty = tmp_path / 'empty'
    empty.mkdir()
    result = subprocess.run([sys.executable, 'sample.py', 'plot', '--save_dir', str(empty)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr == f'error: no stats to plot in {empty}: expected ' \
        'train_reward_stats.jsonl or train_policy_stats.jsonl\n'


def test_combined_figure_panels(tmp_path, monkeypatch):
    _policy_run(tmp_path)
    _reward_run(tmp_path)
    titles = []
    monkeypatch.setattr(plots, '_draw', lambda panels, out, *, title: titles.extend(t for _, t in panels) or out)
    plots.plot_combined(str(tmp_path), str(tmp_path / 'a.png'))
    assert titles == [t for _, t in plots.POLICY_PANELS] + [t for _, t in plots.REWARD_PANELS]
    # Extra panels come last: the demo adds the rule score of samples before and after PPO.
    from lm_human_preferences import demo
    from lm_human_preferences.demo import commands
    titles.clear()
    report = {'eval_queries': 256, 'rule_initial_mean': 2.8, 'rule_initial_std': 1.2,
              'rule_trained_mean': 5.2, 'rule_trained_std': 1.5}
    plots.plot_combined(str(tmp_path), str(tmp_path / 'b.png'), extra_panels=[commands.score_panel(demo.EXPERIMENT, report)])
    assert titles[-1] == 'demo: rule score of 256 samples on test queries' and len(titles) == 8
