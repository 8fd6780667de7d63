"""The README's install, as a user follows it: the wheel its install line names is the one this repository builds,
and its Python snippet runs in an environment holding exactly what that line's extras install (nothing the `test`
extra adds: accelerate once went missing that way, and `from_pretrained` failed for every Wan user).

The environment: the wheel unpacked, plus every distribution its `Requires-Dist` reaches with the README's extras,
each linked file by file from this interpreter's site-packages (so nothing is downloaded), run with `python -S`
(site-packages left out) and only that folder on the path."""

from __future__ import annotations

import email
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _readme_extras() -> tuple[str, set[str]]:
    """The wheel file the README's install names, and the extras its install lines ask for."""
    m = re.search(r"pip install '(dist/(chunkflow_dit-[^']+\.whl))\[([a-z,]+)\]'", README)
    assert m, "the README names no wheel to install"
    editable = re.search(r"pip install -e '\.\[([a-z,]+)\]'", README)
    assert editable and set(editable.group(1).split(",")) == set(m.group(3).split(",")), \
        "the README's two install lines ask for different extras"
    return m.group(2), set(m.group(3).split(","))


def _closure(requires: list[str], extras: set[str]) -> dict[str, md.Distribution]:
    """Every installed distribution `requires` (with `extras`) reaches, by name; one it needs and this environment
    lacks fails the test (CI's extra must install it too)."""
    out: dict[str, md.Distribution] = {}
    todo = [(r, extras) for r in requires]
    while todo:
        text, active = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (active or {""})):
            continue
        name = canonicalize_name(req.name)
        if name in out:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{req.name} is installed by the README's extras but not in this environment: add it to "
                        "the `test` extra")
        out[name] = dist
        todo += [(r, set(req.extras)) for r in dist.requires or []]
    return out


def _link_distribution(dist: md.Distribution, into: Path) -> None:
    """The distribution's files (its RECORD) linked into `into` at their paths under site-packages."""
    for f in dist.files or []:
        if f.parts and f.parts[0] == "..":  # scripts and data outside site-packages
            continue
        src = Path(dist.locate_file(f))
        dst = into / f
        if src.is_file() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src)


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory) -> Path:
    """A folder holding the built wheel's package and exactly the distributions of the README's extras."""
    wheel_name, extras = _readme_extras()
    out = tmp_path_factory.mktemp("readme-env")
    dist = out / "dist"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(dist), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    built = [w.name for w in dist.glob("*.whl")]
    assert built == [wheel_name], f"the README installs {wheel_name}, this repository builds {built}"
    site = out / "site"
    with zipfile.ZipFile(dist / wheel_name) as whl:
        whl.extractall(site)
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        requires = email.message_from_bytes(whl.read(meta)).get_all("Requires-Dist") or []
    for d in _closure(requires, extras).values():
        _link_distribution(d, site)
    return site


def _python_block(marker: str) -> str:
    """The README's Python code block that holds `marker`."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if marker in b]
    assert len(blocks) == 1, f"the README has {len(blocks)} Python snippets with {marker!r}: update this test"
    return blocks[0]


def _snippet() -> str:
    """The README's Python snippet with the three things a CPU test must change: the Hub id becomes a tiny saved
    folder, "cuda" the CPU, the 480p clip a 64x64 one of 5 frames in 2 steps (each replaced exactly once)."""
    code = _python_block("chunkflow.offload(")
    for old, new in (('"Wan-AI/Wan2.1-T2V-14B-Diffusers"', "FOLDER"), ('"cuda"', '"cpu"'),
                     ("num_frames=81, height=480, width=832",
                      "num_frames=5, height=64, width=64, num_inference_steps=2, max_sequence_length=8")):
        assert old in code, f"the README's snippet no longer has {old}: update this test with it"
        code = code.replace(old, new)
    return code


@pytest.mark.slow
def test_the_readme_snippet_runs_with_the_readme_extras_only(readme_env, tmp_path):
    """In the README-extras environment: accelerate is there (the `diffusers` extra has it) and the test extra's
    tools are not, the snippet offloads the tiny Wan pipeline loaded in bf16 as the README does, generates, prints
    the handle's stats and removes it."""
    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("tiny", tmp_path / "tiny")
    probe = ("import importlib.util as u, sys\n"
             "print('HAVE', [m for m in ('accelerate', 'pytest', 'peft', 'hypothesis', 'matplotlib') "
             "if u.find_spec(m)])\n"
             "import chunkflow; print('FROM', chunkflow.__file__)\n")
    code = probe + f"FOLDER = {str(folder)!r}\n" + _snippet() + "\nprint('FRAMES', video.shape)\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(readme_env), PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "HAVE ['accelerate']" in p.stdout
    assert f"FROM {readme_env}" in p.stdout  # the wheel's package, not the repository's src/
    assert "chunkflow on cpu: 2 of 2 blocks" in p.stdout  # the stats the snippet prints: both blocks streamed
    assert "FRAMES (5, 64, 64, 3)" in p.stdout


@pytest.mark.slow
def test_the_readme_session_snippet_runs_with_the_readme_extras_only(readme_env, tmp_path):
    """The README's `chunkflow.load` snippet in the README-extras environment, the Hub id a tiny saved folder and
    plan.json a CPU plan of it made by the wheel's own command: four videos written, each generation's seconds
    printed, the session closed by its `with`."""
    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("tiny", tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(readme_env), PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               CHUNKFLOW_CONFIG_DIR=str(tmp_path / "config"))
    plan = subprocess.run([sys.executable, "-S", "-m", "chunkflow", "plan", "--model", "tiny", "--hardware", "cpu",
                           "--host-mem-budget", "8GB", "--out", "plan.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    code = _python_block("chunkflow.load(")
    hub = '"Wan-AI/Wan2.2-TI2V-5B-Diffusers"'
    assert code.count(hub) == 1, "the README's session snippet no longer loads the 5B by its Hub id: update this test"
    code = f"FOLDER = {str(folder)!r}\n" + code.replace(hub, "FOLDER") + "\nprint('CLOSED', session.closed)\n"
    p = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert sorted(f.name for f in tmp_path.glob("fox-*.mp4")) == [f"fox-{i}.mp4" for i in range(4)]
    assert p.stdout.count(" None") == 4  # seconds and predicted_s (None: the plan's times are a GPU's) each time
    assert "CLOSED True" in p.stdout
