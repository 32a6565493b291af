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
import torch

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
    frontier(tmp_path, arms='best_of_n,dpo', points='best_of_n=2,4;dpo=0.1', lr='dpo=0.03')
    out = capsys.readouterr().out
    seed_dir = tmp_path / 'out' / 'seed1'
    # the seed's reward model, trained once for both arms, and the initial model exported for TRL
    assert out.count('[frontier] seed 1: training its reward model') == 1
    assert (seed_dir / 'reward' / 'reward_model').is_dir()
    export = json.loads((seed_dir / 'initial_hf' / 'lmhp_export.json').read_text())
    assert export['encoding'] == 'test'
    # DPOTrainer trained on the seed's training labels alone (16 best-of-4 labels: 48 pairs, one pass of 8 a step),
    # saved a Hugging Face folder that our import reads back (the `test` tokenizer) and that the report scored.
    run = seed_dir / 'dpo-beta0.1-lr0.03'  # a rate other than DPO's default names its run
    trained = json.loads((run / 'policy_hf' / 'trained.json').read_text())
    assert trained['pairs'] == 48 and trained['steps'] == 6 and trained['beta'] == 0.1
    assert trained['final_loss'] > 0 and 0 <= trained['final_pair_accuracy'] <= 1
    from safetensors.torch import load_file
    before, after = (load_file(str(folder / 'model.safetensors'))
                     for folder in (seed_dir / 'initial_hf', run / 'policy_hf'))
    assert set(before) <= set(after) and any(not bool((before[k] == after[k]).all()) for k in before)  # it trained
    from lm_human_preferences.language import hf_import
    hf_dir = str(run / 'policy_hf')
    assert hf_import.read_encoding(hf_dir, hf_import.read_hparams(hf_dir)).name == 'test'
    rows = [json.loads(line) for line in (tmp_path / 'out' / 'frontier.jsonl').read_text().splitlines()]
    assert [(r['arm'], r['value']) for r in sorted(rows, key=lambda r: (r['arm'], r['value']))] == [
        ('best_of_n', 2), ('best_of_n', 4), ('dpo', 0.1)]
    dpo_row = next(r for r in rows if r['arm'] == 'dpo')
    assert dpo_row['kl_kind'] == 'measured' and dpo_row['kl'] > 0 and dpo_row['gain_se'] > 0 and dpo_row['lr'] == 0.03
    # the demo's task has no filter: every labelled pair kept; DPO's loss and pair accuracy kept with the point
    assert dpo_row['pairs'] == dict(kept=48, flipped=0, dropped=0) and dpo_row['dpo_final_loss'] == trained['final_loss']
    assert dpo_row['filter_pass'] == 1.0  # the share of its samples PPO's filter passes: all, without a filter
    # one baseline for the seed, stored, which every arm's gain is against
    baseline = json.loads((seed_dir / 'baseline' / sweep.DONE).read_text())['baseline']
    assert len(baseline['scores']) == toy_demo.eval_queries
    assert all(r['baseline_mean'] == baseline['mean'] and r['baseline_std'] == baseline['std'] for r in rows)
    # best-of-n on the same test queries as the other arms (the toy's 4), its gain in the baseline's unit
    assert all(r['queries'] == 4 for r in rows if r['arm'] == 'best_of_n')
    # each run's command makes it again from the repository
    done = json.loads((run / sweep.DONE).read_text())
    assert done['command'].startswith("python launch.py frontier demo --arms dpo --seeds 1 --points 'dpo=0.1' --lr "
                                      "'dpo=0.03'") and '$OUT/seed1/initial_hf' in done['trainer_command']
    assert 0 <= dpo_row['rm_initial'] <= 1 and 0 <= dpo_row['rm_trained'] <= 1
    bound = [r['kl'] for r in rows if r['arm'] == 'best_of_n']
    assert bound == pytest.approx([0.5 * 0 + (0.6931471805599453 - 0.5), 1.3862943611198906 - 0.75])
    assert re.search(r'^\[frontier 1/2\] best_of_n seed 1: 2: [+-][\d.]+ ± [\d.]+ sd at 0\.19 nats; 4: ', out, re.M), out
    assert re.search(r'^\[frontier 2/2\] dpo seed 1 beta 0\.1 lr 0\.03: [+-][\d.]+ ± [\d.]+ sd at [\d.]+ nats \(RM ', out,
                     re.M)
    assert (tmp_path / 'frontier.png').stat().st_size > 0 and table.BEGIN in (tmp_path / 'frontier.md').read_text()
    # the label axis: on the first 8 of the 16 labels (24 pairs) DPO takes the full count's 6 steps, two passes
    frontier(tmp_path, arms='dpo', points='dpo=0.1', lr='dpo=0.03', labels='8')
    labelled = json.loads((seed_dir / 'dpo-beta0.1-lr0.03-labels8' / 'policy_hf' / 'trained.json').read_text())
    assert labelled['pairs'] == 24 and labelled['steps'] == 6


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
    # (†: 6 nats lies 2 nats from the point below it on each seed, more than table.BRACKET)
    assert '| offline PPO (kl_coef) | +2.00† | +2.50† | +2.25 ± 0.35 (2 seeds) | 45.0 % ± 0.0 |' in text
    assert "† the seed's points around 6 nats lie more than 1.5 nats from it on a side" in text
    # online less offline, paired by seed: +0.5 on seed 1, 0 on seed 2: more on one of two seeds
    assert '| online PPO, 3 retrains (kl_coef) | +0.50 | +0.00 | +0.25 ± 0.35 (2 seeds) | 1 of 2 |' in text
    # the second budget, its own section: 3 nats lies between (2, 0.5) and (4, 1.5) on seed 1, (2, 1.0) and (4, 2.0)
    # on seed 2; the reward model 0.55 between 0.6 and 0.5
    at_3 = text[text.index('### Gain at 3 nats'):text.index('### Every point')]
    assert '| offline PPO (kl_coef) | +1.00 | +1.50 | +1.25 ± 0.35 (2 seeds) | 55.0 % ± 0.0 |' in at_3  # 1 nat: tight
    assert '† the seed' not in at_3
    printed = capsys.readouterr().out
    assert 'frontier: ppo at 6 nats: +2.25 ± 0.35 (seeds: +2.00, +2.50)' in printed
    assert 'frontier: ppo at 3 nats: +1.25 ± 0.35 (seeds: +1.00, +1.50)' in printed
    assert len((out / 'frontier.jsonl').read_text().splitlines()) == 12 and (tmp_path / 'frontier.png').is_file()
    # each Markdown links the plot from where it lies: the doc beside it, out's table from out
    assert '![gain against KL](frontier.png)' in text
    assert '![gain against KL](../frontier.png)' in (out / 'frontier.md').read_text()
    summary = readme.read_text()
    assert summary.startswith(f'# Readme\n{table.SUMMARY_BEGIN}\n') and summary.endswith(f'{table.SUMMARY_END}\nrest\n')
    assert '+2.25 ± 0.35 (2 seeds)' in summary and '![gain against KL](frontier.png)' in summary and 'old' not in summary
    assert '+1.25 ± 0.35' not in summary  # the README: the first budget only
    assert 'Against offline PPO' not in summary and 'Against offline PPO' in text  # its paired table: the doc's
    readme.write_text('# A README without the markers\n')
    frontier(tmp_path, arms='ppo', seeds='1,2', table_only=True, readme=str(readme))
    assert readme.read_text() == '# A README without the markers\n'


