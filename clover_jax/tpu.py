"""Compiling for a TPU slice on any machine: the real TPU compiler, compile-only devices, per-chip memory and cost.

    sl = tpu.parse_slice("v5e-16")                      # the name a user says -> topology, chips, HBM per chip
    mesh = tpu.slice_mesh(sl, data=-1, fsdp=4, tp=1)     # a ("data", "fsdp", "tp") mesh of compile-only devices
    prog = tpu.compile_program("train step", jitted, *abstract_args)   # `jax.ShapeDtypeStruct`s with shardings
    print(tpu.report(sl, [prog]))                        # arguments, temporaries, outputs, total against the HBM

JAX builds compile-only TPU devices from libtpu's topology descriptions
(`jax.experimental.topologies.get_topology_desc`); `jax.jit(f).lower(<ShapeDtypeStructs>).compile()` on a mesh of
them runs the TPU compiler itself, which reports per-chip memory (`Compiled.memory_analysis`: arguments, outputs,
temporaries) and cost (`Compiled.cost_analysis`: flops, bytes accessed, the compiler's own `optimal_seconds`). No
TPU, no weights and no download are needed: MaxText's `train_compile.py` works the same way.

libtpu: the version jax's own `tpu` extra pins (`libtpu_requirement`). On a machine without a TPU it must not sit in
site-packages, where JAX would start it (and print its initialisation warnings) on every run: the set-up installs
it into a folder of its own (`pip install --no-deps --target <venv>/libtpu "libtpu==..."`), which `find_libtpu` looks
for; only the compile-only commands load it. On a TPU VM, the installed libtpu is used.

A while loop's cost is its body's counted once (XLA's cost analysis does not know the trip count): a decoding
loop's per-step cost comes from a program of one step (`clover_jax.generation.compiled`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils, topologies
from jax.sharding import AxisType, Mesh

from clover_jax import parallel
from clover_jax.validation import InputError, InsufficientMemoryError

GIB = 1024 ** 3
LIBTPU_ENV = "CLOVER_JAX_LIBTPU"  # a folder holding libtpu (the `--target` of its install) or libtpu.so itself


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: its name in slice names, libtpu's topology prefix, the JAX device kind, HBM per chip, and
    how a slice name counts (v4 and v5p names count TensorCores, two per chip; v5e and v6e names count chips)."""

    name: str
    prefix: str  # libtpu's topology prefix ("v5e:2x4")
    device_kind: str  # `Device.device_kind` of its compile-only devices
    hbm: int  # bytes of HBM per chip
    cores_per_chip: int  # TensorCores a slice name counts per chip
    dims: int  # the topology's dimensions (2: a torus of chips x chips, 3: x x y x z)


# HBM per chip as Cloud TPU's system-architecture pages list it (v5e 16 GiB, v6e 32 GiB, v4 32 GiB, v5p 95 GiB).
GENERATIONS = {g.name: g for g in (
    Generation("v5e", "v5e", "TPU v5 lite", 16 * GIB, 1, 2),
    Generation("v6e", "v6e", "TPU v6 lite", 32 * GIB, 1, 2),
    Generation("v4", "v4", "TPU v4", 32 * GIB, 2, 3),
    Generation("v5p", "v5", "TPU v5", 95 * GIB, 2, 3),
)}
# chips -> the topology libtpu knows for that many chips (MaxText's accelerator_to_spec_map lists the same)
_TORI_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TORI_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
            512: "8x8x8"}


class LibtpuMissingError(InputError):
    """libtpu (the TPU compiler) is not installed where it can be found; the message says how to install it."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice (or several of one shape, joined over the data-center network) by the name a user says."""

    name: str  # as given, normalised: "v5e-16", "2xv5e-16"
    generation: Generation
    topology: str  # libtpu's name of one slice: "v5e:4x4"
    chips: int  # chips per slice (one JAX device each)
    num_slices: int = 1

    @property
    def devices(self) -> int:
        return self.chips * self.num_slices

    @property
    def hbm(self) -> int:
        return self.generation.hbm


def _usage() -> str:
    return ("a TPU slice is named <generation>-<size> (v5e-8, v5e-16, v6e-8, v4-8, v5p-8; v4 and v5p sizes count "
            "TensorCores, two per chip), a libtpu topology (v5e:4x4, v5p:2x2x2), or N slices of one shape as "
            "Nx<slice> (2xv5e-16); generations: " + ", ".join(GENERATIONS))


