"""The install (pyproject.toml): a core that trains, samples and exports, TensorFlow and wandb as extras; a
missing extra is one line naming it. (A plain `pip install -e .` once pulled tensorflow-cpu: 3.1 GB.) The Quick
start's install, the core and [test] (pytest alone), runs its test command, the fast tier: the tests that need
another extra's package skip without it. (The Quick start once installed the core alone, and its test command
said `No module named pytest`.)"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lm_human_preferences.language import trained_models
from lm_human_preferences.utils import hyperparams, optional_deps

REPO_ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip('tomllib', reason='tomllib is in the standard library from Python 3.11')


def _project():
    return tomllib.loads((REPO_ROOT / 'pyproject.toml').read_text())['project']


def _names(requirements):
    return {re.match(r'[A-Za-z0-9_.-]+', r).group(0).lower().replace('_', '-') for r in requirements}


# The module each extra's package installs, where its name is not the package's.
MODULES = {'tensorflow-cpu': 'tensorflow'}


def _other_extras_modules():
    """The modules of every extra's packages but [test]'s (pytest): what the Quick start does not install."""
    project = _project()
    packages = set().union(*(_names(requirements) for extra, requirements in project['optional-dependencies'].items()
                             if extra != 'test')) - {project['name']}
    return sorted(MODULES.get(p, p.replace('-', '_')) for p in packages)


def test_tensorflow_and_wandb_are_extras_not_the_core():
    project = _project()
    core, optional = _names(project['dependencies']), project['optional-dependencies']
    assert not core & {'tensorflow', 'tensorflow-cpu', 'wandb', 'pytest', 'transformers', 'selenium'}
    assert {'torch', 'numpy', 'tiktoken', 'safetensors', 'huggingface-hub', 'tokenizers'} <= core
    assert _names(optional['tf']) == {'tensorflow-cpu'} and _names(optional['wandb']) == {'wandb'}
    assert optional['test'] == ['pytest']  # light: the Quick start installs it
    assert optional['test-full'] == ['lm-human-preferences-torch[test]', 'transformers', 'selenium']
    assert _names(optional['baselines']) == {'trl', 'transformers'}  # the frontier's DPO arm
    assert optional['all'] == ['lm-human-preferences-torch[tf,wandb,test,test-full,baselines]']
    assert _other_extras_modules() == ['selenium', 'tensorflow', 'transformers', 'trl', 'wandb']
    assert project['name'] == optional_deps.PACKAGE


def _readme_commands():
    readme = (REPO_ROOT / 'README.md').read_text()
    return [line.split('#')[0].strip() for line in readme.splitlines() if line.startswith(('pip ', 'python -m pytest'))]


def test_ci_installs_and_runs_what_the_readme_says():
    """The README's first command installs the core and pytest, and its first test command is the fast tier; CI
    installs what the README gives for every test ([all]) and runs the README's command for every test, then under
    the other Pythons the Quick start's install and fast tier."""
    commands = _readme_commands()
    assert commands[:2] == ["pip install -r requirements.txt -e '.[test]'", 'python -m pytest -q -m "not slow" tests']
    ci = [line.strip().split(' || ')[0] for line in (REPO_ROOT / '.ci' / 'run').read_text().splitlines()
          if line.strip().startswith(('pip ', 'python '))]  # the command, without what CI does when it fails
    assert ci == ["pip install -r requirements.txt -e '.[all]'",
                  "pip install -r requirements.txt -e '.[test]'",
                  'python -m pytest -q tests', 'python -m pytest -q -m "not slow" tests'] and set(ci) <= set(commands)


# Python run with some packages not installed, as far as imports see: every finder on sys.meta_path finds nothing
# for them (`import` raises ModuleNotFoundError, importlib.util.find_spec says None, sys.modules never holds them).
# (None in sys.modules is not the same: `"transformers" in sys.modules` is then true, and `datasets` imports it.)
WITHOUT = """import sys
HIDDEN = set({hidden!r})


class Hiding:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        return None if name.split('.')[0] in HIDDEN else self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hiding(f) if hasattr(f, 'find_spec') else f for f in sys.meta_path]
"""


@pytest.mark.slow
def test_the_quick_start_runs_its_tests_without_the_other_extras():
    """The Quick start's test command, the fast tier, passes with every package of the extras it does not
    install hidden from imports: the tests that need one skip."""
    code = (WITHOUT.format(hidden=_other_extras_modules()) +
            "import pytest\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'not slow', 'tests']))\n")
    proc = subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ' passed' in proc.stdout.splitlines()[-1] and ' skipped' in proc.stdout.splitlines()[-1], proc.stdout[-3000:]


@pytest.mark.slow
def test_the_commands_import_without_the_extras():
    """launch.py, sample.py and every module of the training path import with tensorflow, wandb and
    transformers unimportable (None in sys.modules: `import` raises ImportError, as when not installed)."""
    code = ("import sys\n"
            "for m in ('tensorflow', 'wandb', 'transformers'): sys.modules[m] = None\n"
            "import launch, sample\n"
            "from lm_human_preferences import train_policy, train_reward, rewards, policy, demo\n"
            "from lm_human_preferences.language import hf_export, hf_import, convert_tf\n"
            "from lm_human_preferences.training import plots, run\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == 'ok\n', proc.stderr


def test_converting_without_tensorflow_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    # A TF model dir as the converter finds it (state file, index, hparams.json): it fails at the import.
    hparams = trained_models.test_hparams()
    hyperparams.save_json(hparams, str(tmp_path / 'hparams.json'))
    (tmp_path / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n')
    (tmp_path / 'model.ckpt.index').write_bytes(b'')
    monkeypatch.setitem(sys.modules, 'tensorflow', None)
    with pytest.raises(optional_deps.MissingExtra) as e:
        trained_models.TrainedModel(str(tmp_path)).checkpoint()
    assert str(e.value) == (f"converting the TensorFlow checkpoint {tmp_path / 'model.ckpt'} needs tensorflow, which "
                            f"is not installed: pip install 'lm-human-preferences-torch[tf]' (in a checkout: "
                            f"pip install -e '.[tf]')")


def test_the_converter_script_says_it_in_one_line(tmp_path):
    (tmp_path / 'src').mkdir()
    hyperparams.save_json(trained_models.test_hparams(), str(tmp_path / 'src' / 'hparams.json'))
    (tmp_path / 'src' / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n')
    (tmp_path / 'src' / 'model.ckpt.index').write_bytes(b'')
    code = ("import sys, runpy; sys.modules['tensorflow'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, '-c', code, 'saved_models/prepare_pytorch_checkpoint.py',
                           str(tmp_path / 'src'), str(tmp_path / 'dst')], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count('\n') == 1, proc.stderr
    assert proc.stderr.startswith('error: converting the TensorFlow checkpoint') and "'.[tf]'" in proc.stderr


def test_wandb_without_its_extra_is_one_line_at_launch(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(REPO_ROOT))
    import launch as top_launch
    from lm_human_preferences.utils import launch
    monkeypatch.setitem(sys.modules, 'wandb', None)
    with pytest.raises(SystemExit) as e:
        launch.main(dict(train_reward=top_launch.launch_train_reward),
                    argv=['train_reward', 'test', 'x', '--run.wandb', 'true', '--save_dir', str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: x: run.wandb needs wandb, which is not installed: pip install "
                                       "'lm-human-preferences-torch[wandb]' (in a checkout: pip install -e '.[wandb]')\n")
