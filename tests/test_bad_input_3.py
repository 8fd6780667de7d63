"""Hostile input, round three (issue 35): outputs that land on a full disk or on a device, FIFO or socket; plan,
profile and report files that are not regular files or are far too large; plans edited by hand past what their
model or a real run allows; and control characters from files and arguments on their way to the terminal.

Every hostile case ends with one clear line naming the file or field and what to do, exit code 2, before any
model is built, with nothing left at the output's name (a file there before is left whole) and no temporary file."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input_2 import _clear, _no_temporaries  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def _chunkflow(args: list[str], cwd: Path, file_size_limit: int | None = None,
               timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -m chunkflow ARGS` in a process of its own (the timeout guards against a hang); with
    `file_size_limit`, no file it writes can grow past that many bytes (RLIMIT_FSIZE), as on a disk that fills up:
    Python ignores SIGXFSZ, so the write fails (EFBIG), and a program it starts (ffmpeg) is killed by SIGXFSZ."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CHUNKFLOW_CONFIG_DIR=str(cwd / "config"), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
             ) if file_size_limit else None
    return subprocess.run([sys.executable, "-m", "chunkflow", *map(str, args)], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=limit)


def _said(p: subprocess.CompletedProcess) -> str:
    return " ".join((p.stdout + p.stderr).split())


@pytest.fixture
def plan(cli, workdir) -> Path:
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return workdir / "plan.json"


# ------------------------------------------------------------------------------------- outputs: not a file


def _node(path: Path, kind: str):
    """A character device (a link to /dev/full), a FIFO or a listening socket at `path`; returns what to close."""
    if kind == "device":
        path.symlink_to("/dev/full")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        return sock
    return None


def _kind_of(path: Path) -> str:
    mode = os.stat(path).st_mode
    return "device" if stat.S_ISCHR(mode) else "fifo" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) \
        else "other"


OUTPUTS = {  # command -> (arguments with {} for the output, the output's name)
    "plan --out": (["plan", "--model", "tiny", "--hardware", "cpu", "--out", "{}"], "o.json"),
    "run --report": (["run", "--plan", "plan.json", "--report", "{}"], "o.json"),
    "run --latents": (["run", "--plan", "plan.json", "--latents", "{}"], "o.safetensors"),
    "run --prompt --out": (["run", "--plan", "plan.json", "--prompt", "a cat", "--out", "{}"], "o.mp4"),
    "calibrate --out": (["calibrate", "--cpu-smoke", "--no-save", "--out", "{}"], "o.yaml"),
    "calibrate --raw": (["calibrate", "--cpu-smoke", "--no-save", "--raw", "{}"], "o.json"),
    "bench --out": (["bench", "--model", "tiny", "--frames", "5", "--out", "b"], "b/bench.csv"),
}
KIND_SAID = {"device": "is a character device", "fifo": "is a FIFO", "socket": "is a socket"}


@pytest.mark.parametrize("kind", sorted(KIND_SAID))
@pytest.mark.parametrize("command", sorted(OUTPUTS))
def test_an_output_that_is_a_device_fifo_or_socket_is_refused_before_any_work(cli, workdir, plan, command, kind):
    """Outputs are regular files or new names: anything else there (what /dev/full is, a FIFO, a socket) is
    refused before the work, and left as it is (an atomic rename would have replaced the node)."""
    args, name = OUTPUTS[command]
    target = workdir / name
    target.parent.mkdir(exist_ok=True)
    sock = _node(target, kind)
    try:
        said = _clear(cli(*[a.replace("{}", name) for a in args]), 2, KIND_SAID[kind])
        assert name in said and "new file name" in said, said
        assert _kind_of(target) == kind and (kind != "device" or os.readlink(target) == "/dev/full")
        assert "built" not in said and not (workdir / "run-report.json").exists()
        _no_temporaries(workdir)
    finally:
        if sock is not None:
            sock.close()


def test_each_image_of_a_batch_is_an_output_checked_before_any_work(cli, workdir):
    """An image model's batch goes to stem-0.png, stem-1.png, ...: each of those names is checked as --out is."""
    result = cli("plan", "--model", "tiny-flux", "--hardware", "cpu", "--batch", "2", "--out", "f.json")
    assert result.exit_code == 0, result.output
    os.mkfifo("x-1.png")
    said = _clear(cli("run", "--plan", "f.json", "--prompt", "a fox", "--out", "x.png"), 2, "'x-1.png' is a FIFO")
    assert "built" not in said and not Path("x-0.png").exists() and not Path("x.png").exists()
    assert stat.S_ISFIFO(os.lstat("x-1.png").st_mode)


