"""Build a catalog model's whole diffusers pipeline with every component where the plan places it.

Every component is built on the meta device (models/components.py) and written once into its final place by
`offload(source=...)`: from a local diffusers pipeline folder (`--weights`; every class model_index.json names
checked against what its slot may hold before anything is made from it (models/slots.py), every component's
config, size and files checked before any is read, then each read straight from its safetensors files, loading/;
the tokenizers and the scheduler last, models/folder_parts.py), or from random weights with local tokenizers. Both
go through the same placement code, so a loaded pipeline holds what a random one of the same plan holds. Placements (chunkflow_planner/pipeline/placement.py) become offload handles:
- `gpu`: `offload(mode="none")` on the device, never parked;
- `phase`: the same, parked (in one pinned host allocation) outside its phase;
- `stream`: `offload(...)` with the plan's setting (a text encoder: 16 MB chunks, its layers), parked outside;
- `cpu`: on the CPU; its inputs are moved there and its outputs back to the device around each forward;
- `disk`: host memory holds none of it between uses: its weights stay in the checkpoint's safetensors files (needs
  `--weights`) and are read when it runs. A text encoder or a transformer is streamed with every block's tail read
  from the files each forward (runtime/tiers/disk.py; a text encoder in 16 MB chunks, a transformer with the plan's
  setting), a VAE is whole on the device for its phase; the tensors outside the blocks are parked in the files
  (`offload(park_to="disk")`) and read back to the device when it runs. The load reads none of its bytes (it checks
  its files and headers).
Experts (Wan2.2-A14B's `transformer` and `transformer_2`) take turns on the device (`take_turns`).

The pipeline class is the one the run makes (models/adapters.py `run_class`): the folder's model_index.json
`_class_name` (the plan's class, or given an image one of its image family), or the image sibling of the plan's
class (WanPipeline given an image: WanImageToVideoPipeline). What that class takes beyond the plan's model comes from
the folder (models/slots.py): a model (an image encoder) is built and placed as a text encoder is (`gpu`, `phase` by
default, `cpu`), its inputs moved to the device; a processor (an image processor) is loaded as a tokenizer is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from chunkflow.models.components import Component, text_encoder_component, vae_component
from chunkflow.models.prompt_cache import PromptCache
from chunkflow.models.slots import FolderSlots, check_slots
from chunkflow.models.transformer_file import file_setting
from chunkflow.api import offload
from chunkflow.runtime.handle import OffloadError, OffloadHandle, take_turns
from chunkflow_planner.checkpoint import CheckpointError
from chunkflow_planner.offload import OffloadConfig

TEXT_STREAM = OffloadConfig("chunkflow", 16 * 10**6, 0.0)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class BuiltPipeline:
    """A pipeline and the handles that place its components."""

    pipe: Any
    spec: Any
    device: torch.device
    placements: dict[str, str]
    handles: dict[str, OffloadHandle] = field(default_factory=dict)
    hooks: list = field(default_factory=list)
    random_weights: bool = True
    load: "LoadMeasurement | None" = None  # how the build went (build_pipeline)
    prompts: "PromptCache | None" = None  # the text encoders' outputs kept for prompts already encoded
    extra_models: list[str] = field(default_factory=list)  # models beyond the plan's (an image encoder)
    folder: Path | None = None  # the pipeline folder it was loaded from (None: random weights)
    transformer_files: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (file, format) read

    def disk_reads(self) -> dict[str, int]:
        """Bytes each component read from the checkpoint's files since it was built (its blocks' tails and its
        parked tensors), for the components that keep any of their weights on disk."""
        out = {}
        for name, h in self.handles.items():
            st = h.stats()
            if st.disk_blocks or st.park_to == "disk":
                out[name] = st.disk_bytes_read + st.disk_unpark_bytes_read
        return out

    def names(self, kind: str) -> list[str]:
        """Component names of a kind: text_encoder, image_encoder (any model the pipeline class takes beyond the
        plan's), transformer or vae."""
        pipe = self.spec.pipeline
        if kind == "image_encoder":
            return list(self.extra_models)
        if kind == "text_encoder":
            return [te.component for te in pipe.text_encoders]
        if kind == "transformer":
            return ["transformer"] + [f"transformer_{k + 1}" for k in range(1, pipe.experts)]
        return [pipe.vae.component]

    def park(self, kind: str) -> None:
        """Park the components of `kind` placed `phase`, `stream` or `disk` (their device memory back to the
        allocator)."""
        for n in self.names(kind):
            if self.placements.get(n) in ("phase", "stream", "disk"):
                self.handles[n].park()

    def unpark(self, kind: str) -> None:
        for n in self.names(kind):
            if n in self.handles:
                self.handles[n].unpark()

    def remove(self) -> None:
        """Every hook and handle off; components back as they were built (block tensors on the CPU)."""
        self._unhook(lambda h: h.remove())

    def discard(self) -> None:
        """Every hook and handle off and every host and device buffer freed, nothing put back (no copy of the
        weights): for a run that is done with the pipeline. Its modules are left on the meta device."""
        from chunkflow.runtime.handle import discard

        self._unhook(discard)

    def _unhook(self, end_handle) -> None:
        """The prompt cache and every hook off, then `end_handle(h)` for each offload handle."""
        if self.prompts is not None:
            self.prompts.remove()
            self.prompts = None
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for h in self.handles.values():
            end_handle(h)
        self.handles = {}


# ------------------------------------------------------------------------------------------- helpers


def _cpu_io(module: nn.Module, device: torch.device) -> list:
    """Hooks that move a CPU-placed module's tensor inputs to the CPU and its outputs to `device`."""

    def to(x, dev):
        if isinstance(x, torch.Tensor):
            return x.to(dev)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(to(v, dev) for v in x)
        if isinstance(x, dict):
            for k in list(x.keys()):
                x[k] = to(x[k], dev)
            return x
        return x

    def pre(mod, args, kwargs):
        return to(args, torch.device("cpu")), to(kwargs, torch.device("cpu"))

    def post(mod, args, kwargs, out):
        return to(out, device)

    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True)]


