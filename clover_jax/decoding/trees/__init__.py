"""Tree policies, one job per module; `clover_jax.decoding.tree` re-exports their public names (import from there)."""
