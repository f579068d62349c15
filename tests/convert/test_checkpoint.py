"""load_checkpoint / convert_checkpoint / CLI on sharded fixtures: exact tensors, FP8, MTP layers,
atomic and refused writes, error messages that name the file and tensor, bounded memory."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_attn.convert import CheckpointError, absorb_mla_weights, convert_checkpoint, load_checkpoint
from mla_attn.convert.cli import main as cli_main
from mla_attn.convert.fp8 import dequantize_fp8_block

from convert_fixtures import FP8_BLOCK, PEAK_RSS_HELPERS

REPO = Path(__file__).resolve().parents[2]


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        part = load_file(str(folder / fname))
        assert set(part) == {n for n, f in index["weight_map"].items() if f == fname}
        out.update(part)
    return out


def assert_same_tensors(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)
        assert torch.equal(got[k], want[k]), k


# ---------------------------------------------------------------- load_checkpoint


@pytest.mark.parametrize("fixture", ["hf_lora", "hf_plain", "fp8_ckpt"])
def test_load_returns_exact_tensors(fixture, request):
    fx = request.getfixturevalue(fixture)
    got = load_checkpoint(fx.path, dtype=None)
    assert sorted(got) == sorted(fx.expected)
    for i in fx.expected:
        # Same names as DeepseekV3Attention.state_dict(), same values (FP8: the dequantized ones).
        assert_same_tensors(got[i], fx.expected[i])
    bf = load_checkpoint(fx.path, layers=[1])
    assert list(bf) == [1]
    for k, v in bf[1].items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, fx.expected[1][k].to(torch.bfloat16)), k


def test_load_skips_mtp_and_checks_layers(fp8_ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="mla_attn.convert"):
        got = load_checkpoint(fp8_ckpt.path, dtype=None)
    assert sorted(got) == [0, 1]  # layer 2 is the multi-token-prediction layer
    assert any("multi-token-prediction layers [2]" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"layers: indices \[2\] out of range for num_hidden_layers=2"):
        load_checkpoint(fp8_ckpt.path, layers=[0, 2])


def test_fp8_folder_without_config_json_takes_the_block_size_from_the_passed_config(fp8_ckpt, tmp_path):
    """Shards without config.json: the FP8 block size comes from the config the caller passes (dict,
    path or transformers config); a config without quantization_config is refused by name."""
    from mla_attn.layers import MLAConfig

    folder = tmp_path / "shards"
    shutil.copytree(fp8_ckpt.path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").rename(tmp_path / "elsewhere.json")
    want = load_checkpoint(fp8_ckpt.path, layers=[1], dtype=None)
    for passed in (config, tmp_path / "elsewhere.json"):
        got = load_checkpoint(folder, passed, layers=[1], dtype=None)
        for k, v in want[1].items():
            assert torch.equal(got[1][k], v), k
    from transformers import DeepseekV3Config

    got = load_checkpoint(folder, DeepseekV3Config(**config), layers=[1], dtype=None)
    assert torch.equal(got[1]["kv_b_proj.weight"], want[1]["kv_b_proj.weight"])
    with pytest.raises(CheckpointError, match="nor a config passed in has a quantization_config"):
        load_checkpoint(folder, MLAConfig.from_hf(config), layers=[1])


def test_load_single_file_without_index(hf_lora, tmp_path):
    sd = read_all(hf_lora.path)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(hf_lora.path / "config.json", tmp_path / "config.json")
    got = load_checkpoint(tmp_path, dtype=None)
    for i in hf_lora.expected:
        assert_same_tensors(got[i], hf_lora.expected[i])
    # A single-file source converts too (into one shard + an index).
    dst = convert_checkpoint(tmp_path, tmp_path.parent / "single_out", progress=False)
    assert [p.name for p in dst.glob("*.safetensors")] == ["model.safetensors"]
    assert_same_tensors({k: v for k, v in read_all(dst).items() if not k.endswith(("w_uk", "w_uv"))}, sd)


def test_load_is_lazy(fp8_ckpt, monkeypatch):
    """Per-tensor access: only the requested layer's attention tensors (and their scales) are read."""
    from mla_attn.convert import checkpoint as ck

    read = []
    real = ck._read

    def spy(handle, folder, name):
        read.append(name)
        return real(handle, folder, name)

    monkeypatch.setattr(ck, "_read", spy)
    load_checkpoint(fp8_ckpt.path, layers=[1])
    assert read and all(n.startswith("model.layers.1.self_attn.") for n in read)
    assert len(read) == len(set(read))


# ---------------------------------------------------------------- convert_checkpoint


