"""One generation through the diffusers pipeline, phase by phase: encode (text encoders), denoise (the transformer),
decode (the VAE), each measured (time, peak GPU memory as what runs out: the allocator's reserved bytes plus the
memory torch does not count) while the components take their turns on the device.

The pipeline's own `__call__` runs unchanged, so its latents are the ones diffusers makes with the same generator.
The phases are told apart by the pipeline's calls: denoising begins at the first transformer forward, decoding at
`vae.decode`. At each boundary the components of the phase that ended are parked and the allocator's cache is
emptied, so a phase's peak is its own. The execution device is fixed for the call (components may be parked in
host memory, where diffusers would otherwise look for it). The seconds Python's garbage collector ran inside each
phase are counted too (`gc_s`): a full collection of a process holding torch, diffusers and transformers scans
every object they keep alive (hundreds of thousands), which can move a short phase by a noticeable share.

Where a phase's time goes: each text encoder's forwards are timed inside the encode phase (`parts_s`, the device
synchronized at their edges; a CPU-placed one's moving of its inputs and outputs inside), a parked encoder's move to
the device apart from them (`<name> to device`), the rest of the phase is the pipeline's host work (tokenizers, its
own logic). Parking the encoders happens after the phase's clock stopped, as for every phase's components.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from chunkflow.models.pipeline_build import BuiltPipeline
from chunkflow_planner.errors import ChunkflowError
from chunkflow.reports import GcCollection

PHASES = ("encode", "denoise", "decode")


class GenerationError(ChunkflowError):
    """A generation that cannot go on (its numbers broke); the message says what to check."""


@dataclass
class PhaseMeasurement:
    time_s: float = 0.0
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    context_bytes: int | None = None  # device memory in use beyond torch's reserve at the phase's end
    host_rss_bytes: int = 0
    gc_s: float = 0.0  # seconds in Python's garbage collector during the phase
    gc_longest: GcCollection | None = None  # its longest collection
    parts_s: dict[str, float] = field(default_factory=dict)  # text encoder -> seconds in its forwards (and its
    # parked part's move to the device, as "<name> to device")

    @property
    def peak_memory_bytes(self) -> int | None:
        """What runs out: reserved plus context (None on the CPU)."""
        if self.peak_reserved_bytes is None:
            return None
        return self.peak_reserved_bytes + (self.context_bytes or 0)


@dataclass
class Generation:
    output: Any  # frames (video: F x H x W x 3) or images (B x H x W x 3), floats in [0, 1]
    latents: torch.Tensor | None
    phases: dict[str, PhaseMeasurement]
    step_times_s: list[float]
    host_peak_bytes: int
    seconds: float
    encode_cached: bool = False  # the prompt was encoded before in this process: no text encoder ran


class _Clock:
    """Phase boundaries: time, the allocator's peaks since the last boundary, the context, host RSS."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.phases: dict[str, PhaseMeasurement] = {}
        self.current: str | None = None
        self.t0 = 0.0
        self.gc_s = 0.0  # the current phase's seconds in the garbage collector so far
        self.gc_longest: GcCollection | None = None
        self._gc_t0: float | None = None
        self.parts: dict[str, float] = {}  # the current phase's seconds per timed component so far
        self._part_t0: dict[str, float] = {}

    def part_start(self, name: str) -> None:
        """A timed component's forward begins (the device idle first, so its time is its own)."""
        if self.current is not None and name not in self._part_t0:  # an inner call of the same component: one span
            self._sync()
            self._part_t0[name] = time.perf_counter()

    def part_move(self, name: str, move: Callable[[], None]) -> None:
        """`move()` timed as its own part (the device synchronized at its edges), left out of the spans open
        around it: a parked component's move to the device, told apart from its forwards."""
        if self.current is None:
            move()
            return
        self._sync()
        t0 = time.perf_counter()
        move()
        self._sync()
        dt = time.perf_counter() - t0
        self.parts[name] = self.parts.get(name, 0.0) + dt
        for k in self._part_t0:
            self._part_t0[k] += dt

    def part_stop(self, name: str) -> None:
        t0 = self._part_t0.pop(name, None)
        if t0 is not None and self.current is not None:
            self._sync()
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0

    def on_gc(self, event: str, info: dict) -> None:
        """A `gc.callbacks` entry: add a collection's time to the current phase."""
        if event == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            if self.current is not None:
                dt = time.perf_counter() - self._gc_t0
                self.gc_s += dt
                if self.gc_longest is None or dt > self.gc_longest.seconds:
                    self.gc_longest = GcCollection(seconds=dt, generation=int(info.get("generation", -1)),
                                                   collected=int(info.get("collected", 0)))
            self._gc_t0 = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self, name: str) -> None:
        self._sync()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.parts, self._part_t0 = {}, {}
        self.current, self.t0, self.gc_s, self.gc_longest = name, time.perf_counter(), 0.0, None

    def stop(self) -> None:
        from chunkflow.hostmem import rss_bytes

        self._sync()
        m = PhaseMeasurement(time_s=time.perf_counter() - self.t0, host_rss_bytes=rss_bytes(), gc_s=self.gc_s,
                             gc_longest=self.gc_longest,
                             parts_s=dict(self.parts))
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            m.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
            m.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
            m.context_bytes = int(total - free - torch.cuda.memory_reserved(self.device))
        self.phases[self.current] = m
        self.current = None