def parse_slice(name: str) -> Slice:
    """The slice a name says: `v5e-16` (16 chips, `v5e:4x4`), `v4-8` (4 chips: v4 and v5p names count TensorCores),
    `v5p:2x2x2` (a libtpu topology), `2xv5e-16` (two slices, joined over the data-center network)."""
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"topology: {name!r}: {_usage()}")
    text = name.strip().lower()
    num_slices = 1
    m = re.fullmatch(r"(\d+)x(v\w+[-:].+)", text)
    if m:
        num_slices, text = int(m.group(1)), m.group(2)
        if num_slices < 1:
            raise InputError(f"topology: {name!r}: the number of slices must be >= 1")
    m = re.fullmatch(r"(v\d+[a-z]?)-(\d+)", text)
    if m:
        gen = _generation(m.group(1), name)
        size = int(m.group(2))
        chips, rest = divmod(size, gen.cores_per_chip)
        tori = _TORI_2D if gen.dims == 2 else _TORI_3D
        if rest or chips not in tori:
            sizes = sorted(c * gen.cores_per_chip for c in tori)
            raise InputError(f"topology: {name!r}: no {gen.name} slice of {size}; known sizes: "
                             f"{', '.join(map(str, sizes))}, or a libtpu topology such as {gen.prefix}:{tori[8]}")
        return Slice(_name(num_slices, f"{gen.name}-{size}"), gen, f"{gen.prefix}:{tori[chips]}", chips, num_slices)
    m = re.fullmatch(r"(v\d+[a-z]?):(\d+(?:x\d+)+)", text)
    if m:
        gen = next((g for g in GENERATIONS.values() if g.prefix == m.group(1) or g.name == m.group(1)), None)
        if gen is None:
            raise InputError(f"topology: {name!r}: unknown generation {m.group(1)!r}; {_usage()}")
        dims = [int(x) for x in m.group(2).split("x")]
        if len(dims) != gen.dims or min(dims) < 1:
            raise InputError(f"topology: {name!r}: a {gen.name} topology has {gen.dims} dimensions "
                             f"(e.g. {gen.prefix}:{(_TORI_2D if gen.dims == 2 else _TORI_3D)[4]})")
        topo = f"{gen.prefix}:{m.group(2)}"
        return Slice(_name(num_slices, topo), gen, topo, int(np.prod(dims)), num_slices)
    raise InputError(f"topology: {name!r}: {_usage()}")


def _generation(text: str, name: str) -> Generation:
    gen = GENERATIONS.get(text)
    if gen is None:
        raise InputError(f"topology: {name!r}: unknown generation {text!r}; {_usage()}")
    return gen


def _name(num_slices: int, one: str) -> str:
    return one if num_slices == 1 else f"{num_slices}x{one}"


# ---------------------------------------------------------------------------------------------------- libtpu
def libtpu_requirement() -> str:
    """The libtpu requirement jax's `tpu` extra names for the installed jax (`libtpu==0.0.42.*` for jax 0.10.2)."""
    try:
        for req in importlib.metadata.requires("jax") or ():
            spec, _, marker = req.partition(";")
            if spec.strip().startswith("libtpu") and "tpu" in marker:
                return spec.strip().replace(" ", "")
    except importlib.metadata.PackageNotFoundError:
        pass
    return "libtpu"


def _library_in(path: Path) -> Path | None:
    for candidate in (path, path / "libtpu.so", path / "libtpu" / "libtpu.so"):
        if candidate.is_file():
            return candidate
    return None


def default_libtpu_dir() -> Path:
    """Where the set-up installs libtpu beside an environment: `<sys.prefix>/libtpu`."""
    return Path(sys.prefix) / "libtpu"


