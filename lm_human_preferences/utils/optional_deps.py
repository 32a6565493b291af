"""Ours: the optional dependencies (pyproject.toml's extras), imported only by the code that needs them.

    tf      tensorflow, to convert the original's TF checkpoints (language/convert_tf.py)
    wandb   Weights & Biases logging (run.wandb; training/run.py)

A missing one is one line naming the extra that installs it (launch.py reports it like any bad input).
"""

import importlib
import os

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


def check_wandb(name):
    """Ours, at launch: that wandb can log (WANDB_MODE offline / disabled needs nothing); one line for a
    missing package (MissingExtra), and a ValueError for a missing API key or a W&B server that
    cannot be reached."""
    require('wandb', extra='wandb', needed_for=f'{name}: run.wandb')
    if os.environ.get('WANDB_MODE', '').lower() in ('offline', 'disabled', 'dryrun'):
        return
    base_url = os.environ.get('WANDB_BASE_URL', 'https://api.wandb.ai')
    if not (os.environ.get('WANDB_API_KEY') or _netrc_has(base_url)):
        raise ValueError(f'{name}: run.wandb is on but no W&B API key is set: run `wandb login`, set WANDB_API_KEY, '
                         f'or set WANDB_MODE=offline to log locally')
    import requests
    try:
        requests.head(base_url, timeout=5)
    except requests.exceptions.RequestException as e:
        raise ValueError(f'{name}: run.wandb is on but the W&B server {base_url} cannot be reached '
                         f'({type(e).__name__}); set WANDB_MODE=offline to log locally and `wandb sync` '
                         f'later') from None


def _netrc_has(url):
    """Whether ~/.netrc has a login for url's host (where `wandb login` stores the key)."""
    import netrc
    from urllib.parse import urlparse
    try:
        return netrc.netrc().authenticators(urlparse(url).hostname) is not None
    except (OSError, netrc.NetrcParseError):
        return False
