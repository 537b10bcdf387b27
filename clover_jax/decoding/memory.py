"""What one `generate` call will allocate, checked against what the device has free before anything compiles.

`estimate_generate_memory` adds up the KV caches at batch x cache length, the prefill's attention scores and MLP
activations and the draft tree's logits; `check_memory` compares it with the free memory: `Device.memory_stats()`
on accelerators (the allocator's `bytes_limit - bytes_in_use`), the host's available memory (`MemAvailable` of
/proc/meminfo, else `os.sysconf`) on CPU. Too much is an `InsufficientMemoryError` naming the parts and the
settings to lower.
"""

from __future__ import annotations

import os

import jax

from clover_jax.decoding.sizes import PREFILL_CHUNK
from clover_jax.models.llama import CACHE_BLOCK
from clover_jax.validation import InsufficientMemoryError

GIB = 1024 ** 3


def fmt_bytes(nbytes: float) -> str:
    """`12.34 GiB`, or MiB below a tenth of a GiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 1024 ** 2:.1f} MiB"


def available_memory(device=None) -> tuple[int | None, str]:
    """(free bytes, where they were read) for `device` (default: the first JAX device), or (None, why)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - not implemented on some backends
        stats = None
    if stats and stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"{device} (bytes_limit {fmt_bytes(stats['bytes_limit'])} - bytes_in_use)"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host memory (/proc/meminfo MemAvailable)"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory (sysconf)"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def estimate_generate_memory(config, *, batch: int, cache_size: int, prompt_len: int, dtype_bytes: int,
                             tree_nodes: int = 0, head_layers: int = 0, draft_rows: int = 0) -> dict[str, int]:
    """Bytes one `generate` call allocates beyond the weights, by part (an estimate, on the low side).

    KV caches `[L, B, K, S, H]` (keys and values, base and the draft head's Augmenting Block) are held
    twice while the jitted loop starts (the initial value and the loop carry); the prefill's attention
    scores and probabilities are float32, `[B, N, T, T]` for a prompt bucket of at most `PREFILL_CHUNK` tokens,
    else `[B, N, C, C + CACHE_BLOCK]` per block of C tokens (the draft head's prompt pass is blocked the same way); the
    MLP's `[B, T, I]` gate and up activations; the verification's logits `[B, U, V]` float32 (three copies when
    sampling warps them).
    """

    c = config
    kv_row = 2 * cache_size * c.num_key_value_heads * c.head_dim * dtype_bytes
    if prompt_len <= PREFILL_CHUNK:  # one block
        scores = prompt_len * prompt_len
    else:
        scores = PREFILL_CHUNK * (PREFILL_CHUNK + CACHE_BLOCK)
    parts = {
        "KV cache": 2 * c.num_hidden_layers * batch * kv_row,
        "prefill attention": 2 * batch * c.num_attention_heads * scores * 4,
        "prefill activations": batch * prompt_len * (2 * c.intermediate_size + 4 * c.hidden_size) * 4,
        "token buffers": 2 * batch * cache_size * 4,
    }
    if tree_nodes:
        parts["draft-head cache"] = 2 * head_layers * batch * kv_row
        parts["tree logits"] = 3 * batch * tree_nodes * c.vocab_size * 4
        parts["draft logits"] = batch * tree_nodes * max(draft_rows, 1) * 4
    return parts


def split_over_mesh(parts: dict[str, int], config, sizes: dict[str, int]) -> dict[str, int]:
    """Bytes per device of `estimate_generate_memory`'s parts on a decoding mesh of axis `sizes`
    (`{"data", "fsdp", "tp"}`, as `clover_jax.parallel` lays the loop out): per-row buffers divide by the
    batch shards (data * fsdp, which must divide the batch), KV caches also by tp where tp divides the KV
    heads, the prefill's attention by tp where it divides the query heads, logits by tp where it divides V."""
    rows = int(sizes.get("data", 1)) * int(sizes.get("fsdp", 1))
    tp = int(sizes.get("tp", 1))
    kv_tp = tp if config.num_key_value_heads % tp == 0 else 1
    heads_tp = tp if config.num_attention_heads % tp == 0 else 1
    vocab_tp = tp if config.vocab_size % tp == 0 else 1
    div = {"KV cache": rows * kv_tp, "draft-head cache": rows * kv_tp, "prefill attention": rows * heads_tp,
           "tree logits": rows * vocab_tp}
    return {k: -(-v // div.get(k, rows)) for k, v in parts.items()}


def check_mesh_memory(parts: dict[str, int], *, weights_bytes: int, weights_to_place: int, what: str,
                      devices) -> None:
    """`check_memory` for a decoding mesh: `parts` and `weights_to_place` (the weights that still have to be
    copied onto the mesh, 0 when they are already there) are bytes per device. Devices with their own memory
    (accelerators) are each checked against their free memory; CPU devices share the host's, so their
    needs add up."""
    devices = list(devices)
    need = dict(parts)
    if weights_to_place:
        need["weights placed on the mesh"] = weights_to_place
    if all(d.platform == "cpu" for d in devices):
        n = len(devices)
        check_memory({k: v * n for k, v in need.items()}, weights_bytes=weights_bytes * n,
                     what=f"{what} on {n} CPU devices (sharing host memory)", device=devices[0], hint=MESH_HINT)
        return
    for d in devices:
        check_memory(need, weights_bytes=weights_bytes, what=f"{what}, per device,", device=d, hint=MESH_HINT)


HINT = "lower the batch size, max_new_tokens or cache_size"
MESH_HINT = HINT + ", or spread the model over more devices (a larger mesh tp axis)"


def check_memory(parts: dict[str, int], *, weights_bytes: int, what: str, device=None,
                 available: tuple[int | None, str] | None = None, hint: str = HINT) -> None:
    """InsufficientMemoryError when the parts add up to more than the device has free (weights already
    loaded are counted as used there, so they are only reported)."""
    free, where = available if available is not None else available_memory(device)
    need = sum(parts.values())
    if free is None or need <= free:
        return
    detail = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
    raise InsufficientMemoryError(
        f"{what} needs about {fmt_bytes(need)} beyond the {fmt_bytes(weights_bytes)} of weights ({detail}), but only "
        f"{fmt_bytes(free)} are free on {where}; {hint}")
