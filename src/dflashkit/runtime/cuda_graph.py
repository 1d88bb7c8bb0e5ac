"""Steps run eagerly or as CUDA graphs: the one helper `prepare`'s slot generator (``dflashkit.data.generator``)
and the graphs decode engine (``dflashkit.infer.graph_engine``) capture and replay their fixed-shape steps with."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class Steps:
    """Runs zero-argument step functions that read and write fixed buffers. With CUDA graphs, the first
    call of a shape key runs the step for real (on a side stream: it also warms cuBLAS and the
    allocator), then captures it; later calls replay the capture."""

    def __init__(self, graphs: bool):
        self.graphs = graphs
        self._graphs: dict[tuple[Any, ...], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self.capture_seconds = 0.0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: tuple[Any, ...], step: Callable[[], None]) -> None:
        if not self.graphs:
            step()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # the real step (and the warm-up the capture needs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            step()  # recorded, not run
        self._graphs[key] = graph
        self.capture_seconds += time.perf_counter() - t0
