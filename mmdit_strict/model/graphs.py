"""CUDA-graph replay of the strict forward, one graph per batch layout.

The strict forward launches a few thousand small kernels per step; launched from Python each costs
tens of microseconds of host time, which at Qwen-Image size leaves the GPU idle between kernels. A
graph captured once per layout — (batch, image tokens, prompt lengths, latent grids, dtype, runtime)
— replays the same kernels with the same arguments, so the bytes are those of the uncaptured forward
(tested on the GPU), and the host cost is one replay.

Used only where it is safe: CUDA tensors, autograd off (rollout and evaluation), a strict-family
runtime. Capture needs a forward with no host synchronisation and no host→device copies; a warm-up
call with the same layout before capture builds every per-layout table (RoPE, row offsets).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..kernels.keepalive import retaining
from ..kernels.trace import OperatorTrace, active_trace, capture_trace
from .module_index import adapter_layers

if TYPE_CHECKING:
    from .mmdit import ModelInputs
    from .train_graphs import TrainGraphCache


# Warm a capture up on the first and last transformer blocks only (plus the embeddings and the output), not all of
# them. The warm-up exists to compile every kernel and fill every per-layout table before the capture, where neither
# may happen; the blocks are alike (same shapes, kernels, tables and launch plans), so two of them do that at a
# fraction of a whole step's host time (tests/model/test_short_warmup.py on the CPU; on the H200,
# tests/model/test_train_graphs.py::test_a_short_warmup_captures_the_same_steps). False: warm up on every block.
SHORT_WARMUP = True


def warmup_blocks(num_blocks: int) -> tuple[int, ...] | None:
    """The blocks a capture's warm-up runs: the first and the last under :data:`SHORT_WARMUP`, else None (all)."""
    return (0, num_blocks - 1) if SHORT_WARMUP and num_blocks > 2 else None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: "ModelInputs"  # static input buffers
    out: torch.Tensor
    trace: OperatorTrace
    tables: list  # cached device tables the graph reads (kept alive while the graph lives)


def static_inputs(inputs: "ModelInputs") -> "ModelInputs":
    """A graph's input buffers: copies of ``inputs``' tensors (lengths and grids are part of the graph's key)."""
    from .mmdit import ModelInputs

    mask = inputs.txt_mask.clone() if isinstance(inputs.txt_mask, torch.Tensor) else inputs.txt_mask
    return ModelInputs(
        inputs.hidden_states.clone(), inputs.encoder_hidden_states.clone(), mask, list(inputs.txt_lens),
        inputs.sigma.clone(), inputs.img_shapes, list(inputs.img_lens),
    )


def load_inputs(static: "ModelInputs", inputs: "ModelInputs") -> None:
    """Copy this call's data into a graph's input buffers (:func:`static_inputs`) before a replay."""
    static.hidden_states.copy_(inputs.hidden_states)
    static.encoder_hidden_states.copy_(inputs.encoder_hidden_states)
    static.sigma.copy_(inputs.sigma)


def graph_stats(model: torch.nn.Module) -> dict[str, dict[str, int]] | None:
    """How a model's CUDA graphs served its forwards so far (captures, replays; for training graphs also the calls
    that ran uncaptured for want of room), or None where graphs are off (``enable_cuda_graphs``)."""
    fwd, train = getattr(model, "graph_cache", None), getattr(model, "train_graphs", None)
    if fwd is None and train is None:
        return None
    stats: dict[str, dict[str, int]] = {}
    if fwd is not None:
        stats["forward"] = {"captures": fwd.captures, "replays": fwd.replays}
    if train is not None:
        stats["training"] = {"captures": train.captures, "replays": train.replays, "uncaptured": train.uncaptured}
    return stats


def release_forward_graphs(model: torch.nn.Module) -> int:
    """Drop ``model``'s captured no-grad forwards and with them their memory pools (the training steps' graphs
    stay); returns how many were held. The next forward of a layout captures it again."""
    return _release(getattr(model, "graph_cache", None))