@contextlib.contextmanager
def execution_device(pipe, device: torch.device):
    """Within: the pipeline computes on `device` whatever its components' devices are (parked components sit in
    host memory). The instance's class is swapped for a subclass with a fixed `_execution_device`, then restored."""
    cls = type(pipe)
    pipe.__class__ = type(cls.__name__, (cls,), {"_execution_device": property(lambda self: device),
                                                 "__module__": cls.__module__})
    try:
        yield pipe
    finally:
        pipe.__class__ = cls


def takes_negative_prompt(spec) -> bool:
    """Whether the model's pipeline, called as chunkflow calls it, uses a negative prompt (models/adapters.py)."""
    from chunkflow.models.adapters import takes_negative_prompt as takes

    return takes(spec)


def call_kwargs(spec, w, prompt: str, negative: str | None, guidance: float | None, steps: int,
                generator: torch.Generator, pipe_cls: type | None = None, image=None) -> dict[str, Any]:
    """The pipeline call for workload `w`: the keyword arguments the class's `__call__` takes (models/adapters.py;
    `pipe_cls` defaults to the plan's pipeline class)."""
    from chunkflow.models.adapters import call_kwargs as kwargs_of, diffusers_pipeline_class

    cls = pipe_cls if pipe_cls is not None else diffusers_pipeline_class(spec.pipeline.cls)
    return kwargs_of(spec, cls, w, prompt, negative, guidance, steps, generator, image)