def test_gain_at_does_not_extrapolate():
    rows = [dict(kl=2.0, gain=1.0), dict(kl=4.0, gain=2.0)]
    assert table.gain_at(rows, 3.0) == pytest.approx(1.5)
    assert table.gain_at(rows, 6.0) is None


@pytest.mark.parametrize('options, message', [
    (dict(arms='ppo,sft'), '--arms ppo,sft: sft is not an arm (choose from: ppo, ppo_nofilter, ppo_4x, online, '
                           'best_of_n, dpo)'),
    (dict(arms='ppo', lr='dpo=1e-4'), '--lr dpo=1e-4: dpo is not in --arms'),
    (dict(arms='ppo', lr='ppo=x'), '--lr ppo=x: a comma-separated list of floats'),
    (dict(arms='ppo', lr='best_of_n=1'), '--lr best_of_n=1: each part is ARM=R1,R2,... with ARM one of'),
    (dict(arms='ppo', labels='8,12'), '--labels 8,12: each count at most labels.num_train (16) and a multiple of the '
                                      'reward batch_size (8)'),
    (dict(arms='ppo', labels='0'), '--labels 0: counts of training labels, each at least 1'),
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


def test_dpo_cpu_tiles_keep_trls_log_probs_and_gradients(monkeypatch):
    """dpo.cpu_tiles only regroups TRL's fused LM head (tiles a core's cache holds): the same log-probabilities, entropy
    and gradients as TRL's own tiles, at sizes where both cut the tokens and the vocabulary into several tiles; TRL's
    settings restored after. The installed TRL must have the settings, or the DPO arm silently runs 3x slower. On the
    CPU whatever the machine (on CUDA cpu_tiles leaves TRL's Triton kernels as they are)."""
    pytest.importorskip('trl', reason="the frontier's dpo arm needs the baselines extra: pip install -e '.[baselines]'")
    import torch
    import transformers
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as trl_utils
    from lm_human_preferences.frontier import dpo
    monkeypatch.setattr(dpo.utils, 'get_device', lambda: torch.device('cpu'))
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
    rows, counts = dpo.preference_rows([record], task, 'test', 'best_of_4')
    assert rows == dict(prompt=['q:ab>'] * 3, chosen=['e.e'] * 3, rejected=['x', 'y', 'z'])
    assert counts == dict(kept=3, flipped=0, dropped=0)  # the task has no filter


def test_dpo_pairs_follow_ppos_objective_under_the_filter():
    """PPO's score gives a response that fails the task's filter (no '.' at or after truncate_after) the penalty: DPO's
    pairs follow it. The labelled best passes: its pairs as labelled; the best fails and the other passes: flipped;
    both fail: dropped (one penalty each, no preference)."""
    from lm_human_preferences.frontier import dpo
    from lm_human_preferences.language import encodings
    from lm_human_preferences.lm_tasks import TaskHParams
    encoder = encodings.Test.get_encoder()
    task = TaskHParams(truncate_token=encoder.encode('.')[0], truncate_after=1, penalty_reward_value=0)
    texts = ('ab.', 'abc', 'a.', 'zz')  # pass, fail, pass, fail
    def record(best):
        return dict(query=encoder.encode('q'), best=best, **{f'sample{i}': encoder.encode(t) for i, t in enumerate(texts)})
    rows, counts = dpo.preference_rows([record(0), record(1)], task, 'test', 'best_of_4')
    # best 0 (passes) against 1, 2, 3: kept; best 1 (fails) against 0 and 2 (pass): flipped, against 3 (fails): dropped
    assert list(zip(rows['chosen'], rows['rejected'])) == [('ab.', 'abc'), ('ab.', 'a.'), ('ab.', 'zz'),
                                                           ('ab.', 'abc'), ('a.', 'abc')]
    assert counts == dict(kept=3, flipped=2, dropped=1)
    # without the filter (ppo_nofilter's objective) every pair is as labelled
    rows, counts = dpo.preference_rows([record(1)], dataclasses.replace(task, filter_responses=False), 'test',
                                       'best_of_4')
    assert rows['chosen'] == ['abc'] * 3 and counts == dict(kept=3, flipped=0, dropped=0)


def test_ppos_score_is_what_best_of_n_picks_by():
    """Best-of-n ranks by PPO's score (train_policy.make_score_fn: the reward model's score, penalty_reward_value for a
    response that fails the filter; report.best_of_n_rows's ppo_score column), and its gain is in the seed's baseline's
    unit, each tier against the initial policy's mean on its own queries."""
    import torch
    from lm_human_preferences import train_policy
    from lm_human_preferences.frontier import evaluate
    from lm_human_preferences.lm_tasks import TaskHParams

    class Scores:  # a reward model that likes the failing response best
        padding_token = 0
        def score_fn(self, queries, responses):
            return torch.tensor([5.0, 1.0, -1.0])
    task = TaskHParams(truncate_token=9, truncate_after=1, penalty_reward_value=0)
    responses = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 9]])  # fails, passes, passes
    score, _, _ = train_policy.make_score_fn(task, Scores())(torch.zeros(3, 1, dtype=torch.long), responses)
    assert score.tolist() == [0.0, 1.0, -1.0] and int(score.argmax()) == 1  # the failing 5.0 scores the penalty
    score, _, _ = train_policy.make_score_fn(dataclasses.replace(task, filter_responses=False), Scores())(
        torch.zeros(3, 1, dtype=torch.long), responses)
    assert score.tolist() == [5.0, 1.0, -1.0]

    calls = []
    def rows(exp, hparams, *, n, queries, seed, samples=None):
        calls.append((n, queries))
        return ([dict(k=k, reward_model_pick=9.0, reward_model_pick_std=1.0, ppo_score_pick=2.0 + k / 1000,
                      ppo_score_pick_std=0.5) for k in (1, 2, 4, 8)], torch.full((queries, n), 1.0 + n / 1000))
    original = evaluate.best_of_n_rows, evaluate.reward_model_on_samples, evaluate.ALL_QUERIES_MAX_N
    try:
        evaluate.best_of_n_rows = rows
        evaluate.reward_model_on_samples = lambda *a, **k: dict(rm_accuracy_initial_samples=0.6)
        evaluate.ALL_QUERIES_MAX_N = 2
        hparams = type('H', (), dict(task=task))()
        points = evaluate.best_of_n_points(None, hparams, [2, 4, 8], 'dir', queries=16, seed=1,
                                           baseline=dict(std=2.0, mean=0.0))
    finally:
        evaluate.best_of_n_rows, evaluate.reward_model_on_samples, evaluate.ALL_QUERIES_MAX_N = original
    # n <= 2 on all 16 queries; 4 and 8 on 16 x 2 / 8 = 4 queries (as many samples)
    assert calls == [(2, 16), (8, 4)]
    assert [p['queries'] for p in points] == [16, 4, 4]
    assert [p['gain'] for p in points] == pytest.approx([(2.002 - 1.002) / 2, (2.004 - 1.008) / 2, (2.008 - 1.008) / 2])
    assert points[0]['gain_se'] == pytest.approx(0.5 / 2 / 4)


