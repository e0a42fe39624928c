"""A step's forward pass, chosen once per runner (`ModelRunner`): the eager torch model (the reference), the
native CPU step (motet/engine/worker/cpu_forward.py) in its place, or decode steps replayed from CUDA graphs
(motet/engine/worker/cuda_graphs.py) in front of either. Each plans a step's inputs on the host from its plan and the runner's rows (`plan`), runs them
(`run`: the hidden states and each row's offset in them), gives the logits of hidden rows (`logits`) and warms
itself up; the runner around them never asks which one it has."""

from __future__ import annotations

from collections.abc import Callable

import torch

from motet.engine.core.step_plan import StepPlan
from motet.engine.worker.cuda_graphs import DecodeGraphs
from motet.engine.worker.rows import Row
from motet.engine.worker.step_inputs import GraphRows, HostInputs, InputBuilder
from motet.lora.pool import LoRABatch


class EagerSteps:
    """Every step through `forward(ids, positions, meta, lora) -> hidden` (the model's, or the native step's in
    its place); `logits(hidden, reuse)` likewise. `broadcast`: the tensor-parallel plan to the other ranks
    (motet/engine/worker/tp_workers.py; it sends nothing on one rank)."""

    def __init__(self, inputs: InputBuilder, forward: Callable, logits: Callable, broadcast):
        self.inputs, self.forward, self.logits, self.broadcast = inputs, forward, logits, broadcast

    def plan(self, step: StepPlan, rows: list[Row]) -> HostInputs:
        return self.inputs.host(step, rows)

    def run(self, plan: HostInputs, lora: LoRABatch | None, on_launch=None) -> tuple[torch.Tensor, list[int]]:
        ids, positions, meta, qsl = self.inputs.to_device(plan)
        if on_launch is not None:
            on_launch()
        self.broadcast.send_forward(ids, positions, meta, lora)
        return self.forward(ids, positions, meta, lora), qsl

    def warm_up(self) -> str:
        """One padding token (slot -1: no KV write, nothing a request can read) through the step and the
        lm_head, starting the thread pool and touching the code and the weights."""
        self.logits(self.forward(*self.inputs.padding_token()))
        return "one token through the step"


class GraphSteps:
    """Decode steps replayed from their bucket's CUDA graph; the others (prompt chunks, batches too large for the
    graphs) through `eager`."""

    def __init__(self, graphs: DecodeGraphs, eager: EagerSteps):
        self.graphs, self.eager = graphs, eager
        self.logits = eager.logits

    def plan(self, step: StepPlan, rows: list[Row]) -> GraphRows | HostInputs:
        return self.eager.inputs.graph_rows(step, rows, self.graphs.fits) or self.eager.plan(step, rows)

    def run(self, plan, lora: LoRABatch | None, on_launch=None) -> tuple[torch.Tensor, list[int]]:
        if not isinstance(plan, GraphRows):
            return self.eager.run(plan, lora, on_launch)
        hidden = self.graphs.run_rows(
            plan.rows,
            plan.starts,
            plan.slots,
            plan.tables,
            lora,
            on_launch,
            plan.feeds,
            self.eager.inputs.sampled,
        )
        return hidden, plan.qsl

    def warm_up(self) -> str:
        """Every decode graph of the base model captured (`DecodeGraphs.capture_all`)."""
        self.graphs.capture_all()
        return f"{len(self.graphs.graphs)} decode CUDA graphs captured"
