"""Captured training steps (``model/train_graphs.py``): the deposits a captured backward hands the grad sink,
and, on the GPU, forward + backward replays byte-equal to the uncaptured step."""

from __future__ import annotations

import dataclasses
import importlib
import threading
from typing import Any

import pytest
import torch

from mmdit_strict.config.arch import preset
from mmdit_strict.config.schema import LoraConfig
from mmdit_strict.kernels.execution import bind, current
from mmdit_strict.kernels.deposit_log import DepositLog
from mmdit_strict.kernels.grad_sink import SampleGradSink, collect_sample_grads, sample_keys
from mmdit_strict.kernels.keepalive import retain, retaining
from mmdit_strict.kernels.trace import OperatorTrace
from mmdit_strict.model.graphs import adapter_state, static_inputs
from mmdit_strict.model.init import build_model
from mmdit_strict.model.train_graphs import add_into_grads
from mmdit_strict.trajectories.setup import attach_lora
from mmdit_strict.training.policy import adapters_disabled
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs

LORA = LoraConfig(rank=4, alpha=8.0, init="random", seed=3)  # scale 2: the LoRA dW products carry a scale


def _lora_model(arch: Any, device: str = "cpu", dtype: torch.dtype = torch.float32, checkpointing: bool = True):
    model = build_model(arch, seed=0, runtime="strict", dtype=dtype, device=device)
    attach_lora(model, dataclasses.replace(LORA, targets=list(LORA.targets) + ["img_mod.1", "txt_mod.1"]))
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.enable_gradient_checkpointing(checkpointing)
    return model


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().sum()


def check_add_into_grads(device: str) -> None:
    """Accumulating a replay's gradients in multi-tensor launches gives the per-parameter loop's bytes: an add
    where ``.grad`` exists, a copy where it is None, nothing for a None gradient; FP32 and BF16, odd sizes."""
    g = torch.Generator().manual_seed(5)
    shapes = [(7, 3), (64,), (5, 11), (1,), (33, 2), (4, 4)]
    dtypes = [torch.float32, torch.bfloat16] * 3
    params = [torch.zeros(s, dtype=dt, device=device, requires_grad=True) for s, dt in zip(shapes, dtypes)]
    grads = tuple(None if i == 4 else torch.randn(s, generator=g).to(device, dt) for i, (s, dt) in enumerate(zip(shapes, dtypes)))
    start = [None if i % 3 == 0 else torch.randn(s, generator=g).to(device, dt) for i, (s, dt) in enumerate(zip(shapes, dtypes))]

    def accumulate(fn) -> list[torch.Tensor | None]:
        for p, s0 in zip(params, start):
            p.grad = None if s0 is None else s0.clone()
        fn()
        return [p.grad for p in params]

    def loop() -> None:
        for p, gr in zip(params, grads):
            if gr is not None:
                p.grad = gr.clone() if p.grad is None else p.grad.add_(gr)

    ours = accumulate(lambda: add_into_grads(params, grads))
    ref = accumulate(loop)
    for i, (a, c) in enumerate(zip(ours, ref)):
        if c is None:
            assert a is None, f"parameter {i}: a gradient appeared from nothing"
        else:
            assert_bytes_equal(a, c, f"parameter {i} ({a.dtype}) .grad")
            if grads[i] is not None:
                assert a.data_ptr() != grads[i].data_ptr(), "a .grad must not alias the graph's static gradient"


def test_add_into_grads_equals_the_per_parameter_loop() -> None:
    check_add_into_grads("cpu")


@pytest.mark.gpu
def test_gpu_add_into_grads_equals_the_per_parameter_loop() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check_add_into_grads("cuda")


def test_deposit_log_replays_a_backwards_deposits_under_the_calls_keys() -> None:
    """A backward recorded under batch positions and replayed into a sink under the call's keys gives the
    sink the folds it gets when the backward deposits into it directly (stored and streamed)."""
    model = _lora_model(preset("tiny"))
    inp = make_inputs(3, (4, 4), [5, 3, 4])
    keys = [("b", 1), ("a", 0), ("c", 2)]

    for streamed in (False, True):
        direct = SampleGradSink(keys) if streamed else SampleGradSink()
        with collect_sample_grads(direct), sample_keys(keys):
            out = model(**inp).sample
        _loss(out).backward()
        direct.done(keys)

        log = DepositLog()
        with bind(current().replace(grad_sink=log, sample_keys=(0, 1, 2))):
            again = model(**inp).sample
        _loss(again).backward()
        assert_bytes_equal(again, out, "forward under the log")
        assert log.entries, "the strict backward deposited nothing into the log"
        replayed = SampleGradSink(keys) if streamed else SampleGradSink()
        log.replay(replayed, keys)
        replayed.done(keys)
        for name, p in _trainable(model):
            assert_bytes_equal(replayed.fold(p), direct.fold(p), f"{name} (streamed={streamed})")
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("keys", [[("b", 1), ("a", 0)], [("c", 0), ("a", 1), ("b", 2), ("a", 0)]])
def test_a_folding_deposit_log_hands_the_sink_one_node_with_the_per_sample_bytes(keys) -> None:
    """The strict backward into a log that folds its batch (``DepositLog(fold=...)``, buffers from a partial arena
    reserved for one position): one buffer per trained tensor, and the node it hands a streamed sink folds to the bytes
    the sink gets from the per-sample partials; the arena holds one flat buffer, not one per sample."""
    from mmdit_strict.model.train_graphs import PartialArena

    model = _lora_model(preset("tiny"))
    b = len(keys)
    inp = make_inputs(b, (4, 4), [5, 3, 4, 6][:b])
    params = [p for _, p in _trainable(model)]
    direct = SampleGradSink(keys)
    with collect_sample_grads(direct), sample_keys(keys):
        out = model(**inp).sample
    _loss(out).backward()
    direct.done(keys)
    model.zero_grad(set_to_none=True)

    order = direct.node_order(keys)
    assert order is not None and [keys[i] for i in order] == sorted(keys)
    log = DepositLog(fold=order)
    arena = PartialArena()
    arena.attach(log, params, b)
    with bind(current().replace(grad_sink=log, sample_keys=tuple(range(b)))):
        again = model(**inp).sample
    _loss(again).backward()
    assert_bytes_equal(again, out, "forward under the folding log")
    assert log.entries and all(len(parts) == 1 and pos == tuple(range(b)) for _, pos, parts in log.entries)
    assert len(log.flat.flats) == 1 and arena.nbytes() == log.flat.flats[0].numel() * 4
    folded = SampleGradSink(keys)
    log.replay(folded, keys)
    folded.done(keys)
    assert folded.stats.group_tensors == len(log.entries)
    for name, p in _trainable(model):
        want = direct.fold(p)
        if want is None:
            assert folded.fold(p) is None, name
        else:
            assert_bytes_equal(folded.fold(p), want, name)


