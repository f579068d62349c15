"""The main job (python -m mla_attn) and the KV-cache calculator run and report what they claim."""

import subprocess
import sys
from pathlib import Path

from mla_attn.demo import main as demo_main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_decode_matches(capsys):
    assert demo_main(["--layers", "1", "--batch", "2", "--prompt-len", "9", "--new-tokens", "3",
                      "--page-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "OK: decode through the cache matches" in out
    assert "| MLA (latent 512 + rope key 64) | 1,152 |" in out  # (512 + 64) values x 2 bytes
    assert "hold 576 values / token / layer" in out  # what the cache buffers really hold


def test_demo_contiguous_and_config_file(capsys):
    assert demo_main(["--config", str(ROOT / "configs" / "Moonlight-16B-A3B.json"), "--layers", "1",
                      "--prompt-len", "4", "--new-tokens", "2", "--page-size", "0"]) == 0
    assert "contiguous cache" in capsys.readouterr().out


def test_kv_cache_calculator_numbers():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kv_cache.py")], capture_output=True, text=True,
                         check=True).stdout
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "| 68.6 KiB | 4.8 MiB | 71.1x |" in rows["DeepSeek-V3"]  # (512 + 64) x 61 x 2 B
    assert "| 320.0 KiB | 2.5 MiB | 8.0x |" in rows["Llama-3.1-70B"]  # 2 x 8 x 128 x 80 x 2 B
    assert "40.0 GiB" in rows["Llama-3.1-70B"]
