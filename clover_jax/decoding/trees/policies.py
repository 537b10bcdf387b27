"""Tree policies whose tree the drafter builds per step and per row (`DynamicTree`, `BeamTree`) and the prompt-lookup
chain beside any tree (`LookupTree`), each with the parser of its names."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, ClassVar

import numpy as np

from clover_jax.decoding.trees.base import MAX_DEPTH, TreePolicy, TreeSpecError


@dataclasses.dataclass(frozen=True)
class DynamicTree(TreePolicy):
    """A tree policy, not a tree: the drafter builds a new tree per step and per row (EAGLE-2, Li et al. 2024,
    arXiv 2406.16858). From the root it expands the `top_k` frontier nodes with the highest cumulative draft
    log-probability, `depth` times, each into its `top_k` most likely children; then it keeps the `budget - 1`
    best of all the candidates by cumulative log-probability (an ancestor-closed set: a child never scores
    above its parent) and verifies them with the root. Name: `dynamic-N` (N = budget, root included), optionally
    `dynamic-N-dD-kK`. The defaults (depth 5, top-k 8), the Clover-2 head's depth and EAGLE-2's order of
    magnitude, gave the shipped SmolLM2 head the highest tau of depth 3-5 x top-k 2-8 on MT-Bench prompts
    (docs/trees.md).

    `top_p < 1` adds Clover-1's candidate selection (Xiao et al. 2024, arXiv 2405.00263): each node keeps only
    its children up to cumulative draft probability `top_p` (the first always), the rest are never verified;
    what is kept is ranked by joint probability into the same budget, so a confident head verifies fewer tokens
    (the slots left over are unused). Name suffix `-pP`, e.g. `dynamic-10-p0.8`."""

    kind: ClassVar[str] = "dynamic tree policy (dynamic-N, dynamic-N-pP)"

    budget: int
    depth: int = 5
    top_k: int = 8
    top_p: float = 1.0
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        for field, lo in (("budget", 2), ("depth", 1), ("top_k", 1)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise TreeSpecError(f"dynamic tree: {field} must be an integer >= {lo}, got {v!r}")
        if self.depth > MAX_DEPTH:
            raise TreeSpecError(f"dynamic tree: depth {self.depth} > MAX_DEPTH {MAX_DEPTH}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise TreeSpecError(f"dynamic tree: top_p must be in (0, 1], got {self.top_p!r}")
        if self.budget - 1 > self.num_candidates:
            raise TreeSpecError(f"dynamic tree: budget {self.budget} needs {self.budget - 1} drafts but depth "
                                f"{self.depth} x top-k {self.top_k} proposes only {self.num_candidates}")
        if not self.name:
            p = "" if self.top_p == 1 else f"-p{self.top_p:g}"
            object.__setattr__(self, "name", f"dynamic-{self.budget}-d{self.depth}-k{self.top_k}{p}")

    @property
    def num_candidates(self) -> int:
        """Draft nodes generated per step before the final selection: k at depth 1, k*k at each deeper one."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def num_nodes(self) -> int:
        return int(self.budget)

    @property
    def max_depth(self) -> int:
        return int(self.depth)

    @classmethod
    def parse(cls, name: str, resolve: Callable[[str], TreePolicy]) -> DynamicTree | None:
        """`dynamic-N[-dD][-kK][-pP]`, or None."""
        m = re.fullmatch(r"dynamic-(\d+)(?:-d(\d+))?(?:-k(\d+))?(?:-p(\d*\.?\d+))?", name)
        if not m:
            return None
        n, d, k, p = m.groups()
        return cls(int(n), depth=int(d) if d else 5, top_k=int(k) if k else 8, top_p=float(p) if p else 1.0,
                   name=name)


