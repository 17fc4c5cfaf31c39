"""The three storage formats: memory-mapped raw arrays, HDF5 and JSON.

Memory-mapped ``.bin`` files are the training format: opening them costs nothing
and a window is a view into the page cache. HDF5 suits exchange with other tools,
JSON is readable by eye and by anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from astrai.dataset.storage_formats import META_FILE, BaseStorage, register_storage, shard_names
from astrai.errors import DataError


def _key_dtypes(meta: dict, path: Path) -> dict[str, np.dtype]:
    keys = meta.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise DataError(f"{path / META_FILE}: 'keys' must map each stored key to {{'dtype': ...}}")
    try:
        return {key: np.dtype(spec["dtype"]) for key, spec in keys.items()}
    except (KeyError, TypeError) as exc:
        raise DataError(f"{path / META_FILE}: bad key description ({exc})") from None


def _as_array(values, where: str) -> np.ndarray:
    try:
        array = np.asarray(values)
    except ValueError:
        raise DataError(f"{where}: expected a flat list of numbers") from None
    if array.ndim != 1 or (array.size and not (np.issubdtype(array.dtype, np.number) or array.dtype == bool)):
        raise DataError(f"{where}: expected a flat list of numbers, got {array.dtype} of shape {array.shape}")
    return array


# ----- memory-mapped -------------------------------------------------------------------
def mmap_file(path: Path, key: str, shard: str) -> Path:
    return path / f"{key}.{shard}.bin"


@register_storage("mmap")
class MmapStorage(BaseStorage):
    """Raw little-endian arrays, one file per key per shard, opened with numpy.memmap."""

    def shard_file(self, key: str, shard: str) -> Path:
        return mmap_file(self.path, key, shard)

    def _load_segments(self, path: Path) -> dict[str, list[np.ndarray]]:
        if not path.is_dir() or not self.meta:
            raise DataError(f"{path}: a memory-mapped dataset is a directory with {META_FILE}")
        dtypes = _key_dtypes(self.meta, path)
        segments: dict[str, list[np.ndarray]] = {key: [] for key in dtypes}
        for shard in shard_names(self.meta, path):
            for key, dtype in dtypes.items():
                file = mmap_file(path, key, shard)
                try:
                    size = file.stat().st_size
                except OSError as exc:
                    raise DataError(f"{file}: cannot be read ({exc.strerror})") from None
                if size % dtype.itemsize:
                    raise DataError(f"{file}: size {size} is not a multiple of {dtype} ({dtype.itemsize} bytes); "
                                    f"the file is truncated")
                # copy-on-write: views are writable for torch.from_numpy, the file is never modified
                segments[key].append(np.memmap(file, dtype=dtype, mode="c") if size else np.empty(0, dtype))
        return segments


def write_mmap_shard(path: Path, shard: str, arrays: dict[str, np.ndarray]) -> None:
    for key, array in arrays.items():
        np.ascontiguousarray(array).tofile(mmap_file(path, key, shard))


# ----- HDF5 ----------------------------------------------------------------------------
def save_h5(file_path: str | Path, data: dict[str, np.ndarray | list]) -> None:
    """Write key → flat array as datasets of one HDF5 file."""
    with h5py.File(file_path, "w") as handle:
        for key, values in data.items():
            handle.create_dataset(key, data=np.asarray(values))


def load_h5(path: str | Path) -> dict[str, list[np.ndarray]]:
    """key → arrays, from an HDF5 file or every .h5 file of a directory (sorted by name)."""
    path = Path(path)
    files = sorted(path.glob("*.h5")) + sorted(path.glob("*.hdf5")) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: no .h5 files")
    out: dict[str, list[np.ndarray]] = {}
    for file in files:
        try:
            with h5py.File(file, "r") as handle:
                for key in handle.keys():
                    if not isinstance(handle[key], h5py.Dataset):
                        raise DataError(f"{file}: '{key}' is a group; expected flat datasets, one per key")
                    out.setdefault(key, []).append(_as_array(handle[key][()], f"{file}: dataset '{key}'"))
        except OSError as exc:
            raise DataError(f"{file}: not a readable HDF5 file ({exc})") from None
    return out


@register_storage("h5")
class H5Storage(BaseStorage):
    """One HDF5 file per shard (``shard-{name}.h5``), or any .h5 file(s) of flat datasets."""

    def _load_segments(self, path: Path) -> dict[str, list[np.ndarray]]:
        if path.is_dir() and self.meta:
            data = {}
            for shard in shard_names(self.meta, path):
                for key, arrays in load_h5(path / f"shard-{shard}.h5").items():
                    data.setdefault(key, []).extend(arrays)
            return data
        return load_h5(path)


# ----- JSON ----------------------------------------------------------------------------
def save_json(file_path: str | Path, data: dict[str, np.ndarray | list]) -> None:
    """Write key → flat list as one JSON object."""
    payload = {key: np.asarray(values).tolist() for key, values in data.items()}
    Path(file_path).write_text(json.dumps(payload, separators=(",", ":")), encoding="utf-8")


def _json_objects(file: Path):
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{file}: cannot be read ({exc})") from None
    if file.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line), f"{file}:{lineno}"
                except json.JSONDecodeError as exc:
                    raise DataError(f"{file}:{lineno}: not valid JSON ({exc.msg})") from None
    else:
        try:
            yield json.loads(text), str(file)
        except json.JSONDecodeError as exc:
            raise DataError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg})") from None


def load_json(path: str | Path) -> dict[str, list[np.ndarray]]:
    """key → arrays, from a .json object / .jsonl lines of key → list (a file or a directory of them)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.name != META_FILE) \
        if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: no .json or .jsonl data files")
    out: dict[str, list[np.ndarray]] = {}
    for file in files:
        for obj, where in _json_objects(file):
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected an object mapping each key to a list of numbers")
            for key, values in obj.items():
                if not isinstance(values, list):
                    raise DataError(f"{where}: key '{key}' must be a list of numbers, got {type(values).__name__}")
                out.setdefault(key, []).append(_as_array(values, f"{where}: key '{key}'"))
    return out


@register_storage("json")
class JSONStorage(BaseStorage):
    """One JSON file per shard (``shard-{name}.json``), or any JSON/JSONL of key → list."""

    def _load_segments(self, path: Path) -> dict[str, list[np.ndarray]]:
        if path.is_dir() and self.meta:
            dtypes = {}
            if "keys" in self.meta:
                dtypes = {k: v.get("dtype") for k, v in self.meta["keys"].items() if isinstance(v, dict)}
            data = {}
            for shard in shard_names(self.meta, path):
                for key, arrays in load_json(path / f"shard-{shard}.json").items():
                    dtype = dtypes.get(key)
                    data.setdefault(key, []).extend(a.astype(dtype) if dtype else a for a in arrays)
            return data
        return load_json(path)


WRITERS = {
    "mmap": write_mmap_shard,
    "h5": lambda path, shard, arrays: save_h5(path / f"shard-{shard}.h5", arrays),
    "json": lambda path, shard, arrays: save_json(path / f"shard-{shard}.json", arrays),
}
