"""The one CUDA-graph runner: a decode step's phases captured once and replayed.

A decode step on static buffers (`loop.PlainStep`, for one row or the generate
stage's batch, and the three phases of `SpeculativeStep`) launches
hundreds to thousands of small kernels; replaying each phase as one CUDA graph turns them into
one launch. Every user goes through `PhaseRunner`:

    runner = PhaseRunner(step.phases(), state=step.graph_state(), device=step.device)
    for phase in runner.phases: phase()        # graph replays on CUDA, the phases themselves elsewhere

Capture warms each phase up twice on a side stream (lazy initialisation, kernel and cuDNN plan
choice happen outside the graph), captures it, then puts back the small counters in `state` that
the warm-up moved (the buffers they index are rewritten before they are read again). A capture
that fails warns once and runs the same phases eagerly: the answers are the same, only slower.

Capture runs in "thread_local" error mode with the garbage collector off: in the default "global"
mode an unsafe CUDA call from anywhere in the process invalidates the capture, and a collection
during capture can finalise objects that make such calls (a Triton kernel's module unloaded after
compiled attention in evaluate, vllm-project/vllm#54646).
"""

import gc
import warnings

import torch


class PhaseRunner:
    """`phases` (callables without arguments that read and write only preallocated tensors) as
    they run on `device`: captured CUDA graphs on CUDA (`graphed` True), the callables elsewhere
    or when capture fails."""

    def __init__(self, phases, *, state: list[torch.Tensor], device: torch.device, capture: bool | None = None):
        self.graphed = False
        self.phases = tuple(phases)
        if not (device.type == "cuda" if capture is None else capture):
            return
        saved = [tensor.clone() for tensor in state]
        try:
            self.phases = self._captured(self.phases)
            self.graphed = True
        except Exception as error:  # a capture that fails must not stop the decode: the same phases, eagerly
            warnings.warn(f"CUDA graph capture of the decode step failed ({error}); running it eagerly")
        for tensor, value in zip(state, saved):
            tensor.copy_(value)

    @staticmethod
    def _captured(phases) -> tuple:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graphs
            for _ in range(2):
                for phase in phases:
                    phase()
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        collecting = gc.isenabled()
        gc.disable()
        try:
            for phase in phases:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    phase()
                graphs.append(graph)
        finally:
            if collecting:  # as it was: a caller that had switched collection off keeps it off
                gc.enable()
        return tuple(graph.replay for graph in graphs)
