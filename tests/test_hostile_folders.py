"""Hostile or broken pipeline folders (issue 35, round three). A real tiny pipeline written by save_pretrained, then
corrupted as an attacker would: a class in a slot that does not hold it, a file that is not a regular file or is
far larger than what it claims to be, a config that would build a model far larger than the plan's, a safetensors
header that does not describe its bytes, names of a hundred thousand characters. `chunkflow run --plan plan.json
--weights DIR --prompt x` ends each with one line naming the file and what to do, exit 2, nothing built (no module
constructed, no tensor read) and nothing written. The cases that would take the machine's memory or never end if a
check were missing run in a process of their own under an address-space limit, with a timeout as a hang guard."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from pipelines import one_thread, save_catalog_pipeline

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from chunkflow_planner.catalog import get_model  # noqa: E402
from chunkflow_planner.checkpoint import CheckpointError, read_header  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT_AS = 4 * 2**30  # a whole tiny generation runs in 1.5 GiB of address space; every bomb here needs far more
HANG_GUARD_S = 300


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_catalog_pipeline("tiny", tmp_path_factory.mktemp("saved") / "tiny")


@pytest.fixture
def plan(cli, workdir) -> Path:
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return workdir / "plan.json"


@pytest.fixture
def pipe(saved, workdir) -> Path:
    """A fresh copy of the saved pipeline to damage."""
    return Path(shutil.copytree(saved, workdir / "pipe"))


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "pipe" not in p.relative_to(root).parts[:1]}


def _refused(code: int, output: str, *say: str) -> str:
    """One line, `error: ...`, exit 2, each of `say` in it; no traceback, no internal error."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2, output[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), output[-3000:]
    assert "Traceback" not in output and "internal error" not in output
    assert len(lines[0]) < 1200, lines[0][:300]  # a name of 100,000 characters is cut short
    for s in say:
        assert s in lines[0], lines[0]
    return lines[0]


def _run_cli(cli, workdir: Path, folder: Path, *say: str) -> str:
    before = _files(workdir)
    result = cli("run", "--plan", "plan.json", "--weights", folder, "--prompt", "x", "--out", "x.mp4")
    line = _refused(result.exit_code, result.output, *say)
    assert _files(workdir) == before  # no video, no report, no temporary
    return line