@dataclasses.dataclass(frozen=True)
class BeamTree(TreePolicy):
    """A tree policy for beam-search drafters (ReDrafter, Zhang et al. 2024, arXiv 2403.09919): per step and
    per row the drafter runs a beam search of `width` beams of `length` tokens (the root included, the
    reference's `BeamShape(width, length)`), then merges beams that share a prefix into one tree (each distinct
    prefix one node). The distinct nodes are packed in (beam, depth) order into a budget of `budget` verified
    tokens, root included (default `1 + width * (length - 1)`: every node of every beam fits); a smaller budget
    keeps the best beams whole and cuts the later ones, and slots that dedup left empty are unused (verified but
    never accepted). Name: `beam-WxL`, optionally `beam-WxL-uN`."""

    kind: ClassVar[str] = "beam-search policy (beam-WxL)"

    width: int
    length: int
    budget: int = 0
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        for field, lo in (("width", 1), ("length", 2), ("budget", 0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise TreeSpecError(f"beam tree: {field} must be an integer >= {lo}, got {v!r}")
        if self.length - 1 > MAX_DEPTH:
            raise TreeSpecError(f"beam tree: length {self.length} drafts {self.length - 1} deep > MAX_DEPTH "
                                f"{MAX_DEPTH}")
        full = 1 + self.width * (self.length - 1)
        if self.budget == 0:
            object.__setattr__(self, "budget", full)
        if not self.length <= self.budget <= full:
            raise TreeSpecError(f"beam tree: budget {self.budget} must lie between the beam length {self.length} "
                                f"(the best beam whole) and {full} (every node of {self.width} beams)")
        if not self.name:
            suffix = "" if self.budget == full else f"-u{self.budget}"
            object.__setattr__(self, "name", f"beam-{self.width}x{self.length}{suffix}")

    @property
    def num_nodes(self) -> int:
        return int(self.budget)

    @property
    def max_depth(self) -> int:
        return int(self.length) - 1

    top_k = property(lambda self: int(self.width))  # the most children a node can have

    @classmethod
    def parse(cls, name: str, resolve: Callable[[str], TreePolicy]) -> BeamTree | None:
        """`beam-WxL[-uN]`, or None."""
        m = re.fullmatch(r"beam-(\d+)x(\d+)(?:-u(\d+))?", name)
        if not m:
            return None
        w, n, u = m.groups()
        return cls(int(w), int(n), int(u) if u else 0, name=name)


@dataclasses.dataclass(frozen=True)
class LookupTree(TreePolicy):
    """A tree policy (`clover_jax.decoding.lookup`): `inner` (a head's static tree or per-step policy, or None: the
    root alone) plus a chain of `length` tokens found by prompt lookup, under the root. Names: `lookup-K[-nN][-table]`
    (no head), `TREE+lookup-K[-nN][-table]` (N = `max_ngram`, default 3; `-table`: where the sequence has no match,
    the chain comes from an n-gram table of the base model's replies, `clover_jax.decoding.ngram`)."""

    kind: ClassVar[str] = "prompt-lookup tree (lookup-K, TREE+lookup-K)"

    inner: Any  # TreeSpec, DynamicTree or BeamTree (a head drafts it), or None: the root alone
    length: int
    max_ngram: int = 3
    name: str = dataclasses.field(default="", compare=False)
    table: bool = False  # fall back to an n-gram table (the drafter is given one) where lookup finds no match

    def __post_init__(self):
        for field, lo in (("length", 1), ("max_ngram", 1)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise TreeSpecError(f"lookup tree: {field} must be an integer >= {lo}, got {v!r}")
        if self.length > MAX_DEPTH:
            raise TreeSpecError(f"lookup tree: a chain of {self.length} tokens is deeper than MAX_DEPTH {MAX_DEPTH}")
        if isinstance(self.inner, LookupTree):
            raise TreeSpecError("lookup tree: the inner tree is already a lookup tree (one lookup chain per tree)")
        if not self.name:
            n = "" if self.max_ngram == 3 else f"-n{self.max_ngram}"
            inner = "" if self.inner is None else f"{self.inner.name}+"
            object.__setattr__(self, "name", f"{inner}lookup-{self.length}{n}{'-table' if self.table else ''}")

    @property
    def num_nodes(self) -> int:
        return (1 if self.inner is None else int(self.inner.num_nodes)) + int(self.length)

    @property
    def max_depth(self) -> int:
        return max(0 if self.inner is None else int(self.inner.max_depth), int(self.length))

    @property
    def top_k(self) -> int:  # the most children a node can have: the inner tree's, plus the chain under the root
        return (0 if self.inner is None else int(self.inner.top_k)) + 1

    @classmethod
    def parse(cls, name: str, resolve: Callable[[str], TreePolicy]) -> LookupTree | None:
        """`lookup-K[-nN][-table]` or `TREE+lookup-K[-nN][-table]` (TREE resolved by `resolve`), or None."""
        m = re.fullmatch(r"(?:(.+)\+)?lookup-(\d+)(?:-n(\d+))?(-table)?", name)
        if not m:
            return None
        inner, k, n, table = m.groups()
        return cls(None if inner is None else resolve(inner), int(k), int(n) if n else 3, name=name,
                   table=bool(table))
