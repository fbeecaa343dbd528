"""Key-sorted micro-batches (``train.sort_update_pairs``, the default) keep one prompt's samples together, so the
training forwards of an epoch see few batch layouts (prompt lengths in order) and each captured training step
(``model/train_graphs.py``, keyed by layout) serves many micro-batches; the shuffled cut mixes prompts."""

from __future__ import annotations

from mmdit_strict.training.loop import Trainer
from tests.training.conftest import SMALL, compose_train

# 2 prompts × 4 images × 3 steps = 24 pairs per epoch: 2 updates of 6 micro-batches of 2 pairs
LAYOUT = [*SMALL, "sample.num_image_per_prompt=4", "train.micro_batch=2", "train.gradient_accumulation_steps=6"]


def _prompt_tuples(tmp_path, sort: bool) -> tuple[list[tuple[int, ...]], int, list[tuple[int, int]]]:
    """The prompt ids of every micro-batch of epoch 0 in the order they are cut, the prompts per epoch and the
    pairs in that order."""
    cfg = compose_train([f"output_dir={tmp_path / str(sort)}", *LAYOUT, f"train.sort_update_pairs={str(sort).lower()}"])
    tr = Trainer(cfg, progress=False)
    samples = tr._rollout(0)
    # sample ids are prompt-major (group by group): sorting by key groups a prompt's samples
    by_id = sorted(range(len(samples.sample_ids)), key=lambda n: samples.sample_ids[n])
    assert [samples.prompt_ids[n] for n in by_id] == sorted(samples.prompt_ids)
    tuples, pairs = [], []
    for chunk in tr._update_chunks(tr._pairs(samples), 0, 0):
        assert len(chunk) == 12
        batches = tr._update_batches(samples, chunk)
        tuples += [tuple(samples.prompt_ids[n] for n, _ in mb) for mb in batches]
        pairs += [p for mb in batches for p in mb]
    return tuples, len(set(samples.prompt_ids)), pairs


def test_sorted_micro_batches_mix_prompts_only_at_the_boundary(tmp_path) -> None:
    assert compose_train([f"output_dir={tmp_path}", *SMALL]).train.sort_update_pairs is True  # the default
    tuples, prompts, pairs = _prompt_tuples(tmp_path, sort=True)
    assert prompts == 2 and len(tuples) == 12
    mixed = [t for t in tuples if len(set(t)) > 1]
    assert len(mixed) <= 2 * (prompts - 1), tuples  # per update at most one micro-batch straddles the two prompts
    shuffled, _, shuffled_pairs = _prompt_tuples(tmp_path, sort=False)
    assert pairs != shuffled_pairs and sorted(pairs) == sorted(shuffled_pairs)  # the same pairs, cut differently
    # the keyed shuffle of this seed mixes prompts in more micro-batches, so more distinct layouts
    assert len([t for t in shuffled if len(set(t)) > 1]) > len(mixed)
    assert len(set(shuffled)) > len(set(tuples))


class _Watching(Trainer):
    """Records how many captured forwards the model holds when the training phase starts."""

    def _train(self, epoch, samples, adv):
        self.held_at_train = len(self.model.graph_cache)
        return super()._train(epoch, samples, adv)


def test_the_rollouts_captured_forwards_are_released_before_the_updates(tmp_path) -> None:
    """The rollout's graphs (keyed by this epoch's prompt lengths) do not sit beside the training steps' graphs;
    the training graphs stay. (On the CPU nothing is captured: stand-in entries take the graphs' place.)"""
    from mmdit_strict.model.graphs import release_forward_graphs

    tr = _Watching(compose_train([f"output_dir={tmp_path}", *SMALL]), progress=False)
    tr.model.enable_cuda_graphs()
    kept = tr.model.train_graphs
    tr.model.graph_cache._graphs.update({("rollout", i): object() for i in range(3)})
    tr.train_epoch(0)
    assert tr.held_at_train == 0 and tr.model.train_graphs is kept
    tr.model.graph_cache._graphs[("eval",)] = object()
    assert release_forward_graphs(tr.model) == 1 and len(tr.model.graph_cache) == 0
    tr.model.enable_cuda_graphs(False)
    assert release_forward_graphs(tr.model) == 0


class _WatchingSteps(Trainer):
    """Records how many captured training steps (and partial-buffer bytes) the model holds when the rollout starts."""

    def _rollout(self, epoch):
        self.steps_at_rollout = len(self.model.train_graphs)
        self.arena_at_rollout = self.model.train_graphs.arena_bytes()
        return super()._rollout(epoch)


def test_the_training_steps_graphs_are_released_before_the_rollout_when_asked(tmp_path) -> None:
    """``train.release_training_graphs=true``: the captured training steps and their shared partial buffers are gone
    when the rollout starts; by default they stay for the next epoch's updates. (On the CPU nothing is captured:
    stand-in entries and a stand-in buffer take their place.)"""
    import torch

    from mmdit_strict.model.graphs import release_training_graphs

    held = {}
    for release in (False, True):
        cfg = compose_train([f"output_dir={tmp_path / str(release)}", *SMALL,
                             f"train.release_training_graphs={str(release).lower()}"])
        tr = _WatchingSteps(cfg, progress=False)
        tr.model.enable_cuda_graphs()
        tr.model.train_graphs._entries.update({("layout", i): [object()] for i in range(2)})
        tr.model.train_graphs._arena._bufs[0, 0, 0] = torch.zeros(16)
        tr.train_epoch(0)
        held[release] = (tr.steps_at_rollout, tr.arena_at_rollout)
    assert held == {False: (2, 64), True: (0, 0)}
    tr.model.enable_cuda_graphs(False)
    assert release_training_graphs(tr.model) == 0
