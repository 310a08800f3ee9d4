"""The GPUs a plan is for: ``--gpus 8``, ``--gpus 1,2,3,4``, ``--nodes 2 --gpus-per-node 8``.

A World is one GPU count laid out on nodes. Ranks fill a node before the next one, so a
group of ranks stays inside one node when it spans no more ranks than a node holds; that
decides whether its collectives run over NVLink or over the network (``time_model.py``).
Pure Python, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchfit.errors import OptionError

DEFAULT_GPUS_PER_NODE = 8
"""An HGX/DGX node: what ``--gpus 16`` with no ``--gpus-per-node`` is taken to mean (2 x 8)."""

CHINCHILLA_TOKENS_PER_PARAM = 20
"""Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models"): ~20 tokens per parameter."""


@dataclass(frozen=True)
class World:
    """``gpus`` GPUs on ``nodes`` nodes of ``gpus // nodes`` each."""

    gpus: int
    nodes: int = 1

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node}


def _counts(text: str) -> list[int]:
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        raise OptionError(f"cannot read `gpus` '{text}': give a GPU count or counts separated by commas, "
                          "e.g. `gpus` 8 or `gpus` 1,2,4")
    counts = [int(c) for c in text.split(",")]
    if min(counts) < 1:
        raise OptionError(f"`gpus` {text}: every GPU count must be 1 or more, e.g. `gpus` 8 or `gpus` 1,2,4")
    return sorted(set(counts))


def parse_worlds(gpus: str | None, nodes: int | None = None, gpus_per_node: int | None = None) -> list[World]:
    """The worlds to plan for, from the CLI's three options (see the module docstring)."""
    if nodes is not None and nodes < 1:
        raise OptionError(f"`nodes` must be 1 or more, got {nodes}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise OptionError(f"`gpus_per_node` must be 1 or more, got {gpus_per_node}")
    counts = _counts(gpus) if gpus is not None else None
    if nodes is not None or gpus_per_node is not None:
        if counts is not None and len(counts) > 1:
            raise OptionError("a list of GPU counts (`gpus` 1,2,4) is for one node: drop `nodes`/`gpus_per_node`, "
                              "or give one count")
        if gpus_per_node is None:
            if counts is None or counts[0] % nodes:
                raise OptionError(f"`nodes` {nodes} needs `gpus_per_node`, e.g. `nodes` {nodes} `gpus_per_node` 8")
            gpus_per_node = counts[0] // nodes
        nodes = nodes or 1
        if counts is not None and counts[0] != nodes * gpus_per_node:
            raise OptionError(f"`gpus` {counts[0]} is not `nodes` {nodes} x `gpus_per_node` {gpus_per_node}: "
                              f"drop `gpus` (it is {nodes * gpus_per_node})")
        return [World(nodes * gpus_per_node, nodes)]
    if counts is None:
        raise OptionError("say how many GPUs: `gpus` 8 (one node), `gpus` 1,2,4 (a table by GPU count), "
                          "or `nodes` 2 `gpus_per_node` 8")
    worlds = []
    for count in counts:
        if count <= DEFAULT_GPUS_PER_NODE:
            worlds.append(World(count, 1))
        elif count % DEFAULT_GPUS_PER_NODE == 0:
            worlds.append(World(count, count // DEFAULT_GPUS_PER_NODE))
        else:
            raise OptionError(f"`gpus` {count} does not fill nodes of {DEFAULT_GPUS_PER_NODE}: give the layout, "
                              f"e.g. `nodes` 2 `gpus_per_node` {-(-count // 2)}")
    return worlds


def parse_tokens(text: str | None) -> str | float | None:
    """--tokens: a count ('2e11', '300000000000') or 'chinchilla' (20 x parameters, resolved
    once the parameters are counted)."""
    if text is None:
        return None
    if text.strip().lower() == "chinchilla":
        return "chinchilla"
    try:
        tokens = float(text)
    except ValueError:
        tokens = -1.0
    if not tokens > 0:
        raise OptionError(f"cannot read `tokens` '{text}': give a token count such as 2e11, or chinchilla "
                          f"({CHINCHILLA_TOKENS_PER_PARAM} x the parameters)")
    return tokens