def toy_sweep(tmp_path, **options):
    """A Sweep of the toy demo whose commands are never called (what it plans, names and checks); no dpo arm, which
    needs TRL (the `baselines` extra) installed."""
    return sweep.Sweep(demo.EXPERIMENT, str(tmp_path / 'out'), arms=['ppo', 'best_of_n'], seeds=[1],
                       points=sweep.parse_points(None, ['ppo', 'best_of_n']), train_policy=None,
                       train_reward=None, bound={'rewards.train_new_model.labels.num_train': 16,
                                                 'rewards.train_new_model.batch_size': 8, 'ppo.lr': 1e-4},
                       extra={}, best_of_n_queries=4, dpo_options={}, **options)


def test_the_label_axis_trains_on_a_prefix_and_holds_out_the_same_labels(tmp_path, toy_demo):
    """--labels 8: the first 8 of the seed's 16 training labels, and the same 8 held out after them (train_reward holds
    out the records past labels.num_train); its runs named for the count, the default count's not."""
    s = toy_sweep(tmp_path, labels=[8, 16])
    assert s.labels == [8, None]
    names = [s.run_name(run) for run in s.runs()]
    assert 'ppo-kl_coef0.3-labels8' in names and 'ppo-kl_coef0.3' in names and 'best_of_n-labels8' in names
    assert names.index('ppo-kl_coef0.3-labels8') < names.index('ppo-kl_coef0.3')  # the fewest labels first
    # stated before it starts: the runs, and their time at the arms' estimates
    plan = s.runs()
    expected = sum(sweep.ESTIMATED_SECONDS[r.arm] for r in plan)
    expected += 2 * sweep.ESTIMATED_SECONDS['reward']  # the seed's two reward models: 8 and 16 labels
    # best-of-n's second run of the seed ranks the samples its first drew
    expected -= (1 - sweep.BEST_OF_N_RANKING_SHARE) * sweep.ESTIMATED_SECONDS['best_of_n']
    assert s.plan_line(plan).startswith(f'frontier: {len(plan)} runs, 0 finished earlier; the rest about '
                                        f'{expected / 3600:.1f} h (with 2 reward models;')
    # DPO on 8 of 16 labels takes the full count's steps: a whole run's time
    assert s.label_share(sweep.Planned('dpo', 1, 0.4, labels=8)) == 1.0
    assert s.label_share(sweep.Planned('ppo', 1, 0.2, labels=8)) == 1.0
    assert s.label_share(sweep.Planned('best_of_n', 1, None, labels=8), draws=False) == sweep.BEST_OF_N_RANKING_SHARE
    # a PPO run finished in --out (of another point than the plan's): its time stands for PPO's runs
    other = tmp_path / 'out' / 'seed1' / 'ppo-kl_coef9'
    other.mkdir(parents=True)
    (other / sweep.DONE).write_text(json.dumps(dict(identity=dict(arm='ppo', seed=1, value=9), seconds=7200.0)))
    expected += sum(7200.0 - sweep.ESTIMATED_SECONDS['ppo'] for r in plan if r.arm == 'ppo')
    assert f'the rest about {expected / 3600:.1f} h' in s.plan_line(plan)
    records = [dict(query=[i], sample0=[i], best=0) for i in range(16 + 8)]
    reward_dir = tmp_path / 'out' / 'seed1' / 'reward'
    reward_dir.mkdir(parents=True)
    (reward_dir / 'demo_labels.json').write_text(json.dumps(records))
    made = json.loads(Path(s.label_prefix_file(1, 8)).read_text())
    assert made == records[:8] + records[16:]


