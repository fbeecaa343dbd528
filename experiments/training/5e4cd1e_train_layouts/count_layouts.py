"""Count the batch layouts of `train experiment=grpo_qwen_image`'s training forwards, shuffled vs key-sorted cut.

The layouts depend on the prompts' lengths, the epoch's samples and pairs and how each update is cut into
micro-batches, not on the model's widths, so the run uses the tiny model on the CPU at a 32² grid with every
other setting of the experiment. A forward pre-hook records (batch, prompt lengths) of each forward with
autograd; the captures are counted by replaying that sequence through a least-recently-used set of
`max_training_graphs` instances with the lease rule of `model/train_graphs.py` (both forwards of a sequential-CFG
micro-batch hold their instance until the micro-batch's backward).

    python experiments/training/5e4cd1e_train_layouts/count_layouts.py OUT.json
"""

from __future__ import annotations

import json
import sys
from collections import Counter, OrderedDict

import torch

from mmdit_strict.training.loop import Trainer
from mmdit_strict.training.rewards import compose_train

EPOCHS = 8
BASE = ["experiment=grpo_qwen_image", "model=tiny", "model.checkpoint=null", "sampler.height=32", "sampler.width=32",
        "lora.rank=4", "train.eval_freq=0", "wandb.mode=disabled", "progress=false", "train.export=false"]


def record(sort: bool, out_dir: str) -> list[tuple]:
    cfg = compose_train([*BASE, f"train.num_epochs={EPOCHS}", f"train.sort_update_pairs={str(sort).lower()}",
                         f"output_dir={out_dir}"])
    tr = Trainer(cfg, progress=False)
    seen: list[tuple] = []

    def hook(_module, args, kwargs) -> None:
        if torch.is_grad_enabled():
            hs, ehs, mask = args[0], args[1], args[2]
            lens = tuple(int(n) for n in mask.sum(1)) if mask is not None else (ehs.shape[1],) * ehs.shape[0]
            seen.append((hs.shape[0], lens))

    tr.model.register_forward_pre_hook(hook, with_kwargs=True)
    for epoch in range(EPOCHS):
        tr.train_epoch(epoch)
    return seen


def captures(seq: list[tuple], max_instances: int, per_micro_batch: int = 2) -> int:
    entries: OrderedDict[tuple, list[object]] = OrderedDict()
    made = 0
    for i in range(0, len(seq), per_micro_batch):
        busy: list[object] = []
        for key in seq[i:i + per_micro_batch]:
            inst = next((x for x in entries.get(key, []) if x not in busy), None)
            if inst is None:
                while sum(map(len, entries.values())) >= max_instances:
                    victim = next(k for k, pool in entries.items() if any(x not in busy for x in pool))
                    entries[victim].remove(next(x for x in entries[victim] if x not in busy))
                    if not entries[victim]:
                        del entries[victim]
                inst = object()
                entries.setdefault(key, []).append(inst)
                made += 1
            entries.move_to_end(key)
            busy.append(inst)
    return made


def main(out: str) -> None:
    report = {"epochs": EPOCHS, "overrides": BASE}
    for sort in (False, True):
        seq = record(sort, f"/tmp/count_layouts_{sort}")
        per_epoch = len(seq) // EPOCHS
        epochs = [seq[e * per_epoch:(e + 1) * per_epoch] for e in range(EPOCHS)]
        report[f"sort_update_pairs={str(sort).lower()}"] = {
            "forwards": len(seq), "forwards_per_epoch": per_epoch,
            "layouts_per_epoch": [len(set(e)) for e in epochs],
            "layouts_used_once_per_epoch": [sum(1 for c in Counter(e).values() if c == 1) for e in epochs],
            "distinct_layouts": len(set(seq)),
            "captures": {str(n): captures(seq, n) for n in (2, 4, 8)},
        }
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
