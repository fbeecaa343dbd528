"""Byte snapshot of the strict model, to show that a refactor moved no byte.

A snapshot hashes (sha256 of the raw bytes) everything the strict product path computes on fixed inputs:

* ``ops``: every operator output of a captured forward (the unfused operators, packed rows), at Qwen-Image
  widths with 2 blocks, a batch of 3 samples with other prompt lengths and prompt padding, a 32×32 grid
  (1024 image tokens), BF16 and FP32 on the GPU (FP32, tiny widths, in the Triton interpreter / CPU);
* ``forward``: the model output of a normal (fused) forward on the same inputs;
* ``grads``: a backward through the strict kernels with every base weight trainable (each parameter's
  gradient and the input's), and a LoRA backward with the per-sample grad sink (each adapter tensor's
  folded gradient), with gradient checkpointing on;
* ``model_60``: on the GPU, the 60-block Qwen-Image model's BF16 output at 1024² (4096 image tokens), B = 1
  and B = 2 with CFG-like prompt lengths, random weights from seed 0.

Two snapshots, one made with the code before a change and one after, are compared key by key:

    PYTHONPATH=<tree> python benchmarks/byte_snapshot.py snap --out BEFORE.json
    python benchmarks/byte_snapshot.py compare BEFORE.json AFTER.json --md REPORT.md   # exit 1 on any difference

The inputs come from CPU generators, so they do not depend on the device's generator.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _sha(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _inputs(arch: Any, grid: tuple[int, int], lens: list[int], pad_to: int, seed: int, dtype: torch.dtype, device: str) -> dict:
    from mmdit_strict.model.inputs import random_inputs

    inp = random_inputs(arch, grid, lens, pad_to=pad_to, seed=seed)
    out = {}
    for k, v in inp.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            out[k] = v.to(dtype) if v.is_floating_point() else v
        else:
            out[k] = v
    return out


def _model(arch: Any, dtype: torch.dtype, device: str):
    from mmdit_strict.model.init import build_model

    return build_model(arch, seed=0, runtime="strict", dtype=dtype, device=device)


def _lora(model: Any) -> None:
    from omegaconf import OmegaConf

    from mmdit_strict.trajectories.setup import attach_lora

    attach_lora(model, OmegaConf.create({"rank": 8, "alpha": 8.0, "seed": 0, "init": "random",
                                         "targets": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                                     "add_v_proj", "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                                                     "txt_mlp.net.0.proj", "txt_mlp.net.2"]}))


def _case(arch: Any, dtype: torch.dtype, device: str, grid: tuple[int, int], name: str) -> dict[str, str]:
    from mmdit_strict.kernels.grad_sink import collect_sample_grads, sample_keys
    from mmdit_strict.model.strict import capture_operators

    out: dict[str, str] = {}
    lens, pad = [37, 5, 61], 64
    model = _model(arch, dtype, device)
    inp = _inputs(arch, grid, lens, pad, seed=11, dtype=dtype, device=device)
    with torch.no_grad():
        out[f"{name}.forward"] = _sha(model(**inp).sample)
        with capture_operators() as cap:
            model(**inp)
        for k, v in sorted(cap.items()):
            out[f"{name}.ops.{k}"] = _sha(v)
    weight = torch.randn(inp["hidden_states"].shape, generator=torch.Generator().manual_seed(5)).to(device)

    model.requires_grad_(True)
    x = inp["hidden_states"].clone().requires_grad_(True)
    loss = (model(**{**inp, "hidden_states": x}).sample.float() * weight).sum()
    loss.backward()
    out[f"{name}.grads.input"] = _sha(x.grad)
    for n, p in sorted(model.named_parameters()):
        if p.grad is not None:
            out[f"{name}.grads.{n}"] = _sha(p.grad)

    lora_model = _model(arch, dtype, device)
    _lora(lora_model)
    lora_model.requires_grad_(False)
    params = sorted((n, p) for n, p in lora_model.named_parameters() if "lora_" in n)
    for _, p in params:
        p.requires_grad_(True)
    lora_model.enable_gradient_checkpointing(True)
    with collect_sample_grads() as sink, sample_keys([(i, 0) for i in range(len(lens))]):
        loss = (lora_model(**inp).sample.float() * weight).sum()
        loss.backward()
    for n, p in params:
        folded = sink.fold(p)
        if folded is not None:
            out[f"{name}.lora_fold.{n}"] = _sha(folded)
        if p.grad is not None:
            out[f"{name}.lora_autograd.{n}"] = _sha(p.grad)
    return out


def _model_60(device: str) -> dict[str, str]:
    from mmdit_strict.config.arch import preset

    arch = preset("qwen-image")
    model = _model(arch, torch.bfloat16, device)
    out = {}
    with torch.no_grad():
        for name, lens in (("b1", [77]), ("b2", [77, 5])):
            inp = _inputs(arch, (64, 64), lens, max(lens), seed=3, dtype=torch.bfloat16, device=device)
            out[f"model_60.{name}"] = _sha(model(**inp).sample)
    del model
    torch.cuda.empty_cache()
    return out


def snapshot(include_60: bool = True) -> dict[str, Any]:
    from mmdit_strict.config.arch import preset

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    hashes: dict[str, str] = {}
    t0 = time.perf_counter()
    if gpu:
        arch = dataclasses.replace(preset("qwen-image"), num_layers=2)
        for dt in (torch.bfloat16, torch.float32):
            hashes.update(_case(arch, dt, device, (32, 32), f"qwen2_{str(dt).removeprefix('torch.')}"))
        if include_60:
            hashes.update(_model_60(device))
    else:
        hashes.update(_case(preset("tiny"), torch.float32, device, (4, 6), "tiny_float32"))
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if gpu else "cpu",
           "seconds": round(time.perf_counter() - t0, 1)}
    return {"environment": env, "hashes": hashes}


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str], int]:
    """(keys whose bytes differ, keys present on one side only, keys compared)."""
    ha, hb = a["hashes"], b["hashes"]
    differ = sorted(k for k in set(ha) & set(hb) if ha[k] != hb[k])
    one_side = sorted(set(ha) ^ set(hb))
    return differ, one_side, len(set(ha) & set(hb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("snap", help="hash the product path with the code on sys.path")
    p.add_argument("--out", required=True)
    p.add_argument("--no-60", action="store_true", help="skip the 60-block model")
    p = sub.add_parser("compare", help="compare two snapshots; exit 1 on any difference")
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--md", default=None, help="write a markdown report here")
    args = parser.parse_args(argv)
    if args.cmd == "snap":
        snap = snapshot(include_60=not args.no_60)
        Path(args.out).write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
        print(f"{len(snap['hashes'])} hashes → {args.out} ({snap['environment']})")
        return 0
    a, b = (json.loads(Path(f).read_text()) for f in (args.before, args.after))
    differ, one_side, n = compare(a, b)
    lines = [f"# Byte snapshot: {args.before} vs {args.after}", "",
             f"{n} tensors compared: {n - len(differ)} equal in every byte, {len(differ)} differ; "
             f"{len(one_side)} present on one side only.", ""]
    lines += [f"- differs: `{k}`" for k in differ] + [f"- one side only: `{k}`" for k in one_side]
    text = "\n".join(lines) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 1 if differ or one_side else 0


if __name__ == "__main__":
    sys.exit(main())
