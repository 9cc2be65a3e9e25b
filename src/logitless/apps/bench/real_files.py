"""The real-head data file: one `torch.save` file (tensors, strings and numbers only) that `load` reads with torch
alone, the head as its Q8_0 blocks; cut into parts of any size (`split_file`) and read back from them (real.py
prepares it).
"""

from __future__ import annotations

import glob
import io
import os
from pathlib import Path

import torch

FORMAT = "logitless-real-head/1"


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Q8_0 -> float32, exactly (an 8-bit integer times a float16 needs at most 19 significant bits)."""
    V, D = q.shape
    return (q.float().view(V, D // 32, 32) * scale.float().unsqueeze(-1)).view(V, D)


def write(path: str | os.PathLike, obj: dict) -> Path:
    """Save a real-head dict (format, model, V, D, text, weight_q8, weight_scale, input, target) for `load`."""
    missing = {"model", "V", "D", "text", "weight_q8", "weight_scale", "input", "target"} - set(obj)
    if missing:
        raise ValueError(f"a real-head file needs {', '.join(sorted(missing))}")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({**obj, "format": FORMAT}, tmp)
    os.replace(tmp, path)
    return path


def split_file(path: str | os.PathLike, part_mib: float = 55.0) -> list[Path]:
    """Cut `path` into PATH.part00, PATH.part01, ... of at most `part_mib` MiB; `cat PATH.part* > PATH` joins them."""
    path = Path(path)
    size = int(part_mib * 2**20)
    parts = []
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(size), b"")):
            p = path.with_name(f"{path.name}.part{i:02d}")
            p.write_bytes(block)
            parts.append(p)
    return parts


def _parts(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and ".part" in p.name)
        if not found:
            raise FileNotFoundError(f"{path} is a folder with no *.partNN files")
        return found
    if path.exists():
        return [path]
    found = sorted(Path(p) for p in glob.glob(glob.escape(str(path)) + ".part*"))
    if not found:
        raise FileNotFoundError(f"no data file {path} (nor {path}.partNN parts)")
    return found


def load(path: str | os.PathLike) -> dict:
    """A prepared data file (or its parts) -> dict with the float32 `weight` (V, D), `input` (N, D), `target`."""
    parts = _parts(Path(path))
    if len(parts) == 1:
        obj = torch.load(parts[0], map_location="cpu", weights_only=True)
    else:
        buf = io.BytesIO(b"".join(p.read_bytes() for p in parts))
        try:
            obj = torch.load(buf, map_location="cpu", weights_only=True)
        except Exception as e:  # a missing or truncated part breaks the zip archive
            raise ValueError(f"cannot read the data file joined from {len(parts)} parts "
                             f"({', '.join(p.name for p in parts)}): is a part missing? ({e})") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{path} is not a logitless real-head file (format {FORMAT})")
    obj["weight"] = dequantize(obj.pop("weight_q8"), obj.pop("weight_scale"))
    return obj
