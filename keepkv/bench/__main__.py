"""``python -m keepkv.bench``: the ``keepkv bench`` command without the main CLI."""

import sys

from .core import build_parser, main

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
