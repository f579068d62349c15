"""The code in docs/checkpoints.md runs, on a tiny converted checkpoint instead of DeepSeek-V3."""

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"


def test_checkpoints_guide_runs(hf_lora, tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    code = "\n".join(blocks)
    code, n = re.subn(r'^SRC = .*$', f"SRC = {str(hf_lora.path)!r}", code, flags=re.M)
    code, m = re.subn(r'^DST = .*$', f"DST = {str(tmp_path / 'converted')!r}", code, flags=re.M)
    assert n == m == 1
    namespace = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    # The names the guide prints are the ones it promises.
    assert "'q_b_proj.weight', 'w_uk', 'w_uv']" in out
    # Decode equals the training path (float32 on CPU: rounding only).
    y_train, y_decode = namespace["y_train"], namespace["y_decode"]
    torch.testing.assert_close(y_decode, y_train, rtol=1e-5, atol=1e-5 * y_train.abs().max().item())
    assert len(namespace["cache"]) == 12