def find_libtpu() -> Path:
    """The libtpu library to compile with: `$CLOVER_JAX_LIBTPU` (a folder or the .so), `$TPU_LIBRARY_PATH`, the
    folder the set-up installs it into (`default_libtpu_dir`), else an importable `libtpu` package (a TPU VM's).
    None of them: a `LibtpuMissingError` naming the command that installs it."""
    env = os.environ.get(LIBTPU_ENV)
    if env:
        found = _library_in(Path(env).expanduser())
        if found is None:
            raise LibtpuMissingError(f"{LIBTPU_ENV}={env}: no libtpu.so there; {_install_hint()}")
        return found
    for path in (os.environ.get("TPU_LIBRARY_PATH"), default_libtpu_dir()):
        found = _library_in(Path(path)) if path else None
        if found is not None:
            return found
    spec = importlib.util.find_spec("libtpu")
    if spec is not None and spec.submodule_search_locations:
        found = _library_in(Path(list(spec.submodule_search_locations)[0]))
        if found is not None:
            return found
    raise LibtpuMissingError(f"compiling for a TPU needs libtpu, the TPU compiler; {_install_hint()}")


def _install_hint() -> str:
    return (f"install the version this jax pins beside the environment (not into site-packages, where JAX would start "
            f"it on every run): pip install --no-deps --target {default_libtpu_dir()} '{libtpu_requirement()}' "
            f"(or set {LIBTPU_ENV} to the folder it is in)")