def test_deposit_log_takes_batch_positions_only() -> None:
    log = DepositLog()
    p = torch.zeros(2)
    with pytest.raises(ValueError, match="batch positions"):
        log.add(p, [("a", 0)], [torch.ones(2)])
    with pytest.raises(ValueError, match="2 sample keys for 1"):
        log.add(p, [0, 1], [torch.ones(2)])


def test_retaining_every_thread_collects_what_another_thread_retains() -> None:
    """A backward runs on autograd's device thread, outside the capturing thread's context."""
    table = object()
    with retaining() as mine:
        worker = threading.Thread(target=retain, args=(table,))
        worker.start(), worker.join()
    assert table not in mine
    with retaining(every_thread=True) as held:
        worker = threading.Thread(target=retain, args=(table,))
        worker.start(), worker.join()
    assert any(t is table for t in held)


def test_adapter_state_tells_disabled_adapters_apart() -> None:
    model = _lora_model(preset("tiny"))
    on = adapter_state(model)
    assert on and all(not disabled for disabled, _, _ in on)
    with adapters_disabled(model):
        off = adapter_state(model)
    assert off != on and all(disabled for disabled, _, _ in off)
    assert adapter_state(model) == on


def test_training_graphs_are_bypassed_on_the_cpu() -> None:
    model = _lora_model(preset("tiny")).enable_cuda_graphs()
    inp = make_inputs(2, (4, 4), [5, 3])
    out = model(**inp).sample
    _loss(out).backward()
    assert model.train_graphs.captures == 0 and model.train_graphs.replays == 0
    grads = {n: p.grad for n, p in _trainable(model) if p.grad is not None}
    assert grads, "the uncaptured backward gave no LoRA gradient"
    model.zero_grad(set_to_none=True)
    model.enable_cuda_graphs(False)
    _loss(model(**inp).sample).backward()
    for n, p in _trainable(model):
        if n in grads:
            assert_bytes_equal(p.grad, grads[n], n)


# ----------------------------------------------------------------------------------------------------- GPU


def _cuda_case(num_layers: int = 2, checkpointing: bool = True):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    arch = dataclasses.replace(preset("qwen-image"), num_layers=num_layers)
    return arch, _lora_model(arch, "cuda", torch.bfloat16, checkpointing)