class _PhaseWatch:
    """The hooks that see a pipeline call's phases go by: the first transformer forward ends encode, the VAE's
    decode ends denoise, each text encoder's (and image encoder's) forward is timed (and unparked) on its own, every
    denoising step is timed and its latents checked. An image pipeline's `vae.encode` of its image (in the encode
    phase) has the VAE unparked and its inputs on the device first. `remove()` takes every hook off again."""

    def __init__(self, built: BuiltPipeline, clock: _Clock, tell: Callable[[str], None], steps: int,
                 on_step: Callable[[int, int], None] | None) -> None:
        self.built, self.clock, self.tell, self.steps, self.on_step = built, clock, tell, steps, on_step
        self.latents = None
        self.step_times: list[float] = []
        self._t_step: float | None = None
        pipe = built.pipe
        self._hooks = [getattr(pipe, name).register_forward_pre_hook(self._to_denoise, prepend=True)
                       for name in built.names("transformer")]
        # first in, last out: a CPU one's moves of inputs and outputs inside
        for name in built.names("text_encoder") + built.names("image_encoder"):
            module = getattr(pipe, name)
            self._hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: self._encoder_starts(name),
                                                                prepend=True))
            self._hooks.append(module.register_forward_hook(lambda m, a, out, name=name: clock.part_stop(name)))
        self._vae = getattr(pipe, built.spec.pipeline.vae.component)
        self._decode = self._vae.decode
        self._vae.decode = self._decode_phase
        self._encode = getattr(self._vae, "encode", None)
        if self._encode is not None:
            self._vae.encode = self._vae_encode

    def call_kwargs(self) -> dict[str, Any]:
        """What the pipeline call takes to report each step here: its step callback, handed the latents where the
        class hands them out (`_callback_tensor_inputs`), else an older class's `callback`; a class with neither
        reports no step (the report takes the denoise phase's mean step)."""
        from chunkflow.models.adapters import call_parameters

        pipe = self.built.pipe
        params = call_parameters(type(pipe))
        if "callback_on_step_end" not in params:  # older classes (PixArt): callback(step, timestep, latents)
            if "callback" in params and "callback_steps" in params:
                return {"callback": self._legacy_step_end, "callback_steps": 1}
            return {}
        latents = "latents" in (getattr(pipe, "_callback_tensor_inputs", None) or ["latents"])
        return {"callback_on_step_end": self._step_end,
                "callback_on_step_end_tensor_inputs": ["latents"] if latents else []}

    def _legacy_step_end(self, step: int, timestep, latents) -> None:
        self._step_end(self.built.pipe, step, timestep, {"latents": latents})

    def _to_denoise(self, module, args) -> None:
        if self.clock.current == "encode":
            self.clock.stop()
            self.built.park("text_encoder")
            self.built.park("image_encoder")
            self.built.park("vae")  # an image pipeline's encode of its image: the VAE is back for the decode
            self.tell("denoise")
            self.clock.start("denoise")
            self._t_step = time.perf_counter()

    def _encoder_starts(self, name: str) -> None:
        self.clock.part_start(name)
        handle = self.built.handles.get(name)
        if handle is not None and handle.parked:  # what its own pre-hook would do next, timed apart
            self.clock.part_move(f"{name} to device", handle.unpark)

    def _vae_encode(self, *args, **kw):
        """An image pipeline's encode of its image: the VAE on the device first (the pipeline moved the image to
        where the parked VAE's weights were, host memory), its inputs moved there too; untiled, as diffusers
        encodes it (a plan tiles the decode only: tiling the encode too changed the image's latents, by up to 0.40
        on Wan2.2-TI2V-5B at 704x1280 on an H200)."""
        self.built.unpark("vae")
        dev = self.built.device
        args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
        kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        tiled = getattr(self._vae, "use_tiling", False)
        if tiled:
            self._vae.use_tiling = False
        try:
            return self._encode(*args, **kw)
        finally:
            if tiled:
                self._vae.use_tiling = True

    def _decode_phase(self, *args, **kw):
        if self.clock.current == "denoise":
            self.clock.stop()
            self.built.park("transformer")
            self.tell("decode")
            self.clock.start("decode")
            self.built.unpark("vae")
        return self._decode(*args, **kw)

    def _step_end(self, p, i, t, cb_kwargs):
        if self.built.device.type == "cuda":
            torch.cuda.synchronize(self.built.device)
        now = time.perf_counter()
        self.step_times.append(now - self._t_step)
        self._t_step = now
        latents = self.latents = cb_kwargs.get("latents")
        if not self.built.random_weights and latents is not None and not bool(torch.isfinite(latents).all()):
            raise GenerationError(  # stop now, not after the decode: the rest would be NaN too
                f"the latents hold NaN or infinite values after denoising step {i + 1} of {self.steps}: the "
                "checkpoint's weights may hold NaN or inf (a damaged or badly converted file), or the model overflows "
                "in its dtype; nothing was written")
        if self.on_step is not None:
            self.on_step(i + 1, self.steps)
        return cb_kwargs

    def remove(self) -> None:
        del self._vae.decode  # the instance attributes go; the class's methods are back
        if self._encode is not None:
            del self._vae.encode
        for h in self._hooks:
            h.remove()


