"""Hostile input, round two, generated: outputs that clash with each other or with the inputs (through symlinks
and relative paths too), files nested too deeply, broken pipeline folders and caches, words and numbers a generation
cannot take, output types the model does not make, and signals at random moments in a process of its own. Every
case ends with exit 0, or one clear line and exit 2 (130 / 143 for a signal) before any expensive work, no traceback,
no temporary file left, and no input or earlier output overwritten."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines import save_catalog_pipeline

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _clear(result, code: int = 2, say: str | None = None) -> str:
    said = " ".join(result.output.split())
    assert result.exit_code == code, result.output
    assert "Traceback" not in said and "internal error" not in said, result.output
    if say is not None:
        assert say in said, said
    return said


def _no_temporaries(folder: Path) -> None:
    left = [p.name for p in folder.rglob(".*") if p.is_file() and (".tmp" in p.name or p.name.endswith("tmp"))]
    assert not left, left


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    return save_catalog_pipeline("tiny", root / "tiny")


@pytest.fixture
def plan(cli, workdir) -> Path:
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return workdir / "plan.json"


# ---------------------------------------------------------------------------------------- clashing outputs


SPELLINGS = ["{}", "./{}", "sub/../{}", "link/{}"]


@SETTINGS
@given(first=st.sampled_from(["out", "report", "latents"]), second=st.sampled_from(["out", "report", "latents",
                                                                                      "plan"]),
       spelling=st.sampled_from(SPELLINGS))
def test_outputs_never_overwrite_each_other_or_the_plan(cli, workdir, plan, first, second, spelling):
    """Two of run's outputs (or an output and the plan it runs) named the same file, however the path is spelled,
    are refused before any work; the plan is untouched and nothing is written."""
    if first == second:
        return
    (workdir / "sub").mkdir(exist_ok=True)
    if not (workdir / "link").exists():
        os.symlink(workdir, workdir / "link")
    names = {"out": "x.mp4", "report": "x.mp4", "latents": "x.mp4", "plan": "plan.json"}
    target = names[second] if second == "plan" else "x.mp4"
    flags = {"out": ["--out", "y.mp4"], "report": ["--report", "y.json"], "latents": ["--latents", "y.st"]}
    flags[first] = [f"--{first}", spelling.format(target)]
    if second != "plan":
        flags[second] = [f"--{second}", target]
    before = plan.read_bytes()
    args = ["run", "--plan", plan, "--prompt", "a cat"] + [a for f in flags.values() for a in f]
    if first == "out" and target == "plan.json":
        return  # a .json --out is refused for its suffix anyway
    said = _clear(cli(*args), 2)
    assert "same file" in said or "reads" in said
    assert plan.read_bytes() == before and not (workdir / "x.mp4").exists() and not (workdir / "y.json").exists()


def test_calibrate_outputs_and_the_saved_profile(cli, workdir):
    """calibrate's --out and --raw, and the previous default profile it keeps, are three files; --from-report's
    reports are not overwritten; saving over the default keeps the old default as the previous one."""
    _clear(cli("calibrate", "--cpu-smoke", "--out", "p.yaml", "--raw", "p.yaml"), 2, "same file")
    config = workdir / "config"
    config.mkdir()
    _clear(cli("calibrate", "--cpu-smoke", "--save", "--out", str(config / "hardware-profile.previous.yaml")), 2,
           "same file")
    assert not (config / "hardware-profile.previous.yaml").exists()
    Path("r.json").write_text("{}")
    _clear(cli("calibrate", "--from-report", "r.json", "--out", "r.json"), 2, "reads")
    assert Path("r.json").read_text() == "{}"
    old = "# an earlier profile\n" + (workdir.parent / "x").as_posix()
    default = config / "hardware-profile.yaml"
    default.write_text(old)
    result = cli("calibrate", "--cpu-smoke", "--save", "--out", str(default))
    assert result.exit_code == 0, result.output
    assert (config / "hardware-profile.previous.yaml").read_text() == old  # kept, not the new one
    assert default.read_text() != old


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_a_config_directory_that_cannot_take_the_profile_is_refused_before_calibrating(cli, workdir, monkeypatch,
                                                                                         kind):
    where = workdir / "cfg"
    if kind == "file":
        where.write_text("not a directory")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        where.mkdir()
        where.chmod(0o500)
    monkeypatch.setenv("CHUNKFLOW_CONFIG_DIR", str(where))
    said = _clear(cli("calibrate", "--cpu-smoke", "--save", "--out", "p.yaml"), 2, "config directory")
    assert "CHUNKFLOW_CONFIG_DIR" in said and not Path("p.yaml").exists()


# ------------------------------------------------------------------------------------------- nested files


@SETTINGS
@given(depth=st.integers(2_000, 200_000), kind=st.sampled_from(["plan", "profile", "default profile", "report",
                                                                  "model_index"]))
def test_files_nested_too_deeply_are_refused_by_name(cli, workdir, saved, depth, kind, monkeypatch):
    deep = "[" * depth + "]" * depth
    if kind == "plan":
        Path("deep.json").write_text(deep)
        _clear(cli("run", "--plan", "deep.json"), 2, "deep.json")
    elif kind == "report":
        Path("deep.json").write_text(deep)
        _clear(cli("calibrate", "--from-report", "deep.json", "--out", "p.yaml"), 2, "deep.json")
    elif kind in ("profile", "default profile"):
        text = "a: " + deep
        if kind == "profile":
            Path("deep.yaml").write_text(text)
            _clear(cli("plan", "--model", "tiny", "--hardware", "deep.yaml"), 2, "deep.yaml")
        else:
            config = workdir / "config"
            config.mkdir(exist_ok=True)
            (config / "hardware-profile.yaml").write_text(text)
            _clear(cli("plan", "--model", "tiny"), 2, "default profile")
            (config / "hardware-profile.yaml").unlink()
    else:
        folder = workdir / "pipe"
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(saved, folder)
        (folder / "model_index.json").write_text(deep)
        result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "p.json")
        assert result.exit_code == 0
        _clear(cli("run", "--plan", "p.json", "--weights", folder, "--prompt", "a cat"), 2, "model_index.json")


def test_a_newer_plan_with_an_unknown_field_says_so(cli, workdir, plan):
    data = json.loads(plan.read_text())
    data["offload"]["future_setting"] = 1
    plan.write_text(json.dumps(data))
    _clear(cli("run", "--plan", plan, "--device", "cpu"), 2, "'future_setting' this chunkflow does not know")


# ------------------------------------------------------------------------------ broken folders and caches


DAMAGE = {
    "no model_index": lambda f: (f / "model_index.json").unlink(),
    "no tokenizer": lambda f: shutil.rmtree(f / "tokenizer"),
    "no scheduler": lambda f: shutil.rmtree(f / "scheduler"),
    "scheduler config garbage": lambda f: (f / "scheduler" / "scheduler_config.json").write_text("{oops"),
    "scheduler config a list": lambda f: (f / "scheduler" / "scheduler_config.json").write_text("[1]"),
    "tokenizer garbage": lambda f: [p.write_text("{oops") for p in (f / "tokenizer").glob("*.json")],
    "text encoder config garbage": lambda f: (f / "text_encoder" / "config.json").write_text("{"),
    "transformer truncated": lambda f: [p.write_bytes(p.read_bytes()[:100]) for p in
                                        (f / "transformer").glob("*.safetensors")],
    "vae header lies": lambda f: [p.write_bytes((10**6).to_bytes(8, "little") + p.read_bytes()[8:]) for p in
                                  (f / "vae").glob("*.safetensors")],
    "vae empty": lambda f: [p.write_bytes(b"") for p in (f / "vae").glob("*.safetensors")],
    "model_index pipeline class": lambda f: (f / "model_index.json").write_text(
        json.dumps({**json.loads((f / "model_index.json").read_text()), "_class_name": "FluxPipeline"})),
    "model_index component garbage": lambda f: (f / "model_index.json").write_text(
        json.dumps({**json.loads((f / "model_index.json").read_text()), "vae": [1, 2]})),
    "weights a directory": lambda f: [(shutil.rmtree(p) if p.is_dir() else p.unlink(), p.mkdir())
                                      for p in (f / "text_encoder").glob("*.safetensors")],
}


@SETTINGS
@given(damages=st.lists(st.sampled_from(sorted(DAMAGE)), min_size=1, max_size=3, unique=True),
       cache=st.booleans())
def test_a_broken_pipeline_folder_or_cache_is_one_line_before_any_work(cli, workdir, saved, monkeypatch, damages,
                                                                       cache):
    """One to three kinds of damage to a saved pipeline, as a folder or as a Hugging Face cache entry (blobs and
    symlinked snapshots): one clear line naming a file, exit 2, no traceback."""
    from pipelines import as_hub_cache

    root = workdir / "w"
    if root.exists():
        shutil.rmtree(root)
    folder = shutil.copytree(saved, root / "pipe")
    if cache:
        folder = as_hub_cache(folder, root / "hub", "someone/tiny")
        for p in list(folder.rglob("*")):  # damage the snapshot's own files, not the shared blobs behind them
            if p.is_symlink():
                target = p.resolve()
                p.unlink()
                shutil.copyfile(target, p)
    for d in damages:
        try:
            DAMAGE[d](folder)
        except FileNotFoundError:  # an earlier damage removed what this one edits: that damage stands alone
            pass
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "p.json")
    assert result.exit_code == 0
    said = _clear(cli("run", "--plan", "p.json", "--weights", folder, "--prompt", "a cat", "--out", "x.mp4"), 2)
    assert str(root) in said or "model_index" in said
    assert not Path("x.mp4").exists()


# ---------------------------------------------------------------------------- words, numbers, output types


@pytest.mark.parametrize("args, say", [
    (["--prompt", "a \udcff cat"], "not valid UTF-8"),
    (["--prompt", "   "], "--prompt is empty"),
    (["--prompt", "a cat", "--steps", str(10**20)], "--steps must be between"),
    (["--prompt", "a cat", "--seed", str(2**64)], "--seed must be between"),
    (["--prompt", "a cat", "--seed", "-1"], "--seed must be between"),
    (["--prompt", "a cat", "--out", "x.png"], "makes videos"),
])
def test_a_generation_it_cannot_make_is_refused_before_any_work(cli, workdir, plan, args, say):
    _clear(cli("run", "--plan", plan, *args), 2, say)


def test_flux_takes_no_negative_prompt_and_makes_no_video(cli, workdir):
    result = cli("plan", "--model", "tiny-flux", "--hardware", "cpu", "--out", "f.json")
    assert result.exit_code == 0
    _clear(cli("run", "--plan", "f.json", "--prompt", "a fox", "--negative-prompt", "blurry"), 2,
           "takes no negative prompt")
    _clear(cli("run", "--plan", "f.json", "--prompt", "a fox", "--out", "x.mp4"), 2, "makes images")


def test_markup_in_user_text_is_printed_as_given(cli, workdir):
    said = _clear(cli("run", "--plan", "x[bold]y[/bold].json"), 2)
    assert "x[bold]y[/bold].json" in said
    said = _clear(cli("plan", "--model", "[blink]tiny[/blink]"), 2)
    assert "[blink]tiny[/blink]" in said


def test_nan_weights_stop_the_generation_before_the_decode(cli, workdir, saved):
    """A checkpoint with NaN in the transformer: the generation stops at the first step whose latents are not
    finite, with a message about the weights (not a float16 hint), and writes nothing."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(saved, workdir / "nan")
    f = next((folder / "transformer").glob("*.safetensors"))
    sd = load_file(str(f))
    key = next(k for k in sd if k.endswith("proj_out.weight"))
    sd[key] = sd[key] * float("nan")
    save_file(sd, str(f), metadata={"format": "pt"})
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "p.json")
    assert result.exit_code == 0
    said = _clear(cli("run", "--plan", "p.json", "--weights", folder, "--prompt", "a cat", "--out", "x.mp4"), 2,
                  "NaN or infinite values after denoising step 1")
    assert "float16" not in said and not Path("x.mp4").exists()