@pytest.mark.slow  # two toy reward models and two best-of-n runs
def test_best_of_n_draws_its_samples_once_a_seed_for_every_label_count(tmp_path, toy_demo, monkeypatch):
    """The label axis's best-of-n runs rank one draw of the seed's samples (seed1/best_of_n_samples), each by its own
    reward model; ranked again from the file, they give the rows a fresh draw gives; a file of other settings is
    refused in one line."""
    from lm_human_preferences.frontier import evaluate
    from lm_human_preferences.offline import report
    draws = []
    def counted(*args, **kwargs):
        draws.append(kwargs['n'])
        return report.best_of_n_samples(*args, **kwargs)
    monkeypatch.setattr(evaluate, 'best_of_n_samples', counted)
    frontier(tmp_path, arms='best_of_n', points='best_of_n=2,4', labels='8,16')
    assert draws == [4]  # the labels-8 run drew them, the 16-label run read them back
    kept = tmp_path / 'out' / 'seed1' / 'best_of_n_samples' / 'n4-queries4.safetensors'
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]
    done = {name: json.loads((tmp_path / 'out' / 'seed1' / name / sweep.DONE).read_text())
            for name in ('best_of_n', 'best_of_n-labels8')}
    assert {name: d['drew_samples'] for name, d in done.items()} == {'best_of_n': False, 'best_of_n-labels8': True}
    s = toy_sweep(tmp_path)
    hparams = s.seed_hparams(1)
    identity = dict(experiment='demo', seed=1, initial_model=s.reward_fingerprints(s.reward_dir(1))['initial model'])
    samples = evaluate.kept_best_of_n_samples(toy_demo, hparams.task, n=4, queries=4, seed=1,
                                              samples_dir=str(kept.parent), identity=identity)
    assert draws == [4]
    fresh = report.best_of_n_rows(toy_demo, hparams, n=4, queries=4, seed=1)
    assert report.best_of_n_rows(toy_demo, hparams, n=4, queries=4, seed=1, samples=samples)[0] == fresh[0]
    assert torch.equal(samples['labeler_scores'], fresh[1])
    with pytest.raises(ValueError, match=r'n4-queries4\.safetensors holds best-of-n samples of other settings \(.*'
                                         r'"seed": 1.*this run: .*"seed": 2.*remove it to draw them again'):
        evaluate.kept_best_of_n_samples(toy_demo, hparams.task, n=4, queries=4, seed=2, samples_dir=str(kept.parent),
                                        identity=dict(identity, seed=2))


