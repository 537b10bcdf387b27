"""JAX's persistent compilation cache, on for the library and its command lines alike, and a counter of compiles.

`import clover_jax` turns the cache on (`enable_compile_cache`) before any array exists, so a new process (a new
notebook kernel, the next run of a command) loads the decoding loops an earlier one compiled instead of compiling
them again:

  * the folder: `$CLOVER_JAX_COMPILE_CACHE`, else `xla/` in the library's cache folder (`$CLOVER_JAX_CACHE`,
    default `~/.cache/clover_jax`); `CLOVER_JAX_COMPILE_CACHE=off` turns it off. A cache configured through JAX
    (`JAX_COMPILATION_CACHE_DIR`, `jax.config.update("jax_compilation_cache_dir", ...)`) is left as it is.
  * every program is kept, however fast it compiled and however small (JAX keeps only programs that took a second
    or more by default; a loop of a small model on a fast machine can compile in less). A threshold the user set
    through JAX's variables (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, `..._MIN_ENTRY_SIZE_BYTES`) is kept.
  * at most 8 GiB on disk (least recently used programs evicted; `JAX_COMPILATION_CACHE_MAX_SIZE` overrides), which
    also makes JAX lock the folder while it reads and writes, so processes sharing it cannot tear an entry.
  * on GPUs, XLA's autotuning results are kept beside the programs (`xla_gpu_per_fusion_autotune_cache_dir/` in
    the folder: `jax_persistent_cache_enable_xla_caches`), so a new process does not autotune its fusions again.

`CompileCounter` counts the programs XLA compiles, and those loaded from the cache instead, while it is active.
"""

from __future__ import annotations

import collections
import os
import threading

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

COMPILE_CACHE_ENV = "CLOVER_JAX_COMPILE_CACHE"  # a folder, or "off"
OFF = ("off", "0", "false", "no", "none")
# (jax config name, value, the JAX variable through which a user sets it): keep every program
THRESHOLDS = (("jax_persistent_cache_min_compile_time_secs", 0.0, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"),
              ("jax_persistent_cache_min_entry_size_bytes", -1, "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"))
# at most this many bytes on disk, the least recently used programs evicted; a bounded cache is also one JAX reads and
# writes under a file lock, so two processes compiling the same program at once cannot leave a torn entry
MAX_SIZE = (8 << 30, "JAX_COMPILATION_CACHE_MAX_SIZE")
XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"  # XLA's GPU autotuning results, kept in the cache folder
# JAX's monitoring events (jax._src.dispatch.BACKEND_COMPILE_EVENT; jax._src.compiler): the compile-or-load of a
# program, and a load from the persistent cache inside it
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def cache_root() -> str:
    """The library's cache folder: `$CLOVER_JAX_CACHE`, default `~/.cache/clover_jax`."""
    return os.environ.get("CLOVER_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "clover_jax")


def enable_compile_cache(path: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache in `path`, else `$CLOVER_JAX_COMPILE_CACHE`, else `xla/` in
    `cache_root()` (see the module docstring); returns the folder in use, or None (turned off, or the folder
    cannot be made: a read-only home runs without the cache rather than fail). Called by `import clover_jax`; again
    it changes nothing."""
    path = path or os.environ.get(COMPILE_CACHE_ENV) or os.path.join(cache_root(), "xla")
    if path.strip().lower() in OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    for name, value, env in THRESHOLDS:
        if env not in os.environ:
            jax.config.update(name, value)
    if MAX_SIZE[1] not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_SIZE[0])
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
        jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
    # JAX decides once per process whether a cache is used, at the first compile: one that ran before this call
    # (an array made before `import clover_jax`) would otherwise keep this process off the cache
    compilation_cache.reset_cache()
    return path


class CompileCounter:
    """Counts, per function name, the programs XLA compiles (`compiled`) and those loaded from the persistent
    cache instead (`loaded`) while the counter is active:

        with CompileCounter() as count:
            generate(...)
        count.total  # programs compiled
    """

    def __init__(self):
        self.compiled: collections.Counter[str] = collections.Counter()
        self.loaded: collections.Counter[str] = collections.Counter()
        self._hit = threading.local()  # a load from the cache seen inside this thread's current compile

    @property
    def total(self) -> int:
        return sum(self.compiled.values())

    def _on_event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            self._hit.value = True

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        name = str(kwargs.get("fun_name", "?"))
        name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name  # jit(f) -> f
        (self.loaded if getattr(self._hit, "value", False) else self.compiled)[name] += 1
        self._hit.value = False

    def __enter__(self) -> "CompileCounter":
        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_listener(self._on_event)
        monitoring.unregister_event_duration_listener(self._on_duration)
