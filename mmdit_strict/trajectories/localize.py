"""First-drift localizer: re-run the first drifting step on both sides with operator capture.

Each side's forward for the drifting sample is replayed with that side's runtime, batch
composition (rollout batch or recompute micro-batch), CFG layout and padding, through the
operator graph with every operator output captured. Walking the operators in execution order,
the first whose rows for the drifting sample differ in bytes is the first drift: operator, block,
stream, logical row (token within the sample), element, max-abs and ULP distance. Each side is
replayed with the forward it ran: a strict / auto side through the strict graph on packed rows, a
``runtime=off`` side through the production forward on padded tensors (the same operator keys; its
captures are unpadded to the sample's valid rows before comparing).

Each side is rebuilt from the configuration stored in its own manifest (never from a config file a
later run may have rewritten), and its weight and LoRA hashes must equal the manifest's: a replay
of other weights would blame the wrong place, so it is refused with :class:`TrajectoryError`.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf

from ..overlay import perturbing
from ..kernels.runtime import Runtime, runtime_mode
from ..sampling import cfg_combine
from ..model.edit import edit_batch
from ..model.strict import capture_operators, inject_fault, strict_forward
from .artifact import Trajectory, TrajectoryError
from .compare import FirstDrift
from .engine import pad_prompts, sampling_op
from .hashing import ulp_distance
from .recompute import parse_fault, recorded_prompts
from .rollout import step_latents, used_sigmas
from .record import model_hashes
from .setup import build_side_model

_KEY = re.compile(r"^(?:block(?P<block>\d+)\.)?(?P<stream>[a-z_]+)(?:\.(?P<sub>[a-z.]+?))?\.(?P<op>[a-z_]+)(?:\.(?P<part>\d))?$")


@dataclass
class OperatorDrift:
    branch: str  # cond | neg (the model's forwards) | sampling (sigma table, CFG combine, noise, SDE step)
    key: str
    operator: str
    block: int | None
    stream: str  # img | txt | embed | ...
    logical_row: int  # token (or sample-vector) row within the drifting sample
    element: int  # column within that row
    row_width: int  # elements per row of the operator output (the element's column shard under tensor parallelism)
    max_abs: float
    max_ulp: int
    rows_differing: int
    rows_total: int
    # which tokens the row belongs to: "noisy latent" | "conditioning image" (edit: the input image's rows,
    # after the noisy ones) | "text" | "sample vector" (timestep embedding, modulation) | "sampling"
    region: str = ""
    region_row: int = 0  # the row within its region (a conditioning row counts from its input image's first token)
    region_image: int = 0  # conditioning rows: which of the sample's input images (0-based)
    region_images: int = 1  # conditioning rows: how many input images the sample has
    owners: str = ""  # model-parallel sides: the rank that computed this row on each side ("" otherwise)


@dataclass
class Localization:
    sample_id: int
    step: int
    first: OperatorDrift | None
    notes: list[str] = field(default_factory=list)
    block_drift: list[float] = field(default_factory=list)  # per block: max-abs of the image-stream block output

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _side_batch(traj: Trajectory, position: int) -> list[int]:
    side = traj.manifest["side"]
    ids = list(range(len(traj.sample_ids)))
    if side.get("rank_batches"):  # many ranks (torchrun): the batch the owning rank ran, as recorded
        for batches in side["rank_batches"]:
            for b in batches:
                group = [traj.sample_ids.index(s) for s in b]
                if position in group:
                    return group
    if traj.manifest["kind"] == "rollout":
        size = side["batch_size"]
        groups = [ids[i:i + size] for i in range(0, len(ids), size)]
    else:
        order = [traj.sample_ids.index(s) for s in side["order"]]
        size = side["micro_batch"]
        groups = [order[i:i + size] for i in range(0, len(order), size)]
    for g in groups:
        if position in g:
            return g
    raise ValueError(f"sample position {position} not found in the {traj.manifest['kind']} batches")


def _replay(traj: Trajectory, ref: Trajectory, step: int, position: int) -> list[tuple[str, str, torch.Tensor]]:
    """One side's step for the drifting sample, in execution order: ``(branch, key, rows)`` of the sigma
    table it used, every operator output of its forwards (cond branch, then neg) and of its sampling
    chain (CFG combine, noise, SDE step and logp), each as that sample's rows."""
    runtime = Runtime.parse(traj.manifest["runtime"])
    cfg = OmegaConf.create(traj.manifest["config"])
    model = build_side_model(cfg.model, cfg.lora, runtime)
    for key, val in model_hashes(model).items():
        if val != traj.manifest[key]:
            raise TrajectoryError(
                f"cannot localize: the {traj.manifest['kind']} side's {key} is {str(traj.manifest[key])[:12]}… but "
                f"its configuration now builds {str(val)[:12]}… (model.checkpoint={cfg.model.checkpoint} "
                "changed since the run); re-run the job"
            )
    side = traj.manifest["side"]
    prompts = recorded_prompts(ref, model.dtype, cfg.model.device)
    batch = _side_batch(traj, position)
    j = batch.index(position)
    grid = tuple(traj.manifest["grid"])
    T = grid[0] * grid[1]
    images = prompts.images_of(batch)
    x = ref.tensors["x"][step][batch].to(device=cfg.model.device, dtype=model.dtype)
    cond = [prompts.embeds[i] for i in batch]
    negs = prompts.negative_list(batch)
    scale = float(traj.manifest["cfg_scale"])

    fault_key, fault_step = parse_fault(side.get("inject_fault"))
    fault = fault_key if fault_step == step else None
    padded = runtime is Runtime.OFF
    order: list[tuple[str, str, torch.Tensor]] = []

    with perturbing(side.get("perturb"), model, runtime.value), runtime_mode(runtime), torch.no_grad():
        with capture_operators() as cap:
            used = used_sigmas(ref.tensors["sigmas"])
        order += [("sampling", k, t.reshape(1, -1)) for k, t in cap.items()]
        sigma = float(used[step])

        def run(xs: torch.Tensor, rows: list[torch.Tensor], copies: int) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
            ehs, mask = pad_prompts(rows, side.get("pad_to"))
            t = torch.full((xs.shape[0],), sigma, dtype=torch.float32, device=xs.device)
            if images is None:
                inputs = model.validate_inputs(xs, ehs, mask, t, [[(1, grid[0], grid[1])]] * xs.shape[0])
            else:
                eb = edit_batch(xs, images * copies, grid)  # type: ignore[arg-type]
                inputs = model.validate_inputs(eb.hidden_states, ehs, mask, t, eb.img_shapes, eb.image_padding)
            with capture_operators() as cap, inject_fault(fault):
                if padded:
                    model.production_forward(inputs)  # what model(...) runs under runtime=off
                else:
                    strict_forward(model, inputs)
            return cap, [r.shape[0] for r in rows], inputs.img_lens

        if padded and images is not None and len({im.tokens for im in images}) > 1:
            raise TrajectoryError("cannot localize in a runtime=off side whose batch mixed conditioning sizes: the "
                                  "production forward ran it sample by sample, which operator capture does not separate")
        branches: dict[str, dict[str, torch.Tensor]] = {}
        if scale != 1.0 and side["cfg_layout"] == "batched":
            cap, lens, ilens = run(torch.cat([x, x]), cond + negs, 2)
            branches["cond"] = _sample_rows(cap, j, ilens, lens, padded)
            branches["neg"] = _sample_rows(cap, len(batch) + j, ilens, lens, padded)
        else:
            cap, lens, ilens = run(x, cond, 1)
            branches["cond"] = _sample_rows(cap, j, ilens, lens, padded)
            if scale != 1.0:
                cap, lens, ilens = run(x, negs, 1)
                branches["neg"] = _sample_rows(cap, j, ilens, lens, padded)
        for branch, rows in branches.items():
            order += [(branch, k, t) for k, t in rows.items()]

        # the sampling chain of this sample, from its model outputs (per-token and per-sample operators:
        # the sample alone gives the bytes it had in its batch)
        out_key = "proj_out.latent_proj_gemm"
        v = branches["cond"][out_key][:T].reshape(1, T, -1).float()
        x_t = ref.tensors["x"][step][position:position + 1].to(cfg.model.device)
        with capture_operators() as cap, inject_fault(fault):
            if scale != 1.0:
                v = sampling_op("cfg_combine_renorm", cfg_combine, v, branches["neg"][out_key][:T].reshape(1, T, -1).float(), scale)
            sampler = SimpleNamespace(sde=bool(traj.manifest["sde"]), eta=float(traj.manifest["eta"]))
            step_latents(sampler, int(cfg.seed), v, x_t, used, step, [traj.sample_ids[position]])  # type: ignore[arg-type]
        for k, t in cap.items():
            order.append(("sampling", k, t[0].reshape(-1, t.shape[-1]) if t.dim() > 2 else t.reshape(1, -1)))
    return order


