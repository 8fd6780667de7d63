"""What each slot of a pipeline folder's model_index.json may hold, checked before anything is imported from the
folder or built from it. A class name in model_index.json is looked up in its library and called
(`from_config`, `from_pretrained`): a model class named as the scheduler builds a full-size model, a function named
as a tokenizer runs. So every slot the plan's pipeline takes is checked first:

- the pipeline (`_class_name`): the plan's pipeline class, or given an image one of its image family
  (models/adapters.py `run_class`: a FLUX Kontext folder for a FLUX plan);
- transformers, text encoders, the VAE: the catalog's class, of the catalog's library;
- tokenizers: a tokenizer class of transformers (a `PreTrainedTokenizerBase`). A class transformers lacks is
  refused, as diffusers' `from_pretrained` refuses it ("`transformers` has no class ..."): no silent stand-in;
- the scheduler: a diffusers scheduler (a `SchedulerMixin`) offering what the pipeline calls of its scheduler
  (`set_timesteps` with the keywords the pipeline passes, `step`, `set_begin_index`: SCHEDULER_METHODS and
  SCHEDULER_KEYWORDS for the catalog's pipelines, read from the class's source for any other: scheduler_calls);
- the pipeline's own settings its class takes (Wan's boundary_ratio, expand_timesteps): the catalog model's;
- the components the run's pipeline class takes beyond the plan's model (an image-to-video pipeline's
  image_encoder and image_processor, an edit pipeline's processor): from its `__init__`, each a transformers or
  diffusers model (built from its folder) or a transformers processor (tokenizer, image processor, feature
  extractor, processor); loaded where the class needs it or the run takes an image, else left None.

A slot the plan's model does not have is refused when it is a transformer (the folder holds a model of more
experts); any other the run does not load (an image encoder for IP-adapters) is not loaded, and the build says so.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkflow_planner.checkpoint import CheckpointError, shown

__all__ = ["FolderSlots", "check_slots", "SCHEDULER_METHODS", "SCHEDULER_KEYWORDS"]

SCHEDULER_METHODS = ("set_timesteps", "step", "set_begin_index")  # what every catalog pipeline calls
# the keywords each catalog pipeline passes to its scheduler's set_timesteps (through diffusers'
# retrieve_timesteps, which refuses a scheduler whose set_timesteps does not take them); the tests read them from
# the pipelines' own source
SCHEDULER_KEYWORDS: dict[str, tuple[str, ...]] = {
    "WanPipeline": (),
    "FluxPipeline": ("sigmas", "mu"),
    "QwenImagePipeline": ("sigmas", "mu"),
    "HunyuanVideoPipeline": ("sigmas",),
}
_TRANSFORMER = re.compile(r"transformer(_\d+)?")


@dataclass(frozen=True)
class FolderSlots:
    """The classes a folder's tokenizers and scheduler are made with, the pipeline's own settings, and the slots
    left unloaded (each said as 'name (library Class)')."""

    tokenizers: dict[str, type]
    scheduler: type
    settings: dict[str, Any]
    unloaded: list[str] = field(default_factory=list)
    pipeline: type | None = None  # the diffusers pipeline class the run makes
    models: dict[str, type] = field(default_factory=dict)  # extra model components: name -> class (image_encoder)
    processors: dict[str, type] = field(default_factory=dict)  # extra processors: name -> class (image_processor)
    absent: list[str] = field(default_factory=list)  # components the class takes that are None (optional)


def _where(folder: Path) -> str:
    """How errors name the file: model_index.json in '<folder>'."""
    return f"model_index.json in {str(folder)!r}"


def _model_slots(spec) -> dict[str, tuple[str, str]]:
    """Slot -> (library, class) of the plan's model classes: transformers, text encoders, VAE."""
    pipe = spec.pipeline
    want = {"transformer": ("diffusers", spec.diffusers.cls)}
    want.update({f"transformer_{k + 1}": ("diffusers", spec.diffusers.cls) for k in range(1, pipe.experts)})
    want.update({te.component: ("transformers", te.cls) for te in pipe.text_encoders})
    want[pipe.vae.component] = ("diffusers", pipe.vae.cls)
    return want