# ------------------------------------------------------------------------------------- outputs: a full disk


def test_a_full_disk_fails_plan_out_naming_the_file_and_leaving_nothing(cli, workdir, plan):
    """`plan --out` on a disk that fills up: one line naming the file, exit 2, nothing at its name, and a plan
    there before is left whole."""
    p = _chunkflow(["plan", "--model", "tiny", "--hardware", "cpu", "--out", "new.json"], workdir, 2048)
    said = _said(p)
    assert p.returncode == 2 and "cannot write 'new.json': File too large" in said, said
    assert "Plan written" not in said and "Traceback" not in said and not (workdir / "new.json").exists()
    before = plan.read_bytes()
    p = _chunkflow(["plan", "--model", "tiny", "--hardware", "cpu", "--frames", "9", "--out", "plan.json"], workdir,
                   2048)
    assert p.returncode == 2 and "left as it was" in _said(p) and plan.read_bytes() == before
    _no_temporaries(workdir)


@pytest.mark.slow
def test_a_full_disk_fails_the_video_and_the_report_naming_the_file(cli, workdir, plan):
    """`run --prompt --out v.mp4` on a disk that fills up (it printed ffmpeg's "No space left on device", then
    "Written: v.mp4", exit 0, and left a 0-byte video): the encoder's failure is one line naming the video, exit 2,
    no "Written:", no video and no report; a synthetic run's report likewise."""
    p = _chunkflow(["run", "--plan", "plan.json", "--prompt", "a cat", "--out", "v.mp4", "--report", "r.json"],
                   workdir, 1024, timeout=600)  # the tiny model's video is about 2 KB
    said = _said(p)
    assert p.returncode == 2 and "ffmpeg could not write 'v.mp4'" in said and "left as it was" in said, said
    assert "Written" not in said and "Traceback" not in said
    assert not (workdir / "v.mp4").exists() and not (workdir / "r.json").exists()
    p = _chunkflow(["run", "--plan", "plan.json", "--steps", "1", "--report", "r.json"], workdir, 4096, timeout=600)
    said = _said(p)
    assert p.returncode == 2 and "cannot write 'r.json'" in said and "Run report written" not in said, said
    assert not (workdir / "r.json").exists()
    _no_temporaries(workdir)


# --------------------------------------------------------------------------------- files read: not a file


