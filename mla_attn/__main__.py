"""``python -m mla_attn``: the demo (see ``mla_attn.demo``); ``python -m mla_attn convert SRC DST`` converts."""

from .cli import main

raise SystemExit(main())
