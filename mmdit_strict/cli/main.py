"""``mmdit-strict``: the command-line interface.

Every command that runs something takes hydra-style overrides after its name
(``mmdit-strict run runtime=off sampler.num_steps=4``); ``--help`` on each command says more.

Exit status (also in ``--help``): 0 byte-identical or done, 1 drift, 2 bad input or any error. An
error prints one line; ``-v`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

EXIT_OK, EXIT_DRIFT, EXIT_ERROR = 0, 1, 2
_EXIT_HELP = """exit status:
  0  byte-identical (or the command finished)
  1  drift: the compared trajectories differ in some byte
  2  bad input or any error (bad config, unusable output_dir, corrupt artifact, crash,
     out of memory); one line on stderr, the traceback with -v
"""

_ABLATE_HELP = """entries (configs/ablation/standard.yaml; docs/ablation.md):
  probe        a deliberate mismatch on one side: perturb=<name> (see --list) and/or overrides;
               passes when the localizer's first drifting operator is its expected key
  control      a change strict mode must not see (batch size, padding, CFG layout, autograd, ...);
               passes when every v_t, x_t, logp_t is byte-identical
  combination  rollout/recompute runtimes (strict, off); expect identical or drift

  ablation.only=[a,b] runs some entries; resume=true (default) reuses every job's verified stages.

