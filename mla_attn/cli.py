"""The ``mla-attn`` command: ``demo`` (the default) and ``convert``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "convert":
        from .convert.cli import main as convert_main

        return convert_main(argv[1:], prog="mla-attn convert")
    if argv and argv[0] == "demo":
        argv = argv[1:]
    if argv and not argv[0].startswith("-") and argv[0] not in ("demo",):
        # `mla-attn SRC DST ...` is the checkpoint converter (API.md), kept as a shorthand
        from .convert.cli import main as convert_main

        return convert_main(argv)
    from .demo import main as demo_main

    return demo_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
