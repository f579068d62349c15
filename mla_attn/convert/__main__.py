"""``python -m mla_attn.convert SRC DST [--dtype bf16] [--no-absorb] [--overwrite]``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