def test_a_reward_model_of_other_settings_or_labels_is_refused(tmp_path, toy_demo, monkeypatch):
    """A finished reward model in --out is reused only if made with this sweep's hparams and its count of training
    labels (which the experiment binds, not the command line), from the labels and the initial model it was made
    from: else one line, and nothing is trained."""
    from lm_human_preferences import train_reward
    from lm_human_preferences.utils import hyperparams
    s = toy_sweep(tmp_path)
    reward_dir = tmp_path / 'out' / 'seed1' / 'reward'
    reward_dir.mkdir(parents=True)
    def trained_on(num_train):  # as the reward model's run saved its hparams
        saved = train_reward.HParams()
        saved.labels.num_train = num_train
        hyperparams.save_json(saved, str(reward_dir / 'train_reward_hparams.json'))
    trained_on(16)
    fingerprints = {'labels': 'a' * 64, 'initial model': 'b' * 64}
    monkeypatch.setattr(sweep.Sweep, 'reward_fingerprints', lambda self, d: dict(fingerprints))
    def done(hparams):
        (reward_dir / sweep.DONE).write_text(json.dumps(dict(
            identity=dict(experiment='demo', seed=1, hparams=hparams), fingerprints=dict(fingerprints), points=[])))
    done({'run.seed': '1'})
    s.ensure_reward_model(1)  # the same: reused (train_reward is None: it would fail if called)
    done({'run.seed': '1', 'lr': '0.1'})
    with pytest.raises(ValueError, match=r'reward is a reward model of other settings \(.*lr.*this sweep'):
        s.ensure_reward_model(1)
    done({'run.seed': '1'})
    trained_on(8)  # e.g. made before the experiment bound another labels.num_train
    with pytest.raises(ValueError, match=r'^\S+/seed1/reward was trained on 8 labels \(labels.num_train\), this sweep '
                                         r'trains on 16: give this sweep another --out, or remove that folder$'):
        s.ensure_reward_model(1)
    trained_on(16)
    fingerprints['labels'] = 'c' * 64  # the labels file changed since
    with pytest.raises(ValueError, match=r"was trained on other labels than .*'s labels now \(sha256 aaaaaaaaaaaa, now "
                                         r"cccccccccccc\)"):
        s.ensure_reward_model(1)


def test_the_frontier_trains_on_its_own_count_of_labels_whatever_the_experiment_binds(tmp_path, monkeypatch):
    """The miniature's own run binds 8,192 training labels, its frontier keeps the 16,384 its runs were made on
    (sweep.NUM_TRAIN), the command line another; a seed's reward model's command states the count."""
    bound = {k: v for k, v, _ in top_launch.get_experiments()['sentiment_mini'][0] if k is not None}
    assert bound['rewards.train_new_model.labels.num_train'] == 8192
    assert sweep.labels_num_train('sentiment_mini', {}, bound) == 16384
    assert sweep.labels_num_train('sentiment_mini', {'rewards.train_new_model.labels.num_train': '4096'}, bound) == 4096
    monkeypatch.setitem(sweep.NUM_TRAIN, 'demo', 16)
    s = sweep.Sweep(demo.EXPERIMENT, str(tmp_path / 'out'), arms=['ppo'], seeds=[1],
                    points=sweep.parse_points(None, ['ppo']), train_policy=None, train_reward=None,
                    bound={'rewards.train_new_model.labels.num_train': 32, 'rewards.train_new_model.batch_size': 8,
                           'ppo.lr': 1e-4}, extra={}, best_of_n_queries=4, dpo_options={})
    assert s.num_train == 16
    commands = []
    class Stop(Exception):
        pass
    def train_reward(exp, name, **hparams):
        commands.append((exp, name, hparams))
        raise Stop
    s.train_reward_command = train_reward
    with pytest.raises(Stop):
        s.ensure_reward_model(1)
    assert commands == [('demo', 'reward', {'save_dir': str(tmp_path / 'out' / 'seed1'), 'labels.num_train': '16',
                                            'run.seed': '1'})]


def test_a_resumed_runs_time_sums_its_processes(tmp_path):
    """A run killed and resumed: its seconds are the first process's (to its last write, noted as the second started,
    whatever the second rewrites) plus the second's; a file of starts alone (an older run's) reads as before."""
    run_dir = tmp_path / 'run'
    first = sweep.start_attempt(str(run_dir))
    (run_dir / 'state.json').write_text('{}')
    os.utime(run_dir / 'state.json', (first + 100, first + 100))  # its last write, 100 s in; then killed
    attempts = json.loads((run_dir / sweep.ATTEMPTS).read_text())
    (run_dir / sweep.ATTEMPTS).write_text(json.dumps([first - 1000]))  # it started 1,000 s before this
    os.utime(run_dir / 'state.json', (first - 900, first - 900))  # and last wrote 100 s in
    second = sweep.start_attempt(str(run_dir))
    assert len(attempts) == 1
    (run_dir / 'state.json').write_text('{"resumed": 1}')  # the second rewrites what the first left (a rotated
    os.utime(run_dir / 'state.json', (second + 5, second + 5))  # checkpoint): the first's end was noted at the start
    seconds = sweep.attempts_seconds(str(run_dir), second)
    assert 100 <= seconds < 100 + (time.time() - second) + 1
    third = sweep.start_attempt(str(run_dir))  # killed again 5 s in, and resumed
    noted = json.loads((run_dir / sweep.ATTEMPTS).read_text())[:2]
    assert [t for a in noted for t in a] == pytest.approx([first - 1000, first - 900, second, second + 5], abs=1e-3)
    assert 105 <= sweep.attempts_seconds(str(run_dir), third) < 105 + (time.time() - third) + 1


# ---- table.py's plot and label axis, on hand-made rows (no model)

