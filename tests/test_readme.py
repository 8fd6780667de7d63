"""The README's command blocks, every one (issue 53): each ```bash, ```sh, ```console and ```python block runs as
written on the CPU, or its marker, an HTML comment on the line just before it, says what CI changes or why it cannot
run it:

    <!-- not run in CI: REASON -->                       nothing of it runs here (a GPU, a download, an install)
    <!-- CI runs this with: ADAPTATION; ADAPTATION -->   it runs, with exactly these changes (APPLIES below)

A block neither run nor marked, a marker without a reason, an adaptation this file does not know or a block with
no expectation here fails; so a new README block cannot be skipped silently. The weights a block names are stood in
by tiny random pipelines of the same classes (a folder, or a Hugging Face cache entry for a Hub id); each block's
files and printed words are checked (EXPECT), not only its exit codes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
COMMANDS = {"bash", "sh", "console", "python"}  # the languages of command blocks; `text` holds none
NOT_RUN, ADAPTED = "not run in CI", "CI runs this with"
MARKER = re.compile(rf"<!--\s*({NOT_RUN}|{ADAPTED}):\s*(.*?)\s*-->", re.S)
# the real weights a block may name -> what stands in: a catalog model saved as a folder, or a tiny LTX-Video folder
STAND_INS = {"Wan-AI/Wan2.2-TI2V-5B-Diffusers": "tiny-ti2v", "Wan-AI/Wan2.1-T2V-14B-Diffusers": "tiny",
             "./ltx-video": "ltx_video"}
WAIT_S = 120
Cli = Callable[..., Any]  # the `cli` fixture: cli(*args) -> click's Result


@dataclass(frozen=True)
class Block:
    """A fenced block of the README: its language, its text, the line of its opening fence, its marker."""

    lang: str
    text: str
    line: int
    mark: str = ""
    note: str = ""

    @property
    def adaptations(self) -> list[str]:
        return [a.strip() for a in self.note.split(";")] if self.mark == ADAPTED else []

    def adapted(self, start: str) -> bool:
        return any(a.startswith(start) for a in self.adaptations)

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of `text` (the README), with the marker (an HTML comment) that ends on the line before
    its fence."""
    lines, blocks, i = (README if text is None else text).splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark = ("", "")
        if i and lines[i - 1].rstrip().endswith("-->"):
            start = max(j for j in range(i) if lines[j].startswith("<!--"))
            m = MARKER.fullmatch("\n".join(lines[start:i]).strip())
            mark = (m.group(1), " ".join(m.group(2).split())) if m else ("", "")
        blocks.append(Block(fence.group(1), "\n".join(lines[i + 1:end]), i + 1, *mark))
        i = end + 1
    return blocks


def runnable_blocks() -> list[Block]:
    return [b for b in readme_blocks() if b.lang in COMMANDS and b.mark != NOT_RUN]


def logical_lines(block: Block) -> list[str]:
    """A shell block's commands as bash reads them: continuation lines joined, a heredoc kept whole with its
    command, comment-only and blank lines dropped; a console block's `$ ` lines only."""
    raw = block.text.splitlines()
    if block.lang == "console":
        raw = [x[2:] for x in raw if x.startswith("$ ")]
    out, pending, it = [], "", iter(raw)
    for x in it:
        if x.rstrip().endswith("\\"):
            pending += x.rstrip()[:-1]
            continue
        line, pending = pending + x, ""
        tag = re.search(r"<<-?'?(\w+)'?", line)
        if tag:  # the body, and the end line takewhile consumes
            line = "\n".join([line, *takewhile(lambda y: y.strip() != tag.group(1), it), tag.group(1)])
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
    return out


def chain(line: str) -> list[list[str]]:
    """A command line's `&&`-chained commands, as words (comments dropped)."""
    steps: list[list[str]] = [[]]
    for w in shlex.split(line, comments=True):
        if w == "&&":
            steps.append([])
        else:
            steps[-1].append(w)
    return steps


def _is_chunkflow(words: list[str]) -> bool:
    return bool(words) and Path(words[0]).name == "chunkflow"


def _installs(words: list[str]) -> bool:
    return words[:3] == ["python3", "-m", "venv"] or (Path(words[0]).name == "pip" and words[1:2] == ["install"])