def test_an_sp_plan_run_as_one_process_says_so(cli, workdir):
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--sp", "2", "--transformer-only", "--out", "sp.json")
    if result.exit_code != 0:
        pytest.skip(result.output)
    result = cli("run", "--plan", "sp.json", "--device", "cpu", "--steps", "1")
    said = " ".join(result.output.split())
    assert result.exit_code == 0 and "the plan is for SP=2" in said and "torchrun --nproc-per-node 2" in said


# ----------------------------------------------------------------------------------------------- signals


def _chunkflow(args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", CHUNKFLOW_CONFIG_DIR=str(cwd / "config"), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "chunkflow", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_signals_at_random_moments_leave_no_temporary_and_no_success(tmp_path):
    """`chunkflow run --prompt --out x.mp4` (the video through ffmpeg) and `chunkflow calibrate --cpu-smoke` in a
    process of their own, sent SIGINT (to the whole process group, as a terminal's Ctrl-C is, ffmpeg included) or
    SIGTERM at a random moment: exit 130 / 143, or 0 when the signal came after the command ended; never a temporary
    file beside an output, never a traceback, and after a signal's exit an output is whole or absent."""
    from chunkflow.media import read_video

    p = _chunkflow(["plan", "--model", "tiny", "--hardware", "cpu", "--out", "plan.json"], tmp_path)
    assert p.wait(60) == 0
    rng = random.Random(24)
    t0 = time.perf_counter()
    full = _chunkflow(["run", "--plan", "plan.json", "--prompt", "a cat", "--out", "x.mp4", "--report", "r.json"],
                      tmp_path)
    assert full.wait(300) == 0
    length = time.perf_counter() - t0
    commands = [["run", "--plan", "plan.json", "--prompt", "a cat", "--out", "x.mp4", "--report", "r.json"],
                ["calibrate", "--cpu-smoke", "--out", "p.yaml", "--raw", "raw.json", "--no-save"]]
    for trial in range(8):
        for f in ("x.mp4", "r.json", "p.yaml", "raw.json"):
            (tmp_path / f).unlink(missing_ok=True)
        args = commands[trial % 2]
        sig = signal.SIGINT if trial % 4 < 2 else signal.SIGTERM
        proc = _chunkflow(args, tmp_path)
        time.sleep(rng.uniform(0.2, length * (1.0 if trial % 2 == 0 else 3.0)))
        try:
            os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode in (0, 128 + sig), (args, sig, proc.returncode, out[-2000:])
        assert "Traceback" not in out, out[-3000:]
        _no_temporaries(tmp_path)
        if (tmp_path / "x.mp4").exists():
            assert read_video(str(tmp_path / "x.mp4")).shape[0] == 5  # whole
        for f in ("r.json", "raw.json"):
            if (tmp_path / f).exists():
                json.loads((tmp_path / f).read_text())  # whole


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_process_tears_down_is_no_death_by_signal(tmp_path, sig):
    """A signal that comes once the command has finished, while the process is freeing what it held (Python puts
    SIGINT and SIGTERM back to their defaults before it frees its modules, so there it killed the process: -15
    after 'Run report written'), ends it with 0 or 128 + the signal, never by the signal."""
    late = (f"import os, sys\nclass Late:\n    def __del__(self):\n        os.kill(os.getpid(), {int(sig)})\n"
            "sys.modules['__main__'].late = Late()  # freed among the modules, after the command\n"
            "sys.argv = ['chunkflow', 'plan', '--model', 'tiny', '--hardware', 'cpu', '--out', 'p.json']\n"
            "from chunkflow.entry import main\nmain()\n")
    env = dict(os.environ, CHUNKFLOW_CONFIG_DIR=str(tmp_path / "config"))
    done = subprocess.run([sys.executable, "-c", late], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode in (0, 128 + sig), (done.returncode, done.stderr[-2000:])
    assert json.loads((tmp_path / "p.json").read_text())["schema_version"]


def test_a_signal_during_an_import_is_raised_once_the_import_is_over(tmp_path, monkeypatch):
    """Ctrl-C while a module is being imported (an extension's initialisation can abort the interpreter on an
    exception, or mark the process killed by SIGINT whatever it exits with) is held until the import is over, then
    raised as usual: the module is whole, the KeyboardInterrupt still comes."""
    import time

    from chunkflow import signals
    from chunkflow_planner.files import interrupted, note_interrupt

    (tmp_path / "cf_probe_slow_import.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\nstart = time.monotonic()\n"
        "while time.monotonic() - start < 0.3:\n    pass\nWHOLE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signals.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            import cf_probe_slow_import  # noqa: F401
            time.sleep(5)  # the held signal is delivered again within RETRY_S
        assert sys.modules["cf_probe_slow_import"].WHOLE
        assert interrupted() == signal.SIGINT
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        sys.modules.pop("cf_probe_slow_import", None)
        note_interrupt(None)
