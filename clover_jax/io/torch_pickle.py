"""Tensors of a PyTorch checkpoint (`torch.save` of a state dict: `pytorch_model.bin`, `medusa_lm_head.pt`) as
numpy arrays, without torch and without running the file's code.

Published draft heads often ship only in this format (EAGLE-1's `pytorch_model.bin`, Medusa-1's
`medusa_lm_head.pt`). Since torch 1.6 `torch.save` writes a zip archive: `<name>/data.pkl`, a pickle of the state
dict in which each tensor is a call `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` and each
storage a persistent id `("storage", <dtype>Storage, key, location, numel)` whose bytes are the archive member
`<name>/data/<key>` (little-endian unless `<name>/byteorder` says otherwise). The unpickler below resolves only
those names (a whitelist), so a checkpoint cannot execute code while being read; anything else is a clear error.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

# torch's legacy typed-storage classes, as pickled, -> numpy dtype
_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_, "BFloat16Storage": "bfloat16",
}


class TorchFileError(ValueError):
    """A file that is not a readable `torch.save` zip archive of tensors."""


class _StorageType:
    def __init__(self, name: str):
        dtype = _STORAGE_DTYPES[name]
        if dtype == "bfloat16":
            dtype = ml_dtypes.bfloat16
        self.dtype = np.dtype(dtype)


class _Storage:
    """A storage named by the pickle: its bytes are read from the archive only when a tensor needs them."""

    def __init__(self, key: str, dtype: np.dtype, numel: int | None):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`, kept lazy."""

    def __init__(self, storage, offset, size, stride, *_ignored):
        if not isinstance(storage, _Storage):
            raise TorchFileError(f"a tensor's storage is a {type(storage).__name__}")
        self.storage, self.offset = storage, int(offset)
        self.size, self.stride = tuple(int(n) for n in size), tuple(int(n) for n in stride)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size

    def materialize(self, data: np.ndarray) -> np.ndarray:
        """The tensor as a contiguous array, from its storage's elements `data` (1-D)."""
        size, stride, offset = self.size, self.stride, self.offset
        if any(n == 0 for n in size):
            return np.zeros(size, data.dtype)
        extent = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if extent > data.size:
            raise TorchFileError(f"a tensor of shape {size} reaches element {extent} of a storage of {data.size}")
        if not size:
            return np.array(data[offset])
        item = data.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(data[offset:], size, tuple(s * item for s in stride), writeable=False)
        return np.ascontiguousarray(view)


def _rebuild_parameter(data, *_ignored):  # torch._utils._rebuild_parameter(data, requires_grad, hooks)
    return data


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _Tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, where: Path):
        super().__init__(file)
        self._where = where

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        fn = _ALLOWED.get((module, name))
        if fn is None:
            raise TorchFileError(f"{self._where}: holds {module}.{name}, which a tensor checkpoint does not need "
                                 "(only state dicts of tensors are read, and no code in the file is run)")
        return fn

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise TorchFileError(f"{self._where}: unexpected persistent id {pid!r}")
        if not isinstance(pid[1], _StorageType):
            raise TorchFileError(f"{self._where}: storage {pid[2]} has an unknown type {pid[1]!r}")
        return _Storage(str(pid[2]), pid[1].dtype, int(pid[4]) if len(pid) > 4 else None)


def open_torch_file(path):
    """`(get(name) -> np.ndarray, names)` over a `torch.save`d state dict (zip format, torch >= 1.6), read
    without torch; each `get` reads only that tensor's storage from the archive."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise TorchFileError(f"{path}: not a zip-format torch checkpoint (files written by torch < 1.6, or not a "
                             "torch file at all, are not read; re-save it with a current torch, or as safetensors)")
    with zipfile.ZipFile(path) as archive:
        pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pkl) != 1:
            raise TorchFileError(f"{path}: expected one data.pkl in the archive, found {len(pkl)}")
        prefix = pkl[0][: -len("data.pkl")]
        names = set(archive.namelist())
        byteorder = archive.read(prefix + "byteorder").decode().strip() if prefix + "byteorder" in names else "little"
        with archive.open(pkl[0]) as f:
            try:
                obj = _Unpickler(f, path).load()
            except TorchFileError:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged pickle raises many types
                raise TorchFileError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise TorchFileError(f"{path}: holds a {type(obj).__name__}, not a state dict of tensors")
    bad = [k for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, _Tensor))]
    if bad:
        raise TorchFileError(f"{path}: entry {bad[0]!r} is not a tensor (a state dict of tensors is expected)")
    order = "<" if byteorder == "little" else ">"

    def get(name: str) -> np.ndarray:
        t = obj[name]
        st = t.storage
        try:
            with zipfile.ZipFile(path) as archive:
                raw = archive.read(f"{prefix}data/{st.key}")
        except KeyError:
            raise TorchFileError(f"{path}: storage {st.key} of {name!r} is missing from the archive") from None
        except (OSError, zipfile.BadZipFile) as e:
            raise TorchFileError(f"{path}: storage {st.key} of {name!r} cannot be read ({e})") from None
        data = np.frombuffer(raw, st.dtype.newbyteorder(order)).astype(st.dtype, copy=False)
        return t.materialize(data)

    return get, list(obj)


def read_torch_file(path) -> dict[str, np.ndarray]:
    """{name: array} of a `torch.save`d state dict, read without torch (see `open_torch_file`)."""
    get, names = open_torch_file(path)
    return {k: get(k) for k in names}