def _stream(key: str) -> str:
    if key.endswith("joint_attention_fused.0"):
        return "txt"
    if key.endswith("joint_attention_fused.1"):
        return "img"
    m = _KEY.match(key)
    return m.group("stream") if m else "?"


def _sample_rows(cap: dict[str, torch.Tensor], pos: int, img_lens: list[int], txt_lens: list[int],
                 padded: bool = False) -> dict[str, torch.Tensor]:
    """Sample ``pos``'s rows of every captured operator output, one row per token (heads flattened).

    Packed captures (strict graph) hold the samples' rows back to back (``img_lens``: image rows per
    sample, noisy then conditioning); padded captures (production forward, ``(B, T, ...)``) hold sample
    ``pos`` at index ``pos`` with its text padding after ``txt_lens[pos]``, dropped here. Per-sample
    vectors are one row either way.
    """
    rows = {}
    for key, t in cap.items():
        if "adaln_mod_projection" in key or "timestep_embed_mlp" in key:
            r = t[pos:pos + 1]
        elif padded:
            r = t[pos, :txt_lens[pos]] if _stream(key) in ("txt", "txt_in") else t[pos]
        elif _stream(key) in ("txt", "txt_in"):
            start = sum(txt_lens[:pos])
            r = t[start:start + txt_lens[pos]]
        else:
            start = sum(img_lens[:pos])
            r = t[start:start + img_lens[pos]]
        rows[key] = r.reshape(r.shape[0], -1)
    return rows