def _inputs_to(module: nn.Module, device: torch.device):
    """A hook moving the module's tensor inputs to `device`: a pipeline moves them to where the module's weights are
    (diffusers' get_module_execution_device), which for a parked module is host memory until its forward."""

    def pre(mod, args, kwargs):
        return (tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args),
                {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    return module.register_forward_pre_hook(pre, with_kwargs=True)


def _place(module: nn.Module, placement: str, device: torch.device, cfg: OffloadConfig | None, source=None,
           blocks=None, share_host: bool = True) -> tuple[OffloadHandle, list]:
    """Offload `module` as `placement` says (see the module docstring); returns (handle, extra hooks). `share_host`:
    the plan's (parked in one copy the ranks of a host share, under torchrun)."""
    if placement == "cpu":
        handle = offload(module, "none", device="cpu", source=source)
        return handle, _cpu_io(module, device)
    if placement in ("gpu", "phase"):
        handle = offload(module, OffloadConfig("none", share_host=share_host), device=device, source=source)
    elif placement == "stream":
        handle = offload(module, cfg, device=device, source=source, blocks=blocks)
    elif placement == "disk":
        handle = _on_disk(module, cfg, device, source, blocks)
    else:
        raise OffloadError(f"unknown placement {placement!r}")
    if placement != "gpu":
        handle.park()
    return handle, []


def _on_disk(module: nn.Module, cfg: OffloadConfig | None, device: torch.device, source, blocks=None
             ) -> OffloadHandle:
    """`module` placed `disk`: streamed with every block's tail in the checkpoint's files where `cfg` streams (its
    weights as the files hold them: bf16 storage), whole on the device for its phase otherwise; the tensors outside
    the blocks parked in the files. Returned parked."""
    from chunkflow.models.adapters import find_blocks

    if source is None or getattr(source, "disk_files", None) is None:
        raise OffloadError(f"{type(module).__name__} is placed on disk, read from the checkpoint's files when it runs, "
                           "but its weights come from no file: give the pipeline folder (`chunkflow run --weights "
                           "DIR`), or plan it in host memory")
    if cfg is not None and cfg.streams:
        n = len(blocks if blocks is not None else find_blocks(module))
        cfg = cfg.with_overrides(disk_blocks=n, weight_dtype="bf16", fp8_cast="compute")
        handle = offload(module, cfg, device=device, source=source, blocks=blocks, park_to="disk")
    else:
        handle = offload(module, "none", device=device, source=source, park_to="disk")
    handle.park()
    return handle


# --------------------------------------------------------------------------------------------- build


@dataclass
class LoadMeasurement:
    """How the build went: its time, what was read from the checkpoint files (bytes, those the page cache held
    before, seconds in the reads), the process's host peak at its end (the load's: nothing ran before it), and the
    bytes each component holds."""

    seconds: float
    startup_seconds: float = 0.0  # before the first byte was read or drawn: imports, tokenizers, modules, checks
    read_bytes: int = 0
    cached_bytes: int | None = 0  # None: the page cache's state could not be told
    read_seconds: float = 0.0
    pin_seconds: float = 0.0  # inside cudaHostRegister, on any thread (store.PIN_CLOCK)
    pin_wait_seconds: float = 0.0  # of the build's own thread: the page-locking the reads did not hide
    host_peak_bytes: int = 0
    component_bytes: dict[str, int] = field(default_factory=dict)
    disk_component_bytes: dict[str, int] = field(default_factory=dict)  # placed `disk`: left in the files, not read


def _prepare(spec, placements: dict[str, str], folder: Path | None, dtype: torch.dtype, device: torch.device,
             seed: int, reader, variant: str | None, slots: FolderSlots | None = None,
             files: dict[str, Path] | None = None) -> list[tuple[str, Component]]:
    """Every component on the meta device with its source, in build order (transformers, text encoders, image
    encoders, VAE); each of a folder checked (class, size, files, tensors) before any is read. `files`: transformers
    read from a single file each (checked here, loaded when placed: models/transformer_file.py)."""
    from chunkflow.models.components import extra_component

    from chunkflow.models.build import transformer_module, transformer_source
    from chunkflow.models.meta import RandomSource
    from chunkflow.models.transformer_file import file_component, no_expert

    pipe_spec = spec.pipeline
    out: list[tuple[str, Component]] = []
    names = BuiltPipeline(None, spec, device, {}).names("transformer")
    for name in files or {}:
        if name not in names:
            raise CheckpointError(no_expert(spec, name))
    for k, name in enumerate(names):
        if files and name in files:
            out.append(("transformer", file_component(name, Path(files[name]), spec, folder)))
            continue
        module = transformer_module(spec, dtype)
        if folder is not None:
            source = transformer_source(folder / name, spec, module, reader, variant, fallback=True)
            out.append(("transformer", Component(name, module, source, source.nbytes, source.variant)))
        else:
            out.append(("transformer", Component(name, module, RandomSource(seed + k, device, module))))
    for i, te in enumerate(pipe_spec.text_encoders):
        gen_dev = device if placements.get(te.component, "phase") != "cpu" else torch.device("cpu")
        out.append(("text_encoder", text_encoder_component(te, dtype, folder=folder, reader=reader, variant=variant,
                                                           seed=seed + 100 + i, gen_device=gen_dev)))
    for name, cls in (slots.models if slots is not None else {}).items():
        out.append(("image_encoder", extra_component(name, cls, dtype, folder=folder, reader=reader, variant=variant)))
    vae = pipe_spec.vae
    out.append(("vae", vae_component(vae, DTYPES[vae.dtype], folder=folder, reader=reader, variant=variant,
                                     seed=seed + 200, gen_device=device)))
    return out


def _place_component(kind: str, c: Component, where: str, device: torch.device, transformer_cfg: OffloadConfig,
                     vae_tiling: bool) -> tuple[OffloadHandle, list, str]:
    """One prepared component offloaded where the plan puts it: (handle, extra hooks, what to log)."""
    share = transformer_cfg.share_host  # the plan's, for every component of the run
    if c.file is not None:
        transformer_cfg = file_setting(transformer_cfg, c.fmt, lambda s: None)
    if kind == "transformer" and where == "disk":
        cfg = transformer_cfg if transformer_cfg.streams else TEXT_STREAM.with_overrides(share_host=share)
        handle = _on_disk(c.module, cfg, device, c.source)
        return handle, [], f"disk ({handle.cfg.label})"
    if kind == "transformer":
        cfg = transformer_cfg if where == "stream" else OffloadConfig("none", share_host=share)
        handle = offload(c.module, cfg, device=device, source=c.source)
        if where != "gpu":
            handle.park()
        return handle, [], f"{where} ({cfg.label})"
    if kind == "text_encoder":
        handle, hooks = _place(c.module, where, device, TEXT_STREAM.with_overrides(share_host=share), c.source,
                               share_host=share)
        return handle, hooks, where
    if kind == "image_encoder":  # whole where it runs (its blocks are not streamed); its inputs to its device
        where = where if where in ("gpu", "phase", "cpu") else "phase"
        handle, hooks = _place(c.module, where, device, None, c.source, share_host=share)
        if where != "cpu":
            hooks.append(_inputs_to(c.module, device))
        return handle, hooks, where
    handle, hooks = _place(c.module, where if where in ("phase", "disk") else "gpu", device, None, c.source,
                           share_host=share)
    if vae_tiling:
        c.module.enable_tiling()
    return handle, hooks, where + (" (tiled decode)" if vae_tiling else "")


def placement_words(said: str, device: torch.device) -> str:
    """What a component's placement is called on `device`: on the CPU the plan's "gpu" (and "phase") is the device,
    which is the CPU (`vae: on the device, the CPU (tiled decode)`, never `gpu`)."""
    if device.type == "cuda":
        return said
    where, _, rest = said.partition(" ")
    words = {"gpu": "on the device, the CPU", "phase": "on the device, the CPU, for its phase"}.get(where, where)
    return f"{words} {rest}".rstrip()


def build_pipeline(spec, placements: dict[str, str], transformer_cfg: OffloadConfig, device: torch.device, *,
                   weights: Path | None = None, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   vae_tiling: bool = False, variant: str | None = None, log=lambda s: None,
                   on_bytes: Callable[[int, int], None] | None = None, image: bool = False,
                   transformer_files: dict[str, Path] | None = None) -> BuiltPipeline:
    """The catalog model's pipeline with its components placed (`placements`: component name -> placement), from
    random weights or the pipeline folder `weights` (its `variant` files, e.g. "fp16", if given). Everything in the
    folder is checked before anything is read; then each component is read straight into its place.
    `on_bytes(done, total)` hears of the bytes read; `built.load` says how the build went. `image`: the run gives
    the pipeline an image (image-to-video, edit), so its class is the one that takes it (module docstring).
    `transformer_files`: transformer component name -> a single file it is read from instead of the folder
    (`--transformer FILE`; models/transformer_file.py)."""
    from chunkflow.launch import torchrun_world
    from chunkflow.models.transformer_file import load_file_component
    from chunkflow.loading.reader import FileReader

    from chunkflow.runtime.store import PIN_CLOCK

    t0, pin0 = time.perf_counter(), PIN_CLOCK.now()
    pipe_spec = spec.pipeline
    built = BuiltPipeline(None, spec, device, dict(placements), random_weights=weights is None)
    folder = Path(weights) if weights is not None else None
    built.folder = folder
    from chunkflow.models.adapters import check_masks, run_class

    slots = check_slots(folder, spec, image) if folder is not None else None  # every class it names, first
    pipe_cls = slots.pipeline if slots is not None else run_class(pipe_spec.cls, None, image, spec=spec)
    for slot in slots.unloaded if slots is not None else []:
        log(f"note: model_index.json names {slot}, which the plan's model does not use; it is not loaded")
    counter = _ByteCounter(on_bytes)
    parts: list[tuple[str, Component]] = []
    # several ranks read the same files: one's dropping the pages it brought in would make the others read them
    # from the disk again, so under torchrun the page cache keeps them
    reader = FileReader(on_bytes=counter.heard, keep_cache=torchrun_world() > 1)
    try:
        parts = _prepare(spec, placements, folder, dtype, device, seed, reader, variant, slots, transformer_files)
        built.transformer_files = {c.name: (str(c.file), c.fmt) for _, c in parts if c.file is not None}
        built.extra_models = [c.name for kind, c in parts if kind == "image_encoder"]
        _check_variant(parts, folder, variant, log)
        objects, extra = _pipeline_objects(folder, pipe_spec, slots)  # once every component's files are checked
        check_masks(pipe_cls)  # its files checked first (a broken folder says so), before any byte of them is read
        t_first = time.perf_counter()
        counter.begin(sum(c.read_bytes for _, c in parts if placements.get(c.name) != "disk"))  # disk: not read
        for kind, c in parts:
            if c.file is not None:  # a transformer from its own file: loaded now, every file checked
                load_file_component(c, spec, dtype, reader)
                file_setting(transformer_cfg, c.fmt, log)
            where = placements.get(c.name, "stream" if kind == "transformer" else "phase")
            built.placements.setdefault(c.name, where)
            handle, hooks, said = _place_component(kind, c, where, device, transformer_cfg,
                                                   vae_tiling or pipe_spec.vae.tiled_only)  # a VAE only tiles
            objects[c.name], built.handles[c.name] = c.module, handle
            built.hooks += hooks
            log(f"{c.name}: {placement_words(said, device)}")
        if pipe_spec.experts > 1:
            built.hooks.append(take_turns(*[built.handles[n] for n in built.names("transformer")]))
        built.pipe = pipe_cls(**objects, **extra)
        built.pipe.set_progress_bar_config(disable=True)
        built.prompts = PromptCache(built.pipe, built.names("text_encoder"))
    except BaseException:
        built.discard()  # nothing is copied back: what was loaded is dropped (a full host copy, else)
        raise
    finally:
        reader.close()
    built.load = _load_measurement(built, parts, reader.stats, time.perf_counter() - t0, t_first - t0)
    pin1 = PIN_CLOCK.now()
    built.load.pin_seconds, built.load.pin_wait_seconds = pin1[0] - pin0[0], pin1[1] - pin0[1]
    return built


class _ByteCounter:
    """The bytes a build has read so far, told to `on_bytes(done, total)` as they come."""

    def __init__(self, on_bytes: Callable[[int, int], None] | None) -> None:
        self.on_bytes, self.done, self.total = on_bytes, 0, 0

    def begin(self, total: int) -> None:
        self.total = total
        if self.on_bytes is not None:
            self.on_bytes(0, total)

    def heard(self, n: int) -> None:
        self.done += n
        if self.on_bytes is not None:
            self.on_bytes(self.done, self.total)


def _pipeline_objects(folder: Path | None, pipe_spec,
                      slots: FolderSlots | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pipeline's tokenizers and scheduler (from the folder, of the classes `slots` checked; or the
    catalog's), and the pipeline's own config arguments."""
    import diffusers

    from chunkflow.models.folder_parts import load_processor, load_scheduler, load_tokenizer

    objects: dict[str, Any] = {}
    if folder is not None:
        for te in pipe_spec.text_encoders:
            objects[te.tokenizer] = load_tokenizer(folder, te.tokenizer, slots.tokenizers[te.tokenizer])
        objects["scheduler"] = load_scheduler(folder, slots.scheduler)
        for name, cls in slots.processors.items():
            objects[name] = load_processor(folder, name, cls)
        objects.update({name: None for name in slots.absent})
        return objects, dict(slots.settings)
    for te in pipe_spec.text_encoders:
        objects[te.tokenizer] = _local_tokenizer(te, pipe_spec)
    objects["scheduler"] = getattr(diffusers, pipe_spec.scheduler.cls).from_config(pipe_spec.scheduler.config)
    return objects, dict(pipe_spec.config)


def _check_variant(parts: list[tuple[str, Component]], folder: Path | None, variant: str | None, log) -> None:
    """A --variant some component has; the components without it named (they read their default files)."""
    if variant is None:
        return
    plain = [c.name for _, c in parts if c.variant is None]
    if len(plain) == len(parts):
        raise CheckpointError(f"no component in {str(folder)!r} has {variant!r} variant files; leave "
                              "--variant out for the default weights")
    if plain:
        log(f"note: {', '.join(plain)} {'has' if len(plain) == 1 else 'have'} no {variant!r} variant files; "
            "their default files are read (as diffusers does)")


def _load_measurement(built: BuiltPipeline, parts: list[tuple[str, Component]], st, seconds: float,
                      startup: float) -> LoadMeasurement:
    """How the build went: its time, the bytes read (and found in the page cache), the host peak, each
    component's bytes where it now is."""
    from chunkflow.hostmem import peak_rss_bytes

    return LoadMeasurement(
        seconds=seconds, startup_seconds=startup, read_bytes=st.bytes_read, cached_bytes=st.bytes_cached if st.cache_known else None,
        read_seconds=st.seconds, host_peak_bytes=peak_rss_bytes(),
        component_bytes={c.name: held_bytes(built.handles[c.name]) for _, c in parts},
        disk_component_bytes={c.name: held_bytes(built.handles[c.name]) for _, c in parts
                              if built.placements.get(c.name) == "disk"})


def held_bytes(handle: OffloadHandle) -> int:
    """Bytes of the offloaded module's distinct parameters, wherever they are (what the plan counts)."""
    from chunkflow.runtime.tensors import all_tensors

    return sum(t.get().numel() * t.get().element_size() for t in all_tensors(handle.module) if t.is_param)


def _local_tokenizer(te, pipe_spec):
    from chunkflow.models.tokenizers import build_tokenizer

    template = None
    if te.tokenizer_kind == "qwen2":
        import diffusers

        template = getattr(getattr(diffusers, pipe_spec.cls), "prompt_template_encode", None)
    return build_tokenizer(te.tokenizer_kind, te.tokens, template)


def check_folder(spec, folder: Path, *, image: bool = False, dtype: torch.dtype = torch.bfloat16) -> FolderSlots:
    """Everything about pipeline folder `folder` that can be told without reading a weight, against the plan's model
    `spec`: every class model_index.json names (slots.py: the pipeline class the run makes, given an image or not),
    each transformer's config.json against the model's, each text encoder's, the VAE's and each extra model's
    config.json class and size (built on the meta device and counted). What `chunkflow run` checks before the load
    and its progress bar; the build checks the same again, and the files and their tensors, before it reads any."""
    from chunkflow.models.build import check_transformer_config
    from chunkflow.models.components import (checked_extra, checked_module, meta_text_encoder, meta_vae,
                                             text_encoder_reference, vae_reference)
    from chunkflow_planner.checkpoint import is_dir

    folder = Path(folder)
    slots = check_slots(folder, spec, image)
    for name in BuiltPipeline(None, spec, torch.device("cpu"), {}).names("transformer"):
        if not is_dir(folder / name):
            raise CheckpointError(f"{str(folder)!r} has no {name}/ folder; the pipeline folder is incomplete: "
                                  "download or save it again")
        check_transformer_config(folder / name, spec)
    for te in spec.pipeline.text_encoders:
        checked_module(te, lambda cfg, te=te: meta_text_encoder(te, dtype, cfg), text_encoder_reference, folder)
    vae = spec.pipeline.vae
    checked_module(vae, lambda cfg: meta_vae(vae, DTYPES[vae.dtype], cfg), vae_reference, folder)
    for name, cls in slots.models.items():
        checked_extra(name, cls, folder, dtype)
    return slots