def _check_models(folder: Path, declared: dict[str, tuple[str, str]], spec) -> None:
    """Each model slot of the plan's pipeline declared, with the catalog's class of the catalog's library."""
    for name, (lib, cls) in _model_slots(spec).items():
        if name not in declared:
            raise CheckpointError(f"{_where(folder)} names no {name}; the pipeline folder is incomplete: download "
                                  "or save it again")
        if declared[name][1] != cls:
            raise CheckpointError(f"{_where(folder)} makes {name} a {declared[name][1]}, but the plan's model runs a "
                                  f"{cls}; the folder holds another pipeline")
        if declared[name][0] != lib:
            raise CheckpointError(f"{_where(folder)} makes {name} a {cls} of {declared[name][0]}; {cls} is a {lib} "
                                  f"class: fix model_index.json ([\"{lib}\", \"{cls}\"]) or download the pipeline "
                                  "again")


def _library_class(library: str, name: str):
    """`library`'s attribute `name`, or None (a name it lacks, or one whose import fails)."""
    import importlib

    try:
        return getattr(importlib.import_module(library), name, None)
    except Exception:  # a lazily imported module that cannot be imported here: the class is not available
        return None


def _tokenizer_class(folder: Path, slot: str, declared: dict[str, tuple[str, str]]) -> type:
    """The transformers tokenizer class the folder declares for `slot`, checked to be one."""
    import transformers

    if slot not in declared:
        raise CheckpointError(f"{_where(folder)} names no {slot}; the pipeline folder is incomplete: download or "
                              "save it again")
    lib, name = declared[slot]
    if lib != "transformers":
        raise CheckpointError(f"{_where(folder)} makes {slot} a {name} of {lib}; a tokenizer is a transformers "
                              "class: fix model_index.json or download the pipeline again")
    cls = _library_class("transformers", name)
    if cls is None:
        raise CheckpointError(f"{_where(folder)} makes {slot} a {name}, which transformers {transformers.__version__} "
                              "does not have (diffusers refuses it too); upgrade transformers, or fix model_index.json")
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        raise CheckpointError(f"{_where(folder)} makes {slot} a {name}, which is not a tokenizer (a transformers "
                              "PreTrainedTokenizerBase); nothing was made from it: fix model_index.json or download "
                              "the pipeline again")
    return cls