def generate(built: BuiltPipeline, w, prompt: str, *, negative: str | None = None, guidance: float | None = None,
             steps: int | None = None, seed: int = 0, on_step: Callable[[int, int], None] | None = None,
             on_phase: Callable[[str], None] | None = None, cfg_batched: bool = False, image=None) -> Generation:
    """One generation of workload `w` from `prompt`, phase by phase (module docstring). `on_step(i, n)` hears of
    every denoising step, `on_phase(name)` of every phase as it begins. `cfg_batched`: both guidance passes of a
    step in one transformer forward (chunkflow.cfg.batch_cfg). `image`: the image to animate or edit (a path,
    checked by chunkflow.media.load_input_image, or a PIL image), for a pipeline built with `image=True`.

    `latents` are the denoising loop's last latents (as `callback_on_step_end` sees them): what the pipeline returns
    with `output_type="latent"`, except where it mixes a condition in after the loop (Wan2.2-TI2V's image-to-video,
    expand_timesteps, puts the image's latents back into the first frame)."""
    from chunkflow.hostmem import peak_rss_bytes
    from chunkflow.loading.folder_errors import folder_error

    tell = on_phase or (lambda name: None)
    device, pipe = built.device, built.pipe
    steps = steps or w.steps
    clock = _Clock(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    image = _input_image(built, image)
    kwargs = call_kwargs(built.spec, w, prompt, negative, guidance, steps, generator, type(pipe), image)
    watch = _PhaseWatch(built, clock, tell, steps, on_step)
    kwargs.update(watch.call_kwargs())
    batching = None
    gc.callbacks.append(clock.on_gc)
    cache = built.prompts
    hits, misses = (cache.hits, cache.misses) if cache is not None else (0, 0)
    t0 = time.perf_counter()
    try:
        if cfg_batched:
            from chunkflow.cfg import batch_cfg

            batching = batch_cfg(pipe)
        with torch.no_grad(), execution_device(pipe, device):
            tell("encode")
            clock.start("encode")
            out = pipe(**kwargs)
            clock.stop()
    except Exception as exc:
        blamed = folder_error(exc, pipe, built.folder)  # the folder's configs, not chunkflow (loading/folder_errors)
        if blamed is None:
            raise
        raise blamed from exc
    finally:
        gc.callbacks.remove(clock.on_gc)
        watch.remove()
        if batching is not None:
            batching.remove()
        for name in ("vae", "transformer", "text_encoder", "image_encoder"):
            built.park(name)
    seconds = time.perf_counter() - t0
    frames = out.frames[0] if hasattr(out, "frames") else out.images
    latents = watch.latents
    cached = cache is not None and cache.hits > hits and cache.misses == misses
    return Generation(frames, None if latents is None else latents.detach().to("cpu"), clock.phases,
                      watch.step_times, peak_rss_bytes(), seconds, cached)


def _input_image(built: BuiltPipeline, image):
    """The image the call is given: None where the pipeline takes none, else the checked image; a pipeline given an
    image it cannot take, or none where it needs one, is refused (GenerationError: what to do)."""
    from chunkflow.models.adapters import needs_image, takes_image

    cls = type(built.pipe)
    if image is None:
        if needs_image(cls):
            raise GenerationError(f"{cls.__name__} animates or edits an image: give it (image=..., or --image PATH)")
        return None
    if not takes_image(cls):
        raise GenerationError(f"{cls.__name__} takes no image; build the pipeline with image=True (the image "
                              "pipeline of its family), or leave the image out")
    if isinstance(image, (str, bytes)) or hasattr(image, "__fspath__"):
        from chunkflow.media import load_input_image

        return load_input_image(image)
    return image
