"""Reading and converting Hugging Face DeepSeek-style safetensors checkpoints, shard by shard.

Tensors are read one at a time through ``safetensors.safe_open`` (memory-mapped; a whole file is
never loaded), so reading the attention of a 700 GB DeepSeek-V3 folder costs the attention
weights, and converting it costs about one input shard plus one output shard.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .absorb import (
    ABSORBED_NAMES,
    EXPANDED_NAMES,
    AttentionDims,
    _config_mapping,
    absorb_mla_weights,
    attention_dims,
)
from .fp8 import SCALE_SUFFIX, block_size_from_config, dequantize_fp8_block, scale_shape

__all__ = ["CheckpointError", "convert_checkpoint", "load_checkpoint"]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Key of the record convert_checkpoint writes into config.json.
CONVERSION_KEY = "mla_attn_conversion"
# `model.layers.{i}.self_attn.{name}`: the Hugging Face DeepSeek-V2/V3, Kimi-K2, Moonlight layout.
ATTN_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$")
ATTN_PREFIX = "model.layers.{}.self_attn."
# safetensors dtype strings of the float8 formats.
FP8_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
DEFAULT_MAX_SHARD_SIZE = "5GB"  # 5 * 10**9 bytes, as Hugging Face counts


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or converted; the message names the file and the tensor."""

    def __init__(self, message: str, *, file: str | os.PathLike | None = None, tensor: str | None = None):
        where = []
        if file is not None:
            where.append(f"file {os.fspath(file)!s}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.file = None if file is None else os.fspath(file)
        self.tensor = tensor


def _scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


class _Folder:
    """A Hugging Face style checkpoint folder: config.json, shards and (optionally) their index.

    Holds only names, file names, shapes and dtypes; tensor data is read on demand.
    """

    def __init__(self, path: str | os.PathLike, *, need_config: bool):
        self.root = Path(path)
        # name -> (shape, safetensors dtype string), filled per file by `_header`.
        self.info: dict[str, tuple[tuple[int, ...], str]] = {}
        self._headers_read: set[str] = set()
        if not self.root.is_dir():
            raise CheckpointError("not a checkpoint folder (expected config.json and *.safetensors)", file=self.root)
        self.config: dict[str, Any] | None = None
        config_path = self.root / CONFIG_NAME
        if config_path.is_file():
            try:
                self.config = json.loads(config_path.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot parse: {e}", file=config_path) from None
            if not isinstance(self.config, dict):
                raise CheckpointError(f"expected a JSON object, got {type(self.config).__name__}", file=config_path)
        elif need_config:
            raise CheckpointError("missing (needed for the model's sizes)", file=config_path)
        index_path = self.root / INDEX_NAME
        self.index_path: Path | None = index_path if index_path.is_file() else None
        # name -> file name (relative to root)
        self.weight_map: dict[str, str] = {}
        if self.index_path is not None:
            try:
                index = json.loads(self.index_path.read_text())
                weight_map = index["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"cannot parse the shard index: {e!r}", file=self.index_path) from None
            self.weight_map = dict(weight_map)
            bad = next((n for n, f in self.weight_map.items() if not isinstance(f, str)), None)
            if bad is not None:
                raise CheckpointError(f"weight_map value {self.weight_map[bad]!r} is not a file name", file=self.index_path, tensor=bad)
            # Shards are checked when first needed (`read_headers`), so reading a few layers works
            # from a partial download that holds only their shards.
        else:
            files = sorted(p.name for p in self.root.glob("*.safetensors"))
            if not files:
                raise CheckpointError("no *.safetensors files and no " + INDEX_NAME, file=self.root)
            for fname in files:
                for name in self._header(fname):
                    if name in self.weight_map:
                        raise CheckpointError(
                            f"tensor stored twice, also in {self.weight_map[name]}", file=self.root / fname, tensor=name
                        )
                    self.weight_map[name] = fname
                self._headers_read.add(fname)

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def _header(self, fname: str) -> list[str]:
        """Read one shard's header (names, shapes, dtypes), never its data. Returns its names."""
        path = self.root / fname
        names = []
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    self.info[name] = (tuple(sl.get_shape()), sl.get_dtype())
                    names.append(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read the safetensors header (truncated or corrupt file?): {e}", file=path) from None
        return names

    def read_headers(self, files: Iterable[str]) -> None:
        """Read the headers of `files`, checking that each holds what the index says it holds."""
        expected = defaultdict(set)
        for name, fname in self.weight_map.items():
            expected[fname].add(name)
        for fname in files:
            if fname in self._headers_read:
                continue
            if not (self.root / fname).is_file():
                raise CheckpointError(f"shard listed in {INDEX_NAME} is missing", file=self.root / fname, tensor=min(expected[fname]))
            present = set(self._header(fname))
            missing = sorted(expected[fname] - present)
            if missing:
                raise CheckpointError(
                    f"tensor listed in {INDEX_NAME} is missing from the shard ({len(missing)} missing)",
                    file=self.root / fname,
                    tensor=missing[0],
                )
            extra = sorted(present - expected[fname])
            if extra:
                logger.warning("%s holds %d tensors not listed in the index (ignored), e.g. %r", fname, len(extra), extra[0])
            self._headers_read.add(fname)

    def file_of(self, name: str) -> Path:
        return self.root / self.weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info[name][0]

    def st_dtype(self, name: str) -> str:
        return self.info[name][1]

    def is_fp8(self, name: str) -> bool:
        return self.st_dtype(name) in FP8_ST_DTYPES

    def nbytes(self, name: str) -> int:
        shape, dt = self.info[name]
        return math.prod(shape) * ST_DTYPE_BYTES.get(dt, 4)


def _read(handle, folder: _Folder, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as e:  # SafetensorError, OSError, RuntimeError from a damaged mmap
        raise CheckpointError(f"cannot read tensor data: {e}", file=folder.file_of(name), tensor=name) from None


class _Reader:
    """Reads tensors by name, one safe_open handle at a time; dequantizes FP8 weights."""

    def __init__(self, folder: _Folder, block_size: tuple[int, int] | None):
        self.folder = folder
        self.block_size = block_size
        self._fname: str | None = None
        self._handle = None
        self._ctx = None

    def _open(self, fname: str):
        if self._fname != fname:
            self.close()
            path = self.folder.root / fname
            try:
                self._ctx = safe_open(path, framework="pt", device="cpu")
                self._handle = self._ctx.__enter__()
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot open (truncated or corrupt file?): {e}", file=path) from None
            self._fname = fname
        return self._handle

    def close(self):
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
        self._ctx = self._handle = self._fname = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor as it is (FP8 stays FP8)."""
        return _read(self._open(self.folder.weight_map[name]), self.folder, name)

    def _scale(self, name: str) -> torch.Tensor:
        sname = _scale_name(name)
        fname = self.folder.weight_map[sname]
        if fname == self._fname:
            return _read(self._handle, self.folder, sname)
        # The scale lives in another shard: open that one just for this tensor.
        path = self.folder.root / fname
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                return _read(f, self.folder, sname)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot open (truncated or corrupt file?): {e}", file=path, tensor=sname) from None

    def get(self, name: str, dtype: torch.dtype | None) -> tuple[torch.Tensor, bool]:
        """The tensor in `dtype` (None: as stored, FP8 -> float32). Returns (tensor, was_fp8)."""
        t = self.raw(name)
        if self.folder.is_fp8(name):
            scale = self._scale(name)
            try:
                t = dequantize_fp8_block(t, scale, self.block_size, dtype=dtype)
            except ValueError as e:
                raise CheckpointError(str(e), file=self.folder.file_of(name), tensor=name) from None
            # A block quantizer never writes NaN (e4m3fn has no inf; it saturates at +-448), so a
            # non-finite value is a damaged shard or scale, or a value too large for `dtype`.
            if not torch.isfinite(t).all():
                raise CheckpointError(
                    f"non-finite values after dequantizing to {t.dtype} (NaN in the float8 data or "
                    f"its {SCALE_SUFFIX.lstrip('_')}, or a value beyond the range of {t.dtype})",
                    file=self.folder.file_of(name),
                    tensor=name,
                )
            return t, True
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t, False


def _parse_layers(folder: _Folder) -> dict[int, dict[str, str]]:
    """{layer: {short name: full name}} of every attention tensor in the checkpoint."""
    layers: dict[int, dict[str, str]] = defaultdict(dict)
    for full in folder.weight_map:
        m = ATTN_RE.match(full)
        if m:
            layers[int(m.group(1))][m.group(2)] = full
    return dict(layers)


def _num_hidden_layers(*configs) -> int | None:
    for c in configs:
        if isinstance(c, (str, os.PathLike)):
            c = _config_mapping(c)  # a config.json path, or the folder holding one
        if c is None:
            continue
        if isinstance(c, Mapping):
            c = c.get("text_config", c) if "num_hidden_layers" not in c else c
            n = c.get("num_hidden_layers")
        else:
            n = getattr(c, "num_hidden_layers", None)
        if n is not None:
            return int(n)
    return None


def _validate_layer(folder: _Folder, layer: int, names: dict[str, str], dims: AttentionDims) -> None:
    """Check one layer's attention tensors against the config: presence, shapes, FP8 scales."""
    shapes = dims.expected_shapes()
    required = [n for n in shapes if n not in ABSORBED_NAMES]  # weights, norms, and biases when attention_bias
    has_absorbed = "w_uk" in names and "w_uv" in names
    index_file = folder.index_path or folder.root
    for short in required:
        if short not in names and not (short == "kv_b_proj.weight" and has_absorbed):
            raise CheckpointError(
                f"missing from the checkpoint (config.json says layer {layer} has it)",
                file=index_file,
                tensor=ATTN_PREFIX.format(layer) + short,
            )
    for short, full in names.items():
        if short.endswith(SCALE_SUFFIX):
            weight = full[: -len(SCALE_SUFFIX)]
            if weight not in folder.weight_map:
                raise CheckpointError("scale without its weight", file=folder.file_of(full), tensor=full)
            continue
        if short not in shapes:
            if short.endswith(".bias") or short in EXPANDED_NAMES:
                raise CheckpointError(
                    f"unexpected attention tensor for this config (shape {list(folder.shape(full))})",
                    file=folder.file_of(full),
                    tensor=full,
                )
            # Something we do not read (e.g. a rotary buffer): leave it alone.
            continue
        got = folder.shape(full)
        if got != shapes[short]:
            raise CheckpointError(
                f"shape {list(got)} contradicts config.json (expected {list(shapes[short])})",
                file=folder.file_of(full),
                tensor=full,
            )


def _validate_fp8(folder: _Folder, names: Iterable[str], block_size) -> None:
    for full in names:
        if folder.is_fp8(full):
            if block_size is None:
                raise CheckpointError(
                    "float8 tensor but neither config.json nor a config passed in has a quantization_config "
                    "(block size unknown)",
                    file=folder.file_of(full),
                    tensor=full,
                )
            sname = _scale_name(full)
            if sname not in folder.weight_map:
                raise CheckpointError(f"float8 weight without its {sname.rsplit('.', 1)[-1]}", file=folder.file_of(full), tensor=full)
            folder.read_headers([folder.weight_map[sname]])
            want = scale_shape(folder.shape(full), block_size) if len(folder.shape(full)) == 2 else None
            if want is None or folder.shape(sname) != want:
                raise CheckpointError(
                    f"scale shape {list(folder.shape(sname))} does not match weight shape "
                    f"{list(folder.shape(full))} with blocks {list(block_size)}",
                    file=folder.file_of(sname),
                    tensor=sname,
                )


def _quantization_source(config: Any) -> Mapping[str, Any] | None:
    """A mapping holding ``quantization_config`` from a config passed by the caller (dict, config.json
    path or folder, transformers config), or None when it holds none (an MLAConfig never does)."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        path = path / CONFIG_NAME if path.is_dir() else path
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read the config passed in: {e}", file=path) from None
    if isinstance(config, Mapping):
        return config if "quantization_config" in config else None
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return {"quantization_config": qc if isinstance(qc, Mapping) else qc.to_dict()}


def _block_size(folder: _Folder, config: Any = None):
    """FP8 block size from the folder's config.json, else from the config the caller passed (a folder
    of shards without config.json still needs ``quantization_config`` from somewhere)."""
    source, where = folder.config, folder.root / CONFIG_NAME
    if (source is None or "quantization_config" not in source) and config is not None:
        passed = _quantization_source(config)
        if passed is not None:
            source, where = passed, "the config passed in"
    try:
        return block_size_from_config(source)
    except ValueError as e:
        raise CheckpointError(str(e), file=where) from None


def _check_absorbed_fresh(layer: int, weights: dict[str, torch.Tensor], dims: AttentionDims, file) -> None:
    """Refuse absorbed matrices that no longer match kv_b_proj (stale after fine-tuning).

    `weights` are as stored. w_uk / w_uv are re-indexings of kv_b_proj.weight, so they must be
    equal exactly once both are rounded to the less precise of their two storage dtypes.
    """
    kv_b = weights["kv_b_proj.weight"]
    fresh = absorb_mla_weights({"kv_b_proj.weight": kv_b}, dims, dtype=torch.float32)
    for name in ("w_uk", "w_uv"):
        if name not in weights:
            continue
        stored = weights[name]
        low = max((stored.dtype, kv_b.dtype), key=lambda d: torch.finfo(d).eps)
        if stored.shape != fresh[name].shape or not torch.equal(stored.to(low), fresh[name].to(low)):
            raise CheckpointError(
                "stale absorbed weight: it does not equal the one computed from kv_b_proj.weight "
                "(were the expanded weights fine-tuned after absorbing?). Re-run "
                "`python -m mla_attn.convert` or recompute with absorb_mla_weights",
                file=file,
                tensor=ATTN_PREFIX.format(layer) + name,
            )


def load_checkpoint(
    path: str | os.PathLike,
    config: Any = None,
    *,
    layers: Iterable[int] | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
) -> dict[int, dict[str, torch.Tensor]]:
    """Read the MLA attention weights of a Hugging Face DeepSeek-style checkpoint folder.

    Args:
        path: folder with ``config.json`` and one ``*.safetensors`` file or several plus
            ``model.safetensors.index.json`` (DeepSeek-V2/V3, Kimi-K2, Moonlight layout:
            ``model.layers.{i}.self_attn.*``).
        config: sizes to check the shapes against (``MLAConfig``, transformers config, dict or
            path); None reads ``path/config.json``. When the folder has no config.json with a
            ``quantization_config``, an FP8 checkpoint's block size is read from this one.
        layers: layer indices to read (default: all). Multi-token-prediction layers (index >=
            ``num_hidden_layers``) are skipped with a log line.
        dtype: dtype of every returned tensor; None keeps the stored dtype (FP8 -> float32).

    Returns:
        ``{layer_index: {name: tensor}}`` with names as in ``DeepseekV3Attention.state_dict()``
        (``q_proj.weight`` or ``q_a_proj.weight`` / ``q_a_layernorm.weight`` / ``q_b_proj.weight``,
        ``kv_a_proj_with_mqa.weight``, ``kv_a_layernorm.weight``, ``kv_b_proj.weight``,
        ``o_proj.weight``, biases if present) plus ``w_uk`` ``[H, qk_nope, Dc]`` / ``w_uv``
        ``[H, Dc, v_head]`` when the checkpoint holds them (checked against ``kv_b_proj.weight``:
        stale ones raise). FP8 block-quantized weights come back dequantized; their
        ``weight_scale_inv`` tensors are consumed, not returned.

    Raises:
        CheckpointError (a ValueError) naming the file and tensor for anything missing, misshapen,
        truncated or in an unknown quantization format.
    """
    folder = _Folder(path, need_config=config is None)
    dims = attention_dims(config if config is not None else folder.config)
    block_size = _block_size(folder, config)
    n_layers = _num_hidden_layers(config, folder.config)
    found = _parse_layers(folder)
    mtp = sorted(i for i in found if n_layers is not None and i >= n_layers)
    if mtp:
        logger.info("skipping multi-token-prediction layers %s (num_hidden_layers=%d)", mtp, n_layers)
    main = sorted(i for i in found if i not in mtp)
    if layers is None:
        wanted = list(range(n_layers)) if n_layers is not None else main
    else:
        wanted = sorted({int(i) for i in layers})
        bad = [i for i in wanted if i < 0 or (n_layers is not None and i >= n_layers)]
        if bad:
            raise ValueError(f"layers: indices {bad} out of range for num_hidden_layers={n_layers}")
    for i in wanted:
        if i not in found:
            raise CheckpointError(
                f"no attention tensors for layer {i}", file=folder.index_path or folder.root, tensor=ATTN_PREFIX.format(i) + "*"
            )

    # Headers of the shards we need only; then validate before reading any data.
    needed = {i: found[i] for i in wanted}
    folder.read_headers({folder.weight_map[full] for names in needed.values() for full in names.values()})
    for i, names in needed.items():
        _validate_layer(folder, i, names, dims)
        _validate_fp8(folder, names.values(), block_size)

    # Read grouped by shard so each file is opened once.
    plan = sorted(
        (folder.weight_map[full], i, short, full)
        for i, names in needed.items()
        for short, full in names.items()
        if short in EXPANDED_NAMES or short in ("w_uk", "w_uv")
    )
    out: dict[int, dict[str, torch.Tensor]] = {i: {} for i in wanted}
    # Layers whose stored w_uk / w_uv are compared with kv_b_proj as stored (FP8 -> float32);
    # every other tensor is cast as it is read, so float32 copies of all layers never coexist.
    to_check = {i for i, names in needed.items() if "kv_b_proj.weight" in names and ("w_uk" in names or "w_uv" in names)}
    with _Reader(folder, block_size) as reader:
        for _fname, i, short, full in plan:
            as_stored = i in to_check and short in ("kv_b_proj.weight", "w_uk", "w_uv")
            out[i][short], _ = reader.get(full, None if as_stored else dtype)
    for i, weights in out.items():
        if "kv_b_proj.weight" in weights and ("w_uk" in weights or "w_uv" in weights):
            _check_absorbed_fresh(i, weights, dims, folder.root)
        for short, t in weights.items():
            if dtype is not None and t.dtype != dtype:
                weights[short] = t.to(dtype)
    return {i: dict(sorted(w.items())) for i, w in out.items()}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.I)
    if not m:
        raise ValueError(f"max_shard_size: expected bytes or a size like '5GB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(m.group(1)) * mult[unit])


class _ShardWriter:
    """Accumulates output tensors and writes a shard each time `max_bytes` is reached."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.parts: list[tuple[str, list[str]]] = []  # (temporary file name, names)
        self.names: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise CheckpointError("tensor written twice", tensor=name)
        self.names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.buffer_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.buffer:
            return
        fname = f"part-{len(self.parts):05d}.safetensors"
        try:
            save_file(self.buffer, str(self.folder / fname), metadata={"format": "pt"})
        except SafetensorError as e:  # an I/O failure (disk full, quota) surfaces as SafetensorError
            raise OSError(f"cannot write {self.folder / fname}: {e}") from None
        self.parts.append((fname, list(self.buffer)))
        self.buffer = {}
        self.buffer_bytes = 0

    def finish(self) -> dict[str, str]:
        """Rename the parts to `model-0000k-of-0000n.safetensors`; return the weight map."""
        self.flush()
        n = len(self.parts)
        weight_map = {}
        for k, (tmp, names) in enumerate(self.parts):
            final = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp, self.folder / final)
            weight_map.update({name: final for name in names})
        return dict(sorted(weight_map.items()))


def _copy_other_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer files, generation config, custom code, ...: everything but the weights."""
    copied = []
    for entry in sorted(src.iterdir()):
        if entry.name.startswith(".") or entry.name in (CONFIG_NAME, INDEX_NAME) or entry.suffix == ".safetensors":
            continue
        if entry.name.startswith("pytorch_model") and (entry.suffix == ".bin" or entry.name.endswith(".bin.index.json")):
            # Legacy pickled copies of the same weights: they would contradict the converted ones.
            logger.warning("not copying %s (legacy weights; the converted *.safetensors replace them)", entry.name)
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name, symlinks=False)
        else:
            shutil.copy2(entry, dst / entry.name)
        copied.append(entry.name)
    return copied


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    absorb: bool = True,
    progress: bool = True,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Convert a Hugging Face DeepSeek-style checkpoint folder for ``mla_attn``, streaming.

    * FP8 block-quantized weights are dequantized (float32 math) to ``dtype``; their
      ``weight_scale_inv`` tensors and config.json's ``quantization_config`` are dropped.
    * With ``absorb``, ``model.layers.{i}.self_attn.w_uk`` ``[H, qk_nope, Dc]`` and ``.w_uv``
      ``[H, Dc, v_head]`` are added for every layer ``i < num_hidden_layers``, in the dtype its
      ``kv_b_proj.weight`` is written in (so they equal their source exactly). Absorbed tensors
      already in ``src`` are never copied: recomputed with ``absorb``, dropped without.
    * Every other tensor is copied unchanged (name, dtype, values); other files (tokenizer,
      generation config, code) are copied; config.json gets a ``"mla_attn_conversion"`` record.

    Tensors are read one at a time and written in shards of at most ``max_shard_size`` bytes
    (a single larger tensor gets a shard of its own), so peak memory is about one input shard
    (memory-mapped) plus one output shard. Everything is checked before any data is read; the
    output is built in a temporary folder beside ``dst`` and renamed into place at the end, so an
    error leaves no partial output. An existing ``dst`` is refused unless ``overwrite``.

    Returns the destination path. Raises CheckpointError (a ValueError) naming the file and tensor
    (also for an FP8 weight that dequantizes to NaN or overflows ``dtype``, found while streaming),
    ValueError for a ``dst`` that is, lies in, or holds ``src``, FileExistsError, or OSError when
    writing fails (disk full).
    """
    src_path, dst_path = Path(src).resolve(), Path(dst).resolve()
    if dst_path == src_path or src_path in dst_path.parents or dst_path in src_path.parents:
        # dst inside src would be copied into itself; src inside dst would be deleted by overwrite.
        raise ValueError(f"dst: {dst_path} must not be the source folder, inside it, or a folder holding it")
    if dst_path.exists() and not overwrite:
        raise FileExistsError(f"dst: {dst_path} already exists (pass overwrite=True / --overwrite to replace it)")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(f"dtype: expected a floating torch.dtype of 16 bits or more, got {dtype!r}")
    max_bytes = _parse_size(max_shard_size)
    if max_bytes <= 0:
        raise ValueError(f"max_shard_size: must be positive, got {max_shard_size!r}")

    # ---- Plan and validate: headers only, no tensor data. ----
    folder = _Folder(src_path, need_config=True)
    block_size = _block_size(folder)
    dims = attention_dims(folder.config)
    n_layers = _num_hidden_layers(folder.config)
    if n_layers is None:
        raise CheckpointError("missing 'num_hidden_layers'", file=src_path / CONFIG_NAME)
    folder.read_headers(folder.files)
    found = _parse_layers(folder)
    for i in range(n_layers):
        if i not in found:
            raise CheckpointError(
                f"no attention tensors for layer {i} (num_hidden_layers={n_layers})",
                file=folder.index_path or folder.root,
                tensor=ATTN_PREFIX.format(i) + "kv_b_proj.weight",
            )
        _validate_layer(folder, i, found[i], dims)
    _validate_fp8(folder, folder.weight_map, block_size)
    for name in folder.weight_map:
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] not in folder.weight_map:
            raise CheckpointError("scale without its weight", file=folder.file_of(name), tensor=name)

    # Which stored absorbed tensors to drop (their layer has kv_b_proj to recompute them from).
    stale = set()
    for i, names in found.items():
        if "kv_b_proj.weight" in names:
            stale.update(names[s] for s in ABSORBED_NAMES if s in names)
    if stale:
        logger.info("dropping %d absorbed tensors stored in the source (%s)", len(stale), "recomputed" if absorb else "--no-absorb")
    kv_b_names = {found[i]["kv_b_proj.weight"]: i for i in range(n_layers) if "kv_b_proj.weight" in found[i]}

    # ---- Stream. ----
    tmp = dst_path.parent / f".{dst_path.name}.partial-{uuid.uuid4().hex[:8]}"
    created_parents = [p for p in dst_path.parents if not p.exists()]  # deepest first
    record = {
        "source": str(src_path),
        "dtype": str(dtype).replace("torch.", ""),
        "dequantized_fp8_tensors": 0,
        "fp8_block_size": list(block_size) if block_size else None,
        "dropped_scale_tensors": 0,
        "absorbed": bool(absorb),
        "absorbed_layers": [],
        "added_tensors": ["model.layers.{i}.self_attn.w_uk [H, qk_nope_head_dim, kv_lora_rank]",
                          "model.layers.{i}.self_attn.w_uv [H, kv_lora_rank, v_head_dim]"] if absorb else [],
        "dropped_absorbed_tensors": len(stale),
    }  # fmt: skip
    try:
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        from tqdm.auto import tqdm

        by_file = defaultdict(list)
        for name, fname in folder.weight_map.items():
            by_file[fname].append(name)
        names_in_order = [n for f in folder.files for n in sorted(by_file[f])]
        total_bytes = sum(folder.nbytes(n) for n in names_in_order)
        writer = _ShardWriter(tmp, max_bytes)
        with (
            tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress) as bar,
            _Reader(folder, block_size) as reader,
        ):
            for k, name in enumerate(names_in_order):
                bar.set_postfix_str(f"tensors {k + 1}/{len(names_in_order)}", refresh=False)
                bar.update(folder.nbytes(name))  # bytes of the source read so far
                if name.endswith(SCALE_SUFFIX):
                    record["dropped_scale_tensors"] += 1
                    continue
                if name in stale:
                    continue
                if folder.is_fp8(name):
                    tensor, _ = reader.get(name, dtype)
                    record["dequantized_fp8_tensors"] += 1
                else:
                    tensor = reader.raw(name)
                writer.add(name, tensor)
                if absorb and name in kv_b_names:
                    i = kv_b_names[name]
                    for short, t in absorb_mla_weights({"kv_b_proj.weight": tensor}, dims).items():
                        writer.add(ATTN_PREFIX.format(i) + short, t)
                    record["absorbed_layers"].append(i)
                del tensor
        weight_map = writer.finish()
        index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        config = dict(folder.config)
        if block_size is not None:
            config.pop("quantization_config", None)
        record["absorbed_layers"].sort()
        config[CONVERSION_KEY] = record
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        _copy_other_files(src_path, tmp)
        _replace(tmp, dst_path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created_parents:  # only folders this call made, and only while empty
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    logger.info(
        "converted %s -> %s: %d FP8 tensors dequantized, %d layers absorbed, %d shards",
        src_path, dst_path, record["dequantized_fp8_tensors"], len(record["absorbed_layers"]), len(set(weight_map.values())),
    )  # fmt: skip
    return dst_path


def _replace(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Move the finished `tmp` folder to `dst`; an old `dst` is swapped out, then deleted."""
    if not dst.exists():
        os.rename(tmp, dst)
        return
    if not overwrite:
        raise FileExistsError(f"dst: {dst} appeared while converting; not overwriting it")
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(dst, old)
        os.rename(tmp, dst)
    except BaseException:
        # Also when interrupted right after the first rename returned: put the old dst back.
        if old.exists() and not dst.exists():
            os.rename(old, dst)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()
