"""Where `--weights DIR_OR_ID` points: a local diffusers pipeline folder, or a Hugging Face Hub id found in the
local Hugging Face cache. Nothing here downloads or opens a network connection; a model that is not on this
machine is an error that says how to get it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from chunkflow_planner.errors import ChunkflowError

__all__ = ["WeightsError", "hub_cache_dir", "pipeline_class_name", "pipeline_components", "resolve_weights"]

MODEL_INDEX = "model_index.json"
# a Hub repo id: org/name, each part word characters, '-' and '.', starting and ending with a word character
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")


class WeightsError(ChunkflowError):
    """`--weights` names no usable diffusers pipeline on this machine."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process uses, read from the environment now (HF_HUB_CACHE, the legacy
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub), as
    huggingface_hub does when it is imported."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def _looks_like_path(source: str) -> bool:
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return (source.startswith(("/", ".", "~")) or source.endswith(tuple(seps)) or "\\" in source
            or re.match(r"[A-Za-z]:", source) is not None or sum(source.count(s) for s in seps) >= 2)


def _check_pipeline_folder(folder: Path, shown: str) -> Path:
    """`folder` if it holds model_index.json (whatever kind of file: reading it says what is wrong with it), else
    the error saying what it is instead."""
    if (folder / MODEL_INDEX).exists():
        return folder
    msg = f"--weights {shown}: {str(folder)!r} is not a diffusers pipeline folder ({MODEL_INDEX} missing)"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors*")):
        msg += ("; it holds a single model (config.json + safetensors), and --weights takes the whole pipeline "
                f"folder, the one holding {MODEL_INDEX} and a subfolder per component")
        if (folder.parent / MODEL_INDEX).is_file():
            msg += f": here {str(folder.parent)!r}"
    elif folder.name.startswith("models--") and (folder / "snapshots").is_dir():
        repo_id = folder.name[len("models--"):].replace("--", "/")
        msg += f"; it is a Hugging Face cache entry: pass the Hub id, --weights {repo_id}"
    else:
        msg += f"; give the folder holding {MODEL_INDEX} (what pipe.save_pretrained or `hf download` makes)"
    raise WeightsError(msg)


def resolve_weights(source: str) -> Path:
    """The diffusers pipeline folder `--weights DIR_OR_ID` points to, never downloading anything.

    An existing directory must hold model_index.json. Otherwise `org/name` or `org/name@revision` (a branch, tag
    or commit hash) is looked up in the local Hugging Face cache only (`hub_cache_dir()`), with
    `huggingface_hub.snapshot_download(..., local_files_only=True)`, and the snapshot must hold model_index.json.
    """
    source = str(source).strip()
    if not source:
        raise WeightsError("--weights is empty; give a diffusers pipeline folder or a Hub id org/name")
    try:
        return _resolve(source)
    except OSError as exc:  # a name longer than the file system takes (ENAMETOOLONG), a loop of links, ...
        from chunkflow_planner.checkpoint import shown

        raise WeightsError(f"--weights {shown(source)} cannot be looked up: {exc.strerror or exc}; give a diffusers "
                           "pipeline folder or a Hub id org/name") from None


def _resolve(source: str) -> Path:
    local = Path(source).expanduser()
    if local.is_dir():
        return _check_pipeline_folder(local.absolute(), repr(source))
    if local.exists():
        hint = f"give its folder, --weights {str(local.parent)!r}" if local.name == MODEL_INDEX else (
            f"give the diffusers pipeline folder (the one holding {MODEL_INDEX})")
        raise WeightsError(f"--weights {source!r} is a file; {hint}")
    if _looks_like_path(source):
        from chunkflow_planner.files import not_there

        why = not_there(local.absolute())
        if why != "does not exist":
            raise WeightsError(f"--weights {source!r} {why}")
        raise WeightsError(f"--weights {source!r}: no such folder ({str(local.absolute())!r} does not exist); give "
                           f"a diffusers pipeline folder (the one holding {MODEL_INDEX}) or a Hub id org/name")
    repo_id, at, revision = source.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or (at and not revision.strip()):
        raise WeightsError(f"--weights {source!r} is neither an existing folder nor a Hub id (org/name or "
                           "org/name@revision); give a diffusers pipeline folder or a Hub id")
    return _from_cache(repo_id, revision.strip() or None, source)


def _from_cache(repo_id: str, revision: str | None, source: str) -> Path:
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise WeightsError(f"--weights {source!r} is a Hub id, and reading the Hugging Face cache needs "
                           "huggingface_hub: pip install 'chunkflow-dit[diffusers]' (or pass a local folder)") from None
    get = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        # local_files_only: the cache is read (refs/<revision>, snapshots/<commit>), the Hub never asked
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except HFValidationError as exc:
        raise WeightsError(f"--weights {source!r} is not a valid Hub id ({exc}); give org/name or a folder") from None
    except LocalEntryNotFoundError as exc:
        if type(exc).__name__ == "IncompleteSnapshotError":
            raise WeightsError(f"--weights {source!r}: the cached snapshot in {str(cache)!r} is incomplete (an "
                               f"interrupted download?); finish it with `{get}` on a machine with internet, "
                               "or pass a local pipeline folder") from None
        raise WeightsError(f"--weights {source!r}: {repo_id}{_revision_note(cache, repo_id, revision)} is not in the "
                           f"local Hugging Face cache {str(cache)!r} (HF_HUB_CACHE / HF_HOME) and chunkflow never "
                           f"downloads; get it with `{get}` (or `huggingface-cli download {repo_id}`) on a machine "
                           "with internet into that cache, or pass a local pipeline folder") from None
    return _check_pipeline_folder(Path(folder), repr(source))


