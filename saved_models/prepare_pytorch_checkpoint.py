#!/usr/bin/env python3
"""Convert an original (TensorFlow) lm-human-preferences / GPT-2 checkpoint into our format.

    python saved_models/prepare_pytorch_checkpoint.py SRC DST [--scope SCOPE]

SRC: a GPT-2 release dir (checkpoint, model.ckpt.*, hparams.json), a train_reward or train_policy save
dir of the original (<save_dir>/reward_model, <save_dir>/policy), a checkpoint prefix
(.../checkpoints/model.ckpt-7), or a GPT-2 release name such as 124M (downloaded first).
DST: the directory to write (hparams.json, encoding, checkpoints/model-<step>.safetensors).
See saved_models/README.md.
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lm_human_preferences.language import convert_tf, trained_models  # noqa: E402
from lm_human_preferences.utils import optional_deps  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('src', help='TF checkpoint dir or prefix, or a GPT-2 release name (e.g. 124M)')
    parser.add_argument('dst', help='output directory')
    parser.add_argument('--scope', default=None,
                        help="model scope in the checkpoint ('' = GPT-2 release layout, policy, reward_model); "
                             "default: inferred from the variables and SRC's directory name")
    args = parser.parse_args(argv)
    src = args.src
    if not os.path.exists(src) and not os.path.exists(src + '.index') and re.fullmatch(r'\d+M', src):
        src = trained_models.TrainedModel(src).download_release()
    try:
        path = convert_tf.convert_tf_checkpoint(src, args.dst, scope=args.scope)
    except optional_deps.MissingExtra as e:
        sys.exit(f'error: {e}')
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
