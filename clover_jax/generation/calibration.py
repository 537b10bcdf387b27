"""The calibration store: which tree a calibration found fastest for a head on some hardware, dtype and batch size,
and the shapes of the trees it fitted (`fit-N-<hash>`), saved as `calibration.json` beside the head or in the user's
cache. `clover_jax.tuning.calibrate` fills and reads it (`tree="auto"`); a head's fitted trees are read by
`clover_jax.heads.folder`.

A calibration is keyed by the hardware (backend and device kind; on a CPU the processor model and core count), the
compute dtype and the batch size. It is saved beside the head (`calibration.json` in the head's folder) when that
folder is writable, else in `~/.cache/clover_jax/calibration/` (`CLOVER_JAX_CACHE` overrides). An entry measured
with other weights (their digest differs) or by an older calibration version is stale and not used. A new entry
keeps the fitted tree shapes of the one it replaces (`kept_trees`), so a fitted tree named elsewhere (a registered
head's default tree) still resolves.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import jax

from clover_jax.heads.folder import CALIBRATION_FILE, KEPT_TREES, HeadFolder, open_folder
from clover_jax.io.files import atomic_write_text, read_json_object, update_json
from clover_jax.validation import InputError

AUTO = "auto"


AR = "ar"  # the calibration's answer when no tree beats autoregressive decoding


FILE_NAME = CALIBRATION_FILE


# What a calibration tries. An entry saved by an older version never measured candidates the current one would
# try, so `auto` calibrates again rather than trust its answer: 1 the presets and dynamic trees; 2 also the probe,
# the fitted trees and a final round with prompt-lookup chains; 3 also the n-gram table's chains (`...-table`).
VERSION = 3


class CalibrationError(InputError):
    """A calibration that cannot run (no candidate tree fits the head)."""


# ----------------------------------------------------------------------------------------------- keys
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_key(mesh=None) -> str:
    """Where step costs were measured: backend and device kind (CPU: processor model and cores), and the
    mesh shape when decoding is sharded."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        where = f"cpu: {_cpu_name()} x{os.cpu_count()}"
    else:
        where = f"{dev.platform}: {getattr(dev, 'device_kind', dev.platform)}"
    if mesh is not None:
        where += " mesh " + ",".join(f"{k}={v}" for k, v in dict(mesh.shape).items() if v > 1)
    return where


def entry_key(hardware: str, dtype: str, batch_size: int) -> str:
    return f"{hardware} | {dtype} | batch {int(batch_size)}"


# -------------------------------------------------------------------------------------------- storage
def _folder(head_source) -> HeadFolder | None:
    if isinstance(head_source, HeadFolder):
        return head_source if head_source.is_dir else None
    if not isinstance(head_source, (str, os.PathLike)):
        return None
    folder = open_folder(head_source)
    return folder if folder.is_dir else None


def weights_digest(head_source) -> str | None:
    """The digest of a head folder's weight files (`clover_jax.heads.folder.weights_digest`); None for a head given
    as a module."""
    folder = _folder(head_source)
    return folder.digest if folder is not None else None


def calibration_files(head_source) -> list[Path]:
    """Where calibrations of this head are read from, in order: the head's folder, then the user cache."""
    folder = _folder(head_source)
    return folder.calibration_files if folder is not None else []


def read_json(path: Path) -> dict:
    """A JSON object file's contents, or {} where it is missing or unreadable."""
    return read_json_object(path)


def write_json(path: Path, data: dict) -> None:
    """Writes `data` to `path` whole or not at all (a temporary file of a unique name renamed over it); OSError
    where it cannot. Several processes updating one file use `update_json` (locked) instead."""
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def is_stale(entry: dict) -> bool:
    """An entry made by an older calibration (`VERSION`): it never measured some of today's candidates."""
    return int(entry.get("version", 1)) < VERSION


def load_entry(head_source, key: str, stale: list | None = None) -> dict | None:
    """The saved calibration entry for `key`; else one of the same hardware and dtype at the nearest batch
    size (a step's cost changes slowly with the batch); else None. Entries measured on other weights (their
    `weights` digest differs from the head's, `weights_digest`) are skipped, and so are stale ones (`is_stale`):
    their keys are appended to `stale` when it is given."""
    hardware, dtype, batch = key.split(" | ")
    nearest = None
    digest = weights_digest(head_source)
    for path in calibration_files(head_source):
        entries = {k: e for k, e in read_json(path).get("entries", {}).items()
                   if not (digest and e.get("weights") and e["weights"] != digest)}
        if stale is not None:
            stale += [k for k, e in entries.items() if is_stale(e) and k.split(" | ")[:2] == [hardware, dtype]]
        entries = {k: e for k, e in entries.items() if not is_stale(e)}
        if entries.get(key):
            return entries[key]
        for k, entry in entries.items():
            h, d, b = k.split(" | ")
            if (h, d) == (hardware, dtype):
                gap = abs(int(b.split()[-1]) - int(batch.split()[-1]))
                if nearest is None or gap < nearest[0]:
                    nearest = (gap, entry)
    return nearest[1] if nearest else None


def save_entry(head_source, key: str, entry: dict) -> Path | None:
    """Adds `entry` under `key` to the head folder's calibration file, or the user cache's when the folder is
    not writable, stamped with the digest of the head's weights; returns the file (None for a head given as a
    module)."""
    digest = weights_digest(head_source)
    if digest:
        entry = {**entry, "weights": digest}

    def add(data: dict) -> dict:
        # the shapes of the replaced entry's fitted trees stay in the file (`KEPT_TREES`): a name that a registry's
        # default tree or a user's script holds (`fit-5-411aab`) keeps resolving after a new calibration fits
        # other shapes (a fitted tree's name is a hash of its shape)
        replaced = (data.get("entries", {}).get(key) or {}).get("trees") or {}
        if replaced:
            data[KEPT_TREES] = {**replaced, **data.get(KEPT_TREES, {})}
        data.setdefault("entries", {})[key] = entry
        return data

    for path in calibration_files(head_source):
        try:
            update_json(path, add)  # locked: another process's entry saved meanwhile is kept
            return path
        except OSError:
            continue
    return None
