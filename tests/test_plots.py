"""Learning-curve plots (training/plots.py) from the trainers' stats JSONL files."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm_human_preferences.training import plots

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


def _spy_on_panels(monkeypatch):
    """{panel title: (each line's y data, the legend's labels)} of the panels plot_learning_curves draws."""
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
    return drawn


def test_policy_panels_and_kl_target(tmp_path, monkeypatch):
    _policy_run(tmp_path, target=4.5)
    drawn = _spy_on_panels(monkeypatch)
    plots.plot_learning_curves(str(tmp_path))
    # every panel but the online loop's, which this run did not log
    assert list(drawn) == [title for metric, title in plots.POLICY_PANELS if not metric.startswith('online/')]
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
    # A damaged line with lines after it: no append leaves that (a torn last line: tests/test_run.py).
    (tmp_path / 'train_reward_stats.jsonl').write_text('{"step": 0, "loss": 1}\nnot json\n{"step": 1, "loss": 2}\n')
    with pytest.raises(ValueError, match=r'train_reward_stats.jsonl line 2 is not valid JSON \(Expecting value: .*\), '
                                         r'with lines after it .*: delete that line and rerun'):
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
    assert titles == [t for m, t in plots.POLICY_PANELS if not m.startswith('online/')] + [t for _, t in plots.REWARD_PANELS]
    # Extra panels come last: the demo adds the rule score of samples before and after PPO.
    from lm_human_preferences import demo
    from lm_human_preferences.offline import report as offline_report
    titles.clear()
    report = {'eval_queries': 256, 'rule_initial_mean': 2.8, 'rule_initial_std': 1.2,
              'rule_trained_mean': 5.2, 'rule_trained_std': 1.5}
    plots.plot_combined(str(tmp_path), str(tmp_path / 'b.png'), extra_panels=[offline_report.score_panel(demo.EXPERIMENT, report)])
    assert titles[-1] == 'rule score of 256 samples\non test queries' and len(titles) == 8


# ---- what the figures show (read back through matplotlib's objects) ----

@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures drawn (plots.figure), by the path they are saved to."""
    drawn = {}
    real_draw = plots._draw

    def spy(panels, out, *, title):
        real_figure = plots.figure

        def keep(panels, *, title):
            drawn[str(out)] = fig = real_figure(panels, title=title)
            return fig
        monkeypatch.setattr(plots, 'figure', keep)
        try:
            return real_draw(panels, out, title=title)
        finally:
            monkeypatch.setattr(plots, 'figure', real_figure)
    monkeypatch.setattr(plots, '_draw', spy)
    return drawn


def _axes(fig):
    return {ax.get_title(): ax for ax in fig.axes}


def _legend(ax):
    return ax.get_legend_handles_labels()[1]


def test_controller_values_are_plotted_raw_and_raw_lines_are_labelled(tmp_path, figures):
    _policy_run(tmp_path)
    _reward_run(tmp_path)
    plots.plot_learning_curves(str(tmp_path))
    axes = _axes(figures[str(tmp_path / 'train_policy_curves.png')])
    # kl_coef is what the controller set: one line, the logged values (no EMA lagging behind them).
    kl_coef = axes['objective/kl_coef']
    assert len(kl_coef.get_lines()) == 1
    assert list(kl_coef.get_lines()[0].get_ydata()) == pytest.approx([0.15 + 0.001 * i for i in range(30)])
    assert _legend(kl_coef) == ['each PPO batch (raw)']
    # A noisy metric: its raw values and their EMA, both named in the legend.
    score = axes['objective/score (reward model)']
    assert _legend(score) == ['each PPO batch (raw)', 'EMA 0.1 (smoothed)']
    assert list(score.get_lines()[0].get_ydata()) == pytest.approx([0.1 * i for i in range(30)])
    loss = _axes(figures[str(tmp_path / 'train_reward_curves.png')])['reward model loss']
    assert _legend(loss)[:2] == ['each train minibatch (raw)', 'EMA 0.1 (smoothed)']


def _demo_run(save_dir):
    """A finished demo's save dir: both trainers' stats (with the accuracy on the training labels) and
    its report."""
    _policy_run(save_dir)
    _reward_run(save_dir)
    with open(save_dir / 'train_reward_stats.jsonl', 'a') as f:
        f.write(json.dumps({'step': 20, 'eval_train/loss': 1.0, 'eval_train/accuracy': 0.7}) + '\n')
    (save_dir / 'demo_report.json').write_text(json.dumps(dict(
        eval_queries=256, rule_initial_mean=2.7, rule_initial_std=1.3, rule_trained_mean=5.0, rule_trained_std=1.4,
        kl=3.6, rm_heldout_accuracy=0.55, rm_chance_accuracy=0.25, rm_ceiling_accuracy=0.785)))