@contextlib.contextmanager
def _quiet_stderr():
    """Holds what native code writes to the process's stderr (libtpu's start-up warnings about the machine not being
    a TPU VM) and yields a callable returning it; shown again only if the block fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: (sink.seek(0), sink.read().decode("utf-8", "replace"))[1]
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@functools.lru_cache(maxsize=None)
def _topology_devices(topology: str, num_slices: int) -> tuple[Any, ...]:
    jax.devices()  # the backends this process runs on start first, so none of them tries the TPU plugin loaded below
    library = find_libtpu()
    before = os.environ.get("TPU_LIBRARY_PATH")
    os.environ["TPU_LIBRARY_PATH"] = str(library)
    if jax.default_backend() != "tpu":  # no TPU in use here: nothing for libtpu's one-process lock to guard (several
        # compile-only processes may run at once) and no TPU VM metadata server to ask
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    kw = {"num_slices": num_slices} if num_slices > 1 else {}
    if not topology.startswith(("v5e", "v6e")):  # v4, v5p: one JAX device per chip (megacore), as on their VMs
        kw["chip_config_name"] = "megacore"
    try:
        with _quiet_stderr() as said:
            try:
                desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw)
            except Exception as e:  # noqa: BLE001 - libtpu's errors are plain runtime errors
                raise InputError(f"topology {topology!r}: libtpu ({library}) cannot build it: {e}"
                                 + (f"\n{said().strip()}" if said().strip() else "")) from None
    finally:
        if before is None:
            os.environ.pop("TPU_LIBRARY_PATH", None)
        else:
            os.environ["TPU_LIBRARY_PATH"] = before
    return tuple(desc.devices)


def slice_devices(sl: Slice) -> list[Any]:
    """The compile-only devices of `sl` (every host's, every slice's): one per chip."""
    devices = list(_topology_devices(sl.topology, sl.num_slices))
    if devices and devices[0].device_kind != sl.generation.device_kind:
        raise InputError(f"topology {sl.topology!r}: libtpu made {devices[0].device_kind} devices, not "
                         f"{sl.generation.device_kind} ({sl.generation.name})")
    return devices


def slice_hosts(sl: Slice) -> int:
    """The host processes of the slices (libtpu's default chips per host)."""
    return len({(getattr(d, "slice_index", 0), d.process_index) for d in slice_devices(sl)})


def slice_mesh(sl: Slice, data: int = -1, fsdp: int = 1, tp: int = 1) -> Mesh:
    """A ("data", "fsdp", "tp") mesh over the compile-only devices of `sl` (`AxisType.Auto` axes; one axis may be -1).
    Several slices split the data axis between them (the data-center network carries only the gradients' or the
    rows' traffic), fsdp and tp stay inside a slice."""
    devices = slice_devices(sl)
    sizes = parallel.mesh_sizes(data, fsdp, tp, len(devices))
    if sl.num_slices == 1:
        return parallel.make_mesh(sizes["data"], sizes["fsdp"], sizes["tp"], devices=devices)
    if sizes["data"] % sl.num_slices:
        raise parallel.MeshError(f"mesh: data={sizes['data']} must be a multiple of the {sl.num_slices} slices "
                                 f"(fsdp and tp stay inside a slice)")
    ici = (sizes["data"] // sl.num_slices, sizes["fsdp"], sizes["tp"])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (sl.num_slices, 1, 1), devices)
    return Mesh(grid, parallel.AXES, axis_types=(AxisType.Auto,) * 3)


# --------------------------------------------------------------------------------------------------- compiling
@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """What the TPU compiler reports of one program, per chip (bytes, flops, seconds)."""

    name: str
    seconds: float  # compile time on this machine
    arguments: int  # the arguments the caller holds on each chip (those the program leaves unused included)
    read_arguments: int  # the arguments the program reads (the compiler's own count: jit drops unused ones)
    outputs: int
    temporaries: int
    aliased: int  # outputs that reuse a donated argument's buffer (counted once, in the arguments)
    code: int  # the program's generated code
    flops: float
    bytes_accessed: float
    optimal_seconds: float  # the TPU compiler's own estimate of the program's run time
    refused: str = ""  # the compiler's out-of-memory error, when it refused the program (temporaries: what it needed)
    hbm_bytes: float = 0.0  # HBM traffic read off the compiled program (`hbm_traffic`), an estimate

    @property
    def total(self) -> int:
        """Peak bytes per chip: arguments + outputs not aliased to them + temporaries + code."""
        return int(self.arguments + self.outputs - self.aliased + self.temporaries + self.code)

    def fits(self, hbm: int) -> bool:
        return not self.refused and self.total <= hbm

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}


def compile_program(name: str, jitted, *args, **kwargs) -> CompiledProgram:
    """Lowers `jitted` on abstract arguments (`jax.ShapeDtypeStruct`s whose shardings name compile-only devices),
    compiles it with the TPU compiler and reads what it reports. Nothing is allocated and nothing is written to the
    persistent compilation cache (compile-only executables cannot be kept)."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    with _no_persistent_cache(), _quiet_stderr() as said:
        try:
            compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001 - the compiler's errors: shown with the program they came from
            over = _out_of_memory(str(e))
            if over is not None:  # the compiler refuses a program that cannot fit, as the TPU itself would
                return CompiledProgram(
                    name=name, seconds=round(time.perf_counter() - t0, 2), arguments=held_bytes((args, kwargs)),
                    read_arguments=0, outputs=0, temporaries=over, aliased=0, code=0, flops=0.0, bytes_accessed=0.0,
                    optimal_seconds=0.0, refused=str(e).strip().splitlines()[0])
            text = str(e).strip().splitlines()
            raise InputError(f"{name}: the TPU compiler failed: {text[0] if text else type(e).__name__}"
                             + ("\n" + said().strip() if said().strip() else "")) from e
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    # the program's own count leaves out arguments it does not read (jit prunes them), which the caller still holds
    held = max(int(mem.argument_size_in_bytes), held_bytes((args, kwargs)))
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax: one dict per partition
        cost = cost[0] if cost else {}
    return CompiledProgram(
        name=name, seconds=round(seconds, 2), arguments=held, read_arguments=int(mem.argument_size_in_bytes),
        outputs=int(mem.output_size_in_bytes), temporaries=int(mem.temp_size_in_bytes),
        aliased=int(mem.alias_size_in_bytes), code=int(mem.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        optimal_seconds=float(cost.get("optimal_seconds", 0.0)), hbm_bytes=float(hbm_traffic(compiled.as_text())[0]))


# --------------------------------------------------------------------------------------------- HBM traffic
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
# instructions that move no data of their own (an asynchronous copy is counted at its start)
_NO_TRAFFIC = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-done", "slice-done",
               "all-reduce-done", "all-gather-done", "collective-permute-done", "after-all", "partition-id",
               "replica-id", "opt-barrier")


def _arrays(type_text: str) -> list[tuple[int, int]]:
    """(bytes, memory space) of each array in an HLO type (`bf16[4096,1792]{1,0:T(8,128)(2,1)S(1)}`: space 1)."""
    out = []
    for dtype, dims, layout in _SHAPE.findall(type_text):
        n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) if dims else 1
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append((n * _DTYPE_BYTES[dtype], int(space.group(1)) if space else 0))
    return out


def _sliced_parameters(hlo: str) -> dict[str, dict[int, int]]:
    """Per fused computation: the parameters it only slices (`dynamic-slice`, `slice`, `gather` of them as the first
    operand), with the bytes those slices read."""
    out: dict[str, dict[int, int]] = {}
    for comp in re.finditer(r"\n%([\w.\-]+) \([^)]*\) -> [^{]*\{\n(.*?)\n\}", hlo, re.S):
        lines = comp.group(2).splitlines()
        params = {m.group(1): int(m.group(2)) for m in
                  (re.match(r"\s*%([\w.\-]+) = \S+ parameter\((\d+)\)", ln) for ln in lines) if m}
        sliced = {}
        for pname, index in params.items():
            uses = [m for m in (_INSTR.match(ln) for ln in lines) if m and m.group(3) != "parameter"
                    and re.search(r"%" + re.escape(pname) + r"\b", m.group(4))]
            if uses and all(m.group(3) in ("dynamic-slice", "slice", "gather")
                            and re.match(r"%" + re.escape(pname) + r"\b", m.group(4)) for m in uses):
                sliced[index] = sum(_arrays(m.group(2))[0][0] for m in uses)
        out[comp.group(1)] = sliced
    return out


def hbm_traffic(hlo: str) -> tuple[int, dict[str, int]]:
    """(bytes, by instruction kind): an estimate of the HBM traffic of one run of a compiled TPU program's entry
    computation, read off its HLO (`Compiled.as_text()`): each instruction reads its operands and writes its result
    where they sit in HBM (memory space 0; the TPU compiler places prefetched weights and small temporaries in VMEM,
    `S(1)`), an asynchronous copy or slice counts the slice it moves once, and a fused computation that only slices
    an operand (an embedding row) reads the slice, not the whole operand. An in-place `dynamic-update-slice` moves its update only. XLA's own `bytes accessed` counts every
    memory space and whole operands, so it exceeds this. A loop (`while`: the compiler's windowed matmuls, a loop of the
    program's own) is counted as one read of what it carries: right for a windowed matmul, which reads each
    carried weight once over its iterations, and a floor for a loop that reads its carry at every iteration."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    sliced = _sliced_parameters(hlo)
    types: dict[str, str] = {}
    by_kind: dict[str, int] = {}
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if m is None:
            continue
        name, result, op, rest = m.groups()
        types[name] = result
        if op in _NO_TRAFFIC or (op == "custom-call" and "ConcatBitcast" in rest):
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        if op == "copy-start":  # (destination, source, context)
            dst, src = _arrays(result)[:2]
            nbytes = (dst[0] if src[1] == 0 else 0) + (dst[0] if dst[1] == 0 else 0)
        elif op.endswith("-start") and op.split("-")[0] in ("slice", "dynamic"):  # ((operands), result, context)
            moved = _arrays(result)
            dst = moved[1] if len(moved) > 1 else moved[0]
            src = _arrays(types.get(operands[0], "")) if operands else []
            nbytes = (dst[0] if not src or src[0][1] == 0 else 0) + (dst[0] if dst[1] == 0 else 0)
        elif op == "while":  # a compiler's windowed matmul or a loop of ours: what it carries, read once
            nbytes = sum(b for b, space in _arrays(types.get(operands[0], "")) if space == 0) if operands else 0
        elif op == "dynamic-update-slice":  # in place: the update is read and written, not the whole buffer
            update = _arrays(types.get(operands[1], ""))
            nbytes = sum(b for b, space in update if space == 0) + \
                (sum(b for b, _ in update) if _arrays(result)[0][1] == 0 else 0)
        else:
            calls = re.search(r"calls=%([\w.\-]+)", rest)
            only_sliced = sliced.get(calls.group(1), {}) if calls else {}
            nbytes = 0
            for i, operand in enumerate(operands):
                if i in only_sliced:
                    nbytes += only_sliced[i]
                elif not types.get(operand, "(").startswith("("):
                    nbytes += sum(b for b, space in _arrays(types[operand]) if space == 0)
            if not result.startswith("(("):
                nbytes += sum(b for b, space in _arrays(result) if space == 0)
        by_kind[op] = by_kind.get(op, 0) + nbytes
    return sum(by_kind.values()), by_kind


_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _out_of_memory(message: str) -> int | None:
    """The bytes of temporaries the TPU compiler says a program needs when it refuses it for HBM ("Ran out of memory
    in memory space hbm ... required for HLO temporaries (64.16G)"), else None."""
    if "RESOURCE_EXHAUSTED" not in message or "memory" not in message.lower():
        return None
    m = re.search(r"temporaries \(([\d.]+)([KMGT]?)\)", message)
    if m is None:
        m = re.search(r"([\d.]+)([KMGT])\b", message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


def held_bytes(tree: Any) -> int:
    """Bytes of a pytree of arrays or `ShapeDtypeStruct`s on one device (the largest shard of each leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = tuple(getattr(x, "shape", ()))
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = tuple(sharding.shard_shape(shape))
        dtype = _dtype(x)
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # a key: its raw data, two uint32 words
            itemsize = 8
        else:
            itemsize = np.dtype(dtype).itemsize
        total += int(np.prod(shape, dtype=np.int64)) * itemsize
    return total


@contextlib.contextmanager
def _no_persistent_cache():
    """Nothing compiled inside is written to JAX's persistent compilation cache (a program is kept only when it took
    longer to compile than this threshold, read at each write), so nothing compiled only is ever read back."""
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    jax.config.update(name, float("inf"))
    try:
        yield
    finally:
        jax.config.update(name, before)


def fits(sl: Slice, programs: Sequence[CompiledProgram]) -> bool:
    """Whether every program fits one chip's HBM (the programs run one at a time; the largest counts)."""
    return all(p.fits(sl.hbm) for p in programs)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def fmt(n: float) -> str:
    """`12.34 GiB`, or MiB below a tenth of a GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def report(sl: Slice, programs: Sequence[CompiledProgram], mesh: Mesh | None = None) -> str:
    """A table of the programs' per-chip memory against the chip's HBM, with compile seconds and the verdict."""
    hosts = slice_hosts(sl)
    where = (f"{sl.name} ({sl.topology}{f' x {sl.num_slices} slices' if sl.num_slices > 1 else ''}: "
             f"{sl.devices} chips of {sl.generation.name}, {hosts} host{'s' if hosts > 1 else ''}, "
             f"{_gib(sl.hbm)} GiB HBM per chip)")
    if mesh is not None:
        where += f", mesh data={mesh.shape['data']} fsdp={mesh.shape['fsdp']} tp={mesh.shape['tp']}"
    lines = [f"compiled for {where}: {len(programs)} program{'s' if len(programs) != 1 else ''} in "
             f"{sum(p.seconds for p in programs):.1f} s",
             "| program | arguments | temporaries | outputs | total | of HBM | fits | compile s |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for p in programs:
        lines.append(f"| {p.name} | {fmt(p.arguments)} | {fmt(p.temporaries)} | {fmt(p.outputs - p.aliased)} | "
                     f"{fmt(p.total)} | {p.total / sl.hbm:.1%} | {_verdict(p, sl)} | "
                     f"{p.seconds:.1f} |")
    return "\n".join(lines)


def _verdict(p: CompiledProgram, sl: Slice) -> str:
    if p.refused:
        return "**no** (the compiler refused it)"
    return "yes" if p.fits(sl.hbm) else "**no**"


def check_fits(sl: Slice, programs: Sequence[CompiledProgram], settings: str) -> None:
    """An `InsufficientMemoryError` (exit status 2 on the command line) naming the program that does not fit one
    chip and `settings`, what to change."""
    over = [p for p in programs if not p.fits(sl.hbm)]
    if over:
        worst = max(over, key=lambda p: p.total)
        said = f" (the TPU compiler: {worst.refused})" if worst.refused else ""
        raise InsufficientMemoryError(
            f"{worst.name} does not fit a {sl.generation.name} chip: {fmt(worst.total)} per chip (arguments "
            f"{fmt(worst.arguments)}, temporaries {fmt(worst.temporaries)}) of {fmt(sl.hbm)} HBM{said}; {settings}")


def abstract(tree: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s of `tree`'s leaves (arrays or structs) with `shardings` (a matching pytree or one
    sharding for all)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return parallel.abstract_with_shardings(tree, shardings)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=shardings), tree)


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


__all__ = ["CompiledProgram", "GENERATIONS", "Generation", "LibtpuMissingError", "Slice", "abstract", "check_fits",
           "compile_program", "default_libtpu_dir", "find_libtpu", "fits", "fmt", "hbm_traffic", "held_bytes", "libtpu_requirement", "parse_slice",
           "report", "slice_devices", "slice_hosts", "slice_mesh"]