def _point(arm, seed, value, kl, gain, **fields):
    """One row as collect makes it (the fields a frontier.json point carries, and the variant values)."""
    bound = arm == 'best_of_n'
    return dict(arm=arm, seed=seed, knob=table.KNOBS[arm], value=value, gain=gain, gain_se=0.05, kl=kl,
                kl_se=0.0 if bound else 0.1, kl_kind='bound' if bound else 'measured', kl_objective=None if bound else kl,
                rm_initial=0.6, rm_trained=None if bound else 0.5, command='cmd', **fields)


def _write_runs(out, rows):
    """The rows as the frontier.json files of their runs (a run a row), as sweep.py leaves them."""
    for r in rows:
        variant = {k: r[k] for k in table.VARIANTS if k in r}
        run = out / f"seed{r['seed']}" / '-'.join([f"{r['arm']}-{r['knob']}{r['value']:g}"]
                                                   + [f'{k}{v:g}' for k, v in variant.items()])
        run.mkdir(parents=True)
        point = {k: v for k, v in r.items() if k not in ('arm', 'seed', 'knob', 'command')}
        objective = {'objective': 'ppo_score'} if r['arm'] in table.EARLIER else {}  # as sweep.py's runs now say
        identity = dict(arm=r['arm'], seed=r['seed'], **variant, **objective)
        (run / table.DONE).write_text(json.dumps(dict(identity=identity, command=r['command'], points=[point])))


# Offline PPO's kl_coefs land at other KLs on the two seeds: seed 2's frontier lies right of seed 1's.
SEED_KLS = {1: ((0.3, 2.0, 1.0), (0.2, 4.0, 2.0), (0.1, 8.0, 3.0)),
            2: ((0.3, 3.0, 1.5), (0.2, 10.0, 3.0), (0.1, 20.0, 3.5))}


def _ppo_rows(arm='ppo', shift=0.0, **fields):
    return [_point(arm, seed, value, kl, gain + shift, **fields) for seed, points in SEED_KLS.items()
            for value, kl, gain in points]


def _drawn(monkeypatch, rows, tmp_path, **options):
    """The axes table.plot draws for the rows (its figure kept from _save, which still writes it)."""
    drawn = []
    save = table._save
    monkeypatch.setattr(table, '_save', lambda fig, path: (drawn.append(fig.axes[0]), save(fig, path)))
    table.plot(rows, str(tmp_path / 'f.png'), title='t', **{'kl_budgets': (6.0,), **options})
    return drawn[0]


def test_the_plotted_mean_is_the_tables_gain_at_each_budget(tmp_path, monkeypatch):
    """The mean curve is the mean over seeds of each seed's interpolated frontier (the table's gain_at), not the points
    of a knob value averaged (kl and gain) across seeds: where the seeds' KLs differ the two part, and the plot draws
    the table's. Its band is the table's sd; each measured point has its KL's se as a bar, best-of-n's bound is an
    open marker; the budget's line is labeled."""
    rows = _ppo_rows() + [_point('best_of_n', seed, n, kl, gain) for seed in (1, 2)
                          for n, kl, gain in ((4, 0.64, 0.8), (16, 1.84, 1.5), (64, 3.17, 1.9))]
    # by hand: seed 1 at 6 nats between (4, 2.0) and (8, 3.0): 2.5; seed 2 between (3, 1.5) and (10, 3.0): 1.5 +
    # 1.5 * 3/7; mean 2.3214, sd 0.2525
    expected = (2.5 + 1.5 + 1.5 * 3 / 7) / 2
    entry = table.budget_table(rows, 6.0)['ppo']
    assert entry['mean'] == pytest.approx(expected) and entry['std'] == pytest.approx((1 - 1.5 * 3 / 7) / 2 ** 0.5)
    # The old curve: each kl_coef's KL and gain averaged over seeds, (2.5, 1.25), (7, 2.5), (14, 3.25), joined by
    # straight lines: 2.222 at 6 nats, 0.1 below the table, and on to 14 nats, past seed 1's last point.
    old = [(sum(kl for s in SEED_KLS for v2, kl, _ in SEED_KLS[s] if v2 == v) / 2,
            sum(g for s in SEED_KLS for v2, _, g in SEED_KLS[s] if v2 == v) / 2) for v, _, _ in SEED_KLS[1]]
    old_at_6 = table.gain_at([dict(kl=kl, gain=g) for kl, g in old], 6.0)
    assert abs(old_at_6 - expected) > 0.09
    kls, means, sds = table.mean_curve({1: rows[:3], 2: rows[3:6]}, kl_budgets=(6.0,))
    assert means[list(kls).index(6.0)] == entry['mean'] and sds[list(kls).index(6.0)] == entry['std']
    ax = _drawn(monkeypatch, rows, tmp_path)
    line = next(line for line in ax.get_lines() if line.get_label() == table.LABELS['ppo'])
    x, y = list(line.get_xdata()), list(line.get_ydata())
    assert y[x.index(6.0)] == entry['mean']
    assert min(x) == 3.0 and max(x) == 8.0  # where both seeds have points on both sides
    # every point's KL ± se as a bar (0.1 for PPO; best-of-n's bound has none), best-of-n's marker open
    bars = [c for c in ax.containers if c.has_xerr]
    assert len(bars) == 4  # an arm and seed each
    open_markers = [c for c in bars if c.lines[0].get_markerfacecolor() == 'none']
    assert sorted(list(c.lines[0].get_xdata()) for c in open_markers) == [[0.64, 1.84, 3.17]] * 2
    assert '6 nats' in [t.get_text() for t in ax.texts]
    assert any('KL its bound' in line.get_label() for line in ax.get_lines())


