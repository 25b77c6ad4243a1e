"""`manifest.json`: what a graph directory holds, and the refusal of a directory that does not fit.

Written by `k3export export` beside `prefill.pt2` and `decode.pt2` (format described in `k3export/export.py`);
`k3export onnx` adds an `onnx` entry. Every consumer (the exported-program driver, verify, engine builders) calls
`check_manifest` first: a graph built from another config, another checkpoint or other library versions is
refused with a message that names each difference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

FORMAT = "k3export.graphs/1"
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """A graph directory does not match what it is used with; the message lists every difference."""


def library_versions() -> dict[str, str]:
    """Versions that decide whether a serialized graph loads and computes the same (local build tags such as
    `+cpu` are dropped: they name the wheel, not the graph format)."""
    import k3export
    v = {"torch": torch.__version__.split("+")[0], "k3export": k3export.__version__,
         "python": ".".join(platform.python_version_tuple()[:2])}
    return v


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest spelling of a torch dtype: 'float32', 'bfloat16', 'int64'."""
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def replacing(path: str | Path):
    """Write a file atomically: yields a temporary path beside `path` (same suffix, so writers that check it
    accept it); when the block succeeds it is renamed over `path` (os.replace), else removed. A reader never
    sees a half-written file, and an interrupted write leaves the old one."""
    path = Path(path)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def umask_mode(directory: bool = False) -> int:
    """The mode a plain `open()` / `mkdir()` would give under the current umask (0644 / 0755 under 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, then the umask's file mode: `save_file` creates 0600 files, which a serving
    process running as another user could not read."""
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, umask_mode())


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """`path.write_text/write_bytes`, atomically (see `replacing`)."""
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_fingerprint(path: str | Path) -> str:
    """Cheap identity of a checkpoint directory: config.json, then per safetensors file its name, size, header
    (tensor names, dtypes, offsets) and first MiB of data. Reads a few MiB whatever the checkpoint size."""
    p = Path(path)
    h = hashlib.sha256((p / "config.json").read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + str(f.stat().st_size).encode() + fh.read(n) + fh.read(1 << 20))
    return h.hexdigest()[:16]


def preset_fingerprint(preset: str, seed: int, dtype: torch.dtype) -> str:
    """Random preset weights are a function of (preset, seed, dtype)."""
    return f"preset:{preset}:seed{seed}:{dtype_name(dtype)}"


def write_manifest(out: Path, manifest: dict) -> Path:
    return atomic_write(Path(out) / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def load_manifest(graph_dir: str | Path) -> dict:
    path = Path(graph_dir) / MANIFEST
    if not path.exists():
        raise ManifestError(f"{graph_dir} has no {MANIFEST}: not a graph directory (run `k3export export` first)")
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise ManifestError(f"{path} is corrupt (not valid JSON: {e}); re-run `k3export export`") from None
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt != FORMAT:
        raise ManifestError(f"{path}: format {fmt!r}, this k3export reads {FORMAT!r}; re-export")
    return m


def check_graph_files(graph_dir: str | Path, manifest: dict, sha256: bool = True) -> dict[str, Path]:
    """The graph files (`prefill.pt2`, `decode.pt2`) of a graph directory, each present and (unless `sha256` is
    False) with the sha256 the manifest records (one read of each file); raises ManifestError naming each
    missing or different file. Returns {graph: path}."""
    graph_dir, problems, files = Path(graph_dir), [], {}
    for g, rec in manifest["graphs"].items():
        f = files[g] = graph_dir / rec["file"]
        if not f.exists():
            problems.append(f"{rec['file']} is missing")
        elif sha256 and file_sha256(f) != rec["sha256"]:
            problems.append(f"{rec['file']} differs from the manifest (sha256): the file was changed or a "
                            "re-export was interrupted")
    if problems:
        raise ManifestError(f"{graph_dir}: " + "; ".join(problems) + " (re-run `k3export export`)")
    return files


def check_manifest(manifest: dict, *, config_hash: str | None = None, weights: str | None = None,
                   versions: dict[str, str] | None = None) -> None:
    """Refuse a graph directory that does not fit: compares the config hash, the weights fingerprint and the
    library versions (the running ones unless `versions` is given; pass `{}` to skip). Raises ManifestError
    naming each difference."""
    diffs = []
    if config_hash is not None and manifest["config_hash"] != config_hash:
        diffs.append(f"config hash: graphs {manifest['config_hash']}, checkpoint {config_hash}")
    if weights is not None and manifest["source"]["weights"] != weights:
        diffs.append(f"weights: graphs exported from {manifest['source']['weights']}, given {weights}")
    running = library_versions() if versions is None else versions
    for lib, want in running.items():
        have = manifest["versions"].get(lib)
        if have != want:
            diffs.append(f"{lib} version: graphs exported with {have}, running {want}")
    if diffs:
        raise ManifestError("graph directory does not match: " + "; ".join(diffs) +
                            " (re-run `k3export export` for this checkpoint and these libraries)")