def scheduler_calls(pipe_cls: str, sched_cls: type | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the scheduler methods, the keywords of its set_timesteps) the diffusers pipeline class's `__call__` calls,
    read from its source (retrieve_timesteps calls set_timesteps with the keywords it is given): what a pipeline
    outside the catalog asks of its scheduler. With `sched_cls`, a branch under `isinstance(self.scheduler, X)`
    counts only where it runs for that class (Bria gives DDIM no sigmas, FlowMatchEuler a mu). None asked where the
    source cannot be read."""
    import ast
    import textwrap

    import diffusers

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(diffusers, pipe_cls).__call__)))
    except (OSError, TypeError, SyntaxError, AttributeError):
        return ("set_timesteps", "step"), ()
    called, keywords = {"set_timesteps", "step"}, set()
    for node in _reached_calls(tree, sched_cls):
        f = node.func
        if isinstance(f, ast.Attribute) and ast.unparse(f.value) == "self.scheduler":
            called.add(f.attr)
            if f.attr == "set_timesteps":
                keywords |= {k.arg for k in node.keywords if k.arg}
        if isinstance(f, ast.Name) and f.id == "retrieve_timesteps":
            keywords |= {k.arg for k in node.keywords if k.arg}
    return tuple(sorted(called)), tuple(sorted(keywords - {"device", "num_inference_steps"}))


def _scheduler_is(test, sched_cls: type | None) -> tuple[bool, bool]:
    """(whether an `if`'s body may run, whether its else may) for a scheduler of `sched_cls`, from the
    isinstance(self.scheduler, ...) calls of its test: a test of isinstance calls alone (or-ed) decides both; one
    and-ed with other conditions decides only that the body cannot run; anything else, both may."""
    import ast

    import diffusers

    checks = [n for n in ast.walk(test) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id == "isinstance" and len(n.args) == 2 and ast.unparse(n.args[0]) == "self.scheduler"]
    if sched_cls is None or not checks:
        return True, True
    names = [ast.unparse(e) for c in checks for e in (c.args[1].elts if isinstance(c.args[1], ast.Tuple)
                                                       else [c.args[1]])]
    kinds = [k for k in (getattr(diffusers, n.split(".")[-1], None) for n in names) if isinstance(k, type)]
    if len(kinds) != len(names):
        return True, True
    hit = issubclass(sched_cls, tuple(kinds))
    alone = test in checks or (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or)
                               and all(v in checks for v in test.values))
    if alone:
        return hit, not hit
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(v in checks for v in test.values):
        return hit, True
    return True, True


def _reached_calls(node, sched_cls: type | None):
    """The Call nodes under `node` a scheduler of `sched_cls` may reach (_scheduler_is prunes the branches)."""
    import ast

    if isinstance(node, ast.If):
        body, orelse = _scheduler_is(node.test, sched_cls)
        yield from _reached_calls(node.test, sched_cls)
        for stmt in (node.body if body else []) + (node.orelse if orelse else []):
            yield from _reached_calls(stmt, sched_cls)
        return
    if isinstance(node, ast.Call):
        yield node
    for child in ast.iter_child_nodes(node):
        yield from _reached_calls(child, sched_cls)


def _scheduler_class(folder: Path, declared: dict[str, tuple[str, str]], pipe_cls: str) -> type:
    """The diffusers scheduler class the folder declares, checked to offer what `pipe_cls` calls of it."""
    import diffusers

    if "scheduler" not in declared:
        raise CheckpointError(f"{_where(folder)} names no scheduler; the pipeline folder is incomplete: download or "
                              "save it again")
    lib, name = declared["scheduler"]
    if lib != "diffusers":
        raise CheckpointError(f"{_where(folder)} makes the scheduler a {name} of {lib}; a scheduler is a diffusers "
                              "class: fix model_index.json or download the pipeline again")
    cls = _library_class("diffusers", name)
    if cls is None:
        raise CheckpointError(f"{_where(folder)} names scheduler class {name!r}, which diffusers "
                              f"{diffusers.__version__} does not have; fix model_index.json or upgrade diffusers")
    if not (isinstance(cls, type) and issubclass(cls, diffusers.SchedulerMixin)):
        raise CheckpointError(f"{_where(folder)} makes the scheduler a {name}, which is not a scheduler (a diffusers "
                              "SchedulerMixin); nothing was made from it: fix model_index.json or download the "
                              "pipeline again")
    methods, keywords = ((SCHEDULER_METHODS, SCHEDULER_KEYWORDS[pipe_cls]) if pipe_cls in SCHEDULER_KEYWORDS
                         else scheduler_calls(pipe_cls, cls))
    lacks = [m for m in methods if not callable(getattr(cls, m, None))]
    if not lacks:
        takes = inspect.signature(cls.set_timesteps).parameters
        lacks = [f"set_timesteps({k}=...)" for k in keywords if k not in takes]
    if lacks:
        raise CheckpointError(f"{_where(folder)} makes the scheduler a {name}, which lacks {', '.join(lacks)} that "
                              f"{pipe_cls} calls; diffusers would fail in the middle of the generation: use a "
                              "scheduler the pipeline can drive (its own, e.g. the one the model was published with)")
    return cls


def _settings(folder: Path, index: dict[str, Any], pipe_spec, cls: type) -> dict[str, Any]:
    """The pipeline's own settings model_index.json gives that its class `cls` takes, each the catalog model's."""
    params = inspect.signature(cls.__init__).parameters
    out = {}
    for k, v in index.items():
        if k.startswith("_") or isinstance(v, list) or k not in params:
            continue
        want = pipe_spec.config.get(k, params[k].default)
        if k == "boundary_ratio" and pipe_spec.boundary_ratio is not None:
            want = pipe_spec.boundary_ratio
        if v != want or isinstance(v, bool) != isinstance(want, bool):  # 1 is not True here
            raise CheckpointError(f"{_where(folder)} sets {k} to {shown(v)}, but the plan's model runs its "
                                  f"{pipe_spec.cls} with {shown(want)}; the folder holds another model: point "
                                  "--weights at the pipeline the plan was made for")
        out[k] = v
    return out


def _unloaded(folder: Path, declared: dict[str, tuple[str, str]], loaded: set[str]) -> list[str]:
    """The declared slots the plan's pipeline does not load; a transformer among them is refused."""
    out = []
    for name, (lib, cls) in declared.items():
        if name in loaded:
            continue
        if _TRANSFORMER.fullmatch(name):
            raise CheckpointError(f"{_where(folder)} names a {name} ({cls}), which the plan's model does not have; "
                                  "the folder holds a model of more experts: point --weights at the pipeline the "
                                  "plan was made for")
        out.append(f"{name} ({lib} {cls})")
    return out


PROCESSOR_BASES = ("PreTrainedTokenizerBase", "ProcessorMixin", "ImageProcessingMixin", "FeatureExtractionMixin")


def _extra_class(folder: Path, slot: str, lib: str, name: str) -> tuple[str, type]:
    """("model" or "processor", the class) of a component the pipeline class takes beyond the plan's model: a
    transformers or diffusers model, or a transformers processor; anything else refused before it is made."""
    import diffusers
    import transformers

    if lib not in ("transformers", "diffusers"):
        raise CheckpointError(f"{_where(folder)} makes {slot} a {name} of {lib}; chunkflow loads transformers and "
                              "diffusers components only: fix model_index.json or download the pipeline again")
    cls = _library_class(lib, name)
    if not isinstance(cls, type):
        raise CheckpointError(f"{_where(folder)} makes {slot} a {name}, which {lib} does not have; upgrade {lib}, or "
                              "fix model_index.json")
    if issubclass(cls, (transformers.PreTrainedModel, diffusers.ModelMixin)):
        return "model", cls
    if lib == "transformers" and any(issubclass(cls, getattr(transformers, b)) for b in PROCESSOR_BASES):
        return "processor", cls
    raise CheckpointError(f"{_where(folder)} makes {slot} a {name}, which is neither a model nor a processor of "
                          f"{lib}; nothing was made from it: fix model_index.json or download the pipeline again")


def _extras(folder: Path, index: dict[str, Any], declared: dict[str, tuple[str, str]], cls: type, loaded: set[str],
            image: bool) -> tuple[dict[str, type], dict[str, type], list[str]]:
    """The components `cls` takes beyond `loaded`: (models, processors, absent ones). One is loaded where the
    class needs it or the run takes an image (an image-to-video pipeline's image encoder); an optional one the
    folder lacks is None."""
    params = inspect.signature(cls.__init__).parameters
    optional = set(getattr(cls, "_optional_components", None) or [])
    models: dict[str, type] = {}
    processors: dict[str, type] = {}
    absent: list[str] = []
    for name, p in params.items():
        setting = name in index and not isinstance(index[name], list)  # Wan's expand_timesteps
        if name in ("self", "args", "kwargs") or name in loaded or setting:
            continue  # a setting, or a component the plan's model has
        required = p.default is inspect.Parameter.empty and name not in optional
        if name in declared and (required or image):
            kind, found = _extra_class(folder, name, *declared[name])
            (models if kind == "model" else processors)[name] = found
        elif required and name not in declared:
            raise CheckpointError(f"{_where(folder)} names no {name}, which {cls.__name__} needs; the pipeline "
                                  "folder is incomplete: download or save it again")
        elif p.default is None or name in optional or name in index:
            absent.append(name)
    return models, processors, absent


def check_slots(folder: Path, spec, image: bool = False) -> FolderSlots:
    """Every slot of `folder`'s model_index.json checked against what catalog model `spec`'s pipeline may hold
    there (module docstring), before anything is made from the folder: the pipeline class the run makes (given an
    image or not), the tokenizer and scheduler classes to make them with, the extra components its class takes,
    the pipeline's own settings, and the slots not loaded."""
    from chunkflow.models.adapters import run_class
    from chunkflow.weights import _model_index, pipeline_components

    pipe = spec.pipeline
    index = _model_index(folder)
    cls = run_class(pipe.cls, index["_class_name"], image, where=repr(str(folder)))
    settings = _settings(folder, index, pipe, cls)
    run_class(pipe.cls, index["_class_name"], image, where=repr(str(folder)), spec=spec, settings=settings)
    declared = pipeline_components(folder)
    _check_models(folder, declared, spec)
    tokenizers = {te.tokenizer: _tokenizer_class(folder, te.tokenizer, declared) for te in pipe.text_encoders}
    scheduler = _scheduler_class(folder, declared, cls.__name__)
    loaded = set(_model_slots(spec)) | set(tokenizers) | {"scheduler"}
    models, processors, absent = _extras(folder, index, declared, cls, loaded, image)
    unloaded = _unloaded(folder, declared, loaded | set(models) | set(processors))
    return FolderSlots(tokenizers, scheduler, settings, unloaded, cls, models, processors, absent)