def bash(line: str, cwd: Path) -> str:
    """`line` run by bash in `cwd` (the test's environment); exit 0 asserted; what it printed."""
    p = subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=WAIT_S)
    assert p.returncode == 0, f"{line}\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
    return p.stdout


def run_chunkflow(cli: Cli, args: list[str], cwd: Path) -> str:
    """One `chunkflow ARGS` through the CLI: exit 0, what --out / --out-dir name written, a plan's lines 100
    columns at most; what it printed."""
    r = cli(*args)
    assert r.exit_code == 0, f"chunkflow {shlex.join(args)}\n{r.output}"
    for flag in ("--out", "--out-dir"):
        if flag in args:
            path = cwd / args[args.index(flag) + 1]
            assert (path.is_file() and path.stat().st_size > 0) or (path.is_dir() and any(path.iterdir())), path
    assert args[0] != "plan" or all(len(x) <= 100 for x in r.output.splitlines()), "wider than 100 columns"
    return r.output


def run_shell(block: Block, cli: Cli, cwd: Path) -> str:
    """Each command of a shell block in order, as written: chunkflow's through the CLI, the rest through bash (a
    venv or pip step left out only where the marker says so); everything printed."""
    printed = []
    for line in logical_lines(block):
        if "\n" in line or not any(_is_chunkflow(s) for s in chain(line)):
            printed.append(bash(line, cwd))
            continue
        for words in chain(line):
            if _installs(words):
                assert block.adapted("no venv or installs"), f"{block}: {shlex.join(words)} installs: mark it"
                continue
            assert _is_chunkflow(words), f"{block}: {words[0]} chained to chunkflow: teach this test to run it"
            printed.append(run_chunkflow(cli, words[1:], cwd))
    return "\n".join(printed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_done(port: int, job: str) -> None:
    """Until GET /jobs/JOB says done (the README's result line answers 409 before)."""
    deadline = time.monotonic() + WAIT_S
    while json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/jobs/{job}"))["state"] != "done":
        assert time.monotonic() < deadline, f"job {job} not done in {WAIT_S} s"
        time.sleep(0.2)


def run_server(block: Block, cwd: Path) -> str:
    """A `chunkflow serve` block: its first line started as a process (on a free port for 8000), once it serves
    the rest in order through bash (ID the id the first POST returned; the result fetched once the job is done),
    then Ctrl-C, which stops it cleanly; everything printed, the server's stderr last."""
    assert block.adapted("a free port for 8000") and block.adapted("ID the id its POST returned"), block
    port = _free_port()
    first, *rest = [x.replace("8000", str(port)) for x in logical_lines(block)]
    words = shlex.split(first, comments=True)
    assert words[:2] == ["chunkflow", "serve"] and "--port" not in words, block
    words += ["--port", str(port)]  # its default, 8000, is the port the curl lines name
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "chunkflow", *words[1:]], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed, job = [], ""
    try:
        assert f":{port}/" in proc.stdout.readline(), proc.stderr.read() if proc.poll() is not None else ""
        for line in rest:
            line = re.sub(r"\bID\b", job, line) if job else line
            if "/result" in line:
                _wait_done(port, job)
            printed.append(bash(line, cwd))
            job = job or json.loads(printed[-1])["id"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err, err
    return "\n".join([*printed, err])


def run_python(block: Block, stand_in: dict[str, Path],
               capsys: pytest.CaptureFixture[str]) -> tuple[str, dict]:
    """A Python block executed in this process, in the working directory: verbatim, or (its marker saying so) as
    the README's offload snippet is on the CPU (tests/test_readme_install.py's _snippet: the Hub id a tiny folder,
    "cuda" the CPU, a 5-frame 64x64 clip in 2 steps); what it printed and its namespace."""
    import torch

    from pipelines import one_thread
    from test_readme_install import _snippet

    code, names = block.text, {"__name__": "__readme__"}
    if block.adapted('the CPU for "cuda"'):  # the one snippet _snippet adapts: it checks there is one
        assert "chunkflow.offload(" in code, block
        code, names["FOLDER"] = _snippet(), str(stand_in["Wan-AI/Wan2.1-T2V-14B-Diffusers"])
    capsys.readouterr()
    torch.manual_seed(0)
    with one_thread():
        exec(compile(code, str(block), "exec"), names)
    return capsys.readouterr().out, names


WEIGHTS = re.compile(r"""--weights\s+(\S+)|weights=["']([^"']+)|from_pretrained\(\s*["']([^"']+)""")


def weights_named(block: Block) -> list[str]:
    """The weights a block names (--weights, weights=, from_pretrained), each one a tiny pipeline stands in for."""
    names = {g for m in WEIGHTS.finditer(block.text) for g in m.groups() if g}
    assert names <= set(STAND_INS), f"{block}: no tiny pipeline stands in for {names - set(STAND_INS)}: add one"
    return sorted(names)


def stand_ins(block: Block, cli: Cli, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The tiny random pipelines standing in for the weights the block names: a folder where it names a folder, a
    Hugging Face cache entry (HF_HUB_CACHE, offline) where it names a Hub id; a CPU plan.json of them where the
    marker says so. Name -> the folder."""
    from pipelines import as_hub_cache, save_catalog_pipeline

    out: dict[str, Path] = {}
    for name in weights_named(block):
        if STAND_INS[name] == "ltx_video":
            from test_run_any import _ltx

            _ltx(cwd / name)
            out[name] = cwd / name
        else:
            out[name] = save_catalog_pipeline(STAND_INS[name], cwd / "saved" / STAND_INS[name])
            as_hub_cache(out[name], cwd / "hub", name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cwd / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if block.adapted("a plan.json of them"):
        (hub,) = [n for n in out if not n.startswith("./")]
        run_chunkflow(cli, ["plan", "--model", STAND_INS[hub], "--hardware", "cpu", "--out", "plan.json"], cwd)
    return out


def _installs_in(block: Block) -> bool:
    return any(_installs(w) for x in logical_lines(block) if "\n" not in x for w in chain(x))


# each adaptation a marker may name -> whether it applies to the block (a marker must not name one that does not)
APPLIES: dict[str, Callable[[Block], bool]] = {
    "tiny random weights for": lambda b: bool(weights_named(b)),
    "a plan.json of them": lambda b: "plan.json" in b.text and "--out plan.json" not in b.text,
    "no venv or installs": _installs_in,
    "a free port for 8000": lambda b: "8000" in b.text,
    "ID the id its POST returned": lambda b: re.search(r"\bID\b", b.text) is not None,
    'the CPU for "cuda"': lambda b: '"cuda"' in b.text,
}


# ------------------------------------------------------------------------------- what each block must leave


def _streamed(cwd: Path, out: str, names: dict) -> None:
    """The main job: the plan streams the transformer, and the run streamed every block, bytes copied."""
    plan = json.loads((cwd / "plan.json").read_text())
    assert plan["offload"]["mode"] == "chunkflow"
    assert {c["name"]: c["placement"] for c in plan["pipeline"]["components"]}["transformer"] == "stream"
    stats = json.loads((cwd / "run-report.json").read_text())["stats"]
    assert stats["n_streamed_blocks"] == stats["n_blocks"] > 0 and stats["h2d_bytes_issued"] > 0


def _format_rows(cwd: Path, out: str, names: dict) -> None:
    """One row a format, saying whether it fits."""
    for fmt in ("q8_0", "q4_k", "fp8-scaled", "bf16"):
        assert re.search(rf"(^|\s){fmt}\s+[\d.]+\s+(yes|no)\s", out), (fmt, out)


def _three_clips(cwd: Path, out: str, names: dict) -> None:
    assert len(list((cwd / "clips").glob("*.mp4"))) == 3


def _four_generations(cwd: Path, out: str, names: dict) -> None:
    """Four videos written, each generation's measured seconds printed."""
    printed = [x.split() for x in names["__stdout__"].splitlines() if x.strip()]
    assert len(printed) == 4 and all(float(x[0]) > 0 for x in printed), printed


def _a_video(cwd: Path, out: str, names: dict) -> None:
    """The result fetched is the job's video, not the 409's JSON."""
    assert (cwd / "fox.mp4").read_bytes()[4:8] == b"ftyp"


def _unchanged(cwd: Path, out: str, names: dict) -> None:
    """The snippet's clip is 5 frames of 64x64; after its handle.remove() the pipeline runs as its own, and offloaded
    again as the snippet does it gives the same clip bit for bit (both from one seed: the snippet's own call drew
    its noise after loading, from a state this test cannot repeat)."""
    import numpy as np
    import torch

    import chunkflow
    from pipelines import one_thread

    def clip() -> np.ndarray:
        torch.manual_seed(0)
        with one_thread():
            return names["pipe"]("a red fox in snow", num_frames=5, height=64, width=64, num_inference_steps=2,
                                 max_sequence_length=8).frames[0]

    assert names["video"].shape == (5, 64, 64, 3)
    ref = clip()
    handle = chunkflow.offload(names["pipe"].transformer, mode="chunkflow", chunk_size="16MB", residency=0.0,
                               device="cpu")
    try:
        assert np.array_equal(clip(), ref) and handle.stats().n_streamed_blocks > 0
    finally:
        handle.remove()


Check = Callable[[Path, str, dict], None]
# a string exactly one runnable block holds -> (files it leaves, words it prints, a further check)
EXPECT: dict[str, tuple[tuple[str, ...], tuple[str, ...], Check | None]] = {
    "chunkflow plan --model demo": (("plan.json", "fox.mp4", "run-report.json"),
                                    ("blocks streamed from host memory", "Written: fox.mp4"), _streamed),
    "--mem-budget 16GB --host-mem-budget 64GB": ((), ("Wan2.1-T2V-14B at 832x480, 81 frames", "host memory"), None),
    "--format q8_0,q4_k,fp8-scaled,bf16": ((), ("priced before the download",), _format_rows),
    "chunkflow models --describe ./ltx-video": (("plan.json", "fox.mp4", "run-report.json"),
                                                ("source: derived from ./ltx-video", "hardware: h200", "hardware: cpu",
                                                 "Written: fox.mp4"), None),
    "--prompts jobs.jsonl": (("jobs.jsonl", "clips/lighthouse.mp4", "run-report.json"), ("3 of 3 jobs done",),
                             _three_clips),
    "chunkflow.load(": (("fox-0.mp4", "fox-1.mp4", "fox-2.mp4", "fox-3.mp4"), (), _four_generations),
    "chunkflow serve": (("fox.mp4",), ('"predicted_start":', "there is nothing to cancel",
                                       '"components":[{"name":"text_encoder"', '"ok":true',
                                       'chunkflow_jobs{state="done"} 1', "stopped: 1 job done"), _a_video),
    "chunkflow.offload(pipe.transformer": ((), ("chunkflow on cpu: 2 of 2 blocks",), _unchanged),
}


def _keys(block: Block) -> list[str]:
    return [k for k in EXPECT if k in block.text]


# ------------------------------------------------------------------------------------------------ the tests


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README
    assert "pytest" in ci and "torch==2.13.0" in ci


def test_every_command_block_is_run_or_marked_with_a_reason() -> None:
    """Every block is a command block or `text`; each marker stands just before a block, a block not run says why
    (a sentence), a block run with changes names only changes this file makes and that apply to it (weights
    stood in among them, where it names any); each block run has exactly one expectation, and each expectation
    one block."""
    blocks = readme_blocks()
    assert len(MARKER.findall(README)) == sum(bool(b.mark) for b in blocks), "a marker that is not before a block"
    for b in blocks:
        assert b.lang in COMMANDS | {"text"}, f"{b}: a block without a command language: ```text if no commands"
        assert b.mark != NOT_RUN or len(b.note.split()) >= 4, f"{b}: say why it is not run"
        assert b.mark != ADAPTED or b.adaptations, f"{b}: say what CI changes"
        for a in b.adaptations:
            known = [k for k in APPLIES if a.startswith(k)]
            assert known, f"{b}: {a!r} is no change this test makes ({list(APPLIES)})"
            assert APPLIES[known[0]](b), f"{b}: {a!r} does not apply to it"
    runnable = runnable_blocks()
    assert len(runnable) >= 5
    for b in runnable:
        assert len(_keys(b)) == 1, f"{b}: give it one expectation in EXPECT ({_keys(b)})"
        assert not weights_named(b) or b.adapted("tiny random weights for"), f"{b}: say that weights stand in"
    for k in EXPECT:
        assert sum(k in b.text for b in runnable) == 1, f"EXPECT {k!r} names no single block run"


def _param(block: Block) -> object:
    slow = [pytest.mark.slow] if "chunkflow serve" in block.text else []  # it starts a process
    return pytest.param(block, id=re.sub(r"\W+", "-", _keys(block)[0] if _keys(block) else str(block)), marks=slow)


@pytest.mark.parametrize("block", [_param(b) for b in runnable_blocks()])
def test_every_readme_block_runs_as_written(block: Block, cli: Cli, workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The block's commands in order, with the changes its marker names: each exits 0, leaves its files and
    prints what a user is told to look for."""
    stand_in = stand_ins(block, cli, workdir, monkeypatch)
    names: dict = {}
    if block.lang == "python":
        printed, names = run_python(block, stand_in, capsys)
        names["__stdout__"] = printed
    elif logical_lines(block)[0].startswith("chunkflow serve"):
        printed = run_server(block, workdir)
    else:
        printed = run_shell(block, cli, workdir)
    files, words, check = EXPECT[_keys(block)[0]]
    for f in files:
        assert (workdir / f).is_file() and (workdir / f).stat().st_size > 0, f"{block} wrote no {f}"
    flat = " ".join(printed.split())
    for w in words:
        assert w in flat, f"{block}: {w!r} not printed:\n{printed[:2000]}\n...\n{printed[-2000:]}"
    if check is not None:
        check(workdir, printed, names)


def _plan_lines_not_run() -> list[str]:
    """The `chunkflow plan` lines of the blocks not run whole that need no weights: they run anywhere."""
    return [x for b in readme_blocks() if b.lang in COMMANDS and b.mark == NOT_RUN for x in logical_lines(b)
            if x.startswith("chunkflow plan ") and "--weights" not in x]


@pytest.mark.parametrize("line", _plan_lines_not_run())
def test_the_plan_lines_of_blocks_not_run_run_as_written(cli: Cli, workdir: Path, line: str) -> None:
    out = run_chunkflow(cli, shlex.split(line, comments=True)[1:], workdir)
    assert "plan:" in out


def _cpu_timings() -> dict:
    return json.loads((ROOT / "docs" / "data" / "cpu-timings" / "cpu-timings.json").read_text())


def test_the_readme_quotes_the_committed_cpu_timings() -> None:
    """The CPU figures the README gives are those scripts/cpu_timings.py wrote (no time is taken here), measured on
    the README's commands as they are now: rerun the script when a command changes, and quote it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_timings", ROOT / "scripts" / "cpu_timings.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    t = _cpu_timings()
    steps, plan_lines = script.readme_commands(README)
    assert [r["command"] for r in t["fresh_machine"]] == steps
    assert [p["command"] for p in t["plans"]] == [".venv/bin/" + x for x in plan_lines] + [
        ".venv/bin/chunkflow --help"]
    installs = [r for r in t["fresh_machine"] if "chunkflow" not in r["command"]]
    first = [r for r in t["fresh_machine"] if "chunkflow" in r["command"]]
    came = [(k, v) for r in installs for k, v in r.get("sources", {}).items()]
    local, downloaded = (sum(v for k, v in came if k.startswith(w)) for w in ("this machine's", "downloaded"))
    *plans, help_ = t["plans"]
    cpu = [p["cpu_s"] for p in plans]
    flat = " ".join(README.split())
    for said in (
            f"{t['machine']['date'][:10]}, a fresh copy of the repository, pip's cache empty",
            f"the installs took {sum(r['wall_s'] for r in installs):.0f} s "
            f"({sum(r['cpu_s'] for r in installs):.0f} s of CPU; torch and {local - 1} other packages came from "
            f"the machine's own wheel folders and {downloaded} were downloaded",
            f"the plan and the run {sum(r['wall_s'] for r in first):.1f} s together the first time "
            f"({sum(r['cpu_s'] for r in first):.1f} s of CPU), {t['demo']['wall_s']:.1f} s after",
            f"in {cpu[0]:.2f} s of CPU (the README's {len(plans)} plan lines take {min(cpu):.2f}-{max(cpu):.2f} s, "
            f"`--help` {help_['cpu_s']:.2f} s",
            f"with bytecode cached, {t['machine']['date'][:10]}; `scripts/cpu_timings.py`"):
        assert said in flat, said