def test_convert_hf_checkpoint(hf_lora, tmp_path):
    dst = tmp_path / "out"
    assert convert_checkpoint(hf_lora.path, dst, progress=False, max_shard_size="20KB") == dst.resolve()
    src_t, dst_t = read_all(hf_lora.path), read_all(dst)
    added = {f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("w_uk", "w_uv")}
    assert set(dst_t) == set(src_t) | added
    assert_same_tensors({k: dst_t[k] for k in src_t}, src_t)  # everything else unchanged, bit for bit
    for i in range(2):
        ab = absorb_mla_weights({"kv_b_proj.weight": src_t[f"model.layers.{i}.self_attn.kv_b_proj.weight"]}, hf_lora.model.config)
        for n in ("w_uk", "w_uv"):
            t = dst_t[f"model.layers.{i}.self_attn.{n}"]
            assert t.dtype == torch.float32 and torch.equal(t, ab[n])  # dtype of kv_b_proj as written
    assert len(list(dst.glob("model-*.safetensors"))) > 1
    cfg = json.loads((dst / "config.json").read_text())
    rec = cfg.pop("mla_attn_conversion")
    assert rec["absorbed_layers"] == [0, 1] and rec["dequantized_fp8_tensors"] == 0
    assert cfg == json.loads((hf_lora.path / "config.json").read_text())
    assert (dst / "generation_config.json").read_bytes() == (hf_lora.path / "generation_config.json").read_bytes()
    # The converted folder loads; absorbed weights come back and match kv_b_proj.
    got = load_checkpoint(dst, dtype=None)
    for i in range(2):
        assert_same_tensors({k: v for k, v in got[i].items() if not k.startswith("w_")}, hf_lora.expected[i])
        assert {"w_uk", "w_uv"} <= set(got[i])
    # Hugging Face still reads it as the same model (the extra w_uk / w_uv keys are ignored).
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, hf_lora.model(ids).logits)


