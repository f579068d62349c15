"""The README's Python example runs as written and shows what it says."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), {})
        # the usage example prints the largest difference between cached decode and the training path
        value = float(re.search(r"tensor\(([-0-9.e+]+)", out.getvalue()).group(1))
        assert value < 1e-5


def test_readme_commands_match_ci():
    readme = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = ".venv/bin/python -m pytest -q"
    assert test_cmd in readme and ci.strip().splitlines()[-1] == test_cmd
