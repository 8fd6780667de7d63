"""A pipeline folder's tokenizers and scheduler, made from the classes models/slots.py checked, their files checked
first: every file of a tokenizer folder a regular file of a bounded size (transformers reads them whole: a FIFO
blocks it, /dev/zero never ends), and no file outside it named by its tokenizer_config.json; a scheduler config
read bounded with its integers and lists bounded (a scheduler sizes its tables by them). Local files only; nothing
is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from chunkflow_planner.checkpoint import CheckpointError, few_names, plain_name, read_config, read_json, shown
from chunkflow_planner.files import irregular_kind

__all__ = ["load_tokenizer", "load_scheduler", "load_processor"]

MAX_TOKENIZER_FILE = 256 * 2**20  # the largest real tokenizer files (tokenizer.json) are tens of MB
MAX_TOKENIZER_ENTRIES = 256  # files a tokenizer folder holds (real ones: under 10)
MAX_SCHEDULER_INT = 10**6  # a scheduler config's integers: real ones are under 10,000 (1,000 training timesteps)
MAX_SCHEDULER_LIST = 10**5  # and its lists (trained_betas: one per training timestep)


def _check_tokenizer_files(path: Path, what: str) -> None:
    """Every file of a tokenizer folder (and of its subfolders, such as additional_chat_templates/) a regular file
    of at most MAX_TOKENIZER_FILE bytes, before transformers reads any: a FIFO would block it, a device or a
    file of gigabytes take the machine's memory."""
    todo, seen = [path], 0
    while todo:
        folder = todo.pop()
        try:
            entries = sorted(folder.iterdir())
        except OSError as exc:
            raise CheckpointError(f"{what}: {str(folder)!r} cannot be listed: {exc.strerror or exc}") from None
        seen += len(entries)
        if seen > MAX_TOKENIZER_ENTRIES:
            raise CheckpointError(f"{what}: {str(path)!r} holds over {MAX_TOKENIZER_ENTRIES} files, more than a "
                                  "tokenizer has; download or save the pipeline again")
        for p in entries:
            try:
                st = p.stat()
            except OSError as exc:
                raise CheckpointError(f"{what}: {str(p)!r} cannot be read: {exc.strerror or exc}") from None
            kind = irregular_kind(st.st_mode)
            if kind == "a directory" and folder == path:
                todo.append(p)
            elif kind is not None:
                raise CheckpointError(f"{what}: {str(p)!r} is {kind}, not a file; download or save the pipeline "
                                      "again")
            elif st.st_size > MAX_TOKENIZER_FILE:
                raise CheckpointError(f"{what}: {str(p)!r} holds {st.st_size:,} bytes, over the {MAX_TOKENIZER_FILE:,} "
                                      "a tokenizer file may; download or save the pipeline again")


def _check_tokenizer_config(path: Path, what: str) -> None:
    """The files tokenizer_config.json makes transformers read are files of the tokenizer folder: its
    `fast_tokenizer_files` are joined to the folder's path as given, so '../vae/tokenizer.1.json' or an absolute
    path would be read from anywhere, past the checks above."""
    if not (path / "tokenizer_config.json").exists():
        return
    cfg = read_json(path / "tokenizer_config.json", f"{what}: tokenizer_config.json")
    named = cfg.get("fast_tokenizer_files", [])
    names = named if isinstance(named, list) else [named]
    outside = [str(n) for n in names if not (isinstance(n, str) and plain_name(n) and (path / n).is_file())]
    if outside:
        raise CheckpointError(f"{what}: tokenizer_config.json names fast tokenizer file(s) {few_names(outside)} that "
                              "are not files of its folder (transformers would read them from wherever they point); "
                              "the folder is damaged or not to be trusted: download or save the pipeline again")


def _load_checked(folder: Path, name: str, cls: type, what: str):
    """`cls.from_pretrained` of the folder's `name`/ (a tokenizer's or processor's files), its files checked first;
    local files only."""
    if not (folder / name).is_dir():
        raise CheckpointError(f"{str(folder)!r} has no {name}/ folder; the pipeline folder is incomplete: download "
                              "or save it again")
    _check_tokenizer_files(folder / name, what)
    _check_tokenizer_config(folder / name, what)
    try:
        return cls.from_pretrained(folder / name, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a damaged folder
        why = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise CheckpointError(f"{what} cannot be loaded ({type(exc).__name__}: {why}); download or save the pipeline "
                              "again") from None


def load_tokenizer(folder: Path, name: str, cls: type):
    """The folder's tokenizer `name` made by `cls` (slots.py checked it is a transformers tokenizer), its files
    checked first; local files only."""
    said = name if name.startswith("tokenizer") else f"tokenizer {name}"  # `tokenizer_2`, never `tokenizer tokenizer`
    return _load_checked(folder, name, cls, f"{said} in {str(folder)!r}")


def _scheduler_bounds(config: dict, what: str, max_int: int = MAX_SCHEDULER_INT, max_list: int = MAX_SCHEDULER_LIST,
                      name: str = "scheduler_config.json") -> None:
    """A scheduler config's integers at most MAX_SCHEDULER_INT and lists at most MAX_SCHEDULER_LIST long: a
    scheduler sizes its tables by them (num_train_timesteps: 10**10 is 40 GB of betas). Other configs (`name`)
    with other limits the same way."""
    stack = list(config.items())
    while stack:
        key, v = stack.pop()
        big = (isinstance(v, int) and not isinstance(v, bool) and abs(v) > max_int
               or isinstance(v, (list, dict)) and len(v) > max_list)
        if big:
            said = f"a list of {len(v):,}" if isinstance(v, (list, dict)) else f"{v:,}"
            taker = "a scheduler" if name == "scheduler_config.json" else "such a model"
            raise CheckpointError(f"{what}: {name} sets {shown(key)} to {said}, beyond what {taker} takes "
                                  f"(integers up to {max_int:,}, lists up to {max_list:,}); download or save the "
                                  "pipeline again")
        if isinstance(v, list):
            stack += [(key, x) for x in v]
        elif isinstance(v, dict):
            stack += list(v.items())


def load_scheduler(folder: Path, cls: type):
    """The folder's scheduler made by `cls` (slots.py checked it is a diffusers scheduler the pipeline can drive)
    from its scheduler_config.json, read bounded and its sizes checked first."""
    what = f"scheduler in {str(folder)!r}"
    config = read_config(folder / "scheduler", what, "scheduler_config.json")
    _scheduler_bounds(config, what)
    try:
        return cls.from_config(config)
    except Exception as exc:  # a config diffusers cannot build the class from
        why = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise CheckpointError(f"{what}: {cls.__name__} cannot be made from its scheduler_config.json "
                              f"({type(exc).__name__}: {why}); download or save the pipeline again") from None


def load_processor(folder: Path, name: str, cls: type):
    """The folder's processor `name` (an image processor, feature extractor or processor: slots.py checked it is a
    transformers one) made by `cls`, its files checked first as a tokenizer's are; local files only."""
    return _load_checked(folder, name, cls, f"{name} in {str(folder)!r}")
