"""The optional dependencies (ours): pyproject.toml's extras, imported only by the code that needs them.

    tf      tensorflow, to convert the original's TF checkpoints (language/convert_tf.py)
    wandb   Weights & Biases logging (run.wandb; utils/run.py)

A missing one is one line naming the extra that installs it (launch.py reports it like any bad input).
"""

import importlib

PACKAGE = 'lm-human-preferences-torch'


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message is one line naming the extra."""


def install_hint(extra):
    return f"pip install '{PACKAGE}[{extra}]' (in a checkout: pip install -e '.[{extra}]')"


def require(module, *, extra, needed_for):
    """Import and return module, or raise MissingExtra: '<needed_for> needs <module>: pip install ...'."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f'{needed_for} needs {module}, which is not installed: {install_hint(extra)}') from None