def _fifo_or_zero(workdir: Path, name: str, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(workdir / name)
        return name
    return "/dev/zero"


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("what", ["run --plan", "plan --hardware", "run --profile", "calibrate --from-report",
                                  "bench --from-dir"])
def test_a_file_read_that_is_a_fifo_or_a_device_is_refused_at_once(workdir, what, kind):
    """`run --plan FIFO` blocked for ever and `run --plan /dev/zero` read 12.5 GB in 134 s: every file chunkflow reads
    (plans, hardware profiles, run reports, bench files) must be a regular file, refused otherwise without reading
    it, in a process of its own (the timeout guards against the hang)."""
    p = _chunkflow(["plan", "--model", "tiny", "--hardware", "cpu", "--out", "plan.json"], workdir)
    assert p.returncode == 0, _said(p)
    if what == "bench --from-dir":
        (workdir / "old").mkdir()
        name = _fifo_or_zero(workdir, "old/bench.json", kind) if kind == "fifo" else None
        if kind == "zero":
            (workdir / "old" / "bench.json").symlink_to("/dev/zero")
        args = ["bench", "--from-dir", "old", "--out", "new"]
        shown = "old/bench.json"
    else:
        name = _fifo_or_zero(workdir, "x.yaml" if "hardware" in what or "profile" in what else "x.json", kind)
        args = {"run --plan": ["run", "--plan", name],
                "plan --hardware": ["plan", "--model", "tiny", "--hardware", name],
                "run --profile": ["run", "--plan", "plan.json", "--profile", name],
                "calibrate --from-report": ["calibrate", "--from-report", name, "--out", "p.yaml"]}[what]
        shown = name
    p = _chunkflow(args, workdir, timeout=60)
    said = _said(p)
    assert p.returncode == 2 and "Traceback" not in said, said
    assert shown in said and ("is a FIFO" in said or "is a character device" in said), said
    assert "regular file" in said and not (workdir / "p.yaml").exists() and not (workdir / "new").exists()


def test_a_plan_or_report_that_is_a_socket_is_refused_by_kind(cli, workdir):
    """A socket cannot even be opened as a file: it is named for what it is, like a FIFO."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind("s.json")
    try:
        _clear(cli("run", "--plan", "s.json"), 2, "plan file 's.json' is a socket, not a regular file")
        _clear(cli("calibrate", "--from-report", "s.json", "--out", "p.yaml"), 2, "'s.json' is a socket")
    finally:
        sock.close()
    assert not Path("p.yaml").exists()


def test_a_plan_or_profile_far_larger_than_any_chunkflow_writes_is_refused(cli, workdir):
    """A (sparse) 65 MiB plan, or a 2 MiB profile (YAML: ~16 KB as calibrate writes it), is not one chunkflow
    wrote: refused by name, not parsed."""
    for name, size in (("big.json", 65 * 2**20), ("big.yaml", 2 * 2**20)):
        with open(name, "wb") as f:
            f.truncate(size)
    _clear(cli("run", "--plan", "big.json"), 2, "plan file 'big.json' is over 67,108,864 bytes")
    _clear(cli("plan", "--model", "tiny", "--hardware", "big.yaml"), 2, "'big.yaml' is over 1,048,576 bytes")


# ------------------------------------------------------------------------------------- hand-edited plans


def _set(data: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        data = data[key] if not key.isdigit() else data[int(key)]
    data[int(last) if last.isdigit() else last] = value


EDITS = [  # (field path, value, what the error says)
    ("offload.disk_blocks", 99, "offload.disk_blocks is 99, but tiny-wan has 2 blocks"),
    ("workload.steps", 10**9, "workload.steps is 1000000000, more than 100000"),
    ("model.n_blocks", 10**9, "model.n_blocks is 1000000000, but tiny-wan in this chunkflow's catalog has 2"),
    ("model.block_bytes_total", 1, "model.block_bytes_total is 1, but tiny-wan"),
    ("model.non_block_bytes", 10**12, "model.non_block_bytes is 1000000000000, but tiny-wan"),
    ("offload.chunk_bytes", 1, "offload.chunk_bytes 1 cuts tiny-wan's largest block"),
    ("offload.residency", 1.5, "residency 1.5 must be in [0, 1]"),
    ("offload.mode", "turbo", "unknown mode 'turbo'"),
    ("offload.weight_dtype", "fp4", "unknown weight_dtype 'fp4'"),
    ("workload.tokens", 5, "workload.tokens is 5, but 64x64 x5 is 32 tokens"),
    ("workload.height", 64 * 10**4, "workload.tokens is 32, but 64x640000 x5"),
    ("workload.batch", 10**5, "workload.batch is 100000, more than 1024"),
    ("workload.cfg_passes", 3, "workload.cfg_passes"),
    ("parallel.sp_degree", 10**9, "parallel.sp_degree 1000000000 does not divide"),
    ("hardware.spec.peak_tflops", -1, "hardware.spec (the profile planned with) is malformed: peak_tflops"),
    ("hardware.spec.memory_bytes", 0, "hardware.spec (the profile planned with) is malformed: memory_bytes"),
    ("hardware.peak_tflops", 1e300, "hardware.peak_tflops"),
    ("memory_budget_bytes", -5, "memory_budget_bytes"),
    ("memory_margin", 7, "memory_margin"),
    ("pipeline.components.0.name", "evil", "pipeline.components are 'evil', 'transformer', 'vae'"),
    ("pipeline.components.1.bytes", 10**15, "pipeline component 'transformer' is a transformer of 1000000000000000"),
    ("pipeline.components.2.placement", "moon", "pipeline.components.2.placement"),
]


@pytest.mark.parametrize("field, value, say", EDITS, ids=[e[0] for e in EDITS])
def test_a_hand_edited_plan_is_refused_naming_the_file_and_field_before_anything_is_built(cli, workdir, plan, field,
                                                                                          value, say):
    """A plan is checked whole, against the catalog model it names, as it is read: `disk_blocks: 99` for a 2-block
    model was refused only after a 144 s build, `steps: 10**9` ran silently, `n_blocks: 10**9` ran as if nothing
    were wrong, `chunk_bytes: 1` crawled. Each is one line naming the file and the field, exit 2, nothing built
    or written."""
    data = json.loads(plan.read_text())
    if field.startswith("offload.") and field != "offload.mode":
        data["offload"].update(mode="chunkflow", chunk_bytes=4096, residency=0.0)  # a setting that streams
    _set(data, field, value)
    Path("e.json").write_text(json.dumps(data))
    for extra in ([], ["--prompt", "a cat", "--out", "x.mp4"]):
        said = _clear(cli("run", "--plan", "e.json", *extra), 2, say)
        assert "plan file 'e.json'" in said and "built" not in said, said
        assert not Path("run-report.json").exists() and not Path("x.mp4").exists()


def test_a_workload_edited_past_the_plans_budget_is_refused(cli, workdir):
    """Resolution and tokens edited together (consistent): the transformer the plan now describes needs more
    device memory than the budget it was planned for, which no plan holds."""
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.plan import PlanWorkload
    from chunkflow_planner.workload import tokens

    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--mem-budget", "1MB", "--transformer-only",
                 "--out", "small.json")
    assert result.exit_code == 0, result.output
    data = json.loads(Path("small.json").read_text())
    data["workload"].update(height=1024, width=1024)
    data["workload"]["tokens"] = tokens(get_model("tiny"), PlanWorkload(**data["workload"]).to_workload())
    Path("e.json").write_text(json.dumps(data))
    said = _clear(cli("run", "--plan", "e.json"), 2, "more than the plan's budget of 1.00 MB")
    assert "plan file 'e.json'" in said and "built" not in said


@pytest.mark.parametrize("hardware", ["h200", "cpu"])
def test_the_plans_chunkflow_plan_writes_pass_the_whole_check(cli, workdir, hardware):
    """No false refusal: the plan of every catalog model at its default workload (the whole pipeline where it has
    one) passes every check `run` makes of it."""
    from chunkflow_planner.catalog import load_models
    from chunkflow_planner.plan import load_plan

    checked = 0
    for name in load_models():
        result = cli("plan", "--model", name, "--hardware", hardware, "--host-mem-budget", "4TB", "--out", "p.json")
        if result.exit_code == 2 and "infeasible" in result.output:
            continue
        assert result.exit_code == 0, result.output
        load_plan("p.json")
        checked += 1
    assert checked >= len(load_models()) // 2


@pytest.mark.parametrize("args, say", [
    (["plan", "--model", "tiny", "--steps", "100001"], "--steps must be at most 100000"),
    (["plan", "--model", "tiny", "--height", "65536", "--width", "65536"], "more than 4194304"),
    (["plan", "--model", "tiny", "--batch", "1025"], "--batch must be at most 1024"),
    (["run", "--plan", "plan.json", "--mode", "chunkflow", "--chunk-size", "1B"], "--chunk-size 1 cuts tiny-wan's"),
    (["bench", "--model", "tiny", "--frames", "5", "--chunk-sizes", "4KB,1B"], "--chunk-sizes 1 cuts tiny-wan's"),
    (["bench", "--model", "tiny", "--frames", "5", "--steps", "1000000000"], "--steps must be in [1, 100000]"),
])
def test_flags_past_a_real_runs_bounds_are_refused_like_a_plan_field(cli, workdir, plan, args, say):
    """What a plan may not hold, a flag may not ask for: `plan` never writes a plan `run` refuses, and `run`'s
    overrides and `bench`'s sweep meet the plan's bounds."""
    _clear(cli(*args), 2, say)
    assert not Path("b").exists() and not Path("run-report.json").exists()


# -------------------------------------------------------------------------------- control characters


HOSTILE = "\x1b[2J\x1b]0;t\x07\r\x9b31m\u202e"  # clear screen, set the title + BEL, CR, C1 CSI, bidi override
SHOWN = "\\x1b[2J\\x1b]0;t\\x07\\r\\x9b31m\\u202e"  # as repr() shows them


def _escaped(said: str) -> None:
    assert not any(c in said for c in "\x1b\x07\r\x9b\u202e"), repr(said)


def test_control_characters_in_arguments_and_files_reach_the_terminal_escaped(cli, workdir, plan):
    """Every string from an argument or a file is shown with its control characters escaped, on every path: an
    output path holding one refused in one line (a file of that name could not be shown or typed as it is), a
    missing plan named twice, an existing profile file's name and a profile's own name in the plan's tables and
    JSON."""
    name = f"a{HOSTILE}.json"
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", name)
    said = _clear(result, 2, f"--out 'a{SHOWN}.json' holds a control character")
    _escaped(result.output)
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not Path(name).exists(), os.listdir(workdir)
    _no_temporaries(workdir)
    result = cli("run", "--plan", f"gone{HOSTILE}.json")
    said = _clear(result, 2)
    _escaped(result.output)
    assert said.count(f"gone{SHOWN}.json") == 2, said  # the file, and the hint that repeats it
    profile = json.loads(plan.read_text())["hardware"]["spec"]
    profile["name"] = f"gpu{HOSTILE}"
    Path(f"hw{HOSTILE}.json").write_text(json.dumps(profile))  # an input may hold them: it is read, and shown escaped
    result = cli("plan", "--model", "tiny", "--hardware", f"hw{HOSTILE}.json")
    said = _clear(result, 0)
    _escaped(result.output)
    assert f"gpu{SHOWN}" in said and f"hw{SHOWN}.json" in said, said
    result = cli("plan", "--model", "tiny", "--hardware", f"hw{HOSTILE}.json", "--json")
    _clear(result, 0)
    _escaped(result.output)
    assert json.loads(result.stdout)["hardware"]["name"] == f"gpu{HOSTILE}"  # the same JSON document


@pytest.mark.slow
def test_a_class_name_holding_escape_sequences_is_shown_escaped(cli, workdir, plan, tmp_path_factory):
    """A downloaded model_index.json whose `_class_name` holds ESC sequences (clear the screen, restyle it):
    the error it causes shows them escaped, on one line; so does the refusal of a run report's path holding them
    (before the run)."""
    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("tiny", tmp_path_factory.mktemp("saved") / "tiny")
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = f"Evil{HOSTILE}\nPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    result = cli("run", "--plan", plan, "--weights", folder, "--prompt", "a cat", "--out", "x.mp4")
    said = _clear(result, 2, f"Evil{SHOWN}\\nPipeline")
    _escaped(result.output)
    assert len(result.output.strip().splitlines()) == 1 and not Path("x.mp4").exists(), said
    result = cli("run", "--plan", plan, "--steps", "1", "--report", f"r{HOSTILE}.json")
    said = _clear(result, 2, f"--report 'r{SHOWN}.json' holds a control character")  # refused before the run
    _escaped(result.output)
    assert len(result.output.strip().splitlines()) == 1 and "built" not in said, result.output
    assert not list(Path().glob("r*.json")), os.listdir()


def test_warnings_and_library_log_lines_in_a_command_are_escaped(workdir):
    """Warnings (chunkflow's warn_user, a library's warnings.warn) and log records (transformers' and diffusers'
    loggers print tensor and class names from a checkpoint's files) come out escaped within a command, printed by
    Python's own machinery in a process of its own, and are put back after it."""
    code = (f"import logging, warnings\nfrom chunkflow.commands.terminal import escaped_output\n"
            f"logging.basicConfig(format='%(message)s')\nhostile = {HOSTILE!r}\nwith escaped_output():\n"
            "    warnings.warn(f'weights of {hostile} not used')\n"
            "    logging.getLogger('transformers').warning('Some weights of %s were not used', 'model' + hostile)\n"
            "assert logging.getLogRecordFactory() is logging.LogRecord\n"
            "logging.getLogger('after').warning('raw' + hostile)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    inside, after = p.stderr.split("raw")
    _escaped(inside)
    assert f"weights of {SHOWN} not used" in inside and f"Some weights of model{SHOWN} were not used" in inside
    assert after.startswith("\x1b[2J")  # outside a command, Python's own behaviour is left alone