def test_convert_fp8_checkpoint(fp8_ckpt, tmp_path):
    dst = tmp_path / "out"
    convert_checkpoint(fp8_ckpt.path, dst, progress=False)  # default dtype bf16
    src_t, dst_t = read_all(fp8_ckpt.path), read_all(dst)
    scales = {k for k in src_t if k.endswith("_scale_inv")}
    fp8 = {k for k in src_t if src_t[k].dtype == torch.float8_e4m3fn}
    assert len(fp8) == len(scales) == 3 * 5  # 5 quantized weights in each of 2 layers + the MTP layer
    assert not scales & set(dst_t)
    for k in fp8:
        want = dequantize_fp8_block(src_t[k], src_t[k + "_scale_inv"], tuple(FP8_BLOCK), dtype=torch.bfloat16)
        assert dst_t[k].dtype == torch.bfloat16 and torch.equal(dst_t[k], want), k
    others = set(src_t) - fp8 - scales
    assert_same_tensors({k: dst_t[k] for k in others}, {k: src_t[k] for k in others})
    # Absorbed for the 2 main layers, in bf16 (the dtype kv_b_proj is written in); not for MTP layer 2.
    for i in range(2):
        kv_b = dst_t[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        assert torch.equal(dst_t[f"model.layers.{i}.self_attn.w_uk"], kv_b.view(3, 40, 512)[:, :16])
        assert torch.equal(dst_t[f"model.layers.{i}.self_attn.w_uv"], kv_b.view(3, 40, 512)[:, 16:].transpose(1, 2))
    assert "model.layers.2.self_attn.w_uk" not in dst_t
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg
    rec = cfg["mla_attn_conversion"]
    assert rec["dequantized_fp8_tensors"] == 15 and rec["dropped_scale_tensors"] == 15 and rec["dtype"] == "bfloat16"
    assert (dst / "tokenizer_config.json").exists()
    # Float32 conversion loads to exactly the dequantized weights the fixture's HF model holds.
    dst32 = tmp_path / "out32"
    convert_checkpoint(fp8_ckpt.path, dst32, dtype=torch.float32, progress=False)
    got = load_checkpoint(dst32, dtype=None)
    for i in range(2):
        assert_same_tensors({k: v for k, v in got[i].items() if not k.startswith("w_")}, fp8_ckpt.expected[i])


def test_no_absorb_and_reconvert_drops_stale(hf_plain, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    convert_checkpoint(hf_plain.path, a, progress=False)
    # Reconverting a converted folder without absorption drops the stored w_uk / w_uv.
    convert_checkpoint(a, b, absorb=False, progress=False)
    assert_same_tensors(read_all(b), read_all(hf_plain.path))
    assert json.loads((b / "config.json").read_text())["mla_attn_conversion"]["dropped_absorbed_tensors"] == 4


def test_stale_absorbed_weights_refused(hf_lora, tmp_path):
    dst = tmp_path / "out"
    convert_checkpoint(hf_lora.path, dst, progress=False)
    # "Fine-tune" kv_b_proj of layer 1 in place, leaving the stored w_uk / w_uv stale.
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = dst / index["weight_map"][name]
    part = load_file(str(shard))
    part[name] = part[name] + 0.01
    save_file(part, str(shard), metadata={"format": "pt"})
    load_checkpoint(dst, layers=[0])  # layer 0 is still consistent
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.self_attn.w_uk': stale absorbed weight"):
        load_checkpoint(dst, layers=[1])


def test_existing_destination_refused_then_overwritten(hf_plain, tmp_path):
    dst = tmp_path / "out"
    convert_checkpoint(hf_plain.path, dst, progress=False)
    before = read_all(dst)
    with pytest.raises(FileExistsError, match="already exists"):
        convert_checkpoint(hf_plain.path, dst, progress=False)
    assert_same_tensors(read_all(dst), before)
    convert_checkpoint(hf_plain.path, dst, progress=False, absorb=False, overwrite=True)
    assert not any(k.endswith("w_uk") for k in read_all(dst))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or backup folders left
    with pytest.raises(ValueError, match="must not be the source folder"):
        convert_checkpoint(hf_plain.path, hf_plain.path / "sub", progress=False)


def _copy(fx, tmp_path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(fx.path, src)
    return src


def _shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]


def _assert_fails_clean(src, tmp_path, match):
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=match):
        convert_checkpoint(src, dst, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written, no temp folder


def test_truncated_shard(fp8_ckpt, tmp_path):
    src = _copy(fp8_ckpt, tmp_path)
    shard = _shard_of(src, "model.layers.1.self_attn.o_proj.weight")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1000)
    _assert_fails_clean(src, tmp_path, rf"file .*{shard.name}: cannot read the safetensors header \(truncated")
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(src, layers=[1])


def test_missing_tensor(hf_lora, tmp_path):
    src = _copy(hf_lora, tmp_path)
    name = "model.layers.1.self_attn.q_a_layernorm.weight"
    # (a) gone from its shard although the index lists it
    shard = _shard_of(src, name)
    part = load_file(str(shard))
    del part[name]
    save_file(part, str(shard), metadata={"format": "pt"})
    _assert_fails_clean(src, tmp_path, rf"file .*{shard.name}, tensor '{name}': tensor listed in .* is missing")
    # (b) gone from the index too: the config says the layer needs it
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    _assert_fails_clean(src, tmp_path, rf"model.safetensors.index.json, tensor '{name}': missing from the checkpoint")
    # (c) a whole shard gone
    gone = _shard_of(src, "model.layers.0.self_attn.o_proj.weight")
    gone.unlink()
    _assert_fails_clean(src, tmp_path, rf"file .*{gone.name}, tensor 'model.*': shard listed in .* is missing")


def test_shape_contradicting_config(hf_lora, tmp_path):
    src = _copy(hf_lora, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["v_head_dim"] = 9
    (src / "config.json").write_text(json.dumps(cfg))
    _assert_fails_clean(
        src, tmp_path, r"tensor 'model.layers.0.self_attn.kv_b_proj.weight': shape \[54, 20\] contradicts config.json \(expected \[51, 20\]\)"
    )


def test_unknown_quant_method_and_bad_scale(fp8_ckpt, tmp_path):
    src = _copy(fp8_ckpt, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (src / "config.json").write_text(json.dumps(cfg))
    _assert_fails_clean(src, tmp_path, r"config.json: unknown quantization_config.quant_method 'gptq'")
    cfg["quantization_config"]["quant_method"] = "fp8"
    cfg["quantization_config"]["weight_block_size"] = [64, 64]  # contradicts the stored scale grids
    (src / "config.json").write_text(json.dumps(cfg))
    _assert_fails_clean(src, tmp_path, r"weight_scale_inv': scale shape \[.*\] does not match weight shape")


def test_failure_while_writing_leaves_nothing(hf_lora, tmp_path, monkeypatch):
    """An error after the temporary folder exists (here: the second shard write) removes it."""
    from mla_attn.convert import checkpoint as ck

    real, calls = ck.save_file, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(ck, "save_file", failing)
    src = _copy(hf_lora, tmp_path)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(src, tmp_path / "out", progress=False, max_shard_size="10KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli(hf_plain, tmp_path, capsys):
    dst = tmp_path / "out"
    assert cli_main([str(hf_plain.path), str(dst), "--dtype", "fp16", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert json.loads((dst / "config.json").read_text())["mla_attn_conversion"]["dtype"] == "float16"
    assert cli_main([str(hf_plain.path), str(dst), "-q"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli_main([str(hf_plain.path), str(dst), "-q", "--overwrite", "--no-absorb"]) == 0
    # `python -m mla_attn.convert` runs the same main.
    r = subprocess.run(
        [sys.executable, "-m", "mla_attn.convert", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "--no-absorb" in r.stdout


PEAK_SCRIPT = PEAK_RSS_HELPERS + textwrap.dedent(
    """
    import json, os, sys, torch
    from safetensors.torch import save_file
    from mla_attn.convert import convert_checkpoint, quantize_fp8_block

    src, dst = sys.argv[1], sys.argv[2]
    MB = 2**20
    # 6 shards of 24 MiB FP8 each (+ scales): 144 MiB in, 288 MiB of bf16 out.
    cfg = dict(hidden_size=64, num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
               v_head_dim=8, q_lora_rank=None, num_hidden_layers=1,
               quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128]))
    os.makedirs(src)
    attn = {"q_proj.weight": (2 * 16, 64), "kv_a_proj_with_mqa.weight": (40, 64), "kv_a_layernorm.weight": (32,),
            "kv_b_proj.weight": (2 * 16, 32), "o_proj.weight": (64, 16)}
    weight_map = {}
    w = torch.randn(4096, 2048)
    q, s = quantize_fp8_block(w)
    for k in range(6):
        fname = f"model-{k + 1:05d}-of-00006.safetensors"
        part = {}
        for j in range(3):  # 3 x 8 MiB FP8 expert weights per shard
            name = f"model.layers.0.mlp.experts.{3 * k + j}.down_proj.weight"
            part[name], part[name + "_scale_inv"] = q.clone(), s.clone()
        if k == 0:
            part.update({"model.layers.0.self_attn." + n: torch.randn(shape) for n, shape in attn.items()})
        save_file(part, os.path.join(src, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(src, "model.safetensors.index.json"), "w"))
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    del w, q, s, part

    base = rss("VmRSS:")
    reset_peak()
    convert_checkpoint(src, dst, progress=False, max_shard_size=48 * MB)
    print(json.dumps({"peak_mib": (rss("VmHWM:") - base) / MB}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_bounded(tmp_path):
    """Converting 144 MiB of FP8 in 6 shards into 288 MiB of bf16 must hold about one input shard
    (24 MiB, memory-mapped) + one output shard (48 MiB cap) + one tensor in flight (8 MiB FP8 copy +
    16 MiB bf16 result) = 96 MiB, not the whole checkpoint. Bound: 140 MiB (allocator slack), under
    both the 144 MiB input and the 288 MiB output. (Measured: ~98 MiB.)"""
    r = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "src"), str(tmp_path / "dst")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        # Pin glibc's mmap threshold so freed tensors go back to the OS at once: the peak then
        # measures live memory, not what the allocator's per-thread arenas happen to retain.
        env={**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "1048576"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    peak = json.loads(r.stdout.strip().splitlines()[-1])["peak_mib"]
    print(f"peak RSS above baseline while converting: {peak:.1f} MiB")
    assert peak < 140, peak
    assert len(list((tmp_path / "dst").glob("*.safetensors"))) >= 6


def test_stale_check_compares_at_the_coarser_storage_dtype():
    from mla_attn.convert.absorb import attention_dims
    from mla_attn.convert.checkpoint import _check_absorbed_fresh

    d = attention_dims(dict(hidden_size=16, num_attention_heads=3, kv_lora_rank=20, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=10))  # fmt: skip
    kv_b32 = torch.randn(3 * 18, 20)
    ab32 = absorb_mla_weights({"kv_b_proj.weight": kv_b32}, d)
    # float32 absorbed copies next to a bf16 kv_b_proj: consistent once both are bf16.
    _check_absorbed_fresh(0, {"kv_b_proj.weight": kv_b32.bfloat16(), **ab32}, d, "x")
    # One element of kv_b_proj moved by 2**-6 relative (2 to 4 bf16 steps): stale.
    moved = kv_b32.bfloat16()
    moved[0, 0] = moved[0, 0] * (1 + 2**-6)
    assert moved[0, 0] != kv_b32.bfloat16()[0, 0]
    with pytest.raises(CheckpointError, match="tensor 'model.layers.0.self_attn.w_uk': stale"):
        _check_absorbed_fresh(0, {"kv_b_proj.weight": moved, **ab32}, d, "x")
