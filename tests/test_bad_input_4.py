"""Hostile input, round four (issue 51, "Bad inputs still mishandled"), each through the real CLI in a process of its
own: a newline in an output path (it forged an `error:` line), a path or name far over the file system's limits (an
internal error), an output name of 100 emoji (104 characters, 404 bytes: under a character limit, over NAME_MAX, it
failed after the job ran), a prompt file's image holding a NUL byte, a hand-edited codec plan without its decode rate
(refused only after the load) and a full CHUNKFLOW_CACHE_DIR (blamed on "the output").

Each is one line, exit 2, before any work, no traceback; a prompt file's bad line is skipped and the others run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_bad_input_2 import _no_temporaries  # noqa: E402
from test_bad_input_3 import _chunkflow  # noqa: E402

EMOJI = "\U0001F600" * 100  # 100 characters, 400 bytes in UTF-8: under any character limit, over NAME_MAX (255)


def _said(p: subprocess.CompletedProcess) -> str:
    return p.stdout + p.stderr


def _refused(p: subprocess.CompletedProcess, *says: str) -> str:
    """`p` failed with exit 2 on exactly one `error:` line (the first of its output) holding each of `says`, with no
    traceback, no internal error and nothing built; returns that line."""
    out = _said(p)
    assert p.returncode == 2, out
    assert "Traceback" not in out and "internal error" not in out and "built " not in out, out
    lines = [l for l in out.splitlines() if l.strip()]
    errors = [l for l in lines if l.lstrip().startswith("error:")]
    assert len(lines) == 1 and len(errors) == 1, out
    for say in says:
        assert say in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def plan(cli, workdir) -> Path:
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return workdir / "plan.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pytest.importorskip("diffusers")
    from pipelines import one_thread, save_catalog_pipeline

    with one_thread():
        return save_catalog_pipeline("tiny", tmp_path_factory.mktemp("saved") / "tiny")


# ---------------------------------------------------------------------------------------- a newline in an output


@pytest.mark.parametrize("args", [
    ["plan", "--model", "tiny", "--hardware", "cpu", "--out", "p\nerror: forged.json"],
    ["run", "--plan", "plan.json", "--prompt", "a cat", "--out", "x\nerror: forged.mp4"],
    ["run", "--plan", "plan.json", "--steps", "1", "--report", "r\nerror: forged.json"],
    ["run", "--plan", "plan.json", "--prompts", "jobs.txt", "--out-dir", "clips\nerror: forged"],
], ids=["plan --out", "run --out", "run --report", "run --out-dir"])
def test_a_newline_in_an_output_is_refused_and_forges_no_error_line(workdir, plan, args):
    """The path is refused in one line with the newline shown as \\n: no line of the output starts with the forged
    'error: forged', and nothing is written under either half of the name."""
    Path("jobs.txt").write_text("a cat\n")
    before = set(os.listdir(workdir))
    p = _chunkflow(args, workdir)
    line = _refused(p, "holds a control character", "\\nerror: forged", "nothing was written")
    assert not any(l.lstrip().startswith("error: forged") for l in _said(p).splitlines()), _said(p)
    assert line.lstrip().startswith(f"error: {args[-2]} ")  # the flag named first, then its escaped value
    assert set(os.listdir(workdir)) == before, os.listdir(workdir)
    _no_temporaries(workdir)


# ------------------------------------------------------------------------ names far over the file system's limits


def test_a_131000_character_plan_and_a_300_character_model_are_one_line(workdir, plan):
    """`run --plan` with a name of 131,000 characters (near the kernel's 128 KiB limit on one argument) and `plan
    --model` with 300 were internal errors: each is one line, cut short with its length said, exit 2."""
    line = _refused(_chunkflow(["run", "--plan", "a" * 131_000], workdir), "--plan", "(131,000 characters)",
                    "File name too long", "give a shorter one")
    assert len(line) < 600, len(line)  # the name is cut, not printed whole
    line = _refused(_chunkflow(["plan", "--model", "m" * 300, "--hardware", "cpu"], workdir), "--model",
                    "(300 characters)", "File name too long", "255 bytes")
    assert len(line) < 600, len(line)


# ------------------------------------------------------------------------- 100 emoji: counted in bytes, before work


@pytest.mark.parametrize("flag,args,suffix", [
    ("--out", ["run", "--plan", "plan.json", "--prompt", "a cat"], ".mp4"),
    ("--report", ["run", "--plan", "plan.json", "--steps", "1"], ".json"),
    ("--out", ["plan", "--model", "tiny", "--hardware", "cpu"], ".json"),
])
def test_an_output_name_of_100_emoji_is_refused_before_the_work(workdir, plan, flag, args, suffix):
    """104 characters but 404 bytes: the name is counted as the file system counts it and refused before the
    pipeline is built (the run's video and report were lost after the job ran)."""
    before = set(os.listdir(workdir))
    _refused(_chunkflow([*args, flag, EMOJI + suffix], workdir), flag, f"({len(EMOJI + suffix)} characters)",
             f"{len((EMOJI + suffix).encode())} bytes, over the 255 bytes", "give a shorter name")
    assert set(os.listdir(workdir)) == before, os.listdir(workdir)


def test_a_prompt_files_bad_out_and_nul_image_lines_are_skipped_and_the_others_run(workdir, plan):
    """In a prompt file, an `out` of 100 emoji (under the old 120-character limit) and an `image` holding a NUL
    byte (an internal error) are each a line skipped with its reason, said before the load; the next line runs."""
    Path("jobs.jsonl").write_text("\n".join(json.dumps(j) for j in (
        {"prompt": "a cat", "out": EMOJI},
        {"prompt": "a dog", "image": "a\x00b.png"},
        {"prompt": "a cow", "seed": 3})) + "\n")
    p = _chunkflow(["run", "--plan", "plan.json", "--prompts", "jobs.jsonl", "--out-dir", "clips", "--steps", "1",
                    "--report", "rep.json"], workdir, timeout=300)
    out = _said(p)
    assert p.returncode == 0 and "Traceback" not in out and "internal error" not in out, out
    skipped = [l for l in out.splitlines() if "skipped:" in l]
    assert len(skipped) == 2, out
    assert skipped[0].startswith("line 1: skipped: out:") and "400 bytes, over the 255 bytes" in skipped[0], out
    assert skipped[1].startswith("line 2: skipped: image:") and "'a\\x00b.png' holds a NUL byte" in skipped[1], out
    assert out.index("line 2: skipped") < out.index("built "), out  # said before the load
    jobs = {j["line"]: j for j in json.loads(Path("rep.json").read_text())["jobs"]}
    assert {n: j["state"] for n, j in jobs.items()} == {1: "refused", 2: "refused", 3: "done"}
    assert sorted(os.listdir("clips")) == [jobs[3]["out"]] == ["0003-a-cow.mp4"]


# --------------------------------------------------------------------------- a codec plan with no decode rate


def _codec_plan(plan: Path, name: str, **spec) -> Path:
    """`plan` with its transformer streamed in chunks, the lossless codec on, and `spec` set in its profile."""
    p = json.loads(plan.read_text())
    for c in p["pipeline"]["components"]:
        c["placement"] = "stream" if c["kind"] == "transformer" else c["placement"]
    p["offload"].update(mode="chunkflow", chunk_bytes=16000, codec="exponent-pack")
    p["hardware"]["spec"].update(spec)
    out = plan.with_name(name)
    out.write_text(json.dumps(p))
    return out


def test_a_hand_edited_codec_plan_without_a_decode_rate_is_refused_before_the_load(workdir, plan, saved):
    """A plan whose codec cannot be priced (its profile has no codec_decode_gbps) is refused at reading, naming the
    field and what to do, before the pipeline's files are read: it was refused only after the load."""
    edited = _codec_plan(plan, "nodecode.json", disk_read_gbps=1.0, codec_decode_gbps=None)
    p = _chunkflow(["run", "--plan", edited, "--weights", saved, "--prompt", "a cat", "--out", "x.mp4"], workdir)
    _refused(p, "nodecode.json':", "codec_decode_gbps", "--codec off")
    assert not Path("x.mp4").exists()


# ------------------------------------------------------------------------------------ a full cache folder


@pytest.fixture
def full_cache(workdir):
    """A 64 KiB tmpfs mounted at workdir/cache and filled to the last byte; unmounted after."""
    folder = workdir / "cache"
    folder.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True,
                       text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {m.stderr.strip()}")
    try:
        fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_cache_folder_is_one_line_naming_it(workdir, plan, saved, full_cache, monkeypatch):
    """The codec's spill file for the disk blocks on a full CHUNKFLOW_CACHE_DIR: one error line naming the
    variable, the folder and that it is full, and what to do; it was exit 1 blaming 'the output'."""
    monkeypatch.setenv("CHUNKFLOW_CACHE_DIR", str(full_cache))
    disk = _codec_plan(plan, "disk.json", disk_read_gbps=1.0, codec_decode_gbps=50.0)
    p = json.loads(disk.read_text())
    p["offload"].update(disk_blocks=1, residency=0.3)  # a streamed tail to spill
    disk.write_text(json.dumps(p))
    r = _chunkflow(["run", "--plan", disk, "--weights", saved, "--prompt", "a cat", "--out", "y.mp4"], workdir,
                   timeout=300)
    out = _said(r)
    assert r.returncode == 2 and "Traceback" not in out and "internal error" not in out, out
    errors = [l for l in out.splitlines() if l.lstrip().startswith("error:")]
    assert len(errors) == 1, out
    assert f"CHUNKFLOW_CACHE_DIR {str(full_cache)!r}" in errors[0] and "file system is full" in errors[0], out
    assert "--codec off" in errors[0] and "write to (the output)" not in out, out
    assert not Path("y.mp4").exists() and os.listdir(full_cache) == ["filler"], os.listdir(full_cache)


# ------------------------------------------------------------------------- a folder's own invalid config


def test_a_folders_config_value_of_the_wrong_type_is_the_folders_error(workdir, plan, saved):
    """A saved folder whose scheduler's flow_shift is "x": diffusers fails inside the scheduler (a numpy type
    error), which was an "internal error ... a bug in chunkflow". It is the folder's: one line naming the component,
    its config file, the key and value, what diffusers said and what to do, exit 2."""
    import shutil

    folder = workdir / "bad"
    shutil.copytree(saved, folder)
    config = folder / "scheduler" / "scheduler_config.json"
    c = json.loads(config.read_text())
    c["flow_shift"] = "x"
    config.write_text(json.dumps(c))
    p = _chunkflow(["run", "--plan", plan, "--weights", folder, "--prompt", "a cat", "--steps", "1", "--out", "z.mp4"],
                   workdir, timeout=300)
    out = _said(p)
    assert p.returncode == 2 and "Traceback" not in out and "internal error" not in out and "bug" not in out, out
    errors = [l for l in out.splitlines() if l.lstrip().startswith("error:")]
    assert len(errors) == 1, out
    said = errors[0]
    for part in (f"folder's {c['_class_name']} (scheduler_config.json)", "flow_shift = 'x'", "takes a float",
                 "diffusers stopped on it:", "Fix flow_shift"):
        assert part in said, said
    assert not Path("z.mp4").exists()