def test_accuracy_panel_shows_training_labels_chance_and_the_demos_ceiling(tmp_path, figures):
    from lm_human_preferences import demo
    from lm_human_preferences.offline import report as offline_report
    _demo_run(tmp_path)
    path = offline_report.plot_report(demo.EXPERIMENT, str(tmp_path))
    assert path == str(tmp_path / 'demo_curves.png') and _is_png(Path(path))
    accuracy = _axes(figures[path])['reward model accuracy']
    bars = {t.get_text(): p.get_height() for t, p in zip(accuracy.get_xticklabels(), accuracy.patches)}
    assert bars == {'held-out labels\n(eval/accuracy)': 0.55, 'training labels\n(eval_train/accuracy)': 0.7}
    assert _legend(accuracy) == ['chance 25%', 'a perfect learner of the rule 78.5%']
    assert [line.get_ydata()[0] for line in accuracy.get_lines()] == [0.25, 0.785]
    # No report, no demo figure.
    assert offline_report.plot_report(demo.EXPERIMENT, str(tmp_path / 'elsewhere')) is None


def _rows_of(fig):
    """The axes of fig grouped by row (top first), each row left to right."""
    rows = {}
    for ax in fig.axes:
        rows.setdefault(round(ax.get_position().y0, 3), []).append(ax)
    return [sorted(row, key=lambda ax: ax.get_position().x0) for _, row in sorted(rows.items(), reverse=True)]


@pytest.mark.parametrize('n', range(1, 11))
def test_no_empty_slot(n):
    panels = [(lambda ax: ax.plot([0, 1]), f'panel {i}') for i in range(n)]
    fig = plots.figure(panels, title='t')
    rows = _rows_of(fig)
    assert [ax.get_title() for row in rows for ax in row] == [f'panel {i}' for i in range(n)]
    assert all(ax.axison for ax in fig.axes)  # every slot holds a panel: none blank
    assert max(map(len, rows)) - min(map(len, rows)) <= 1
    # Every row spans the figure's width: a shorter row's panels are wider.
    left, right = rows[0][0].get_position().x0, rows[0][-1].get_position().x1
    for row in rows:
        assert row[0].get_position().x0 == pytest.approx(left, abs=0.02)
        assert row[-1].get_position().x1 == pytest.approx(right, abs=0.02)


def test_plot_command_draws_the_demos_figure(tmp_path, figures, capsys):
    """`sample.py plot` on a demo's save dir draws its figures again, demo_curves.png among them, and with
    --out the same panels as that figure (the demo's rule score included), with no empty slot."""
    import sample as top_sample
    from lm_human_preferences.utils import launch
    _demo_run(tmp_path)
    launch.main(top_sample.COMMANDS, argv=['plot', '--save_dir', str(tmp_path)])
    names = ['train_reward_curves.png', 'train_policy_curves.png', 'demo_curves.png']
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / n) for n in names]
    demo_titles = [ax.get_title() for row in _rows_of(figures[str(tmp_path / 'demo_curves.png')]) for ax in row]
    assert len(demo_titles) == 8 and demo_titles[-1] == 'rule score of 256 samples\non test queries'
    out = tmp_path / 'fig.png'
    launch.main(top_sample.COMMANDS, argv=['plot', '--save_dir', str(tmp_path), '--out', str(out)])
    fig = figures[str(out)]
    assert [ax.get_title() for row in _rows_of(fig) for ax in row] == demo_titles
    assert [len(row) for row in _rows_of(fig)] == [4, 4]
    # A save dir that is not the demo's: its 7 panels fill two rows, 4 and 3.
    (tmp_path / 'demo_report.json').unlink()
    launch.main(top_sample.COMMANDS, argv=['plot', '--save_dir', str(tmp_path), '--out', str(out)])
    assert [len(row) for row in _rows_of(figures[str(out)])] == [4, 3]


def test_online_rounds_panel(tmp_path, monkeypatch):
    """The online loop logs each round's pi-beats-rho at its PPO batch, in a row of its own (online/loop.py)."""
    _policy_run(tmp_path)
    with open(tmp_path / 'train_policy_stats.jsonl', 'a') as f:
        for step, wins in ((10, 0.7), (20, 0.8)):
            f.write(json.dumps({'step': step, 'online/round': step // 10, 'online/pi_beats_rho': wins}) + '\n')
    drawn = _spy_on_panels(monkeypatch)
    plots.plot_learning_curves(str(tmp_path))
    lines, labels = drawn['online: pi beats rho\n(validation labels, each round)']
    assert list(lines[0]) == [0.7, 0.8] and labels == ['each round', 'chance (as many of each)']
    assert list(lines[1]) == [0.5, 0.5]