def _cuda_inputs(arch: Any, txt_lens: list[int], seed: int, grid: tuple[int, int] = (16, 16)) -> dict[str, Any]:
    inp = make_inputs(len(txt_lens), grid, txt_lens, txt_dim=arch.joint_attention_dim, seed=seed,
                      sigma=[0.9 - 0.1 * i for i in range(len(txt_lens))])
    return {k: (v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


def _step(model, inputs: list[dict[str, Any]], keys: list[list[Any]], sums: bool = True,
          groups: list[int] | None = None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Forwards of ``inputs`` (each under its keys), one backward of their summed loss: outputs, folds, ``.grad``
    (``groups``: gets how many tensors the sink folded as one group)."""
    flat = [k for ks in keys for k in ks]
    sink = SampleGradSink(flat, autograd_sums=sums)
    outs = []
    with collect_sample_grads(sink):
        for inp, ks in zip(inputs, keys):
            with sample_keys(ks):
                outs.append(model(**inp).sample)
    sum(_loss(o) for o in outs).backward()
    sink.done(flat)
    if groups is not None:
        groups.append(sink.stats.group_tensors)
    folds = {n: sink.fold(p) for n, p in _trainable(model)}
    grads = {n: p.grad.clone() for n, p in _trainable(model) if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [o.detach() for o in outs], folds, grads


def _same(a, b, what: str) -> None:
    (oa, fa, ga), (ob, fb, gb) = a, b
    for i, (x, y) in enumerate(zip(oa, ob)):
        assert_bytes_equal(y, x, f"{what}: output {i}")
    assert fa.keys() == fb.keys() and ga.keys() == gb.keys() and any(v is not None for v in fa.values())
    for n in fa:
        if fa[n] is None:
            assert fb[n] is None, f"{what}: {n} got a partial only when captured"
            continue
        assert_bytes_equal(fb[n], fa[n], f"{what}: fold of {n}")
    for n in ga:
        assert_bytes_equal(gb[n], ga[n], f"{what}: .grad of {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [True, False])
def test_captured_training_step_equals_the_uncaptured_one(checkpointing: bool) -> None:
    arch, model = _cuda_case(checkpointing=checkpointing)
    calls = [([_cuda_inputs(arch, [77, 20], seed=1)], [[(5, 1), (2, 0)]]),
             ([_cuda_inputs(arch, [77, 20], seed=2)], [[(1, 0), (9, 3)]]),  # same layout, other data and keys
             ([_cuda_inputs(arch, [30], seed=3, grid=(8, 24))], [[(4, 4)]])]
    eager_groups, graphed_groups = [], []
    eager = [_step(model, i, k, groups=eager_groups) for i, k in calls]
    model.enable_cuda_graphs()
    graphed = [_step(model, i, k, groups=graphed_groups) for i, k in calls]
    again = _step(model, *calls[0])
    assert model.train_graphs.captures == 2 and model.train_graphs.replays == 4, vars(model.train_graphs)
    # the replays hand the sink their flat partial buffers: every tensor with a partial folded as one group
    assert eager_groups == [0, 0, 0] and all(g == sum(f is not None for f in e[1].values())
                                             for g, e in zip(graphed_groups, eager)), (eager_groups, graphed_groups)
    assert model.train_graphs.pools() == 1  # the two layouts' steps were never live together: one pool
    for n, (a, b) in enumerate(zip(eager, graphed)):
        _same(a, b, f"call {n}")
    _same(eager[0], again, "replay after other layouts")


@pytest.mark.gpu
def test_captured_steps_without_autograd_sums_fold_the_same_bytes_from_shared_buffers() -> None:
    """The trainer's sink (no autograd sums): captured == uncaptured folds, no ``.grad`` written, and the captured
    steps of two layouts and of the sequential CFG pair write their partials into one arena."""
    arch, model = _cuda_case()
    cond, neg = _cuda_inputs(arch, [40], seed=4), _cuda_inputs(arch, [12], seed=5)
    other = _cuda_inputs(arch, [77, 20], seed=1)
    calls = [([cond, neg], [[((0, 1), 0)], [((0, 1), 1)]]), ([other], [[(5, 1), (2, 0)]]),
             ([neg, cond], [[((3, 1), 1)], [((3, 1), 0)]])]
    eager = [_step(model, i, k, sums=False) for i, k in calls]
    assert all(not e[2] for e in eager), "a sink without autograd sums left .grad written"
    model.enable_cuda_graphs()
    groups: list[int] = []
    graphed = [_step(model, i, k, sums=False, groups=groups) for i, k in calls]
    assert all(g > 0 for g in groups), groups  # the sequential CFG pair's two replays continue one group
    assert model.train_graphs.captures == 3 and model.train_graphs.replays == 5, vars(model.train_graphs)
    for n, (a, b) in enumerate(zip(eager, graphed)):
        _same(a, b, f"call {n}")
    insts = [i for pool in model.train_graphs._entries.values() for i in pool]
    arena = model.train_graphs._arena
    assert len(insts) == 3 and all(i.arena is arena for i in insts) and len(arena) > 0
    one_a, one_b, two = ({t.data_ptr() for _, _, parts in i.deposits.entries for t in parts}
                         for i in sorted(insts, key=lambda i: i.inputs.hidden_states.shape[0]))
    assert one_a == one_b and one_a < two and len(two) == 2 * len(one_a)  # position 1 is the B = 2 step's own


@pytest.mark.gpu
def test_captured_steps_that_fold_their_batch_equal_the_uncaptured_ones() -> None:
    """``fold_batches``: a B = 4 call in the batched CFG order (both branches of two pairs: one node of the sink's
    tree) and a B = 2 one fold their batch in the graph, into one flat buffer per position 0 only; the folds equal the
    uncaptured step's bytes, again after the other layout's replay."""
    arch, model = _cuda_case()
    four = _cuda_inputs(arch, [40, 31, 12, 12], seed=6)
    two = _cuda_inputs(arch, [77, 20], seed=7)
    calls = [([four], [[((0, 1), 0), ((0, 2), 0), ((0, 1), 1), ((0, 2), 1)]]), ([two], [[((3, 1), 1), ((3, 1), 0)]])]
    eager = [_step(model, i, k, sums=False) for i, k in calls]
    model.enable_cuda_graphs()
    model.train_graphs.fold_batches = True
    graphed = [_step(model, i, k, sums=False) for i, k in calls + calls[:1]]
    insts = model.train_graphs._instances()
    assert model.train_graphs.captures == 2 and sorted(i.deposits.fold for i in insts) == [(0, 2, 1, 3), (1, 0)]
    assert all(len(i.deposits.flat.flats) == 1 for i in insts)
    for n, (a, b) in enumerate(zip(eager + eager[:1], graphed)):
        _same(a, b, f"call {n}")


@pytest.mark.gpu
def test_captured_steps_that_carry_their_node_equal_the_uncaptured_ones() -> None:
    """``carry``: four B = 2 steps (both CFG branches of a pair: each one node of the sink's tree), one backward each;
    steps 0 and 2 leave their node in the shared buffer and steps 1 and 3 add theirs into it inside the graph. The
    folds equal the uncaptured steps' bytes, in the first update (captures) and the next (replays)."""
    arch, model = _cuda_case()
    inputs = [_cuda_inputs(arch, [40, 12], seed=10 + m) for m in range(4)]
    keys = [[((m, 1), 0), ((m, 1), 1)] for m in range(4)]

    def update() -> tuple[dict[str, torch.Tensor | None], SampleGradSink]:
        sink = SampleGradSink([k for ks in keys for k in ks], autograd_sums=False)
        with collect_sample_grads(sink):
            for inp, ks in zip(inputs, keys):
                with sample_keys(ks):
                    out = model(**inp).sample
                _loss(out).backward()
                sink.done(ks)
        folds = {n: sink.fold(p) for n, p in _trainable(model)}
        model.zero_grad(set_to_none=True)
        return folds, sink

    eager, _ = update()
    model.enable_cuda_graphs()
    model.train_graphs.fold_batches = model.train_graphs.carry = True
    for rep in range(2):
        got, sink = update()
        assert sink.carried == 2 and model.train_graphs.captures == 1, (sink.carried, vars(model.train_graphs))
        for n, want in eager.items():
            if want is None:
                assert got[n] is None, n
            else:
                assert_bytes_equal(got[n], want, f"update {rep}: fold of {n}")


@pytest.mark.gpu
def test_a_short_warmup_captures_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``graphs.SHORT_WARMUP``: captures warmed up on the first and last of 4 blocks replay the uncaptured bytes
    (training steps with the trainer's sink, in the sequential-CFG pattern and a second layout, and no-grad
    forwards), so the two blocks compiled every kernel and filled every table the other two use."""
    from mmdit_strict.model import graphs

    monkeypatch.setattr(graphs, "SHORT_WARMUP", True)
    arch, model = _cuda_case(num_layers=4)
    assert model._graph_warmup() is not None
    cond, neg = _cuda_inputs(arch, [40], seed=4), _cuda_inputs(arch, [12], seed=5)
    other = _cuda_inputs(arch, [77, 20], seed=1, grid=(8, 24))
    calls = [([cond, neg], [[((0, 1), 0)], [((0, 1), 1)]]), ([other], [[(5, 1), (2, 0)]])]
    eager = [_step(model, i, k, sums=False) for i, k in calls]
    with torch.no_grad():
        plain = model(**other).sample
    model.enable_cuda_graphs()
    graphed = [_step(model, i, k, sums=False) for i, k in calls]
    assert model.train_graphs.captures == 3, vars(model.train_graphs)
    for n, (a, b) in enumerate(zip(eager, graphed)):
        _same(a, b, f"short warm-up, call {n}")
    with torch.no_grad():
        assert_bytes_equal(model(**other).sample, plain, "short warm-up, no-grad forward")
    assert model.graph_cache.captures == 1


@pytest.mark.gpu
def test_strict_kernels_read_no_memory_they_did_not_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strict blocks skip PyTorch's NaN fill of ``torch.empty``: safe only if no kernel reads an element it
    did not write. With the fill on (NaN in every fresh buffer) the step gives the same bytes as without."""
    execution = importlib.import_module("mmdit_strict.kernels.execution")  # the module, not the function of that name

    arch, model = _cuda_case()
    calls = ([_cuda_inputs(arch, [77, 20], seed=1)], [[(5, 1), (2, 0)]])
    plain = _step(model, *calls)
    monkeypatch.setattr(execution, "POISON_UNINITIALIZED", True)
    torch.cuda.empty_cache()  # fresh blocks for the poisoned run, not the first run's leftovers
    poisoned = _step(model, *calls)
    _same(plain, poisoned, "NaN-filled empties")
    model.enable_cuda_graphs()
    _same(plain, _step(model, *calls), "NaN-filled empties, captured")


@pytest.mark.gpu
def test_two_forwards_of_one_layout_before_the_backward_use_two_captures() -> None:
    """The sequential CFG layout: the conditional and the negative forward, then one backward."""
    arch, model = _cuda_case()
    cond, neg = _cuda_inputs(arch, [40], seed=4), _cuda_inputs(arch, [40], seed=5)
    keys = [[((0, 1), 0)], [((0, 1), 1)]]
    eager = _step(model, [cond, neg], keys)
    model.enable_cuda_graphs()
    graphed = _step(model, [cond, neg], keys)
    assert model.train_graphs.captures == 2, "the second forward reused the first one's activations"
    assert model.train_graphs.pools() == 2, "the second forward was captured into the busy first one's pool"
    _same(eager, graphed, "sequential CFG")
    graphed_again = _step(model, [neg, cond], [keys[1], keys[0]])
    assert model.train_graphs.captures == 2 and model.train_graphs.replays == 4
    # the same forwards in the other order: per-sample outputs swap, folds and sums are the same bytes
    assert_bytes_equal(graphed_again[0][0], eager[0][1], "negative output")
    for n, f in eager[1].items():
        if f is not None:
            assert_bytes_equal(graphed_again[1][n], f, f"fold of {n}")


@pytest.mark.gpu
def test_a_step_never_backpropagated_frees_its_capture() -> None:
    arch, model = _cuda_case(num_layers=1)
    model.enable_cuda_graphs()
    inp = _cuda_inputs(arch, [40], seed=6)
    for _ in range(3):
        model(**inp).sample  # autograd on, the graph dropped without a backward
    assert model.train_graphs.captures == 1 and model.train_graphs.replays == 3


@pytest.mark.gpu
def test_graphed_forward_with_adapters_disabled_equals_the_uncaptured_one() -> None:
    """A KL reference forward (adapters disabled) must not replay the graph captured with them on."""
    arch, model = _cuda_case(num_layers=1)
    inp = _cuda_inputs(arch, [40], seed=7)
    with torch.no_grad():
        on = model(**inp).sample
        with adapters_disabled(model):
            off = model(**inp).sample
        model.enable_cuda_graphs()
        assert_bytes_equal(model(**inp).sample, on, "adapters on, graphed")
        with adapters_disabled(model):
            assert_bytes_equal(model(**inp).sample, off, "adapters off, graphed")
    assert not torch.equal(on, off)
    assert model.graph_cache.captures == 2


# ------------------------------------------------------------------------- bookkeeping with a stand-in graph


class _StandInPool(dict):
    """A memory pool's stand-in: the activations a forward leaves for its backward live here, so two instances
    of one pool both between forward and backward overwrite each other's, as they would in a shared CUDA pool."""

    __hash__ = object.__hash__  # a handle: compared by identity


class _StandInGraph:
    """What a captured graph does to its static buffers, done by Python (no CUDA here): ``replay`` reruns
    ``fn``, which rewrites the instance's static output / gradient / partial buffers in place."""

    def __init__(self, fn, pool: _StandInPool) -> None:
        self.fn, self._pool = fn, pool

    def replay(self) -> None:
        self.fn()

    def pool(self) -> _StandInPool:
        return self._pool


def _stand_in_capture(inputs, params, forward, with_sink, sums=True, arena=None, warmup=None, pool=None, fold=None,
                      carry=False):
    from mmdit_strict.model import train_graphs as tg

    static = static_inputs(inputs)
    batch = inputs.hidden_states.shape[0]
    held = pool if pool is not None else _StandInPool()
    out = forward(static).detach().clone()
    grad_out = torch.empty_like(out)
    # a sink that takes no autograd sums: the strict backward returns None for the deposited parameters
    grads = tuple(torch.empty_like(p) if sums or not with_sink else None for p in params)
    parts = [[torch.empty_like(p) for _ in range(batch)] for p in params]
    log = DepositLog(autograd_sums=sums, fold=fold) if with_sink else None
    if log is not None and arena is not None:  # as the real capture: buffers reserved from the warm-up's deposits
        for p, ps in zip(params, parts):
            log.add(p, tuple(range(batch)), ps)
        arena.attach(log, params, batch)
        if carry and log.flat is not None:
            log.accumulate = torch.zeros((), dtype=torch.bool)
        log.clear()
        parts = [log.partial_buffers(p, range(batch)) or [torch.empty_like(p) for _ in range(batch)] for p in params]
    if log is not None:
        for p, ps in zip(params, parts):
            log.add(p, tuple(range(batch)), ps)
    folding = log is not None and log.fold is not None and log.buffers is not None

    def fwd() -> None:
        with torch.enable_grad():
            held["y"] = forward(static)
        out.copy_(held["y"].detach())

    def bwd() -> None:
        y = held.pop("y")
        with torch.enable_grad():  # a backward runs without grad mode; the per-sample slices need it
            for dst, g in zip(grads, torch.autograd.grad(y, params, grad_out, retain_graph=True)):
                if dst is not None:
                    dst.copy_(g)
            for b in range(batch):  # each sample's own partial
                for dst, g in zip(parts, torch.autograd.grad(y[b], params, grad_out[b], retain_graph=True)):
                    dst[b].copy_(g)
            if folding:  # what the folding deposit recorded at capture does at each replay
                for p, ps in zip(params, parts):
                    log.fold_into(p, 0, range(batch), ps)

    return tg._Instance(_StandInGraph(fwd, held), _StandInGraph(bwd, held), static, out, grad_out, grads, log, OperatorTrace(), [],
                        arena if log is not None and log.buffers is not None else None)


def _toy(batch: int = 2, seed: int = 0):
    from mmdit_strict.model.mmdit import ModelInputs

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g, requires_grad=True)
    inputs = ModelInputs(torch.randn(batch, 5, 4, generator=g), torch.randn(batch, 2, 6, generator=g), None, [2] * batch,
                         torch.rand(batch, generator=g), [[(1, 1, 5)]] * batch, [5] * batch)
    return w, inputs, (lambda i: (i.hidden_states @ w) * i.sigma[:, None, None])


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    from mmdit_strict.model import train_graphs as tg

    monkeypatch.setattr(tg.TrainGraphCache, "_capture", staticmethod(_stand_in_capture))
    return tg.TrainGraphCache


def test_replay_node_gives_the_output_grad_and_the_sinks_partials(stand_in) -> None:
    w, inputs, forward = _toy()
    eager = forward(inputs)
    (eager * 3).sum().backward()
    want, w.grad = w.grad.clone(), None
    cache = stand_in(max_instances=2)
    keys = [("b", 0), ("a", 1)]
    sink = SampleGradSink(keys)
    with collect_sample_grads(sink), sample_keys(keys):
        out = cache.run(inputs, "strict", [w], forward, ("layout",))
    assert out is not None and out.requires_grad and torch.equal(out, eager.detach())
    (out * 3).sum().backward()
    assert torch.equal(w.grad, want)
    sink.done(keys)
    per_sample = [torch.autograd.grad((forward(inputs)[b] * 3).sum(), w)[0] for b in range(2)]
    from mmdit_strict.kernels import fold_tree

    assert torch.equal(sink.fold(w), fold_tree.fold([per_sample[1], per_sample[0]]))  # keys sorted: ("a", 1) first
    again = stand_in().run(inputs, "strict", [w], forward, ("layout",))
    again.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        again.sum().backward()


def test_a_sink_without_autograd_sums_gets_its_own_capture_and_leaves_grad_unwritten(stand_in) -> None:
    """A step captured for a sink that takes no autograd sums is not replayed for one that does (and back):
    its backward writes no ``.grad`` and hands the sink the same partials, so the fold has the same bytes."""
    w, inputs, forward = _toy()
    cache = stand_in(max_instances=4)
    keys = [("b", 0), ("a", 1)]
    folds = {}
    for sums in (True, False, True, False):
        sink = SampleGradSink(keys, autograd_sums=sums)
        with collect_sample_grads(sink), sample_keys(keys):
            out = cache.run(inputs, "strict", [w], forward, ("layout",))
        (out * 3).sum().backward()
        assert (w.grad is not None) == sums
        sink.done(keys)
        folds[sums] = sink.fold(w)
        w.grad = None
    assert cache.captures == 2 and cache.replays == 4
    assert torch.equal(folds[True], folds[False])


def test_captured_steps_share_the_partials_buffers_and_the_sink_gets_each_replays(stand_in) -> None:
    """Two layouts' captured steps write their per-sample partials into the same buffers (one cache's arena); the
    sequential-CFG pattern (forward A, forward B, then B's and A's backwards) still folds each replay's own
    partials, because each replay hands them to the sink before the next one writes them."""
    w, inputs_a, forward = _toy(seed=0)
    _, inputs_b, _ = _toy(seed=1)
    keys_a, keys_b = [("a", 0), ("a", 1)], [("b", 0), ("b", 1)]

    def folds(cache):
        sink = SampleGradSink(keys_a + keys_b)
        with collect_sample_grads(sink):
            with sample_keys(keys_a):
                ya = cache.run(inputs_a, "strict", [w], forward, ("one",))
            with sample_keys(keys_b):
                yb = cache.run(inputs_b, "strict", [w], forward, ("two",))
        return sink, ya, yb

    want = fold_want = None
    cache = stand_in(max_instances=4)
    for rep in range(3):
        sink, ya, yb = folds(cache)
        ((ya * 3).sum() + (yb * 5).sum()).backward()
        sink.done(keys_a + keys_b)
        got = sink.fold(w)
        w.grad = None
        if want is None:
            per = {}
            for inputs, ks, c in ((inputs_a, keys_a, 3), (inputs_b, keys_b, 5)):
                for b, k in enumerate(ks):
                    per[k] = torch.autograd.grad((forward(inputs)[b] * c).sum(), w)[0]
            from mmdit_strict.kernels import fold_tree

            want = fold_tree.fold(per[k] for k in sorted(per))
            fold_want = got
        assert torch.equal(got, want), f"repeat {rep}"
        assert torch.equal(got, fold_want)
    insts = [i for pool in cache._entries.values() for i in pool]
    assert len(insts) == 2 and insts[0].arena is insts[1].arena is cache._arena
    ptrs = [[t.data_ptr() for _, _, parts in i.deposits.entries for t in parts] for i in insts]
    assert ptrs[0] == ptrs[1] and len(set(ptrs[0])) == 2  # one buffer per batch position, shared by both steps


def test_without_flat_partials_the_sink_folds_tensor_by_tensor_to_the_same_bytes(stand_in, monkeypatch) -> None:
    """``FLAT_PARTIALS = False`` (the switch back): a buffer per tensor and position, deposits tensor by tensor; the
    folds are the flat path's bytes, folding batches or not."""
    from mmdit_strict.model import train_graphs as tg

    w, inputs, forward = _toy()
    v = torch.randn(3, generator=torch.Generator().manual_seed(4), requires_grad=True)
    keys = [("b", 0), ("a", 1)]

    def folds(fold_batches: bool):
        cache = stand_in(max_instances=2, fold_batches=fold_batches)
        sink = SampleGradSink(keys)
        with collect_sample_grads(sink), sample_keys(keys):
            out = cache.run(inputs, "strict", [w, v], lambda i: forward(i) * v.sum(), ("layout",))
        (out * 3).sum().backward()
        sink.done(keys)
        w.grad = v.grad = None
        return [sink.fold(w), sink.fold(v)], sink.stats.group_tensors, cache

    for fold_batches in (False, True):
        flat, group, _ = folds(fold_batches)
        monkeypatch.setattr(tg, "FLAT_PARTIALS", False)
        per, group_off, cache = folds(fold_batches)
        monkeypatch.setattr(tg, "FLAT_PARTIALS", True)
        assert group == 2 and group_off == (1 if fold_batches else 0)  # folded: each tensor's node alone
        assert cache._arena._flat is None
        for a, b in zip(per, flat):
            assert_bytes_equal(a, b, f"fold_batches={fold_batches}")


def test_steps_that_fold_their_batch_give_the_per_sample_bytes(stand_in) -> None:
    """``fold_batches``: a call whose keys are one node of the sink's tree gets an instance that folds its batch (one
    partial buffer per tensor, shared by the sequential-CFG-like pair below); a call whose keys are not (a sink over
    other keys) gets a per-sample instance; every fold has the bytes of the cache without folding."""
    w, inputs_a, forward = _toy(seed=0)
    _, inputs_b, _ = _toy(seed=1)
    keys_a, keys_b = [("a", 1), ("a", 0)], [("b", 0), ("b", 1)]

    def update(cache, every):
        sink = SampleGradSink(every)
        with collect_sample_grads(sink):
            with sample_keys(keys_a):
                ya = cache.run(inputs_a, "strict", [w], forward, ("one",))
            with sample_keys(keys_b):
                yb = cache.run(inputs_b, "strict", [w], forward, ("two",))
        ((ya * 3).sum() + (yb * 5).sum()).backward()
        sink.done(every)
        w.grad = None
        return sink.fold(w)

    plain, folding = stand_in(max_instances=4), stand_in(max_instances=4, fold_batches=True)
    for every in (keys_a + keys_b, [("a", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 0)]):  # the second: b not one node
        for rep in range(2):
            assert_bytes_equal(update(folding, every), update(plain, every), f"{every} repeat {rep}")
    folds = sorted((i.deposits.fold for i in folding._instances()), key=str)
    assert folds == [(0, 1), (1, 0), None], folds  # b, a folded (a's batch order is not key order); b per sample
    assert len(folding._arena.flat([w], 1).flats) == 2  # the per-sample instance reserved its two positions


def test_pick_group_takes_the_lowest_group_with_nothing_busy() -> None:
    from mmdit_strict.model.train_graphs import pick_group

    assert pick_group(set(), 0, True) == 0  # the first instance makes group 0
    assert pick_group({0}, 1, True) == 1  # group 0 waits for a backward: a new group
    assert pick_group({1}, 2, True) == 0 and pick_group({0, 1}, 2, True) == 2
    assert pick_group(set(), 3, False) == 3  # unshared: a group (pool) per instance


def test_instances_never_live_together_share_a_pool(stand_in) -> None:
    """Layouts trained one after another are captured into one pool; the sequential-CFG pattern's second
    forward, captured while the first waits for its backward, gets a second; ``share_pools=False`` gives each
    instance its own. The stand-in's pool holds the activations between forward and backward, so a wrong
    sharing would show as wrong gradients."""
    w, inputs, forward = _toy(seed=0)
    _, other, _ = _toy(seed=1)
    want = {}
    for name, inp, c in (("a", inputs, 3), ("b", other, 5)):
        (forward(inp) * c).sum().backward()
        want[name], w.grad = w.grad.clone(), None
    for share in (True, False):
        cache = stand_in(max_instances=8, share_pools=share)
        for layout in ("one", "two", "three"):  # forward, backward, next: never two live at once
            (cache.run(inputs, "strict", [w], forward, (layout,)) * 3).sum().backward()
            assert torch.equal(w.grad, want["a"]), layout
            w.grad = None
        assert cache.captures == 3 and cache.pools() == (1 if share else 3)
        a = cache.run(inputs, "strict", [w], forward, ("one",))  # replayed: its group is free
        b = cache.run(other, "strict", [w], forward, ("four",))  # captured while "one" waits for its backward
        assert cache.busy_groups() == ({0, 1} if share else {0, 3})
        ((a * 3).sum() + (b * 5).sum()).backward()
        assert torch.equal(w.grad, want["a"] + want["b"])
        w.grad = None
        assert cache.captures == 4 and cache.pools() == (2 if share else 4) and not cache.busy_groups()
        # two and three, both live: shared, they are in one group and three needs a second instance
        a, b = cache.run(inputs, "strict", [w], forward, ("two",)), cache.run(other, "strict", [w], forward, ("three",))
        ((a * 3).sum() + (b * 5).sum()).backward()
        assert cache.captures == (5 if share else 4) and cache.pools() == (2 if share else 4)
        assert torch.equal(w.grad, want["a"] + want["b"])
        w.grad = None


def test_an_evicted_groups_pool_is_not_captured_into_again(stand_in) -> None:
    w, inputs, forward = _toy()
    cache = stand_in(max_instances=1)
    cache.run(inputs, "strict", [w], forward, ("one",)).sum().backward()
    first = next(iter(cache._entries.values()))[0].forward.pool()
    cache.run(inputs, "strict", [w], forward, ("two",)).sum().backward()  # evicts "one", the last of group 0
    second = next(iter(cache._entries.values()))[0]
    assert second.group == 0 and second.forward.pool() is not first and cache.pools() == 1


def test_short_warmup_runs_the_first_and_last_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up forward under ``graphs.SHORT_WARMUP`` runs blocks 0 and n-1 only (off: None, every block); the
    arena reserves one FP32 buffer per trained tensor and position, shared across captures."""
    from mmdit_strict.model import graphs
    from mmdit_strict.model.strict import strict_forward
    from mmdit_strict.model.train_graphs import FLAT_ALIGN, PartialArena

    arch = dataclasses.replace(preset("tiny"), num_layers=4)
    model = _lora_model(arch)
    monkeypatch.setattr(graphs, "SHORT_WARMUP", False)
    assert graphs.warmup_blocks(4) is None and model._graph_warmup() is None
    monkeypatch.setattr(graphs, "SHORT_WARMUP", True)
    assert graphs.warmup_blocks(4) == (0, 3) and graphs.warmup_blocks(2) is None
    inputs = model.validate_inputs(**{k: v for k, v in make_inputs(2, (4, 4), [5, 3], txt_dim=arch.joint_attention_dim,
                                                                   seed=1).items() if k != "guidance"})
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        strict_forward(model, inputs, block_capture=seen, blocks=(0, 3))
    assert sorted(seen) == ["block0.img", "block0.txt", "block3.img", "block3.txt"]
    warm = model._graph_warmup()
    assert warm is not None
    with torch.no_grad():
        short, full = warm(inputs), strict_forward(model, inputs)
    assert short.shape == full.shape and not torch.equal(short, full)  # two blocks of four: other values
    params = [p for _, p in _trainable(model)]
    arena = PartialArena()
    flat = arena.flat(params, 2)
    assert flat is not None and len(arena) == 2 * len(params) and len(flat.flats) == 2
    assert all(arena.buffer(p, pos, 0).shape == p.shape and arena.buffer(p, pos, 0).dtype == torch.float32
               for p in params for pos in (0, 1))
    assert arena.buffer(params[0], 2, 0) is None and arena.buffer(params[0], 0, 1) is None
    # every buffer a view of its position's flat buffer, disjoint, each at a multiple of FLAT_ALIGN elements
    for pos, f in enumerate(flat.flats):
        starts = sorted(arena.buffer(p, pos, 0).data_ptr() - f.data_ptr() for p in params)
        assert all(s % (4 * FLAT_ALIGN) == 0 for s in starts)
        ends = sorted((arena.buffer(p, pos, 0).data_ptr() - f.data_ptr()) // 4 + p.numel() for p in params)
        assert all(e <= s // 4 for e, s in zip(ends, starts[1:])) and ends[-1] <= f.numel()
        assert torch.equal(f, torch.zeros_like(f))  # what no tensor writes stays zero
    assert arena.nbytes() == sum(f.numel() * 4 for f in flat.flats)
    before = arena.buffer(params[0], 0, 0).data_ptr()
    assert arena.flat(params, 1) is not None and arena.buffer(params[0], 0, 0).data_ptr() == before  # made once, shared


def test_instances_are_leased_until_backward_or_drop_then_reused_or_evicted(stand_in) -> None:
    w, inputs, forward = _toy()
    cache = stand_in(max_instances=2)
    a = cache.run(inputs, "strict", [w], forward, ("one",))
    b = cache.run(inputs, "strict", [w], forward, ("one",))  # the first is still waiting for its backward
    assert cache.captures == 2 and len(cache) == 2
    assert cache.run(inputs, "strict", [w], forward, ("one",)) is None and cache.uncaptured == 1  # no room
    a.sum().backward()
    c = cache.run(inputs, "strict", [w], forward, ("one",))  # a's instance is free again
    assert cache.captures == 2 and cache.replays == 3
    del b, c  # dropped without backward: their leases end with their nodes
    cache.run(inputs, "strict", [w], forward, ("two",)).sum().backward()  # evicts the least recently used idle one
    assert cache.captures == 3 and len(cache) == 2
    with pytest.raises(ValueError, match="sample_keys declares 3 samples"):
        with collect_sample_grads(SampleGradSink()), sample_keys([1, 2, 3]):
            cache.run(inputs, "strict", [w], forward, ("one",))


def test_graph_stats_say_how_graphs_served_and_the_report_shows_them() -> None:
    from mmdit_strict.model.graphs import graph_stats
    from mmdit_strict.trajectories.report import _graphs

    model = _lora_model(preset("tiny"))
    assert graph_stats(model) is None and _graphs(None) == "off"
    model.enable_cuda_graphs()
    model.train_graphs.captures, model.train_graphs.replays, model.train_graphs.uncaptured = 4, 36, 1
    stats = graph_stats(model)
    assert stats == {"forward": {"captures": 0, "replays": 0}, "training": {"captures": 4, "replays": 36, "uncaptured": 1}}
    assert _graphs(stats) == "forward 0 / 0, training 4 / 36 (1 uncaptured)"
    model.enable_cuda_graphs(training=False)
    assert graph_stats(model) == {"forward": {"captures": 0, "replays": 0}}


@pytest.mark.parametrize("interrupt", [None, "other layout", "end"])
def test_steps_that_carry_their_node_give_the_per_sample_bytes(stand_in, interrupt) -> None:
    """``carry``: of steps whose keys are consecutive nodes of the sink's tree, a left child leaves its node in the
    shared buffer and its sibling's step adds into it (the instance's flag set before its backward); the folds are
    the bytes of the cache without folding. ``interrupt``: a step of keys that are no node runs between a carried node
    and its sibling (the node is placed in the fold before that step's backward writes the buffer), or the update ends
    on a carried node (placed by the fold)."""
    w, _, forward = _toy(seed=0)
    steps = [_toy(seed=s)[1] for s in range(1, 5)]
    keys = [[("k", 2 * m), ("k", 2 * m + 1)] for m in range(4)]
    extra = [("x", 0), ("x", 1)]  # sorted after every "k" key: with ("z", 0), leaves 8-10; [x1, z0] is no node
    order = list(range(4)) if interrupt != "end" else list(range(3))  # "end": step 3, step 2's sibling, never runs

    def update(cache):
        every = [k for m in range(4) for k in keys[m]] + (extra if interrupt == "other layout" else [])
        sink = SampleGradSink(every + ([("z", 0)] if interrupt == "other layout" else []))
        with collect_sample_grads(sink):
            for n, m in enumerate(order):
                with sample_keys(keys[m]):
                    y = cache.run(steps[m], "strict", [w], forward, ("one",))
                (y * (3 + m)).sum().backward()
                sink.done(keys[m])
                if interrupt == "other layout" and n == 0:  # between step 0 (carried) and step 1, its sibling
                    with sample_keys([extra[1], ("z", 0)]):
                        z = cache.run(_toy(batch=2, seed=9)[1], "strict", [w], forward, ("two",))
                    (z * 7).sum().backward()
                    sink.done([extra[1], ("z", 0)])
        sink.done(every)
        w.grad = None
        return sink.fold(w), sink

    plain = stand_in(max_instances=4, fold_batches=True)
    carrying = stand_in(max_instances=4, fold_batches=True, carry=True)
    for rep in range(2):
        want, _ = update(plain)
        got, sink = update(carrying)
        assert_bytes_equal(got, want, f"{interrupt}, repeat {rep}")
        assert sink.carried == 2  # steps 0 and 2
    assert all(i.deposits.accumulate is not None for i in carrying._instances() if i.deposits.fold is not None)
    assert all(i.deposits.accumulate is None for i in plain._instances())