def test_the_mean_curve_stops_where_a_seeds_frontier_stops():
    """No extrapolation: the curve spans the KLs every seed has points on both sides of; none where they share none;
    a single seed's curve is its own frontier, without a band."""
    rows = _ppo_rows()
    kls, means, sds = table.mean_curve({1: rows[:3], 2: rows[3:6]})
    assert kls[0] == 3.0 and kls[-1] == 8.0 and list(kls) == sorted(kls)
    assert means[0] == pytest.approx((1.5 + 1.5) / 2) and means[-1] == pytest.approx((3.0 + 1.5 + 1.5 * 5 / 7) / 2)
    apart = [dict(r, kl=r['kl'] + 20) if r['seed'] == 2 else r for r in rows]  # seed 2 from 23 nats: no overlap
    assert table.mean_curve({1: apart[:3], 2: apart[3:6]}) is None
    kls, means, sds = table.mean_curve({1: rows[:3]})
    assert kls[0] == 2.0 and kls[-1] == 8.0 and sds is None
    assert means[list(kls).index(4.0)] == 2.0


def test_the_table_and_plot_are_the_same_bytes_from_the_same_runs(tmp_path):
    """Two writes from the same frontier.json files: the same PNG (no matplotlib version or time in it), doc,
    README summary and frontier.md."""
    out = tmp_path / 'out'
    _write_runs(out, _ppo_rows() + _ppo_rows('online', shift=0.2))
    doc, readme, figure = tmp_path / 'frontier.md', tmp_path / 'README.md', tmp_path / 'static' / 'f.png'
    readme.write_text(f'# Readme\n{table.SUMMARY_BEGIN}\n{table.SUMMARY_END}\n')
    written = []
    for _ in range(2):
        table.write(str(out), arms=None, kl_budgets=[6.0, 12.0], command='cmd', figure=str(figure), doc=str(doc),
                    readme=str(readme))
        written.append([p.read_bytes() for p in (figure, doc, readme, out / 'frontier.md')])
    assert written[0] == written[1]
    assert written[0][0].startswith(b'\x89PNG') and b'matplotlib' not in written[0][0]
    assert not list(tmp_path.glob('**/*.tmp-*'))


def test_a_curve_is_an_arm_and_its_variant(tmp_path):
    """Runs of another learning rate or label count are curves of their own, named by them; each is set against
    offline PPO's curve of the same label count (the default rate); rows without them stay the arm's curve."""
    out = tmp_path / 'out'
    rows = (_ppo_rows() + _ppo_rows(shift=0.1, lr=1e-3) + _ppo_rows(labels=4096) + _ppo_rows('dpo', 0.5, labels=4096)
            + _ppo_rows('dpo', 0.5))
    _write_runs(out, rows)
    collected = table.collect(str(out))
    assert len(collected) == len(rows) and sum(r.get('lr') == 1e-3 for r in collected) == 6  # from the identity
    assert list(table.curves(collected)) == ['ppo', 'ppo labels=4096', 'ppo lr=0.001', 'dpo', 'dpo labels=4096']
    budgets = table.budget_table(collected, 6.0)
    assert budgets['ppo lr=0.001']['mean'] == pytest.approx(budgets['ppo']['mean'] + 0.1)
    text = table.summary(collected, 6.0)
    assert '| offline PPO (kl_coef), lr 0.001 | +2.60† | +2.24† |' in text
    assert '| offline PPO (kl_coef), 4,096 labels | +2.50† | +2.14† |' in text
    against = text[text.index('Against offline PPO'):]
    # each against its own label count's offline PPO: DPO +0.5 at both; offline PPO's lr 1e-3 +0.1 against the default
    assert against.count('| +0.50 | +0.50 | +0.50 ± 0.00 (2 seeds) | 2 of 2 |') == 2
    assert '| offline PPO (kl_coef), lr 0.001 | +0.10 | +0.10 |' in against
    assert 'offline PPO (kl_coef), 4,096 labels |' not in against


def _label_rows(default=None):
    """Offline PPO at 256, 1,024 and 4,096 labels (4,096 the default count where `default`: no labels field), DPO at
    the default alone, online without labels; each seed's frontier two points around 6 nats, so that its gain there
    is their midpoint."""
    gains = {256: (0.6, 0.8), 1024: (1.1, 1.3), 4096: (1.5, 1.9)}
    rows = []
    for labels, per_seed in gains.items():
        fields = {} if labels == default else dict(labels=labels)
        for seed, gain in zip((1, 2), per_seed):
            rows += [_point('ppo', seed, 0.2, 4.0, gain - 0.5, **fields), _point('ppo', seed, 0.1, 8.0, gain + 0.5, **fields)]
    return rows + [_point('online', seed, value, kl, 1.0) for seed in (1, 2) for value, kl in ((0.2, 4.0), (0.1, 8.0))]