def _describe(branch: str, key: str, a: torch.Tensor, b: torch.Tensor) -> OperatorDrift:
    fa, fb = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[fa.element_size()]
    neq = fa.contiguous().view(as_int) != fb.contiguous().view(as_int)
    row_bad = neq.any(dim=1)
    r = int(row_bad.nonzero()[0])
    e = int(neq[r].nonzero()[0])
    m = _KEY.match(key)
    op = key.split(".")[-2] if key.split(".")[-1].isdigit() else key.split(".")[-1]
    return OperatorDrift(
        branch=branch, key=key, operator=op,
        block=int(m.group("block")) if m and m.group("block") else None,
        stream=_stream(key), logical_row=r, element=e, row_width=int(fa.shape[1]),
        max_abs=float((fa.double() - fb.double()).abs().max()),
        max_ulp=int(ulp_distance(fa, fb).max()) if fa.dtype in (torch.float32, torch.bfloat16) else -1,
        rows_differing=int(row_bad.sum()), rows_total=int(fa.shape[0]),
    )


def _place(drift: OperatorDrift, grid: tuple[int, int], images: list[list[int]] | None = None) -> None:
    """Name the tokens ``drift``'s row belongs to: an image-stream row past the ``h·w`` noisy tokens is
    the edit conditioning's (its rows follow the noisy latents in every sample); with the sample's input
    image grids ``images`` (``[[h, w], ...]`` in tokens, in order) it names which image and the row in it."""
    T = grid[0] * grid[1]
    if drift.branch == "sampling":
        drift.region, drift.region_row = "sampling", drift.logical_row
    elif "adaln_mod_projection" in drift.key or "timestep_embed_mlp" in drift.key:
        drift.region, drift.region_row = "sample vector", drift.logical_row
    elif drift.stream in ("txt", "txt_in"):
        drift.region, drift.region_row = "text", drift.logical_row
    elif drift.logical_row >= T:
        r, k = drift.logical_row - T, 0
        for k, (h, w) in enumerate(images or []):
            if r < h * w or k == len(images) - 1:
                break
            r -= h * w
        drift.region, drift.region_row = "conditioning image", r
        drift.region_image, drift.region_images = k, max(1, len(images or []))
    else:
        drift.region, drift.region_row = "noisy latent", drift.logical_row