exit status:
  0  every entry passed
  1  an entry did not pass: a probe not caught or caught at another operator, a control that
     drifted, a combination other than expected (each is named on stderr and in the report)
  2  bad input or any error (bad config or entry, an entry's job crashed, unusable output_dir)
"""

_OVERRIDES_HELP = (
    "hydra-style overrides: group=option (model=tiny, runtime=off, experiment=recompute_off) and "
    "key=value (sampler.num_steps=4, recompute.micro_batch=2, model.checkpoint=null); +key=value adds a key that "
    "does not exist yet to a free-form section (+extra.note=v, +train.reward_fn.NAME=w), ++key=value adds or "
    "sets, ~key deletes, ~group drops a group; flags may come anywhere"
)


def _schema_command(args: argparse.Namespace) -> str:
    """The command whose schema ``args`` composes (``config --for`` names one; else the command itself)."""
    return getattr(args, "for_command", None) or args.command


def _compose(args: argparse.Namespace, overrides: Sequence[str] | None = None):
    from ..config.compose import compose

    overrides = args.overrides if overrides is None else overrides
    command = _schema_command(args)
    if command == "train":
        from ..training.rewards import compose_train

        cfg = compose_train(overrides, config_dir=args.config_dir)
    elif command == "ablate":
        from ..ablation.plan import compose_ablate

        cfg = compose_ablate(overrides, config_dir=args.config_dir)
    else:
        cfg = compose(overrides, config_dir=args.config_dir, command=command)
    if command in DISTRIBUTED_COMMANDS and args.command != "config":
        _agree_across_ranks(cfg)
    return cfg


# ---- many processes (torchrun; docs/distributed.md) -------------------------------------------------

#: Commands that run under torchrun: each rank computes its share of the samples.
DISTRIBUTED_COMMANDS = ("run", "rollout", "sample", "recompute", "train")


def _agree_across_ranks(cfg) -> None:
    """torchrun: refuse what cannot run on many ranks, then check every rank composed the same config."""
    from omegaconf import OmegaConf

    from .. import distributed

    if distributed.current() is None:
        return
    if OmegaConf.select(cfg, "prompts.text"):
        raise ValueError("prompts.text is not encoded under torchrun: encode first (`mmdit-strict encode`) and pass prompts.embeddings")
    if OmegaConf.select(cfg, "prompts.edit.source") == "folder":
        raise ValueError("prompts.edit.source=folder is not encoded under torchrun: run it once in one process and pass "
                         "its OUTPUT_DIR/conditioning.safetensors as prompts.edit.source=latents prompts.edit.latents=FILE")
    if OmegaConf.select(cfg, "compare.peer_loop"):
        raise ValueError("compare.peer_loop times one process against diffusers: run it without torchrun")
    distributed.agree_config(OmegaConf.to_container(cfg, resolve=True))


def _distributed_settings(args: argparse.Namespace) -> tuple[float, str, str]:
    """(timeout, backend, device) for the process group, from the composed config; the defaults when it
    does not compose (the command then fails on this rank and the others learn it at the first exchange)."""
    from ..config.schema import DistributedConfig

    try:
        from ..config.compose import compose

        cfg = compose(args.overrides, config_dir=args.config_dir, command=args.command)
        return float(cfg.distributed.timeout_s), str(cfg.distributed.backend), str(cfg.model.device)
    except Exception:
        d = DistributedConfig()
        return d.timeout_s, d.backend, "cpu"


def _main_distributed(args: argparse.Namespace) -> int:
    """One rank of a torchrun job: join the group, run the command, agree on one exit code, leave.

    Rank 0 prints and writes; the other ranks' standard output is discarded (their errors still go to
    standard error, prefixed with the rank).
    """
    import contextlib
    import os

    from .. import distributed
    from ..kernels.execution import Layout, execution

    if args.command not in DISTRIBUTED_COMMANDS or getattr(args, "multirun", False):
        what = "-m sweeps" if getattr(args, "multirun", False) else args.command
        raise ValueError(f"{what} does not run under torchrun (commands that do: {', '.join(DISTRIBUTED_COMMANDS)})")
    timeout, backend, device = _distributed_settings(args)
    with distributed.session(timeout, backend, device) as sess, contextlib.ExitStack() as stack:
        if not sess.root:
            stack.enter_context(contextlib.redirect_stdout(open(os.devnull, "w")))
        with execution(layout=Layout(sess.rank, sess.world_size)):  # the execution context knows this rank
            rc = _run_command(args)
        return distributed.finish(rc)


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)
    p.add_argument("--config-dir", default=None, help="folder holding config.yaml and the groups (default: ./configs)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("-m", "--multirun", action="store_true",
                   help="sweep: key=a,b values run the cartesian product, job i in OUTPUT_DIR/i (hydra's -m)")


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from ..config.arch import preset
    from ..fingerprint import fingerprint

    print(fingerprint(preset(args.preset)))
    return EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    from ..config.compose import to_yaml

    print(to_yaml(_compose(args)), end="")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from ..trajectories.pipeline import run_all
    from .wandb_log import log_run, require_wandb

    from ..pipelines.chain import finish_images, pipeline_folder, prepare_edit, prepare_prompts

    cfg = _compose(args)
    require_wandb(cfg.wandb.mode)
    cfg, timings = prepare_prompts(cfg)  # prompts.text → embeddings with the pipeline folder's text encoder
    cfg = prepare_edit(cfg)  # prompts.edit.source=folder → input pictures VAE-encoded to conditioning latents
    result = run_all(cfg, progress=not args.quiet and cfg.progress)
    from .. import distributed

    if not distributed.is_root():  # torchrun: rank 0 alone writes images and logs to wandb
        return EXIT_OK if result.byte_identical else EXIT_DRIFT
    if cfg.rollout.save_tensors and (timings or pipeline_folder(cfg.model.checkpoint)):
        images = finish_images(cfg, timings)  # final latents → PNGs (VAE) + report section
        print(f"images: {images['contact_sheet']} ({images['mode']})")
    print(result.summary)
    print(f"report: {Path(cfg.output_dir) / 'report' / 'report.md'}", flush=True)
    log_run(cfg, result)  # after the result line: a wandb failure here cannot hide it
    return EXIT_OK if result.byte_identical else EXIT_DRIFT


def cmd_rollout(args: argparse.Namespace) -> int:
    from ..config.compose import save_resolved
    from ..trajectories import run_rollout

    cfg = _compose(args)
    with _claim(cfg) as out:
        if _is_root():
            save_resolved(cfg, out)
        traj = run_rollout(cfg, out / "rollout", progress=not args.quiet and cfg.progress)
    print(f"rollout: {traj.num_steps} steps × {len(traj.sample_ids)} samples [{traj.manifest['runtime']}] → {out / 'rollout'}")
    return EXIT_OK


def cmd_sample(args: argparse.Namespace) -> int:
    """``sample``: a rollout of the tiny default, printing the per-step hashes."""
    from ..config.compose import save_resolved
    from ..trajectories import run_rollout

    cfg = _compose(args)
    with _claim(cfg) as out:
        if _is_root():
            save_resolved(cfg, out)
        traj = run_rollout(cfg, out / "rollout", progress=not args.quiet and cfg.progress)
    for step in traj.manifest["steps"]:
        print(f"step {step['step']:3d} sigma {step['sigma']:.4f}  x[0] {step['x'][0][:16]}  logp[0] {step['logp_values'][0]:+.6f}")
    print(f"latents and hashes → {out / 'rollout'}")
    return EXIT_OK


def cmd_recompute(args: argparse.Namespace) -> int:
    from .. import distributed
    from ..trajectories import read, run_recompute

    cfg = _compose(args)
    with _claim(cfg) as out:
        rollout = distributed.from_root("read the rollout", lambda: read(args.rollout or out / "rollout"))
        traj = run_recompute(cfg, rollout, out / "recompute", progress=not args.quiet and cfg.progress)
    print(f"recompute: {traj.num_steps} steps × {len(traj.sample_ids)} samples [{traj.manifest['runtime']}] → {out / 'recompute'}")
    return EXIT_OK


def _claim(cfg):
    """Claim ``cfg.output_dir`` (rank 0 alone under torchrun; the other ranks write nothing there)."""
    from .. import distributed
    from ..trajectories.outdir import claim_output_dir

    return distributed.root_context("claim output_dir", lambda: claim_output_dir(cfg.output_dir), Path(cfg.output_dir))


def _is_root() -> bool:
    from .. import distributed

    return distributed.is_root()


def cmd_train(args: argparse.Namespace) -> int:
    """Flow-GRPO LoRA training; exit 1 when ``train.recompute_old_logp`` finds the training logp off the rollout's bytes."""
    from ..training import run_training
    from ..training.loop import OldLogpMismatch
    from ..training.metrics import cost_line
    from .wandb_log import require_wandb

    cfg = _compose(args)
    require_wandb(cfg.wandb.mode)
    try:
        result = run_training(cfg, progress=not args.quiet and cfg.progress)
    except OldLogpMismatch as exc:
        print(f"mmdit-strict train: {exc}", file=sys.stderr)
        return EXIT_DRIFT
    last = result.metrics[-1] if result.metrics else {}
    if last:
        n = int(last["first_update_pairs"])
        print(f"train: {result.epochs} epochs; last epoch reward {last['reward_mean']:+.4f} (first {result.metrics[0]['reward_mean']:+.4f}); "
              f"first-update logp byte-equal to the rollout's: {n - int(last['first_update_logp_bytes_differ'])}/{n} pairs "
              f"(max |ratio-1| {last['first_update_ratio_max_abs_dev']:.3g})")
        print(f"last epoch: {cost_line(last)}")
    print(f"metrics: {result.out_dir / 'metrics.jsonl'}; checkpoints: {result.out_dir / 'checkpoints'}")
    for kind, folder in result.export.items():
        print(f"LoRA ({kind}): {folder}")
    if result.wandb_error:  # after the result lines, which it must not hide
        print(f"mmdit-strict train: error: wandb logging failed after the training: {result.wandb_error}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def cmd_ablate(args: argparse.Namespace) -> int:
    """The ablation: every probe, control and runtime combination of the config as one run job, one report."""
    from ..overlay import get_perturbation, known_perturbations

    if args.list:
        for name in known_perturbations():
            p = get_perturbation(name)
            print(f"{p.name:18s} {p.factor:22s} caught at {p.caught_at:36s} {p.description}")
        return EXIT_OK
    from tqdm.auto import tqdm

    from ..ablation.run import run_ablation

    cfg = _compose(args)
    progress = not args.quiet and cfg.progress

    def line(row: dict) -> None:
        mark = "pass" if row["passed"] else row["status"].upper()
        tqdm.write(f"[ablate] {row['name']:24s} {row['kind']:11s} {mark:6s} {row['seconds']:6.1f} s  {row['reason']}")

    result = run_ablation(cfg, progress=progress, on_row=line)
    print(result.report["summary"])
    for row in result.failed + result.errors:
        print(f"  {row['status']}: {row['name']}: {row['reason']}", file=sys.stderr)
    print(f"report: {result.report_path}", flush=True)
    if result.errors:
        return EXIT_ERROR
    return EXIT_OK if result.passed else EXIT_DRIFT


def cmd_encode(args: argparse.Namespace) -> int:
    """Prompts → embeddings + masks with a pipeline folder's Qwen2.5-VL text encoder (a ``prompts.embeddings`` file)."""
    from ..dtypes import from_config
    from ..pipelines.encode import encode_prompts, load_text_components, write_prompt_file

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE (one prompt per line)")
    dtype = from_config(args.dtype)
    if args.images:
        return _encode_edit(args, prompts, dtype)
    tokenizer, encoder = load_text_components(args.pipeline, torch_dtype=dtype, device=args.device)
    encoded = encode_prompts(tokenizer, encoder, prompts, args.negative_prompt, batch_size=args.batch_size,
                             device=args.device, max_sequence_length=args.max_sequence_length)
    path = write_prompt_file(args.out, encoded, pipeline_folder=args.pipeline, batch_size=args.batch_size,
                             max_sequence_length=args.max_sequence_length)
    print(f"encode: {len(prompts)} prompts → {path} (prompt_embeds {tuple(encoded.prompt_embeds.shape)}, "
          f"negative {tuple(encoded.negative_embeds.shape)}); use it with prompts.embeddings={path}")
    return EXIT_OK


def _encode_edit(args: argparse.Namespace, prompts: list[str], dtype: Any) -> int:
    """``encode --images DIR``: each prompt with its input image(s) (``pipelines.edit_images``: one file per
    prompt, or one subfolder per prompt), with the one-image contract or, for a Plus folder, the Plus one."""
    from ..pipelines.edit_images import PLUS_PIPELINE, is_plus_folder, load_image_sets
    from ..pipelines.encode_edit import CONDITION_AREA, encode_edit_prompts, load_edit_components, write_edit_prompt_file
    from ..pipelines.encode_edit_plus import PLUS_CONDITION_AREA, PLUS_PROMPT_TEMPLATE, encode_plus_prompts

    sets = load_image_sets(args.images)
    if len(sets) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(sets)} image sets in {args.images}: give one image (or one "
                         "subfolder of images) per prompt, matched in order of name")
    plus = is_plus_folder(args.pipeline)
    if not plus and any(len(ims) > 1 for _, ims in sets):
        raise ValueError(f"several input images per prompt need a Qwen-Image-Edit-Plus pipeline folder (model_index.json "
                         f"_class_name {PLUS_PIPELINE}); {args.pipeline} takes one image per prompt")
    area = (PLUS_CONDITION_AREA if plus else CONDITION_AREA) if args.condition_area is None else (args.condition_area or None)
    processor, encoder = load_edit_components(args.pipeline, torch_dtype=dtype, device=args.device)
    kw = dict(batch_size=args.batch_size, condition_area=area, negative_with_images=not args.negative_text_only,
              device=args.device)
    if plus:
        images: list[Any] = [ims for _, ims in sets]
        names: list[Any] = [n for n, _ in sets]
        encoded = encode_plus_prompts(processor, encoder, prompts, images, args.negative_prompt, **kw)
    else:
        images, names = [ims[0] for _, ims in sets], [n[0] for n, _ in sets]
        encoded = encode_edit_prompts(processor, encoder, prompts, images, args.negative_prompt, **kw)
    extra = {"template": PLUS_PROMPT_TEMPLATE} if plus else {}
    path = write_edit_prompt_file(args.out, encoded, pipeline_folder=args.pipeline, batch_size=args.batch_size,
                                  image_names=names, images=images, condition_area=area, **extra)
    how = "text-only, shared" if encoded.negative_mask is None else "one per prompt, with its images"
    print(f"encode: {len(prompts)} {'Plus ' if plus else ''}edit prompts with their images → {path} (prompt_embeds "
          f"{tuple(encoded.prompt_embeds.shape)}, negative {tuple(encoded.negative_embeds.shape)}: {how}); "
          f"use it with prompts.embeddings={path}")
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from ..trajectories import compare, read, summary_line

    a, b = read(args.a), read(args.b)
    comp = compare(a, b)
    if args.json:
        print(json.dumps(comp.to_dict(), indent=2, default=str))
    print(summary_line(comp))
    return EXIT_OK if comp.byte_identical else EXIT_DRIFT


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild a run's report from its artifacts: the configuration comes from the manifests (not config.yaml)."""
    from omegaconf import OmegaConf

    from ..trajectories import read
    from ..trajectories.outdir import claim_output_dir
    from ..trajectories.pipeline import compare_stage

    with claim_output_dir(args.run_dir, existing_run=True) as run_dir:
        rollout, recompute = read(run_dir / "rollout"), read(run_dir / "recompute")
        cfg = OmegaConf.create(recompute.manifest["config"])
        result = compare_stage(cfg, rollout, recompute, run_dir)
        from ..pipelines.chain import restore_images_section

        restore_images_section(run_dir)  # decoded images and part timings of a full-chain run
    print(result.summary)
    print((run_dir / "report" / "report.md").read_text() if args.print else f"report: {run_dir / 'report' / 'report.md'}")
    return EXIT_OK if result.byte_identical else EXIT_DRIFT