def test_label_table_and_the_labels_a_gain_needs():
    """The gain at the budget against the label count, mean ± sd over seeds; the labels a target needs interpolated
    on log(labels) between the counts around it (worked by hand)."""
    entries = table.label_table(_label_rows(), 6.0)
    assert list(entries) == ['ppo'] and list(entries['ppo']) == [256, 1024, 4096]
    assert [entries['ppo'][n]['mean'] for n in (256, 1024, 4096)] == pytest.approx([0.7, 1.2, 1.7])
    assert entries['ppo'][4096]['std'] == pytest.approx(0.4 / 2 ** 0.5)
    assert entries['ppo'][256]['seeds'] == pytest.approx({1: 0.6, 2: 0.8})
    # +1: 0.6 of the way from 256 (0.7) to 1,024 (1.2) on log(labels): 256 x 4^0.6 = 588.13; +1.5: 1,024 x 4^0.6
    assert table.labels_needed(entries['ppo'], 1.0) == pytest.approx(588.134, abs=1e-3)
    assert table.labels_needed(entries['ppo'], 1.5) == pytest.approx(2352.54, abs=1e-2)
    assert table.labels_needed(entries['ppo'], 0.5) == 256  # the smallest count reaches it already
    assert table.labels_needed(entries['ppo'], 2.0) is None
    # the first crossing, from the count just below it (a count without a gain there skipped): with a dip at 2,048,
    # +1.5 is 0.75 of the way from 2,048 (0.9) to 4,096 (1.7): 2,048 x 2^0.75
    dipped = {n: dict(mean=m) for n, m in ((256, 0.7), (512, None), (1024, 1.2), (2048, 0.9), (4096, 1.7))}
    assert table.labels_needed(dipped, 1.0) == pytest.approx(588.134, abs=1e-3)
    assert table.labels_needed(dipped, 1.5) == pytest.approx(2048 * 2 ** 0.75)
    # the default count's rows carry no labels: counted at default_labels, for the arms that have other counts only
    assert table.label_table(_label_rows(default=4096), 6.0) == dict(ppo={n: entries['ppo'][n] for n in (256, 1024)})
    assert table.label_table(_label_rows(default=4096), 6.0, default_labels=4096) == entries
    text = table.labels_summary(_label_rows(), 6.0)
    assert ('| offline PPO (kl_coef) | +0.70 ± 0.14 (2 seeds) | +1.20 ± 0.14 (2 seeds) | +1.70 ± 0.28 (2 seeds) | '
            '588 | 2,353 |') in text


def test_write_adds_the_label_axis_where_rows_carry_labels(tmp_path):
    out = tmp_path / 'out'
    _write_runs(out, _label_rows())
    figure, doc = tmp_path / 'f.png', tmp_path / 'frontier.md'
    table.write(str(out), arms=None, kl_budgets=[6.0], command='cmd', figure=str(figure), doc=str(doc))
    text = doc.read_text()
    assert (tmp_path / 'f_labels.png').read_bytes().startswith(b'\x89PNG')
    assert '### Gain at 6 nats against the number of labels' in text and '![gain against labels](f_labels.png)' in text
    _write_runs(tmp_path / 'plain', _ppo_rows())
    table.write(str(tmp_path / 'plain'), arms=None, kl_budgets=[6.0], command='cmd', figure=str(tmp_path / 'g.png'),
                doc=str(tmp_path / 'g.md'))
    assert not (tmp_path / 'g_labels.png').exists() and 'number of labels' not in (tmp_path / 'g.md').read_text()


def test_runs_from_before_one_objective_are_curves_of_their_own(tmp_path):
    """A best-of-n or DPO run without an objective in its identity (ranked by the reward model alone; every labelled
    pair) is not drawn or tabulated as one on PPO's objective."""
    out = tmp_path / 'out'
    for name, identity in (('best_of_n', dict(arm='best_of_n', seed=1)),
                           ('best_of_n-new', dict(arm='best_of_n', seed=1, objective='ppo_score'))):
        run = out / 'seed1' / name
        run.mkdir(parents=True)
        point = dict(value=4, gain=1.0, gain_se=0.1, kl=0.64, kl_se=0.0, kl_kind='bound', kl_objective=None,
                     rm_initial=0.6, rm_trained=None)
        (run / sweep.DONE).write_text(json.dumps(dict(identity=identity, command='cmd', points=[point])))
    rows = table.collect(str(out))
    assert sorted(table.curve_label(r) for r in rows) == sorted([table.EARLIER['best_of_n'], table.LABELS['best_of_n']])
    assert len(table.curves(rows)) == 2


def test_every_point_states_its_compute_and_cpu(tmp_path):
    """The table's every-point rows give a run's samples, optimizer steps and time, and name the CPU it ran on."""
    out = tmp_path / 'out'
    run = out / 'seed1' / 'ppo-kl_coef0.2'
    run.mkdir(parents=True)
    point = dict(value=0.2, gain=1.0, gain_se=0.05, kl=5.0, kl_se=0.1, kl_kind='measured', kl_objective=5.0,
                 rm_initial=0.6, rm_trained=0.5, samples=5632, optimizer_steps=176)
    (run / sweep.DONE).write_text(json.dumps(dict(identity=dict(arm='ppo', seed=1), command='cmd', points=[point],
                                                  seconds=151.0, runs_on='CPU (1 thread, AVX512 kernels) on Zen')))
    text = table.markdown(table.collect(str(out)), [6.0], command='c')
    assert 'on (1) CPU (1 thread, AVX512 kernels) on Zen.' in text
    assert '| 5,632 samples, 176 steps, 2m31s (1) |' in text