def release_training_graphs(model: torch.nn.Module) -> int:
    """Drop ``model``'s captured training steps, their memory pools and the partial buffers they share (the no-grad
    forwards stay); returns how many were held. The next training forward of a layout captures it again (a step
    between its forward and its backward keeps its graphs and buffers until its autograd node is gone)."""
    return _release(getattr(model, "train_graphs", None))


def _release(cache: "GraphCache | TrainGraphCache | None") -> int:
    if cache is None:
        return 0
    held = len(cache)
    cache.clear()
    if held and torch.cuda.is_available():
        torch.cuda.empty_cache()  # a released pool's blocks stay reserved (and unusable by others) until then
    return held


def adapter_state(model: torch.nn.Module) -> tuple:
    """What the strict forward's Python reads of the LoRA adapters: per adapted layer, whether adapters are
    disabled, which are active and their scalings. A graph captured in one state must not replay in another
    (a KL reference forward runs with the adapters disabled, as ``training.policy.adapters_disabled`` does).
    The adapter layers come from the kept walk of the model (:mod:`.module_index`); their state is read now."""
    return tuple((bool(getattr(m, "disable_adapters", False)), tuple(m.active_adapters),
                  tuple(sorted((k, float(v)) for k, v in m.scaling.items())))
                 for m in adapter_layers(model))


class GraphCache:
    """Captured forwards keyed by batch layout (least recently used beyond ``max_graphs`` are dropped).

    Each graph holds its own static input/output buffers; all of a cache's graphs share one memory pool
    (``share_pool``, the default), which is safe because a replay's output is copied out before the call returns:
    nothing a graph writes into the pool is read after another graph replays, so the pool only needs room for
    the largest graph's temporaries, not for the sum of them. ``clear()`` releases the graphs and the pool.
    The runtime mode, parameters' identity and LoRA adapters must not change between capture and
    replay: the key includes the runtime and dtype, and :meth:`clear` must be called after changing
    weights' storage (``load_state_dict(assign=True)``, adding or removing an adapter). In-place weight
    updates (an optimizer step) are seen by the replay, as the graph reads the parameters' storage.
    """

    def __init__(self, max_graphs: int = 8, share_pool: bool = True) -> None:
        self.max_graphs = max_graphs
        self.share_pool = share_pool
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)

    @staticmethod
    def key(inputs: "ModelInputs", runtime: object) -> tuple:
        hs, ehs = inputs.hidden_states, inputs.encoder_hidden_states
        shapes = tuple(tuple(tuple(s) for s in per) for per in inputs.img_shapes)
        return (tuple(hs.shape), tuple(ehs.shape), tuple(inputs.txt_lens), shapes, hs.dtype, str(hs.device), str(runtime))

    def run(self, inputs: "ModelInputs", runtime: object, forward: Callable[["ModelInputs"], torch.Tensor],
            extra_key: tuple = (), warmup: Callable[["ModelInputs"], torch.Tensor] | None = None) -> torch.Tensor:
        """``forward(inputs)`` through the graph for this layout (captured on first use, after a warm-up call of
        ``warmup``, default ``forward``); ``extra_key``: the rest of what the forward's Python reads
        (:func:`adapter_state`)."""
        key = (self.key(inputs, runtime), extra_key)
        cap = self._graphs.get(key)
        if cap is None:
            static = static_inputs(inputs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), capture_trace():  # its own trace: the caller sees one forward per call
                (warmup or forward)(static)  # warm-up: compiles kernels and fills every per-layout cache
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # the pool of a graph still held (none left: the allocator frees the pool, a capture makes a new one)
            pool = next(iter(self._graphs.values())).graph.pool() if self.share_pool and self._graphs else None
            with retaining() as tables, capture_trace() as trace, torch.cuda.graph(graph, pool=pool):
                out = forward(static)
            cap = _Captured(graph, static, out, trace, tables)
            self._graphs[key] = cap
            self.captures += 1
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        load_inputs(cap.inputs, inputs)
        cap.graph.replay()
        self.replays += 1
        outer = active_trace()
        if outer is not None:  # a replay runs the operators recorded at capture: count them again
            outer.merge(cap.trace)
        return cap.out.clone()
