"""The Qwen-Image MMDiT: one parameter tree, two forwards (production and strict).

``MMDiT.forward`` takes the same arguments as diffusers' ``QwenImageTransformer2DModel.forward``.
With ``runtime="off"`` it runs the production operators (``kernels/production.py``: cuBLAS / MKL GEMMs,
SDPA) on padded tensors (``layers.py``); with ``strict`` / ``auto`` /
``audit`` it runs the strict graph of registry operators on packed rows (``strict.py``).

Which runtime a forward runs in is read from one place: the execution context
(``kernels/execution.py``). The model's ``runtime`` argument is a default, entered by the forward only
where the caller has not chosen a runtime (``with runtime_mode("off"): model(...)`` runs ``off`` whatever
the model's default).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..config.arch import ArchConfig
from ..kernels.execution import Runtime, current, using
from .diffusers_compat import DiffusersCompatMixin, check_attention_kwargs
from .graphs import GraphCache, adapter_state, warmup_blocks
from .module_index import trainable_parameters
from .layers import AdaNormOut, DoubleStreamBlock, RMSNorm, TimeTextEmbed, is_plain_linear, linear_op, module_op, production_op
from .rope import normalize_img_shapes, rope_tables
from .strict import checkpointed, instrumented, strict_forward

logger = logging.getLogger(__name__)

# Linear layers LoRA may attach to (PEFT ``target_modules`` names, matched as module-name suffixes).
LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    "img_mod.1", "txt_mod.1",
)


@dataclass
class MMDiTOutput:
    """Mirror of diffusers' ``Transformer2DModelOutput``: ``.sample`` or ``[0]``."""

    sample: torch.Tensor

    def __getitem__(self, idx: int) -> torch.Tensor:
        if idx != 0:
            raise IndexError("MMDiTOutput holds one tensor (index 0)")
        return self.sample

    def to_tuple(self) -> tuple[torch.Tensor]:
        """``(sample,)``, as diffusers' ``BaseOutput.to_tuple``."""
        return (self.sample,)


@dataclass
class ModelInputs:
    """Validated forward inputs."""

    hidden_states: torch.Tensor  # (B, Ti, Cin)
    encoder_hidden_states: torch.Tensor  # (B, L, Ct)
    txt_mask: torch.Tensor | None  # (B, L) bool, prefix-valid, or None
    txt_lens: list[int]  # valid text tokens per sample
    sigma: torch.Tensor  # (B,) model dtype
    img_shapes: list[list[tuple[int, int, int]]]
    img_lens: list[int]  # valid image tokens per sample (all T_img unless image_padding)

    @property
    def image_padded(self) -> bool:
        """True when some sample has fewer image tokens than ``T_img`` (its trailing rows are padding)."""
        return any(n != self.hidden_states.shape[1] for n in self.img_lens)


