"""``QwenImagePipeline`` with a strict denoising loop: not only the transformer, the guidance and the step too.

With :func:`~mmdit_strict.pipelines.diffusers_adapter.use_mmdit` our transformer runs inside diffusers'
own ``__call__``, whose classifier-free guidance (``torch.norm`` rescale) and Euler step
(``FlowMatchEulerDiscreteScheduler.step``) are diffusers' code. :class:`StrictQwenImagePipeline` keeps
diffusers' pieces that are not sampling math and replaces the loop::

    pipe = strict_pipeline(QwenImagePipeline.from_pretrained(folder), runtime="strict")
    with capture_trace() as trace:
        image = pipe("a cat", negative_prompt=" ", num_inference_steps=50).images[0]

What runs where:

==================  =========================================================================
diffusers           ``check_inputs``, ``encode_prompt`` (one prompt at a time), ``prepare_latents`` (the generator's
                    noise), the scheduler's ``set_timesteps`` (its timesteps and sigma table,
                    with the resolution shift ``mu``), ``image_processor.postprocess``, the VAE
ours, traced        the transformer (``MMDiT``), the sigma table as used (``flow_sigma_table``),
                    guidance (``cfg_combine_renorm``: fixed-tree norms, ``sampling.cfg``), the
                    FP32 Euler step (``sampling.euler_step``) — or, with a ``StrictFlowMatchScheduler``,
                    its Euler or SDE step (+ ``log_prob`` per step in ``last_log_probs``), unpack + denormalize
                    (``pipelines.vae.decode_to_images``)
==================  =========================================================================

The loop runs in the transformer's runtime (``runtime_mode(pipe.transformer.runtime)``), so a
``capture_trace()`` around the call records every operator above under that runtime. The latents stay
FP32 between steps (the model sees them cast to its dtype); ``output_type="latent"`` returns them in FP32.
With an FP32 model the result differs from ``QwenImagePipeline`` only by the guidance norms (a few ulp
per step, tolerance ``pipelines.strict_loop_latents_vs_diffusers``); without guidance it is byte-equal.

Arguments diffusers accepts but this loop does not implement (``num_images_per_prompt`` > 1,
``guidance_scale``, ``attention_kwargs``, step callbacks) are refused with a ValueError, never ignored.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..kernels.execution import runtime_mode
from ..kernels.runtime import Runtime
from ..model import MMDiT
from ..sampling import cfg_combine, euler_step
from .scheduler import StrictFlowMatchScheduler
from ..trajectories.engine import pad_prompts, sampling_op
from ..trajectories.rollout import used_sigmas
from .diffusers_adapter import mmdit_from_diffusers, route_lora_methods
from .vae import decode_to_images

try:  # diffusers is an optional dependency of the package; this module needs it
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
except ImportError as exc:  # pragma: no cover - exercised only without diffusers
    raise ImportError("mmdit_strict.pipelines.strict_pipeline needs diffusers (pip install diffusers)") from exc

__all__ = ["StrictQwenImagePipeline", "strict_pipeline", "OUTPUT_TYPES"]

#: ``output_type`` values: packed FP32 latents, or images through diffusers' image processor.
OUTPUT_TYPES = ("latent", "pil", "np", "pt")

#: diffusers' ``__call__`` arguments this loop does not implement, with the value that means "not used".
_REFUSED_DEFAULTS: dict[str, Any] = {
    "guidance_scale": None,
    "num_images_per_prompt": 1,
    "attention_kwargs": None,
    "callback_on_step_end": None,
    "callback_on_step_end_tensor_inputs": ["latents"],
}


def _check_refused(extra: dict[str, Any]) -> None:
    unknown = sorted(set(extra) - set(_REFUSED_DEFAULTS))
    if unknown:
        raise TypeError(f"StrictQwenImagePipeline.__call__ got unexpected keyword arguments {unknown}")
    used = sorted(k for k, v in extra.items() if v != _REFUSED_DEFAULTS[k] and not (k == "attention_kwargs" and v == {}))
    if used:
        raise ValueError(
            f"StrictQwenImagePipeline does not support {used}: its loop implements prompt / negative_prompt / "
            "prompt_embeds (and masks), true_cfg_scale, height, width, num_inference_steps, sigmas, generator, "
            "latents, output_type, return_dict and max_sequence_length (use one prompt per image; the model has "
            "no guidance embedding; no step callbacks). Use QwenImagePipeline (diffusers_adapter.use_mmdit) "
            "for the rest.")


class StrictQwenImagePipeline(QwenImagePipeline):
    """``QwenImagePipeline`` whose ``__call__`` runs our guidance and Euler step around an ``MMDiT``
    (module docstring). Build it with :func:`strict_pipeline`, or with ``from_pretrained`` and then
    :func:`~mmdit_strict.pipelines.diffusers_adapter.use_mmdit`."""

    def _check_components(self) -> MMDiT:
        model = self.transformer
        if not isinstance(model, MMDiT):
            raise TypeError(f"StrictQwenImagePipeline needs an MMDiT transformer, got {type(model).__name__} "
                            "(use_mmdit(pipe) or strict_pipeline(pipe) puts one in place)")
        sched = self.scheduler
        if isinstance(sched, StrictFlowMatchScheduler):  # our Euler or SDE step, through the scheduler
            return model
        if not isinstance(sched, FlowMatchEulerDiscreteScheduler) or sched.config.get("stochastic_sampling", False):
            raise TypeError("StrictQwenImagePipeline steps with the deterministic flow-matching Euler rule: it needs "
                            "a FlowMatchEulerDiscreteScheduler without stochastic_sampling or a StrictFlowMatchScheduler, "
                            f"got {type(sched).__name__}")
        return model

    def _sigma_schedule(self, num_inference_steps: int, sigmas: Sequence[float] | None, image_seq_len: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' schedule: the scheduler's ``(N,)`` timesteps and ``(N + 1,)`` FP32 sigma table (ending in 0)."""
        if sigmas is None:
            if int(num_inference_steps) < 2:
                raise ValueError(f"num_inference_steps must be >= 2, got {num_inference_steps} "
                                 "(diffusers' default schedule for one step has a NaN sigma)")
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        cfg = self.scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(self.scheduler, num_inference_steps, device, sigmas=sigmas, mu=mu)
        table = self.scheduler.sigmas.to(device=device, dtype=torch.float32)
        if not bool(torch.isfinite(table).all()):
            raise ValueError(f"the scheduler made a non-finite sigma table {table.tolist()}")
        return timesteps, table

    def _encode(self, prompt: str | list[str] | None, embeds: torch.Tensor | None, mask: torch.Tensor | None,
                device: torch.device, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``encode_prompt`` one prompt at a time, then zero-padded to the longest with a 0/1 mask.

        diffusers encodes a list of prompts as one text-encoder batch, whose FP32 rows differ from the
        prompt encoded alone by an ulp or so; one at a time, a prompt's embedding (and so its image) does
        not depend on the other prompts of the call (as ``pipelines.encode`` does by default). Given
        embeddings are used as they are.
        """
        if embeds is not None or isinstance(prompt, str):
            return self.encode_prompt(prompt=prompt, prompt_embeds=embeds, prompt_embeds_mask=mask, device=device,
                                      max_sequence_length=max_sequence_length)
        rows = []
        for p in prompt:
            e, m = self.encode_prompt(prompt=p, device=device, max_sequence_length=max_sequence_length)
            rows.append(e[0] if m is None else e[0][m[0].bool()])  # (L_i, C) valid rows
        return pad_prompts(rows)

    def _velocity(self, model: MMDiT, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                  mask: torch.Tensor | None, img_shapes: list, branch: str) -> torch.Tensor:
        """One transformer call on FP32 latents ``x`` ``(B, T, 64)``; the velocity in FP32."""
        timestep = t.expand(x.shape[0]).to(model.dtype)
        with model.cache_context(branch):
            v = model(hidden_states=x.to(model.dtype), timestep=timestep / 1000, encoder_hidden_states=embeds,
                      encoder_hidden_states_mask=mask, img_shapes=img_shapes, return_dict=False)[0]
        return v.float()

    @torch.no_grad()
    def __call__(  # type: ignore[override]
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float = 4.0,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: list[float] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        max_sequence_length: int = 512,
        **refused: Any,
    ) -> Any:
        """Generate images (or packed FP32 latents ``(B, h·w, 64)`` for ``output_type="latent"``).

        The arguments mean what they mean in ``QwenImagePipeline.__call__``. Guidance runs when
        ``true_cfg_scale > 1`` and a negative prompt (or its embeddings) is given, as in diffusers; a single
        negative is shared by the whole batch.
        """
        _check_refused(refused)
        model = self._check_components()
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        height = height or self.default_sample_size * self.vae_scale_factor
        width = width or self.default_sample_size * self.vae_scale_factor
        self.check_inputs(prompt, height, width, negative_prompt=negative_prompt, prompt_embeds=prompt_embeds,
                          negative_prompt_embeds=negative_prompt_embeds, prompt_embeds_mask=prompt_embeds_mask,
                          negative_prompt_embeds_mask=negative_prompt_embeds_mask,
                          max_sequence_length=max_sequence_length)
        device = self._execution_device
        embeds, mask = self._encode(prompt, prompt_embeds, prompt_embeds_mask, device, max_sequence_length)
        batch = embeds.shape[0]
        guided = true_cfg_scale > 1 and (negative_prompt is not None or negative_prompt_embeds is not None)
        if guided:
            neg, neg_mask = self._encode(negative_prompt, negative_prompt_embeds, negative_prompt_embeds_mask,
                                         device, max_sequence_length)
            if neg.shape[0] not in (1, batch):
                raise ValueError(f"{neg.shape[0]} negative prompts for {batch} prompts: give one or one per prompt")
            if neg.shape[0] == 1 and batch > 1:  # one negative for every prompt: the same rows, explicitly
                neg = neg.expand(batch, -1, -1)
                neg_mask = None if neg_mask is None else neg_mask.expand(batch, -1)

        x = self.prepare_latents(batch, model.config.in_channels // 4, height, width, embeds.dtype, device,
                                 generator, latents).float()  # (B, h·w, 64), FP32 between steps
        grid = (height // (self.vae_scale_factor * 2), width // (self.vae_scale_factor * 2))
        img_shapes = [[(1, *grid)]] * batch
        timesteps, table = self._sigma_schedule(num_inference_steps, sigmas, x.shape[1], device)
        self._num_timesteps = len(timesteps)

        self.last_log_probs: list[torch.Tensor | None] = []  # per step, with a StrictFlowMatchScheduler(sde=True)
        if isinstance(self.scheduler, StrictFlowMatchScheduler):
            self.scheduler.set_begin_index(0)
        with runtime_mode(model.runtime):
            table = used_sigmas(table)
            with self.progress_bar(total=len(timesteps)) as progress:
                for i, t in enumerate(timesteps):
                    self._current_timestep = t
                    v = self._velocity(model, x, t, embeds, mask, img_shapes, "cond")
                    if guided:
                        v_neg = self._velocity(model, x, t, neg, neg_mask, img_shapes, "uncond")
                        v = sampling_op("cfg_combine_renorm", cfg_combine, v, v_neg, float(true_cfg_scale))
                    if isinstance(self.scheduler, StrictFlowMatchScheduler):  # its Euler or SDE step (+ log_prob)
                        out = self.scheduler.step(v, t, x)
                        x, self.last_log_probs = out.prev_sample, [*self.last_log_probs, out.log_prob]
                    else:
                        x = sampling_op("flow_euler_step", euler_step, v, x, table[i], table[i + 1])
                    progress.update()
            self._current_timestep = None
            if output_type == "latent":
                images: Any = x
            else:
                decoded = decode_to_images(self.vae, x, grid)
                images = self.image_processor.postprocess(decoded, output_type=output_type)
        self.maybe_free_model_hooks()
        return QwenImagePipelineOutput(images=images) if return_dict else (images,)


def strict_pipeline(pipe: Any, runtime: str | Runtime = "strict") -> StrictQwenImagePipeline:
    """A :class:`StrictQwenImagePipeline` over ``pipe``'s components (shared, not copied), its transformer
    an ``MMDiT`` in ``runtime`` over the same weights (diffusers' transformer is converted as
    :func:`~mmdit_strict.pipelines.diffusers_adapter.use_mmdit` does)."""
    components = dict(pipe.components)
    model = mmdit_from_diffusers(components.pop("transformer"), runtime)
    strict = StrictQwenImagePipeline(transformer=None, **components)
    strict.transformer = model
    route_lora_methods(strict, model)
    strict.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
    return strict