def _row_owners(drift: OperatorDrift, rollout: Trajectory, recompute: Trajectory, position: int) -> str:
    """``"rollout rank 1 (sp 1 of 2), recompute rank 0"``: the rank that computed ``drift``'s row on each side
    whose manifest records a model-parallel layout (``side.parallel``); empty when neither does."""
    from ..parallel import ModelLayout
    from ..parallel.layout import row_owner

    named = []
    for t in (rollout, recompute):
        side = t.manifest["side"]
        if not side.get("parallel"):
            named.append(f"{t.manifest.get('kind')} {'rank ' + str(side['owner_rank'][position]) if side.get('owner_rank') else 'single process'}")
            continue
        leader = side["owner_rank"][position]
        named.append(f"{t.manifest.get('kind')} " + row_owner(ModelLayout.from_config(side["parallel"]), leader,
                                                              drift.branch, drift.region, drift.logical_row, drift.rows_total,
                                                              drift.operator, drift.element, drift.row_width))
    return ", ".join(named) if any(t.manifest["side"].get("parallel") for t in (rollout, recompute)) else ""


def _image_grids(t: Trajectory, position: int) -> list[list[int]] | None:
    """The input image grids of the sample at ``position`` as the artifact records them (None: no edit)."""
    cond = t.manifest.get("conditioning") or {}
    images = cond.get("images")
    if not images or position >= len(images):
        return None
    return [list(im["grid"]) for im in images[position]]


def localize(rollout: Trajectory, recompute: Trajectory, first: FirstDrift) -> Localization:
    """Name the first operator whose output differs for ``first``'s sample at ``first``'s step.

    Both sides' steps are replayed (each with its own runtime, batch, CFG layout, padding, fault and
    perturbation), and their operator outputs compared in execution order: the sigma table, the
    model's operators (cond branch, then neg), CFG combine, the step noise, the SDE step and logp.
    Each side is rebuilt from its manifest's configuration and must hash to its manifest's weights.
    """
    position = rollout.sample_ids.index(first.sample_id)
    a = _replay(rollout, rollout, first.step, position)
    b = {(branch, key): t for branch, key, t in _replay(recompute, rollout, first.step, position)}
    loc = Localization(first.sample_id, first.step, None)
    for branch, key, ta in a:
        tb = b.get((branch, key))
        if tb is None:
            loc.notes.append(f"{branch}:{key} missing on the recompute side")
            continue
        if ta.shape != tb.shape or not torch.equal(ta.view(torch.uint8) if ta.is_floating_point() else ta,
                                                   tb.view(torch.uint8) if tb.is_floating_point() else tb):
            loc.first = _describe(branch, key, ta, tb)
            _place(loc.first, tuple(rollout.manifest["grid"]), _image_grids(rollout, position))
            loc.first.owners = _row_owners(loc.first, rollout, recompute, position)
            break
    cond_a = {k: t for br, k, t in a if br == "cond"}
    cond_b = {k: t for (br, k), t in b.items() if br == "cond"}
    i = 0
    while f"block{i}.img.mlp.adaln_gate_residual" in cond_a:
        k = f"block{i}.img.mlp.adaln_gate_residual"
        loc.block_drift.append(float((cond_a[k].double() - cond_b[k].double()).abs().max()))
        i += 1
    if loc.first is None:
        loc.notes.append(
            "every replayed operator output of this sample (sigma table, model, CFG combine, noise, SDE step and logp) "
            "is byte-equal on both sides: the drift depends on state the replay does not reproduce"
        )
    for name, t in (("rollout", rollout), ("recompute", recompute)):
        if t.manifest["runtime"] == "off":
            loc.notes.append(f"the {name} side ran runtime=off; it was replayed with the production forward it ran "
                             "(padded tensors, production operators), its captures unpadded to the sample's rows")
        if t.manifest["side"].get("perturb"):
            loc.notes.append(f"the {name} side ran under perturbation {t.manifest['side']['perturb']!r}; it was replayed with it")
    return loc