def _revision_note(cache: Path, repo_id: str, revision: str | None) -> str:
    """' at revision R (cached: main, 0123abcd...)' when the repo is cached at other revisions."""
    if revision is None:
        return ""
    entry = cache / ("models--" + repo_id.replace("/", "--"))
    have = sorted(p.name for p in (entry / "refs").glob("*") if p.is_file()) if (entry / "refs").is_dir() else []
    have += sorted(p.name[:12] for p in (entry / "snapshots").glob("*")) if (entry / "snapshots").is_dir() else []
    return f" at revision {revision}" + (f" (cached: {', '.join(have)})" if have else "")


MAX_NAME = 128  # characters of a class, library or component name in model_index.json (real ones: under 64)
_CLASS = re.compile(rf"[A-Za-z_][A-Za-z0-9_]{{0,{MAX_NAME - 1}}}")
_LIBRARY = re.compile(rf"[A-Za-z_][A-Za-z0-9_.]{{0,{MAX_NAME - 1}}}")  # a module: "diffusers", "onnxruntime.training"


def _model_index(folder: Path) -> dict[str, Any]:
    """model_index.json of `folder`, read bounded (a regular file of at most MAX_JSON_BYTES) and checked to be a
    JSON object naming its pipeline class."""
    from chunkflow_planner.checkpoint import MAX_JSON_BYTES, shown
    from chunkflow_planner.files import read_bounded

    path = Path(folder).expanduser() / MODEL_INDEX
    if not path.exists():
        raise WeightsError(f"{str(Path(folder))!r} is not a diffusers pipeline folder ({MODEL_INDEX} missing)")
    raw = read_bounded(path, repr(str(path)), MAX_JSON_BYTES, error=WeightsError,
                       fix="re-download or re-save the pipeline")
    try:
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                           "re-download or re-save the pipeline") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{str(path)!r} cannot be read ({str(exc)[:200]}); re-download or re-save the pipeline"
                           ) from None
    except RecursionError:
        raise WeightsError(f"{str(path)!r} is nested too deeply to be a model_index.json; re-download or re-save the "
                           "pipeline") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{str(path)!r} holds a JSON {type(data).__name__}, not an object; "
                           "re-download or re-save the pipeline")
    cls = data.get("_class_name")
    if not isinstance(cls, str) or not cls:
        raise WeightsError(f"{str(path)!r} has no \"_class_name\" (the pipeline class); "
                           "is it a diffusers model_index.json? re-download or re-save the pipeline")
    if not _CLASS.fullmatch(cls):
        raise WeightsError(f"{str(path)!r}: \"_class_name\" is {shown(cls)}, not the name of a pipeline class "
                           f"(letters, digits and '_', at most {MAX_NAME}); re-download or re-save the pipeline")
    return data


def pipeline_class_name(folder: Path) -> str:
    """The pipeline class model_index.json names ("WanPipeline", "FluxPipeline", ...)."""
    return _model_index(folder)["_class_name"]


def pipeline_components(folder: Path) -> dict[str, tuple[str, str]]:
    """model_index.json's components: name -> (library, class name), e.g. "transformer" -> ("diffusers",
    "WanTransformer3DModel"). Entries starting with "_", absent components ([null, null]) and plain pipeline
    settings (numbers, booleans, strings, such as Wan 2.2's "boundary_ratio") are left out. Every component's
    name, library and class must be names (identifiers of at most MAX_NAME characters): nothing else is looked up
    or shown."""
    from chunkflow_planner.checkpoint import shown

    data = _model_index(folder)
    path = Path(folder) / MODEL_INDEX
    out: dict[str, tuple[str, str]] = {}
    for name, value in data.items():
        if name.startswith("_") or not isinstance(value, list):
            continue
        if value == [None, None]:
            continue
        if len(value) != 2 or not all(isinstance(v, str) and v for v in value):
            raise WeightsError(f"{str(path)!r}: component {shown(name)} is {shown(json.dumps(value))}; expected "
                               "[library, class name] such as [\"diffusers\", \"AutoencoderKL\"]")
        if not _CLASS.fullmatch(name):
            raise WeightsError(f"{str(path)!r}: component name {shown(name)} is not a name (letters, digits and '_', "
                               f"at most {MAX_NAME}); re-download or re-save the pipeline")
        bad = [v for v, pattern in ((value[0], _LIBRARY), (value[1], _CLASS)) if not pattern.fullmatch(v)]
        if bad:
            raise WeightsError(f"{str(path)!r}: component {shown(name)} is {shown(json.dumps(value))}, and "
                               f"{shown(bad[0])} is not a name (letters, digits and '_', at most {MAX_NAME}); "
                               "re-download or re-save the pipeline")
        out[name] = (value[0], value[1])
    return out
