"""The frontier command (lm_human_preferences/frontier/) at a toy size: the demo's pipeline with a model of width 8
pretrained for 2 steps and a handful of labels. The DPO arm's round trip through TRL's DPOTrainer (export, train,
import, report); the sweep's resume after a kill -9 (the killed run finished, not repeated; none run twice); the
table regenerated from the results alone; the options' one-line errors. That the full sweep measures something is
docs/frontier.md's business."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lm_human_preferences import demo
from lm_human_preferences.frontier import sweep, table
from lm_human_preferences.utils.command_line import ConfigError
from conftest import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]
top_launch = load_script('top_launch', 'launch.py')

# The demo shrunk: the same phases in seconds (the fixture shrinks its model, held-out labels and eval queries).
TOY = {'rewards.train_new_model.labels.num_train': '16',
       'rewards.train_new_model.batch_size': '8',
       'rewards.train_new_model.normalize_samples': '8',
       'rewards.train_new_model.rollout_batch_size': '8',
       'ppo.batch_size': '32',
       'ppo.total_episodes': '64',
       'run.save_interval': '1',
       'run.log_interval': '100'}
SHRINK = textwrap.dedent('''
    import dataclasses
    from lm_human_preferences import demo
    exp = demo.EXPERIMENT
    demo.EXPERIMENT = dataclasses.replace(
        exp, held_out_labels=8, eval_queries=8,
        pretrain=dataclasses.replace(exp.pretrain, n_layer=1, n_embd=8, n_head=2, steps=2, batch_size=2))
''')


@pytest.fixture
def toy_demo(monkeypatch):
    exp = demo.EXPERIMENT
    monkeypatch.setattr(demo, 'EXPERIMENT', dataclasses.replace(
        exp, held_out_labels=8, eval_queries=8,
        pretrain=dataclasses.replace(exp.pretrain, n_layer=1, n_embd=8, n_head=2, steps=2, batch_size=2)))
    return demo.EXPERIMENT


def frontier(tmp_path, **options):
    options = {'seeds': '1', 'out': str(tmp_path / 'out'), 'figure': str(tmp_path / 'frontier.png'),
               'doc': str(tmp_path / 'frontier.md'), 'best_of_n_queries': 4, 'dpo_batch_size': 8, **TOY, **options}
    top_launch.launch_commands.frontier_command(top_launch.launch_train_policy, top_launch.launch_train_reward,
                                                top_launch.get_experiments)('demo', **options)


@pytest.mark.slow  # TRL's import and DPOTrainer's set-up alone take seconds
def test_dpo_round_trip_and_best_of_n(tmp_path, toy_demo, capsys):
    pytest.importorskip('trl', reason="the frontier's dpo arm needs the baselines extra: pip install -e '.[baselines]'")
    # a rate high enough that 6 steps move the toy model measurably
    frontier(tmp_path, arms='best_of_n,dpo', points='best_of_n=2,4;dpo=0.1', dpo_learning_rate=0.03)
    out = capsys.readouterr().out
    seed_dir = tmp_path / 'out' / 'seed1'
    # the seed's reward model, trained once for both arms, and the initial model exported for TRL
    assert out.count('[frontier] seed 1: training its reward model') == 1
    assert (seed_dir / 'reward' / 'reward_model').is_dir()
    export = json.loads((seed_dir / 'initial_hf' / 'lmhp_export.json').read_text())
    assert export['encoding'] == 'test'
    # DPOTrainer trained on the seed's training labels alone (16 best-of-4 labels: 48 pairs, one pass of 8 a step),
    # saved a Hugging Face folder that our import reads back (the `test` tokenizer) and that the report scored.
    trained = json.loads((seed_dir / 'dpo-beta0.1' / 'policy_hf' / 'trained.json').read_text())
    assert trained['pairs'] == 48 and trained['steps'] == 6 and trained['beta'] == 0.1
    from safetensors.torch import load_file
    before, after = (load_file(str(seed_dir / folder / 'model.safetensors')) for folder in ('initial_hf', 'dpo-beta0.1/policy_hf'))
    assert set(before) <= set(after) and any(not bool((before[k] == after[k]).all()) for k in before)  # it trained
    from lm_human_preferences.language import hf_import
    assert hf_import.read_encoding(str(seed_dir / 'dpo-beta0.1' / 'policy_hf'),
                                   hf_import.read_hparams(str(seed_dir / 'dpo-beta0.1' / 'policy_hf'))).name == 'test'
    rows = [json.loads(line) for line in (tmp_path / 'out' / 'frontier.jsonl').read_text().splitlines()]
    assert [(r['arm'], r['value']) for r in sorted(rows, key=lambda r: (r['arm'], r['value']))] == [
        ('best_of_n', 2), ('best_of_n', 4), ('dpo', 0.1)]
    dpo_row = next(r for r in rows if r['arm'] == 'dpo')
    assert dpo_row['kl_kind'] == 'measured' and dpo_row['kl'] > 0 and dpo_row['gain_se'] > 0
    assert 0 <= dpo_row['rm_initial'] <= 1 and 0 <= dpo_row['rm_trained'] <= 1
    bound = [r['kl'] for r in rows if r['arm'] == 'best_of_n']
    assert bound == pytest.approx([0.5 * 0 + (0.6931471805599453 - 0.5), 1.3862943611198906 - 0.75])
    assert re.search(r'^\[frontier 1/2\] best_of_n seed 1: 2: [+-][\d.]+ ± [\d.]+ sd at 0\.19 nats; 4: ', out, re.M), out
    assert re.search(r'^\[frontier 2/2\] dpo seed 1 beta 0\.1: [+-][\d.]+ ± [\d.]+ sd at [\d.]+ nats \(RM ', out, re.M)
    assert (tmp_path / 'frontier.png').stat().st_size > 0 and table.BEGIN in (tmp_path / 'frontier.md').read_text()


def test_table_only_regenerates_from_the_results(tmp_path, capsys):
    """The table, plot, doc and README summary from frontier.json files alone (no model is loaded), the gain at the
    budget interpolated per seed, each arm against offline PPO paired by seed; the doc's own text outside the
    markers kept, a README without the markers left alone."""
    out = tmp_path / 'out'
    for arm, offset in (('ppo', 0.0), ('online', 0.5)):
        for seed, gains in ((1, (0.5, 1.5, 2.5)), (2, (1.0, 2.0, 3.0))):
            for kl_coef, gain, kl, rm in zip((0.3, 0.2, 0.1), gains, (2.0, 4.0, 8.0), (0.6, 0.5, 0.4)):
                run = out / f'seed{seed}' / f'{arm}-kl_coef{kl_coef}'
                run.mkdir(parents=True)
                gain += offset * (seed == 1)  # online: 0.5 more on seed 1, the same on seed 2
                point = dict(value=kl_coef, gain=gain, gain_se=0.05, kl=kl, kl_se=0.1, kl_kind='measured',
                             kl_objective=kl, rm_initial=0.6, rm_trained=rm)
                (run / sweep.DONE).write_text(json.dumps(dict(identity=dict(arm=arm, seed=seed), command='cmd',
                                                              points=[point])))
    doc, readme = tmp_path / 'frontier.md', tmp_path / 'README.md'
    doc.write_text(f'# Title\n\nwords\n{table.BEGIN}\nold\n{table.END}\nafter\n')
    readme.write_text(f'# Readme\n{table.SUMMARY_BEGIN}\nold\n{table.SUMMARY_END}\nrest\n')
    frontier(tmp_path, arms='ppo,online', seeds='1,2', table_only=True, readme=str(readme), kl_budget='6,3')
    text = doc.read_text()
    assert text.startswith('# Title\n\nwords\n') and text.endswith(f'{table.END}\nafter\n') and 'old' not in text
    # seed 1: 6 nats lies between (4, 1.5) and (8, 2.5): 2.0; seed 2: 2.5; mean 2.25, sd 0.35; the reward model on
    # the trained policy's samples 0.45 at 6 nats on both seeds
    assert '| offline PPO (kl_coef) | +2.00 | +2.50 | +2.25 ± 0.35 (2 seeds) | 45.0 % ± 0.0 |' in text
    # online less offline, paired by seed: +0.5 on seed 1, 0 on seed 2: more on one of two seeds
    assert '| online PPO, 3 retrains (kl_coef) | +0.50 | +0.00 | +0.25 ± 0.35 (2 seeds) | 1 of 2 |' in text
    # the second budget, its own section: 3 nats lies between (2, 0.5) and (4, 1.5) on seed 1, (2, 1.0) and (4, 2.0)
    # on seed 2; the reward model 0.55 between 0.6 and 0.5
    at_3 = text[text.index('### Gain at 3 nats'):text.index('### Every point')]
    assert '| offline PPO (kl_coef) | +1.00 | +1.50 | +1.25 ± 0.35 (2 seeds) | 55.0 % ± 0.0 |' in at_3
    printed = capsys.readouterr().out
    assert 'frontier: ppo at 6 nats: +2.25 ± 0.35 (seeds: +2.00, +2.50)' in printed
    assert 'frontier: ppo at 3 nats: +1.25 ± 0.35 (seeds: +1.00, +1.50)' in printed
    assert len((out / 'frontier.jsonl').read_text().splitlines()) == 12 and (tmp_path / 'frontier.png').is_file()
    summary = readme.read_text()
    assert summary.startswith(f'# Readme\n{table.SUMMARY_BEGIN}\n') and summary.endswith(f'{table.SUMMARY_END}\nrest\n')
    assert '+2.25 ± 0.35 (2 seeds)' in summary and '![gain against KL](frontier.png)' in summary and 'old' not in summary
    assert '+1.25 ± 0.35' not in summary  # the README: the first budget only
    readme.write_text('# A README without the markers\n')
    frontier(tmp_path, arms='ppo', seeds='1,2', table_only=True, readme=str(readme))
    assert readme.read_text() == '# A README without the markers\n'


def test_gain_at_does_not_extrapolate():
    rows = [dict(kl=2.0, gain=1.0), dict(kl=4.0, gain=2.0)]
    assert table.gain_at(rows, 3.0) == pytest.approx(1.5)
    assert table.gain_at(rows, 6.0) is None


@pytest.mark.parametrize('options, message', [
    (dict(arms='ppo,sft'), '--arms ppo,sft: sft is not an arm (choose from: ppo, online, best_of_n, dpo)'),
    (dict(seeds='1,x'), '--seeds 1,x: a comma-separated list of ints'),
    (dict(kl_budget='6,x'), '--kl_budget 6,x: a comma-separated list of floats'),
    (dict(kl_budget='6,0'), '--kl_budget 6,0: KLs in nats, each above 0'),
    (dict(arms='ppo', points='dpo=0.1'), '--points dpo=0.1: dpo is not in --arms'),
    (dict(arms='best_of_n', points='best_of_n=3,4'), '--points best_of_n=3,4: n must be positive powers of 2'),
    (dict(arms='ppo', points='ppo'), '--points ppo: each part is ARM=V1,V2,... with ARM one of'),
    (dict(arms='online', **{'rewards.train_new_model.labels.num_train': '24'}),
     'the online arm trains on a quarter of labels.num_train (24) first'),
])
def test_bad_options_are_one_line_before_any_work(tmp_path, options, message):
    with pytest.raises(ConfigError, match='^' + message.replace('(', r'\(').replace(')', r'\)').replace('.', r'\.')):
        frontier(tmp_path, **options)
    assert not (tmp_path / 'out').exists()


@pytest.mark.slow  # two sweeps of three toy PPO runs in processes of their own
def test_a_killed_sweep_resumes_the_killed_run_and_repeats_none(tmp_path):
    """kill -9 the sweep while its second run trains; the rerun keeps the first run's results, resumes the second
    from its saved state and runs the third: every run finished once."""
    script = tmp_path / 'sweep.py'
    args = ['demo', '--arms', 'ppo', '--seeds', '1', '--points', 'ppo=0.2,0.1,0.05', '--out', str(tmp_path / 'out'),
            '--figure', str(tmp_path / 'f.png'), '--doc', str(tmp_path / 'f.md')]
    for k, v in TOY.items():
        args += [f'--{k}', v]
    script.write_text(SHRINK + textwrap.dedent(f'''
        import runpy, sys
        sys.argv = ['launch.py', 'frontier'] + {args!r}
        runpy.run_path({str(REPO_ROOT / 'launch.py')!r}, run_name='__main__')
    '''))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), LMHP_CPU_THREADS='1')
    first = tmp_path / 'out' / 'seed1' / 'ppo-kl_coef0.2'
    second = tmp_path / 'out' / 'seed1' / 'ppo-kl_coef0.1'
    with open(tmp_path / 'first.log', 'w') as log:
        proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 300
        # Killed once the second run has saved a training state (its first PPO batch) and before it is finished.
        while not list(second.glob('**/train_state/state-*.json')) and proc.poll() is None:
            assert time.time() < deadline, (tmp_path / 'first.log').read_text()[-3000:]
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / 'first.log').read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (first / sweep.DONE).is_file() and not (second / sweep.DONE).exists(), (tmp_path / 'first.log').read_text()
    first_done = (first / sweep.DONE).stat().st_mtime_ns
    rerun = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = [line for line in rerun.stdout.splitlines() if line.startswith('[frontier ')]
    assert [line.split(':')[0] for line in lines] == [
        '[frontier 1/3] ppo seed 1 kl_coef 0.2', '[frontier 2/3] ppo seed 1 kl_coef 0.1', '[frontier 3/3] ppo seed 1 kl_coef 0.05']
    assert 'done earlier' in lines[0] and 'done earlier' not in lines[1] + lines[2]
    assert (first / sweep.DONE).stat().st_mtime_ns == first_done  # not run again
    assert 'resum' in rerun.stdout.lower()  # the killed run went on from its saved state
    # Every run's stats end as an uninterrupted run's: each of its 2 PPO batches once.
    for run in ('ppo-kl_coef0.2', 'ppo-kl_coef0.1', 'ppo-kl_coef0.05'):
        steps = [json.loads(line)['step'] for line in
                 (tmp_path / 'out' / 'seed1' / run / 'train_policy_stats.jsonl').read_text().splitlines()]
        assert len(steps) == 2 and len(set(steps)) == 2, (run, steps)
    again = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.stdout.count('done earlier') == 3, again.stdout[-2000:]


def test_dpo_cpu_tiles_keep_trls_log_probs_and_gradients():
    """dpo.cpu_tiles only regroups TRL's fused LM head (tiles a core's cache holds): the same log-probabilities, entropy
    and gradients as TRL's own tiles, at sizes where both cut the tokens and the vocabulary into several tiles; TRL's
    settings restored after. The installed TRL must have the settings, or the DPO arm silently runs 3x slower."""
    pytest.importorskip('trl', reason="the frontier's dpo arm needs the baselines extra: pip install -e '.[baselines]'")
    import torch
    import transformers
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as trl_utils
    from lm_human_preferences.frontier import dpo
    default = (kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE)
    tile = (64, 384)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1500, n_positions=64, n_embd=16,
                                                                 n_layer=1, n_head=2)).eval()  # no dropout
    trl_utils.add_fused_lm_head(model, outputs=('log_probs', 'entropy'))
    input_ids = torch.randint(0, 1500, (5, 40))  # 200 scored tokens: 4 tiles of 64 (TRL's: 1), 4 of 384 entries
    labels = input_ids.masked_fill(torch.rand(5, 40) < 0.3, -100)

    def run():
        model.zero_grad()
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        return [out.log_probs.detach(), out.entropy.detach()] + [p.grad.clone() for p in model.parameters()]

    expected = run()
    with dpo.cpu_tiles(tile):
        assert (kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == tile
        tiled = run()
    assert (kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == default
    assert default[0] > 200 and default[1] > 1500  # TRL's own tiles hold it whole: the two runs group differently
    for a, b in zip(expected, tiled):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_dpo_pairs_are_the_labels_as_export_labels_pairs_them():
    """A best-of-4 record is three pairs, its best against each other response (labeling/export.py's label_pairs),
    as texts with the task's query prefix and suffix; the padding token decodes to ''."""
    from lm_human_preferences.frontier import dpo
    from lm_human_preferences.language import encodings
    from lm_human_preferences.lm_tasks import TaskHParams
    encoder = encodings.Test.get_encoder()
    task = TaskHParams(query_prefix='q:', query_suffix='>')
    record = dict(query=encoder.encode('ab'), best=2, **{f'sample{i}': encoder.encode(text) for i, text in
                                                          enumerate(('x', 'y', 'e.e', 'z'))})
    record['sample3'] = record['sample3'] + [encoder.padding_token]
    rows = dpo.preference_rows([record], task, 'test', 'best_of_4')
    assert rows == dict(prompt=['q:ab>'] * 3, chosen=['e.e'] * 3, rejected=['x', 'y', 'z'])