def _run_limited(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m chunkflow ARGS` in `workdir`, under an address-space limit of LIMIT_AS, the hang guard's timeout."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               CHUNKFLOW_CONFIG_DIR=str(workdir / "config"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "chunkflow", *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=HANG_GUARD_S, preexec_fn=limit)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _index(folder: Path, **changes) -> None:
    _edit_json(folder / "model_index.json", **changes)


@contextlib.contextmanager
def _watching():
    """Within: the modules constructed and the checkpoint ranges read, by name and file (observed: each call goes
    on to the real one)."""
    from chunkflow.loading.reader import FileReader

    made = types.SimpleNamespace(modules=[], reads=[])
    init, read = torch.nn.Module.__init__, FileReader.read_into

    def counting_init(module, *a, **k):
        made.modules.append(type(module).__name__)
        init(module, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.Module, "__init__", counting_init)
        mp.setattr(FileReader, "read_into", lambda r, *a, **k: (made.reads.append(a[0]), read(r, *a, **k)))
        yield made


def _build(folder: Path):
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.offload import OffloadConfig

    with one_thread():
        return build_pipeline(get_model("tiny"), {}, OffloadConfig("none"), torch.device("cpu"), weights=folder)


# ------------------------------------------------------------------------------------------------- slots


SLOTS = {
    "a pipeline as the scheduler": (dict(scheduler=["diffusers", "DiffusionPipeline"]),
                                    "makes the scheduler a DiffusionPipeline, which is not a scheduler"),
    "a model as the scheduler": (dict(scheduler=["diffusers", "AutoencoderKLWan"]),
                                 "makes the scheduler a AutoencoderKLWan, which is not a scheduler"),
    "a scheduler of transformers": (dict(scheduler=["transformers", "UniPCMultistepScheduler"]),
                                    "a scheduler is a diffusers class"),
    "no scheduler": (dict(scheduler=[None, None]), "names no scheduler"),
    "a model as the tokenizer": (dict(tokenizer=["transformers", "UMT5EncoderModel"]),
                                 "makes tokenizer a UMT5EncoderModel, which is not a tokenizer"),
    "a function as the tokenizer": (dict(tokenizer=["transformers", "pipeline"]), "which is not a tokenizer"),
    "AutoTokenizer": (dict(tokenizer=["transformers", "AutoTokenizer"]), "which is not a tokenizer"),
    "a tokenizer of diffusers": (dict(tokenizer=["diffusers", "WanTransformer3DModel"]),
                                 "a tokenizer is a transformers class"),
    "a text encoder of diffusers": (dict(text_encoder=["diffusers", "UMT5EncoderModel"]),
                                    "UMT5EncoderModel is a transformers class"),
    "another transformer": (dict(transformer=["diffusers", "FluxTransformer2DModel"]),
                            "makes transformer a FluxTransformer2DModel"),
    "another VAE": (dict(vae=["diffusers", "AutoencoderKL"]), "makes vae a AutoencoderKL"),
    "a second expert": (dict(transformer_2=["diffusers", "WanTransformer3DModel"]),
                        "names a transformer_2 (WanTransformer3DModel), which the plan's model does not have"),
    "a setting of the wrong type": (dict(boundary_ratio="x"), "sets boundary_ratio to 'x'"),
    "a setting of another model": (dict(expand_timesteps=True), "sets expand_timesteps to True"),
}


@pytest.mark.parametrize("case", sorted(SLOTS))
def test_a_class_that_does_not_belong_in_its_slot_is_refused_before_anything_is_made(cli, workdir, plan, pipe,
                                                                                     case):
    changes, say = SLOTS[case]
    _index(pipe, **changes)
    with _watching() as made, pytest.raises(CheckpointError, match="model_index.json"):
        _build(pipe)
    assert made.modules == [] and made.reads == []  # refused from model_index.json alone
    _run_cli(cli, workdir, pipe, say, str(pipe), "model_index.json")


def test_a_tokenizer_class_transformers_lacks_is_refused_as_diffusers_refuses_it(cli, workdir, plan, pipe):
    """Before: a silent AutoTokenizer in its place. diffusers' own from_pretrained refuses the folder."""
    import diffusers

    _index(pipe, tokenizer=["transformers", "NoSuchTokenizer"])
    with pytest.raises(ValueError, match="has no class `NoSuchTokenizer`"):
        diffusers.WanPipeline.from_pretrained(pipe)
    _run_cli(cli, workdir, pipe, "makes tokenizer a NoSuchTokenizer, which transformers", "does not have")


def test_a_scheduler_the_pipeline_cannot_drive_is_refused_before_the_load_not_in_the_middle_of_the_generation(
        cli, workdir, plan, pipe):
    """DDIMScheduler lacks the set_begin_index WanPipeline calls: diffusers loads the folder and fails in the middle
    of the generation; chunkflow refuses it up front."""
    import diffusers

    _index(pipe, scheduler=["diffusers", "DDIMScheduler"])
    loaded = diffusers.WanPipeline.from_pretrained(pipe)
    with pytest.raises(AttributeError, match="set_begin_index"), one_thread():
        loaded(prompt="a cat", num_inference_steps=1, height=64, width=64, num_frames=5, output_type="latent")
    _run_cli(cli, workdir, pipe, "makes the scheduler a DDIMScheduler, which lacks set_begin_index that WanPipeline")


def test_another_scheduler_the_pipeline_can_drive_is_used_as_diffusers_uses_it(cli, workdir, plan, pipe):
    """Not over-strict: WanPipeline's own annotated scheduler, FlowMatchEulerDiscreteScheduler, in place of the
    catalog's UniPC: the run's latents are diffusers' own from the same folder, bit for bit."""
    import diffusers
    from safetensors.torch import load_file

    shutil.rmtree(pipe / "scheduler")
    diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(pipe / "scheduler")
    _index(pipe, scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"])
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", pipe, "--prompt", "a cat", "--negative-prompt", "blurry",
                     "--seed", "5", "--latents", "l.safetensors")
    assert result.exit_code == 0, result.output
    ref = diffusers.WanPipeline.from_pretrained(pipe, torch_dtype={"default": torch.bfloat16, "vae": torch.float32})
    ref.set_progress_bar_config(disable=True)
    w = get_model("tiny").default_workload
    with torch.no_grad(), one_thread():
        want = ref(prompt="a cat", negative_prompt="blurry", height=w.height, width=w.width, num_frames=w.frames,
                   num_inference_steps=w.steps, guidance_scale=5.0, max_sequence_length=8, output_type="latent",
                   generator=torch.Generator("cpu").manual_seed(5)).frames
    assert torch.equal(load_file("l.safetensors")["latents"], want)


def _fast_tokenizer_file(folder: Path, target: str | None = None) -> None:
    """tokenizer_config.json naming a fast tokenizer file in the VAE's folder ('../vae/tokenizer.1.json'): garbage,
    or a link to `target`."""
    outside = folder / "vae" / "tokenizer.1.json"
    if target is None:
        outside.write_text("{garbage")
    else:
        os.symlink(target, outside)
    _edit_json(folder / "tokenizer" / "tokenizer_config.json", fast_tokenizer_files=["../vae/tokenizer.1.json"])


def test_a_tokenizer_config_naming_a_file_outside_its_folder_is_refused(cli, workdir, plan, pipe):
    """transformers joins tokenizer_config.json's fast_tokenizer_files to the folder as given and reads what they
    name, wherever it is (here: garbage in the VAE's folder); chunkflow refuses before transformers reads it."""
    import transformers

    _fast_tokenizer_file(pipe)
    with pytest.raises(json.JSONDecodeError):
        transformers.T5Tokenizer.from_pretrained(pipe / "tokenizer", local_files_only=True)
    _run_cli(cli, workdir, pipe, "tokenizer_config.json names fast tokenizer file(s) ../vae/tokenizer.1.json that "
             "are not files of its folder")


def test_a_slot_the_plan_does_not_load_is_said_and_nothing_is_made_from_it(cli, workdir, plan, pipe):
    _index(pipe, image_encoder=["transformers", "CLIPVisionModel"])
    with _watching() as made:
        built = _build(pipe)
    assert "CLIPVisionModel" not in made.modules and "UMT5EncoderModel" in made.modules
    built.remove()
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", pipe, "--prompt", "a cat", "--steps", "1")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "note: model_index.json names image_encoder (transformers CLIPVisionModel), which the plan's model does " \
           "not use; it is not loaded" in said


def test_every_catalog_pipeline_calls_of_its_scheduler_what_the_slot_check_asks():
    """SCHEDULER_METHODS and SCHEDULER_KEYWORDS read from the catalog pipelines' own source: the scheduler methods
    each __call__ calls, and the keywords it passes to set_timesteps (through retrieve_timesteps); every catalog
    model's own scheduler class passes the check."""
    import ast
    import inspect
    import textwrap

    import diffusers

    from chunkflow.models.slots import SCHEDULER_KEYWORDS, SCHEDULER_METHODS, _scheduler_class
    from chunkflow_planner.catalog import load_models

    specs = [s for s in load_models().values() if s.pipeline is not None]
    for name in sorted({s.pipeline.cls for s in specs}):
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(diffusers, name).__call__)))
        called, keywords = set(), set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and ast.unparse(f.value) == "self.scheduler":
                called.add(f.attr)
                if f.attr == "set_timesteps":
                    keywords |= {k.arg for k in node.keywords}
            if isinstance(f, ast.Name) and f.id == "retrieve_timesteps":
                called.add("set_timesteps")
                keywords |= {k.arg for k in node.keywords}
        assert called <= set(SCHEDULER_METHODS) and "step" in called, (name, called)
        assert keywords - {"device"} == set(SCHEDULER_KEYWORDS[name]), (name, keywords)
    for spec in specs:
        declared = {"scheduler": ("diffusers", spec.pipeline.scheduler.cls)}
        assert _scheduler_class(Path("."), declared, spec.pipeline.cls) is getattr(diffusers, declared["scheduler"][1])


# ------------------------------------------------------------------------------------- over-long names


def _add_tensor(folder: Path, component: str, name: str) -> None:
    """A tensor named `name` added to the component's safetensors file (header rewritten, the data after it)."""
    f = next((folder / component).glob("*.safetensors"))
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [end, end + 4]}
    new = json.dumps(header).encode()
    f.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:] + bytes(4))


def _long_shard(folder: Path) -> None:
    """The VAE's one file renamed, and an index naming a shard of 300 characters (over a file name's 255 bytes)."""
    shard = (folder / "vae" / "diffusion_pytorch_model.safetensors").rename(folder / "vae" / "s.safetensors")
    weight_map = {k: "s" * 300 + ".safetensors" for k in read_header(shard)}
    (folder / "vae" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


LONG = "A" * 100_000
NAMES = {
    "pipeline class": (lambda f: _index(f, _class_name=LONG), "\"_class_name\" is 'AAAA"),
    "scheduler class": (lambda f: _index(f, scheduler=["diffusers", LONG]), "is not a name"),
    "library": (lambda f: _index(f, scheduler=[LONG, "UniPCMultistepScheduler"]), "is not a name"),
    "component name": (lambda f: _index(f, **{LONG: ["diffusers", "AutoencoderKL"]}), "component name 'AAAA"),
    "a class with a NUL": (lambda f: _index(f, scheduler=["diffusers", "Uni\x00PCMultistepScheduler"]),
                           "'Uni\\x00PCMultistepScheduler' is not a name"),
    "a class with ESC": (lambda f: _index(f, _class_name="\x1b[2JWanPipeline"), "'\\x1b[2JWanPipeline'"),
    "text encoder class": (lambda f: _edit_json(f / "text_encoder" / "config.json", architectures=[LONG]),
                           "holds a 'AAAA"),
    "text encoder class not a list": (lambda f: _edit_json(f / "text_encoder" / "config.json", architectures=5),
                                      "holds a 5 (config.json)"),
    "transformer class": (lambda f: _edit_json(f / "transformer" / "config.json", _class_name=LONG),
                          "holds a 'AAAA"),
    "tensor name": (lambda f: _add_tensor(f, "vae", "t" * 1_000_000), "holds tensor(s) the AutoencoderKLWan does not"),
    "shard name": (lambda f: _long_shard(f), "longer than a file name"),
}


@pytest.mark.parametrize("case", sorted(NAMES))
def test_a_name_of_any_length_or_character_is_one_short_escaped_line(cli, workdir, plan, pipe, case):
    damage, say = NAMES[case]
    damage(pipe)
    line = _run_cli(cli, workdir, pipe, say)
    assert "\x1b" not in line and "\x00" not in line
    assert "characters)" in line or len(line) < 600


@pytest.mark.parametrize("weights", ["/tmp/" + "a" * 300, "a/" * 3000], ids=["a name over 255 bytes", "a long path"])
@pytest.mark.parametrize("command", ["run a generation", "run the steps", "plan"])
def test_a_weights_path_the_file_system_cannot_look_up_is_one_line(cli, workdir, plan, weights, command):
    """Before: an internal OSError (ENAMETOOLONG) from the first look at the path."""
    args = {"run a generation": ["run", "--plan", plan, "--weights", weights, "--prompt", "x"],
            "run the steps": ["run", "--plan", plan, "--weights", weights, "--steps", "1"],
            "plan": ["plan", "--model", "tiny", "--hardware", "cpu", "--weights", weights, "--out", "p2.json"]}[command]
    result = cli(*args)
    said = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and len(said) == 1, result.output[-2000:]
    assert "cannot be looked up: File name too long" in said[0] and "characters)" in said[0]
    assert "internal error" not in result.output and not (workdir / "p2.json").exists()


# ---------------------------------------------------------------------------------- safetensors headers


def _header_file(path: Path, header: dict | str, data: bytes) -> None:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


A = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
B = {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}
HEADERS = {
    "overlapping tensors": ({"a": A, "b": A}, "overlaps the tensor before it"),
    "a gap": ({"a": A, "b": {"dtype": "F32", "shape": [3], "data_offsets": [20, 32]}}, "bytes unused before it"),
    "bytes after the last": ({"a": A, "b": {"dtype": "F32", "shape": [3], "data_offsets": [16, 28]}},
                             "after the last tensor belong to none"),
    "a name given twice": ('{"a": %s, "a": %s}' % (json.dumps(A), json.dumps(B)), "the name 'a' is given twice"),
    "offsets beyond the file": ({"a": A, "b": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]}},
                                "end at byte"),
    "begin after end": ({"a": A, "b": {"dtype": "F32", "shape": [4], "data_offsets": [32, 16]}}, "malformed"),
    "a negative shape": ({"a": A, "b": {"dtype": "F32", "shape": [-4], "data_offsets": [16, 32]}}, "malformed"),
    "a boolean shape": ({"a": A, "b": {"dtype": "F32", "shape": [True, 4], "data_offsets": [16, 32]}}, "malformed"),
    "a huge shape": ({"a": A, "b": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [16, 32]}},
                     "but its offsets [16, 32) hold 16"),
    "a dtype its bytes do not fit": ({"a": A, "b": {"dtype": "F64", "shape": [4], "data_offsets": [16, 32]}},
                                     "F64 [4], 32 bytes"),
    "an unknown dtype": ({"a": A, "b": {"dtype": "Q4", "shape": [4], "data_offsets": [16, 32]}}, "malformed"),
    "float offsets": ({"a": A, "b": {"dtype": "F32", "shape": [4], "data_offsets": [16.0, 32]}}, "malformed"),
    "metadata not strings": ({"a": A, "b": B, "__metadata__": {"format": 1}}, "__metadata__"),
    "nested too deeply": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_a_header_safetensors_refuses_is_refused(tmp_path, case):
    """Each crafted header: safetensors' own safe_open refuses the file, and so does read_header, naming it."""
    from safetensors import safe_open

    header, say = HEADERS[case]
    path = tmp_path / "m.safetensors"
    _header_file(path, header, bytes(range(32)))
    with pytest.raises(Exception):
        with safe_open(str(path), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(CheckpointError, match="m.safetensors") as err:
        read_header(path)
    assert say in str(err.value)


def test_a_header_safetensors_accepts_is_read_as_safetensors_reads_it(tmp_path):
    """The control: empty tensors between others, padding spaces, metadata, another field: the same tensors, bytes
    and shapes as safe_open gives."""
    from safetensors import safe_open

    empty = {"dtype": "BF16", "shape": [0, 3], "data_offsets": [16, 16]}
    path = tmp_path / "m.safetensors"
    _header_file(path, json.dumps({"a": {**A, "extra": 1}, "e": empty, "b": B, "__metadata__": {"format": "pt"}})
                 + "    ", bytes(range(32)))
    records = read_header(path)
    with safe_open(str(path), "pt") as f:
        assert sorted(records) == sorted(f.keys())
        for k, r in records.items():
            t = f.get_tensor(k)
            assert list(t.shape) == list(r.shape) and t.numel() * t.element_size() == r.nbytes
            raw = path.read_bytes()[r.begin:r.end]
            assert raw == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_overlapping_tensors_in_a_pipeline_folder_are_refused_before_any_read(cli, workdir, plan, pipe):
    """The issue's case (exit 0 before): two of the VAE's tensors made to share bytes."""
    f = pipe / "vae" / "diffusion_pytorch_model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    (k1, e1), (k2, e2) = sorted(((k, e) for k, e in header.items() if k != "__metadata__"),
                                key=lambda kv: kv[1]["data_offsets"])[:2]
    e2["data_offsets"] = [e1["data_offsets"][0], e1["data_offsets"][0] + e2["data_offsets"][1] - e2["data_offsets"][0]]
    new = json.dumps(header).encode()
    f.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])
    with _watching() as made, pytest.raises(CheckpointError, match="overlaps the tensor before it"):
        _build(pipe)
    assert made.reads == []
    _run_cli(cli, workdir, pipe, "diffusion_pytorch_model.safetensors", "overlaps the tensor before it",
             "download or save it again")


# ----------------------------------------------------------------------------------------- sizes in configs


CONFIGS = {
    "a text encoder smaller than the plan's": ("text_encoder", dict(num_layers=1),
                                               "makes a UMT5EncoderModel of"),
    "a negative width": ("text_encoder", dict(d_model=-5), "does not make a UMT5EncoderModel"),
    "a VAE block list longer than the plan's": ("vae", dict(dim_mult=[1] * 5), "dim_mult: catalog 4 entries at most"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_config_that_does_not_make_the_plans_model_is_refused_before_any_read(cli, workdir, plan, pipe, case):
    component, changes, say = CONFIGS[case]
    _edit_json(pipe / component / "config.json", **changes)
    with _watching() as made, pytest.raises(CheckpointError, match=component):
        _build(pipe)
    assert made.reads == []
    _run_cli(cli, workdir, pipe, say, f"{component} in")


def test_no_catalog_models_own_config_is_refused_as_saved_or_as_the_library_saves_it_again():
    """The control of the size check: every catalog text encoder's and VAE's config, as its checkpoint saved it
    (the catalog's copy) and as this transformers / diffusers would save it again (every default and derived
    value written out, the newer layout), passes."""
    import warnings

    import transformers

    from chunkflow.models.components import meta_vae, text_encoder_reference, vae_reference
    from chunkflow.models.config_bounds import check_config_size
    from chunkflow_planner.catalog import load_models

    seen: set[str] = set()
    for spec in load_models().values():
        if spec.pipeline is None:
            continue
        for te in spec.pipeline.text_encoders:
            if json.dumps([te.cls, te.config], sort_keys=True) in seen:
                continue
            seen.add(json.dumps([te.cls, te.config], sort_keys=True))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made = getattr(transformers, te.cls).config_class.from_dict(dict(te.config))
            for cfg in (dict(te.config), json.loads(made.to_json_string(use_diff=False))):
                check_config_size(cfg, text_encoder_reference(te), spec.name, te.cls)
        vae = spec.pipeline.vae
        if vae.name not in seen:
            seen.add(vae.name)
            resaved = json.loads(json.dumps(dict(meta_vae(vae, torch.bfloat16).config), default=list))
            for cfg in (dict(vae.config), resaved):
                check_config_size(cfg, vae_reference(vae), spec.name, vae.cls)
    assert len(seen) >= 8


# ------------------------------------------------------------ bombs and hangs: in a process of their own


def _sparse(path: Path, size: int = 8 * 2**30) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)  # a hole: no disk used, 8 GiB to whoever reads it whole


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # nobody ever writes: an open for reading blocks for ever


def _link(path: Path, target: str) -> None:
    path.unlink()
    os.symlink(target, path)


def _vae_file(f: Path) -> Path:
    return next((f / "vae").glob("*.safetensors"))


BOMBS = {
    # classes
    "a full-size model as the scheduler": (lambda f: _index(f, scheduler=["diffusers", "WanTransformer3DModel"]),
                                           "makes the scheduler a WanTransformer3DModel, which is not a scheduler"),
    # sizes
    "ten million text encoder layers": (lambda f: _edit_json(f / "text_encoder" / "config.json", num_layers=10**7),
                                        "num_layers: catalog 2, file 10,000,000"),
    "a vocabulary of 10**12": (lambda f: _edit_json(f / "text_encoder" / "config.json", vocab_size=10**12),
                               "vocab_size: catalog 256"),
    "a VAE of width 10**5": (lambda f: _edit_json(f / "vae" / "config.json", base_dim=10**5), "base_dim: catalog 4"),
    "ten million VAE blocks": (lambda f: _edit_json(f / "vae" / "config.json", num_res_blocks=10**7),
                               "num_res_blocks: catalog"),
    "a million-entry VAE list": (lambda f: _edit_json(f / "vae" / "config.json", dim_mult=[1] * 10**6),
                                 "dim_mult: catalog 4 entries at most, file 1,000,000"),
    "10**10 training timesteps": (lambda f: _edit_json(f / "scheduler" / "scheduler_config.json",
                                                       num_train_timesteps=10**10), "num_train_timesteps"),
    "a solver of order 10**9": (lambda f: _edit_json(f / "scheduler" / "scheduler_config.json", solver_order=10**9),
                                "solver_order"),
    # files
    "an 8 GiB model_index.json": (lambda f: _sparse(f / "model_index.json"), "model_index.json' is over"),
    "a FIFO model_index.json": (lambda f: _fifo(f / "model_index.json"), "model_index.json' is a FIFO"),
    "an 8 GiB text encoder config": (lambda f: _sparse(f / "text_encoder" / "config.json"), "config.json in"),
    "a FIFO text encoder config": (lambda f: _fifo(f / "text_encoder" / "config.json"), "is a FIFO"),
    "/dev/zero as a scheduler config": (lambda f: _link(f / "scheduler" / "scheduler_config.json", "/dev/zero"),
                                        "is a character device"),
    "/dev/zero as tokenizer.json": (lambda f: _link(f / "tokenizer" / "tokenizer.json", "/dev/zero"),
                                    "tokenizer.json' is a character device"),
    "a FIFO tokenizer config": (lambda f: _fifo(f / "tokenizer" / "tokenizer_config.json"), "is a FIFO"),
    "an 8 GiB tokenizer.json": (lambda f: _sparse(f / "tokenizer" / "tokenizer.json"), "bytes, over the"),
    "/dev/zero as a fast tokenizer file outside": (lambda f: _fast_tokenizer_file(f, "/dev/zero"),
                                                   "names fast tokenizer file(s) ../vae/tokenizer.1.json"),
    "a FIFO as the weights": (lambda f: _fifo(_vae_file(f)), "is not a regular file"),
    "/dev/zero as the weights": (lambda f: _link(_vae_file(f), "/dev/zero"), "is not a regular file"),
    "an 8 GiB shard index": (lambda f: (_vae_file(f).rename(f / "vae" / "s.safetensors"),
                                        (f / "vae" / "diffusion_pytorch_model.safetensors.index.json").write_text("{}"),
                                        _sparse(f / "vae" / "diffusion_pytorch_model.safetensors.index.json")),
                             "index.json in"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BOMBS))
def test_a_folder_that_would_take_the_memory_or_never_end_is_refused_in_bounded_memory_and_time(plan, pipe, case):
    damage, say = BOMBS[case]
    damage(pipe)
    workdir = plan.parent
    before = _files(workdir)
    p = _run_limited(workdir, "run", "--plan", "plan.json", "--weights", str(pipe), "--prompt", "x", "--out",
                     "x.mp4")
    _refused(p.returncode, p.stdout + p.stderr, say, str(pipe))
    assert _files(workdir) == before


@pytest.mark.slow
@pytest.mark.parametrize("damage, say", [
    (lambda f: _fifo(f / "model_index.json"), "is a FIFO (named pipe), not a regular file"),
    (lambda f: _link(f / "text_encoder" / "model.safetensors", "/dev/zero"), "model.safetensors is not a regular file"),
], ids=["FIFO model_index.json", "/dev/zero as weights"])
def test_planning_with_such_a_folder_is_refused_the_same_way(plan, pipe, damage, say):
    """`plan --weights DIR` reads the folder's headers without torch (pipeline_read_bytes): the same refusals."""
    damage(pipe)
    p = _run_limited(plan.parent, "plan", "--model", "tiny", "--hardware", "cpu", "--weights", str(pipe), "--out",
                     "p2.json")
    _refused(p.returncode, p.stdout + p.stderr, str(pipe), say)
    assert not (plan.parent / "p2.json").exists()


# ---------------------------------------------------------------------------------------- bounded reads


def test_read_bounded_reads_a_regular_file_up_to_its_limit_and_nothing_else(tmp_path):
    from chunkflow_planner.files import FileError, read_bounded

    f = tmp_path / "f.json"
    f.write_bytes(b"x" * 100)
    assert read_bounded(f, "f", 100) == b"x" * 100
    with pytest.raises(FileError, match="is over 99 bytes"):
        read_bounded(f, "f", 99)
    with pytest.raises(FileError, match="is a directory"):
        read_bounded(tmp_path, "d", 100)
    with pytest.raises(FileError, match="is a character device"):
        read_bounded("/dev/zero", "z", 100)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    said: list = []

    def attempt() -> None:
        try:
            read_bounded(fifo, "p", 100)
        except FileError as exc:
            said.append(str(exc))

    t = threading.Thread(target=attempt, daemon=True)  # a blocking open would never return: the thread is left
    t.start()
    t.join(30)
    assert said and "is a FIFO (named pipe), not a regular file" in said[0]