def _require_gpu(what: str) -> None:
    """Exit 2 (a ValueError) before any work when ``what`` needs a CUDA GPU and there is none: 1 means drift."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{what} needs a CUDA GPU and this machine has none "
                         "(on the CPU: `mmdit-strict bench cpu_strict`, and the test suite qualifies the CPU backend)")


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    if args.which not in ("cpu_strict", "peers", "load", "train", "host_profile"):  # these run a tiny case on the CPU
        _require_gpu(f"bench {args.which}")
    argv = ["--out", args.out]
    if args.which == "peers":
        argv += (["--peers", args.peers] if args.peers else []) + (["--families", args.families] if args.families else []) \
            + (["--quick"] if args.quick else []) + (["--profile", args.profile] if args.profile else [])
    elif args.quick or args.peers is not None or args.families is not None or args.profile is not None:
        raise ValueError(f"--quick, --profile, --peers and --families belong to `bench peers`, not `bench {args.which}`")
    if args.which == "load":
        argv += (["--checkpoint", args.checkpoint] if args.checkpoint else []) + (["--device", args.device] if args.device else []) \
            + (["--repeats", str(args.repeats)] if args.repeats is not None else [])
    elif args.which in ("train", "host_profile"):
        if args.checkpoint is not None or args.repeats is not None:
            raise ValueError(f"--checkpoint and --repeats belong to `bench load`, not `bench {args.which}`")
        argv += ["--device", args.device] if args.device else []
    elif args.checkpoint is not None or args.device is not None or args.repeats is not None:
        raise ValueError(f"--checkpoint, --device and --repeats belong to `bench load`, not `bench {args.which}`")
    module = importlib.import_module(f"mmdit_strict.bench.{args.which}")
    return int(module.main(argv) or 0)


def cmd_operators(args: argparse.Namespace) -> int:
    """The operator inventory: every registered implementation, its kernel identity and reduction order."""
    from ..kernels.registry import DTYPE_NAMES, OPERATORS, implementations

    impls = implementations()
    rows = []
    for op in OPERATORS:
        for i in sorted((i for i in impls if i.op == op), key=lambda i: (not i.strict, i.device, i.backend)):
            dts = ",".join(sorted(DTYPE_NAMES.get(d, str(d)) for d in i.dtypes))
            rows.append((op, i.backend, i.device, dts, "yes" if i.strict else "no", i.kernel_name, i.reduction_order))
        if not any(r[0] == op for r in rows):
            rows.append((op, "—", "—", "—", "—", "no implementation yet", ""))
    if args.markdown:
        print("| operator | backend | device | dtypes | strict | kernel | reduction order |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in rows:
            print(f"{r[0]:24s} {r[1]:12s} {r[2]:5s} {r[3]:10s} strict={r[4]:3s} {r[5]}")
    return EXIT_OK


def cmd_qualify(args: argparse.Namespace) -> int:
    """GPU qualification of the strict kernels: accuracy vs FP64, raw-byte invariance, speed vs cuBLAS."""
    _require_gpu("qualify")
    rc = 0
    section = getattr(args, "section", "all")
    if section in ("gemm", "all"):
        from ..bench import gemm

        rc |= int(gemm.main(["--out", args.out]) or 0)
    if section in ("attention", "all"):
        from ..bench import attention

        rc |= int(attention.main(["--out", args.out, "--sections", "accuracy,invariance,speed"]) or 0)
    if section in ("norms", "all"):
        from ..bench import norms

        rc |= int(norms.main(["--out", args.out]) or 0)
    if section in ("model", "all"):
        from ..bench import model_qualify

        rc |= int(model_qualify.main(["--out", args.out, "--block-error-layers", "2"]) or 0)
    if section == "peers":  # not part of "all": it sets CUBLAS_WORKSPACE_CONFIG, which must precede CUDA's start
        from ..bench import peers

        rc |= int(peers.main(["--out", args.out]) or 0)
    return rc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmdit-strict",
        description="Byte-identical rollout and training recomputation for Qwen-Image Flow-GRPO, "
        "and the tools that say where two runs first drift.",
        epilog=_EXIT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details; print the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="command")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str, overrides: bool = True,
            epilog: str = _EXIT_HELP) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="log progress details; print the traceback of an error")
        if overrides:
            _add_overrides(p)
        p.set_defaults(func=fn)
        return p

    add("run", cmd_run, "main job: rollout → recompute → compare → report; exit 0 when byte-identical, 1 on drift, 2 on error")
    add("rollout", cmd_rollout, "sample trajectories (batched CFG + Flow-GRPO SDE) into OUTPUT_DIR/rollout")
    p = add("recompute", cmd_recompute, "training-side recomputation of a rollout into OUTPUT_DIR/recompute")
    p.add_argument("--rollout", default=None, help="rollout artifact folder (default: OUTPUT_DIR/rollout)")
    add("train", cmd_train, "Flow-GRPO LoRA training (experiment=grpo_tiny on the CPU); resume=true continues a killed run")
    p = add("ablate", cmd_ablate, "the ablation (experiment=ablation_tiny on the CPU, ablation_qwen_image on a GPU): "
            "every probe, control and runtime combination as one run job in OUTPUT_DIR/<entry>, one report in "
            "OUTPUT_DIR/ablation/; exit 0 when every entry passes, 1 when one does not (named), 2 on error",
            epilog=_ABLATE_HELP)
    p.add_argument("--list", action="store_true", help="list the registered perturbations (name, factor, the operator "
                   "where the localizer must catch it, what it changes) and exit")
    add("sample", cmd_sample, "sample the configured model and print per-step hashes (a rollout)")
    p = add("compare", cmd_compare, "compare two trajectory artifacts; exit 0 when byte-identical, 1 on drift", overrides=False)
    p.add_argument("a", help="first artifact folder (e.g. runs/default/rollout)")
    p.add_argument("b", help="second artifact folder")
    p.add_argument("--json", action="store_true", help="print the full comparison as JSON")
    p = add("report", cmd_report, "re-run compare + localize on a run folder and write its report", overrides=False)
    p.add_argument("run_dir", help="a folder made by `mmdit-strict run`")
    p.add_argument("--print", action="store_true", help="print the markdown report")
    p = add("config", cmd_config, "print the composed, resolved config of a command (--for; default run)")
    p.add_argument("--for", dest="for_command", default="run", choices=["run", "rollout", "sample", "recompute", "train", "ablate"],
                   help="the command whose keys to compose: run, rollout, sample and recompute share one schema, "
                   "train and ablate have their own (default: run)")
    p = add("encode", cmd_encode, "encode prompts with a Qwen-Image pipeline folder's text encoder into a "
            "safetensors file for prompts.embeddings (Qwen-Image's template, first 34 tokens dropped)", overrides=False)
    p.add_argument("pipeline", help="pipeline folder holding tokenizer/ and text_encoder/")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    p.add_argument("--prompts-file", default=None, help="text file, one prompt per line")
    p.add_argument("--negative-prompt", default=" ", help="negative prompt for CFG (default: ' ')")
    p.add_argument("--out", default="prompts.safetensors", help="output file (default: prompts.safetensors)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts per encoder batch (1: each prompt encoded alone, independent of the others)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="text encoder dtype")
    p.add_argument("--max-sequence-length", type=int, default=1024)
    p.add_argument("--images", default=None,
                   help="Qwen-Image-Edit: a folder of input images, one per prompt in order of file name, or one subfolder "
                   "per prompt (in order of name) holding that prompt's images (several need a Qwen-Image-Edit-Plus "
                   "folder); each prompt is encoded with its images (the pipeline folder needs processor/)")
    p.add_argument("--condition-area", type=int, default=None,
                   help="with --images: resize each image to about this many pixels first, sides multiples of 32 "
                   "(default: 1048576 as QwenImageEditPipeline, 147456 for a Plus folder as QwenImageEditPlusPipeline; "
                   "0: keep the size)")
    p.add_argument("--negative-text-only", action="store_true",
                   help="with --images: encode the negative prompt once, text-only, shared by all prompts (default: "
                   "with each prompt's images, one negative per prompt, as the diffusers edit pipelines do)")
    p = add("fingerprint", cmd_fingerprint, "print the sha256 fingerprint of the model/arithmetic contract", overrides=False)
    p.add_argument("--preset", default="qwen-image", help="architecture preset (qwen-image | tiny)")
    p = add("operators", cmd_operators, "list the operator inventory: implementations per device/dtype, strict or not", overrides=False)
    p.add_argument("--markdown", action="store_true", help="print a markdown table (with reduction orders)")
    p = add("qualify", cmd_qualify, "GPU qualification report of the strict kernels (JSON + markdown)", overrides=False)
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--section", default="all", choices=["gemm", "attention", "norms", "model", "peers", "all"],
                   help="which kernels to qualify (default: all of gemm, attention, norms, model); peers: the survey of "
                   "other batch-invariant kernels through the same checks (bench peers; run on its own, in a fresh process)")
    p = add("bench", cmd_bench, "run a benchmark and write its JSON + markdown report", overrides=False)
    p.add_argument("which", choices=["cpu_strict", "gemm", "ksplit", "lora_tiles", "model", "step_profile", "host_profile", "attention", "norms",
                                      "peers", "load", "train"],
                   help="cpu_strict: CPU strict vs production forward; gemm: Triton GEMM engine (GPU); "
                   "ksplit: the K-split (row-parallel TP) arithmetic of attention output and MLP down vs the unsplit "
                   "strict GEMM and cuBLAS: accuracy, bytes, invariance, speed, communication (GPU); "
                   "lora_tiles: the rank-r LoRA products under candidate tiles, time and bytes, and what the LoRA term costs "
                   "the big products' forward and dX (GPU); "
                   "model: whole transformer vs diffusers eager on identical weights (GPU); "
                   "step_profile: a strict LoRA training step's kernel time by kernel and launch grid (GPU); "
                   "host_profile: the uncaptured strict forward's and LoRA step's host time by stack layer and function "
                   "(GPU; CPU: the tiny preset); "
                   "attention: strict joint attention vs SDPA/cuDNN (GPU); "
                   "norms: strict row operators (norms, modulation, gating, QK-norm, RoPE) vs FP64 and eager PyTorch (GPU); "
                   "peers: other batch-invariant kernels (PyTorch deterministic, SDPA backends, Liger-Kernel, Megatron-Core) "
                   "through our invariance / accuracy / speed checks, per operator family (GPU: full record set; CPU: tiny); "
                   "load: MMDiT.from_pretrained vs diffusers' from_pretrained(...).to(device) on the same files, time and "
                   "host memory (GPU or CPU); "
                   "train: one Flow-GRPO update (group rollout with CFG, LoRA training over the SDE window, AdamW) with ours "
                   "and with diffusers + PEFT on the same weights, per phase (GPU: 60 blocks at 1024²; CPU: the tiny model; "
                   "sizes: python -m mmdit_strict.bench.train --help)")
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--quick", action="store_true", help="peers only: the quick record set (a GPU smoke run)")
    p.add_argument("--profile", default=None, choices=["full", "quick", "tiny"],
                   help="peers only: the record set (default: full on a GPU, tiny on the CPU)")
    p.add_argument("--peers", default=None, help="peers only: comma list of torch-deterministic, sdpa, liger-kernel, "
                   "megatron-core (ours always runs; default: all)")
    p.add_argument("--families", default=None, help="peers only: comma list of projection, norms, qk_norm_rope, "
                   "attention (default: all)")
    p.add_argument("--checkpoint", default=None, help="load only: a diffusers transformer folder (default: write the "
                   "60-block Qwen-Image with random BF16 weights in 9 shards to a cache folder first)")
    p.add_argument("--device", default=None, help="load, train and host_profile only: where the weights go (default: cuda "
                   "when there is a GPU; train, host_profile: the tiny model on the CPU otherwise)")
    p.add_argument("--repeats", type=int, default=None, help="load only: pairs of loads, engines alternating (default 3)")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args that also takes overrides after flags (``run a=1 --quiet b=2``), as hydra does."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [e for e in extra if e.startswith("-") or ("=" not in e and not e.startswith("~"))]
        if stray or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides = list(args.overrides) + extra
    return args


def _output_kind(args: argparse.Namespace) -> str:
    """The kind of output folder the command makes (see ``trajectories.outdir``)."""
    return args.command if args.command in ("train", "ablate") else "run"


def _multirun(args: argparse.Namespace) -> int:
    """Run ``args.func`` once per point of the sweep's cartesian product, job i in ``OUTPUT_DIR/i``.

    Every job's config is composed and validated, and its folder and wandb set-up checked, before the
    first one runs. ``OUTPUT_DIR/multirun.yaml`` is written at the start (every job ``pending``) and
    rewritten as each job ends, whatever happens to it; an error stops the sweep (the rest stay
    ``not run``).
    """
    import copy

    from ..config.compose import ConfigError
    from ..config.overrides import expand_multirun, parse_override
    from ..trajectories.jobs import JobTable
    from ..trajectories.outdir import check_output_dir
    from .wandb_log import require_wandb

    if any(parse_override(o).key == "output_dir" and "," in (parse_override(o).raw or "") for o in args.overrides):
        raise ValueError("output_dir cannot be swept: multirun jobs go to OUTPUT_DIR/<job number>")
    jobs = expand_multirun(args.overrides)
    base = Path(_compose(args, jobs[0]).output_dir)
    rows = []
    for i, job in enumerate(jobs):
        try:
            cfg = _compose(args, [*job, f"output_dir={base / str(i)}"])
            check_output_dir(cfg.output_dir, kind=_output_kind(args))
            if args.command in ("run", "train"):  # the commands that log to wandb
                require_wandb(cfg.wandb.mode)
        except (ConfigError, ValueError) as exc:
            raise type(exc)(f"multirun job {i} ({' '.join(job)}): {exc}; no job was run") from exc
        rows.append({"job": i, "overrides": job, "output_dir": str(base / str(i)), "status": "pending", "exit_code": None})

    table = JobTable(base / "multirun.yaml", rows)
    worst = EXIT_OK
    for row in rows:
        sub = copy.copy(args)
        sub.overrides = [*row["overrides"], f"output_dir={row['output_dir']}"]
        print(f"[multirun] job {row['job']}: {' '.join(row['overrides'])}", flush=True)
        table.start(row)
        try:
            rc = args.func(sub)
        except BaseException as exc:
            rc = EXIT_ERROR
            row["error"] = " ".join(str(exc).split()) or type(exc).__name__
            if not isinstance(exc, Exception):
                table.end(row, "interrupted", rc)
                raise
            _report_error(args, exc, expected=isinstance(exc, (ValueError, OSError)))
        table.end(row, {EXIT_OK: "done", EXIT_DRIFT: "drift"}.get(rc, "error"), rc)
        worst = max(worst, rc)
        if rc == EXIT_ERROR:
            table.stop()
            break
    print(f"[multirun] {table.finished}/{len(jobs)} jobs → {base / 'multirun.yaml'}")
    return worst


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_ERROR
    from ..distributed import launched

    if launched():  # started by torchrun: one rank of a process group
        try:
            return _main_distributed(args)
        except Exception as exc:
            _report_error(args, exc, expected=isinstance(exc, (ValueError, OSError)))
            return EXIT_ERROR
    return _run_command(args)


def exit_process(rc: int) -> None:
    """End the process with ``rc`` (``python -m mmdit_strict``).

    A torchrun rank leaves without the interpreter's finalization: its process group is destroyed and
    every file is written by now, but gloo's worker threads can still abort the teardown ("terminate
    called without an active exception", exit -6), seen on 2-core CI machines (docs/distributed.md)."""
    import sys

    from ..distributed import launched

    if launched():
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc if isinstance(rc, int) else 1)
    sys.exit(rc)


def _run_command(args: argparse.Namespace) -> int:
    """The command's exit code; an error is reported (one line) and gives 2."""
    from ..config.compose import ConfigError
    from ..kernels.registry import NoStrictKernelError
    from ..model.checkpoint import CheckpointError
    from ..trajectories.artifact import TrajectoryError

    try:
        if getattr(args, "multirun", False):
            return _multirun(args)
        return args.func(args)
    except (ConfigError, CheckpointError, TrajectoryError, NoStrictKernelError, ValueError, OSError) as exc:
        _report_error(args, exc, expected=True)
        return EXIT_ERROR
    except Exception as exc:  # a crash is an error (2), never read as drift (1)
        _report_error(args, exc, expected=False)
        return EXIT_ERROR


def _report_error(args: argparse.Namespace, exc: BaseException, expected: bool) -> None:
    """One line on stderr (the exception type too when it was not an expected input error); -v adds the traceback."""
    if args.verbose:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not expected or (isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)):
        text = f"{type(exc).__name__}: {text}"
    from ..distributed import tag

    print(f"{tag()}mmdit-strict {args.command}: error: {text}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
