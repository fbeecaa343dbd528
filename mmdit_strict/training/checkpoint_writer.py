"""Training checkpoints written behind the training: a host snapshot taken at once, the files written by a thread.

At Qwen-Image size with Flow-GRPO's rank-64 LoRA a checkpoint is about 6.8 GB (the LoRA, its EMA and AdamW's two
moments, all FP32), and writing, hashing and syncing it takes seconds to tens of seconds of wall time that the GPU
would spend idle. :class:`CheckpointWriter` copies every tensor to the host before :meth:`~CheckpointWriter.save`
returns (into the previous write's copy, which it keeps), so the next updates may change the live tensors in place,
and hands the copy to one background thread that runs
:func:`~.checkpoint.save_checkpoint` (the same files, written atomically, ``latest`` moved last). One write is in
flight at a time: the next save, and the end of training, wait for it; an error of the write is raised there.

A run killed while a write is in flight loses that checkpoint only: ``latest`` still names the previous one, which
resumes to the same bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .checkpoint import save_checkpoint

logger = logging.getLogger(__name__)


def host_snapshot(obj: Any, reuse: Any = None) -> Any:
    """``obj`` with every tensor (in nested dicts, lists and tuples) replaced by a host copy that nothing else holds.

    ``reuse``: an earlier snapshot nobody reads any more; a tensor at the same place with the same shape, dtype and
    strides is written over instead of allocating (and page-faulting in) new host memory.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(reuse, torch.Tensor) and reuse.shape == obj.shape and reuse.dtype == obj.dtype \
                and reuse.stride() == obj.stride() and reuse.device.type == "cpu":
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: host_snapshot(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = list(reuse) if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(host_snapshot(v, o) for v, o in zip(obj, old))
    return obj


class CheckpointWriter:
    """Writes :func:`~.checkpoint.save_checkpoint` folders from host snapshots; in a background thread if ``background``.

    ``save`` returns once the snapshot is taken (``background``) or the folder is written (not ``background``).
    ``wait`` returns the folder of the last write, or raises the error that ended it.
    """

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self.last_wait_s = 0.0  # how long the last save or wait blocked its caller for the write in flight
        self._thread: threading.Thread | None = None
        self._snapshot: Any = None  # the host copy of the last background write (reused by the next)
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._label = ""

    @property
    def pending(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, root: str | Path, epoch: int, lora: dict[str, torch.Tensor], optimizer: dict[str, Any],
             state: dict[str, Any], ema: dict[str, torch.Tensor] | None = None) -> None:
        """Checkpoint ``epoch`` under ``root``. In the background: from a copy of ``lora``, ``optimizer``, ``state`` and
        ``ema`` taken now (tensors on the host, containers new), so the caller may change the originals as soon as this
        returns; else written from them before returning."""
        self.wait()
        self._label = f"checkpoint epoch_{epoch:06d} under {root}"
        if not self.background:  # written before returning: nothing can change under it, no copy needed
            self._write(Path(root), epoch, lora, optimizer, state, ema)
            self._raise()
            return
        # the last write has ended, so its copy is free: the next one goes into the same host memory
        snap = self._snapshot = host_snapshot({"lora": lora, "optimizer": optimizer, "state": state, "ema": ema},
                                              self._snapshot)
        args = (Path(root), epoch, snap["lora"], snap["optimizer"], snap["state"], snap["ema"])
        self._thread = threading.Thread(target=self._write, args=args, name="checkpoint-writer", daemon=False)
        self._thread.start()

    def _write(self, root: Path, epoch: int, lora: dict[str, torch.Tensor], optimizer: dict[str, Any],
               state: dict[str, Any], ema: dict[str, torch.Tensor] | None) -> None:
        t0 = time.perf_counter()
        try:
            self._result = save_checkpoint(root, epoch, lora, optimizer, state, ema)
        except BaseException as exc:  # handed to the caller by wait()
            self._error = exc
        else:
            logger.info("train: wrote %s in %.1f s", self._result, time.perf_counter() - t0)

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) ends; the folder it wrote, or its error raised here."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.last_wait_s = time.perf_counter() - t0
        self._raise()
        return self._result

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"writing the {self._label} failed: {error}") from error