class MMDiT(DiffusersCompatMixin, nn.Module):
    """Qwen-Image double-stream MMDiT (diffusers parameter names and forward semantics).

    Drop-in for diffusers' ``QwenImageTransformer2DModel`` inside ``QwenImagePipeline`` (see
    ``diffusers_compat.py`` for the pipeline-facing surface: ``cache_context``, LoRA methods, …).

    ``runtime`` is the model's default runtime: a forward runs in the runtime of the execution context
    in force when a caller chose one (``runtime_mode`` / ``execution``), else in this default, which it
    enters for its operators (and for its checkpoint recomputes).
    """

    def __init__(self, config: ArchConfig, runtime: str | Runtime = "off") -> None:
        super().__init__()
        self.config = config
        self._default_runtime = Runtime.parse(runtime)
        d = config.hidden_size
        self.img_in = nn.Linear(config.in_channels, d)
        self.txt_norm = RMSNorm(config.joint_attention_dim, config.eps)
        self.txt_in = nn.Linear(config.joint_attention_dim, d)
        self.time_text_embed = TimeTextEmbed(config)
        self.transformer_blocks = nn.ModuleList([DoubleStreamBlock(config, i) for i in range(config.num_layers)])
        self.norm_out = AdaNormOut(config)
        self.proj_out = nn.Linear(d, config.patch_size**2 * config.out_channels)
        self.gradient_checkpointing = False
        self.keep_attention_outputs = True  # checkpointed strict steps: attention outputs kept for the recompute
        self.audit_records: list[dict[str, Any]] = []  # runtime=audit: one drift record per forward
        self.last_block_capture: dict[str, torch.Tensor] | None = None  # runtime=audit: strict block outputs
        self.graph_cache = None  # set by enable_cuda_graphs(): captured strict forwards per batch layout
        self.train_graphs = None  # set by enable_cuda_graphs(): captured strict training steps per batch layout

    # ------------------------------------------------------------------ helpers
    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    @property
    def default_runtime(self) -> Runtime:
        """The runtime a forward runs in where the caller has not chosen one."""
        return self._default_runtime

    @property
    def runtime(self) -> Runtime:
        """The runtime the next forward runs in here: the execution context's if a caller chose one, else
        :attr:`default_runtime`. Assigning sets the default (as :meth:`set_runtime`)."""
        chosen = current().runtime
        return self._default_runtime if chosen is None else chosen

    @runtime.setter
    def runtime(self, runtime: str | Runtime) -> None:
        self._default_runtime = Runtime.parse(runtime)

    def set_runtime(self, runtime: str | Runtime) -> "MMDiT":
        """Set :attr:`default_runtime`; returns the model."""
        self._default_runtime = Runtime.parse(runtime)
        return self

    def enable_cuda_graphs(self, enabled: bool = True, max_graphs: int = 8, training: bool = True,
                           max_training_graphs: int = 4) -> "MMDiT":
        """Replay strict forwards on CUDA from graphs captured per batch layout, under ``strict`` / ``auto``.

        Autograd off: the forward alone (``model/graphs.py``). Autograd on (``training``): the forward and
        its backward, grad-sink deposits included (``model/train_graphs.py``). Other calls run uncaptured.
        Same bytes as the uncaptured strict step. Call again after replacing weights' storage.
        """
        from .train_graphs import TrainGraphCache

        self.graph_cache = GraphCache(max_graphs) if enabled else None
        self.train_graphs = TrainGraphCache(max_training_graphs) if enabled and training else None
        return self

    def lora_target_modules(self) -> list[str]:
        """Full names of every linear layer a LoRA may attach to."""
        return [n for n, _ in self.named_modules() if any(n.endswith(t) for t in LORA_TARGETS)]

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | Path,
        *,
        runtime: str | Runtime = "off",
        torch_dtype: torch.dtype | str | None = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        subfolder: str | None = None,
        revision: str | None = None,
        local_files_only: bool | None = None,
        low_cpu_mem_usage: bool = True,
    ) -> "MMDiT":
        """Load a diffusers-format transformer (``config.json`` + safetensors, sharded or not).

        ``path_or_repo_id`` is a local folder (the transformer folder or a pipeline folder with a
        ``transformer/`` subfolder) or a Hugging Face repo id, resolved through huggingface_hub
        (from the local cache when offline). ``torch_dtype`` (diffusers' name; ``dtype`` is an alias,
        FP32 when neither is given; ``"auto"``: the checkpoint's stored dtype) is the execution dtype. The
        model is built without storage and each tensor is read straight to ``device`` (several reader
        threads; for a GPU through bounded pinned buffers, cast once on the GPU), so host memory beyond
        the model is a few staging buffers, whatever ``low_cpu_mem_usage`` says. The parameters hold the
        stored values cast once to ``torch_dtype``; every tensor is checked finite.
        """
        from .checkpoint import load_pretrained, resolve_dtype

        return load_pretrained(
            cls, path_or_repo_id, runtime=runtime, dtype=resolve_dtype(torch_dtype, dtype, allow_auto=True), device=device,
            subfolder=subfolder, revision=revision, local_files_only=local_files_only,
        )

    @classmethod
    def from_config(
        cls,
        config: ArchConfig | dict[str, Any] | str | Path,
        *,
        runtime: str | Runtime = "off",
        seed: int = 0,
        torch_dtype: torch.dtype | str | None = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
    ) -> "MMDiT":
        """A randomly initialised model (deterministic in ``seed``) from an :class:`ArchConfig`, a diffusers
        config dict, or a ``config.json`` / transformer folder / pipeline folder path."""
        import json as _json

        from .checkpoint import resolve_dtype
        from .init import build_model

        if isinstance(config, (str, Path)):
            p = Path(config)
            for cand in (p, p / "config.json", p / "transformer" / "config.json"):
                if cand.is_file():
                    config = _json.loads(cand.read_text())
                    break
            else:
                raise FileNotFoundError(f"no config.json at {p} (nor in its transformer/ subfolder)")
        arch = config if isinstance(config, ArchConfig) else ArchConfig.from_diffusers_config(config)  # type: ignore[arg-type]
        rt = runtime.value if isinstance(runtime, Runtime) else runtime
        return build_model(arch, seed=seed, runtime=rt, dtype=resolve_dtype(torch_dtype, dtype), device=str(device))

    def save_pretrained(self, directory: str | Path, max_shard_size: int = 2 * 1024**3) -> Path:
        """Write ``config.json`` and safetensors in diffusers' layout (atomically)."""
        from .checkpoint import save_pretrained

        return save_pretrained(self, directory, max_shard_size=max_shard_size)

    # ------------------------------------------------------------------ inputs
    def validate_inputs(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor | float,
        img_shapes: Any,
        image_padding: bool = False,
    ) -> ModelInputs:
        cfg = self.config
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be a (B, image_tokens, {cfg.in_channels}) tensor, got {_desc(hidden_states)}")
        B, Ti, C = hidden_states.shape
        if B < 1:
            raise ValueError(f"hidden_states needs at least one sample (B >= 1), got shape {tuple(hidden_states.shape)}")
        if C != cfg.in_channels:
            raise ValueError(f"hidden_states must have {cfg.in_channels} channels per token, got shape {tuple(hidden_states.shape)}")
        if not isinstance(encoder_hidden_states, torch.Tensor) or encoder_hidden_states.dim() != 3:
            raise ValueError(
                f"encoder_hidden_states must be a (B, text_tokens, {cfg.joint_attention_dim}) tensor, got {_desc(encoder_hidden_states)}"
            )
        if encoder_hidden_states.shape[0] == 1 and B > 1:
            # One prompt for the whole batch (QwenImagePipeline with a single negative_prompt string):
            # diffusers broadcasts it, so do we, as B identical rows.
            encoder_hidden_states = encoder_hidden_states.expand(B, -1, -1).contiguous()
            if isinstance(encoder_hidden_states_mask, torch.Tensor) and encoder_hidden_states_mask.dim() == 2 \
                    and encoder_hidden_states_mask.shape[0] == 1:
                encoder_hidden_states_mask = encoder_hidden_states_mask.expand(B, -1).contiguous()
        if encoder_hidden_states.shape[0] != B or encoder_hidden_states.shape[2] != cfg.joint_attention_dim:
            raise ValueError(
                f"expected encoder_hidden_states of shape ({B}, L, {cfg.joint_attention_dim}), got {tuple(encoder_hidden_states.shape)}"
            )
        for name, t in (("hidden_states", hidden_states), ("encoder_hidden_states", encoder_hidden_states)):
            if t.dtype != self.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but the model runs in {self.dtype}; cast the input")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the model is on {self.device}")
        L = encoder_hidden_states.shape[1]
        if L < 1:
            raise ValueError("encoder_hidden_states needs at least one text token")
        # Data checks run on the device and come back in one transfer: one host synchronisation on the good path.
        # Each entry: (flag tensor that is True when the check passes, the error raised when it is False).
        checks: list[tuple[torch.Tensor, str]] = [
            (torch.isfinite(hidden_states).all(), "hidden_states contains NaN or Inf"),
            (torch.isfinite(encoder_hidden_states).all(), "encoder_hidden_states contains NaN or Inf"),
        ]
        mask = lens = None
        if encoder_hidden_states_mask is not None:
            m = encoder_hidden_states_mask
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != (B, L):
                raise ValueError(f"encoder_hidden_states_mask must have shape ({B}, {L}), got {_desc(m)}")
            if m.device != self.device:
                raise ValueError(f"encoder_hidden_states_mask is on {m.device} but the model is on {self.device}")
            if m.dtype != torch.bool:
                if m.is_floating_point():
                    checks.append((torch.isfinite(m).all(), "encoder_hidden_states_mask contains NaN or Inf"))
                checks.append((((m == 0) | (m == 1)).all(), "encoder_hidden_states_mask must hold only 0 and 1"))
                m = m != 0
            lens = m.sum(dim=1)
            prefix = torch.arange(L, device=m.device)[None, :] < lens[:, None]
            checks.append(((prefix == m).all(), "encoder_hidden_states_mask must be a prefix mask (valid tokens first, "
                                                "padding after)"))
            mask = m
        sigma = torch.as_tensor(timestep, device=self.device)
        if sigma.dim() == 0:
            sigma = sigma.expand(B)
        if sigma.dim() != 1 or sigma.shape[0] != B:
            raise ValueError(f"timestep must be a scalar or a ({B},) tensor of sigmas, got shape {tuple(sigma.shape)}")
        if not sigma.is_floating_point():
            raise ValueError("timestep must be finite floating-point sigmas (the pipeline passes t / 1000)")
        in_range = ((sigma >= 0) & (sigma <= 1)).all()  # NaN fails both comparisons
        flags = torch.stack([f for f, _ in checks] + [in_range]).to(torch.int64)
        read = (flags if lens is None else torch.cat([flags, lens.to(torch.int64)])).tolist()
        for ok, (_, message) in zip(read, checks):
            if not ok:
                raise ValueError(message)
        txt_lens = [L] * B if lens is None else read[len(checks) + 1:]
        if 0 in txt_lens:
            raise ValueError("every sample needs at least one valid text token (a row of the mask is all zero)")
        if not read[len(checks)]:
            if not torch.isfinite(sigma).all():
                raise ValueError("timestep must be finite floating-point sigmas (the pipeline passes t / 1000)")
            raise ValueError(f"timestep must be sigmas in [0, 1] (the pipeline passes t / 1000), got values from "
                             f"{float(sigma.min())} to {float(sigma.max())}")
        shapes = normalize_img_shapes(img_shapes, B, Ti, image_padding=bool(image_padding))
        img_lens = [sum(f * h * w for f, h, w in s) for s in shapes]
        return ModelInputs(hidden_states, encoder_hidden_states, mask, txt_lens, sigma.to(self.dtype), shapes, img_lens)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        timestep: torch.Tensor | float | None = None,
        img_shapes: Sequence[Any] | None = None,
        guidance: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        image_padding: bool = False,
        **unsupported: Any,
    ) -> MMDiTOutput | tuple[torch.Tensor]:
        """Predict the flow velocity for packed latents.

        Args:
            hidden_states: ``(B, T_img, 64)`` packed latents.
            encoder_hidden_states: ``(B, L, 3584)`` prompt embeddings.
            encoder_hidden_states_mask: ``(B, L)`` 1 for valid, 0 for padding (prefix masks).
            timestep: ``(B,)`` sigma in [0, 1] (the pipeline passes ``t / 1000``).
            img_shapes: latent grids, ``[[(1, H/2, W/2)]] * B`` as diffusers' pipeline passes them, or any
                other form diffusers accepts (``rope.normalize_img_shapes`` states the rule).
            attention_kwargs: ``None`` / ``{}`` (anything that asks for more is a ValueError).
            return_dict: return :class:`MMDiTOutput` (else a 1-tuple).
            image_padding: let samples have fewer image tokens than ``T_img`` (an extension: edit batches
                whose conditioning images differ in size); a sample's rows past its grids are padding,
                never read, and come back as zeros (``rope.normalize_img_shapes`` states the rule).

        Returns:
            ``(B, T_img, 64)`` velocity in the model dtype.
        """
        if guidance is not None:
            raise ValueError("guidance embeddings are outside the Qwen-Image Phase A contract")
        bad = {k: v for k, v in unsupported.items() if v is not None}
        if bad:
            raise ValueError(f"unsupported forward arguments: {sorted(bad)} (Phase A covers the base text-to-image model)")
        check_attention_kwargs(attention_kwargs)
        if encoder_hidden_states is None or timestep is None:
            raise ValueError("encoder_hidden_states and timestep are required")
        inputs = self.validate_inputs(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes,
                                      image_padding)
        ctx = current()
        runtime = self._default_runtime if ctx.runtime is None else ctx.runtime
        if ctx.runtime is None:  # the caller chose no runtime: run in the model's default
            ctx = ctx.replace(runtime=runtime)
        if runtime is Runtime.OFF:
            with using(ctx):
                out = self.production_forward(inputs)  # its operator calls record themselves in the trace
        else:
            audit = runtime is Runtime.AUDIT
            blocks: dict[str, torch.Tensor] | None = {} if audit else None
            capturable = (
                hidden_states.is_cuda and runtime in (Runtime.STRICT, Runtime.AUTO) and not instrumented()
                and not _sharded()
            )
            out = None
            with using(ctx):
                if capturable and torch.is_grad_enabled():
                    out = self._train_graphed(inputs, runtime)
                elif capturable and self.graph_cache is not None:
                    out = self.graph_cache.run(inputs, runtime, lambda i: strict_forward(self, i), adapter_state(self),
                                               self._graph_warmup())
                if out is None:
                    out = strict_forward(self, inputs, block_capture=blocks)
            if audit:
                self.last_block_capture = blocks
                self.audit_records.append(self._audit(inputs, out, blocks))
        return MMDiTOutput(out) if return_dict else (out,)

    def _train_graphed(self, inputs: ModelInputs, runtime: Runtime) -> torch.Tensor | None:
        """The training forward through :attr:`train_graphs` (``model/train_graphs.py``), or None where it
        does not apply (no cache, no trainable parameter, inputs that need gradients)."""
        if self.train_graphs is None or inputs.hidden_states.requires_grad or inputs.encoder_hidden_states.requires_grad:
            return None
        params = trainable_parameters(self)
        if not params:
            return None
        key = (GraphCache.key(inputs, runtime), adapter_state(self), self.gradient_checkpointing,
               self.keep_attention_outputs)
        return self.train_graphs.run(inputs, runtime, params, lambda i: strict_forward(self, i), key, self._graph_warmup())

    def _graph_warmup(self) -> Callable[[ModelInputs], torch.Tensor] | None:
        """The forward a capture warms up with: the first and last blocks (``graphs.SHORT_WARMUP``), or None (all)."""
        blocks = warmup_blocks(len(self.transformer_blocks))
        return None if blocks is None else (lambda i: strict_forward(self, i, blocks=blocks))

    @torch.no_grad()
    def _audit(self, inputs: ModelInputs, out: torch.Tensor, blocks: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Run the production path beside the strict one and record how far it drifts, per block too.

        Never changes the returned (strict) result. The side run is kept out of the operator trace (which
        describes the forward whose result was returned), out of operator capture and fault injection.
        """
        from ..kernels.trace import capture_trace
        from .strict import uninstrumented

        prod_blocks: dict[str, torch.Tensor] = {}
        with capture_trace(), uninstrumented():
            prod = self.production_forward(inputs, capture=prod_blocks)
        rec: dict[str, Any] = {
            "max_abs_drift": float((prod.float() - out.detach().float()).abs().max()),
            "byte_equal": torch.equal(prod, out.detach()),
            "per_block": [],
        }
        for i in range(self.config.num_layers):
            row = {}
            for stream in ("img", "txt"):
                a, b = prod_blocks[f"block{i}.{stream}"], (blocks or {})[f"block{i}.{stream}"]
                row[stream] = float((a.float() - b.float()).abs().max())
            rec["per_block"].append(row)
        return rec

    def production_forward(self, inputs: ModelInputs, capture: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Production forward (runtime ``off``) on padded ``(B, T, D)`` tensors, as diffusers runs it.

        Every operator is the production implementation (``kernels/production.py``) dispatched through the
        registry: recorded in the active trace as it runs, captured by ``capture_operators`` (padded
        tensors, under the strict graph's keys) and open to ``inject_fault``. ``capture`` (audit) receives
        each block's outputs as packed valid rows.

        Diffusers' layout has no image mask: a batch whose samples have different image token counts
        (``image_padding``) runs one sample at a time on its valid rows, zero-padded back (so operator
        captures then hold the last sample's forward only).
        """
        if inputs.image_padded:
            return self._production_per_sample(inputs, capture)
        cfg = self.config
        x = inputs.hidden_states
        B, L = inputs.encoder_hidden_states.shape[:2]
        ehs = inputs.encoder_hidden_states
        txt_lens = None if inputs.txt_mask is None else inputs.txt_lens
        temb = self.time_text_embed(inputs.sigma, x.dtype)  # (B, D)
        img = linear_op("latent_proj_gemm", "img_in", self.img_in, x)  # (B, Ti, D)
        if is_plain_linear(self.txt_in):
            txt = production_op("txt_in_rmsnorm_linear", "txt_in", ehs, ehs, self.txt_norm.weight, self.txt_in.weight,
                                self.txt_in.bias, seqlens=None, eps=self.txt_norm.eps)  # (B, L, D)
        else:
            txt = module_op("txt_in_rmsnorm_linear", "txt_in", ehs, (self.txt_in,), lambda: self.txt_in(self.txt_norm(ehs)))
        tables = [rope_tables(s, L, cfg.axes_dims_rope, cfg.rope_theta, x.device) for s in inputs.img_shapes]
        rope = tuple(torch.stack([t[i] for t in tables]) for i in range(4))
        for i, block in enumerate(self.transformer_blocks):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                img, txt = checkpointed(block, img, txt, txt_lens, temb, rope)
            else:
                img, txt = block(img, txt, txt_lens, temb, rope)
            if capture is not None:
                capture[f"block{i}.img"] = img.detach().reshape(-1, img.shape[-1])
                capture[f"block{i}.txt"] = torch.cat([txt[b, : inputs.txt_lens[b]] for b in range(B)]).detach()
        return linear_op("latent_proj_gemm", "proj_out", self.proj_out, self.norm_out(img, temb))

    def _production_per_sample(self, inputs: ModelInputs, capture: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """:meth:`production_forward` of each sample alone (its valid image rows), padded back to ``T_img``."""
        B, Ti = inputs.hidden_states.shape[:2]
        outs, caps = [], []
        for b in range(B):
            n = inputs.img_lens[b]
            one = ModelInputs(
                inputs.hidden_states[b:b + 1, :n], inputs.encoder_hidden_states[b:b + 1],
                None if inputs.txt_mask is None else inputs.txt_mask[b:b + 1], inputs.txt_lens[b:b + 1],
                inputs.sigma[b:b + 1], inputs.img_shapes[b:b + 1], [n])
            cap: dict[str, torch.Tensor] | None = {} if capture is not None else None
            y = self.production_forward(one, cap)
            outs.append(torch.cat([y[0], y.new_zeros(Ti - n, y.shape[-1])]) if n < Ti else y[0])
            caps.append(cap)
        if capture is not None:
            for k in caps[0]:  # type: ignore[union-attr]
                capture[k] = torch.cat([c[k] for c in caps])  # type: ignore[index]
        return torch.stack(outs)


def _desc(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)} ({t.dtype})"
    return type(t).__name__


def _sharded() -> bool:
    """True under a model-parallel layout that shards the forward (its exchanges cannot run inside a CUDA graph)."""
    par = current().parallel
    return par is not None and (par.sp > 1 or par.tp > 1)
