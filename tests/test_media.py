"""chunkflow.media: videos to .mp4 and images to .png, written atomically, read back, and every bad input refused
with the package's error before any work."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chunkflow.media import MediaError, check_media_path, read_image, read_video, to_uint8_frames, write_media
from chunkflow_planner.errors import ChunkflowError

pytest.importorskip("imageio_ffmpeg")

# H.264 is lossy. Measured on these smooth 32x48 / 33x47 gradients at CRF 18 (yuv420p, BT.709): mean absolute
# error 1.5-1.6 levels of 255 (of which about 0.5 is the RGB -> 4:2:0 YUV -> RGB round trip itself, measured at
# CRF 0), largest single error about 16. A real fault costs far more: decoding with the wrong colour matrix gives
# 5-6, a neighbouring frame's content about 10 or more. So 3.0 leaves room for other ffmpeg builds and still
# catches those.
MP4_MEAN_ABS_TOL = 3.0


def gradient(frames: int, height: int, width: int) -> np.ndarray:
    """A smooth float32 video in [0, 1], (F, H, W, 3): red across, green down, blue a slow wave moving in time."""
    t = np.arange(frames)[:, None, None]
    y = np.arange(height)[None, :, None] / height
    x = np.arange(width)[None, None, :] / width
    r = 0.15 + 0.7 * x + 0 * t
    g = 0.15 + 0.7 * y + 0 * t
    b = 0.5 + 0.21 * np.sin(np.pi * (x + y) + 0.3 * t)
    return np.stack(np.broadcast_arrays(r, g, b), axis=-1).astype(np.float32)


def expected_uint8(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, 0, 1) * 255).round().astype("uint8")


def no_temp_files(directory) -> bool:
    return not [p for p in directory.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("height,width", [(32, 48), (33, 47)])
def test_mp4_round_trip_keeps_frames_size_and_pixels(tmp_path, height, width):
    frames = gradient(5, height, width)
    out = write_media(tmp_path / "clip.mp4", frames, fps=8)
    assert out == tmp_path / "clip.mp4" and no_temp_files(tmp_path)
    video = read_video(out)
    # odd sizes are padded by one row / column (yuv420p needs even sizes), never rescaled
    assert video.shape == (5, height + height % 2, width + width % 2, 3) and video.dtype == np.uint8
    ref = expected_uint8(frames).astype(int)
    got = video[:, :height, :width].astype(int)
    errors = np.abs(got - ref).mean(axis=(1, 2, 3))
    assert errors.max() < MP4_MEAN_ABS_TOL, errors
    for i in range(5):  # each frame is closest to its own input: order kept, none dropped or repeated
        others = [np.abs(got[i] - ref[j]).mean() for j in range(5) if j != i]
        assert errors[i] < min(others)
    if height % 2:  # the padding row repeats the last one
        assert np.abs(video[:, height].astype(int) - video[:, height - 1].astype(int)).mean() < MP4_MEAN_ABS_TOL
    if width % 2:
        assert np.abs(video[:, :, width].astype(int) - video[:, :, width - 1].astype(int)).mean() < MP4_MEAN_ABS_TOL


def test_mp4_accepts_torch_tensor_pil_list_batch_of_one_and_upper_case_suffix(tmp_path):
    torch = pytest.importorskip("torch")
    from PIL import Image

    frames = gradient(3, 32, 48)
    ref = read_video(write_media(tmp_path / "np.mp4", frames, fps=8))
    inputs = {
        "tensor.mp4": torch.from_numpy(frames),
        "bf16.mp4": torch.from_numpy(frames).to(torch.bfloat16),
        "pil.mp4": [Image.fromarray(f) for f in expected_uint8(frames)],
        "batch.MP4": frames[None],  # pipe(...).frames with one prompt: (1, F, H, W, 3)
        "list.mp4": list(frames),
    }
    for name, value in inputs.items():
        got = read_video(write_media(tmp_path / name, value, fps=8))
        assert got.shape == ref.shape
        tol = 0.5 if name != "bf16.mp4" else MP4_MEAN_ABS_TOL  # bfloat16 rounds the input itself
        assert np.abs(got.astype(int) - ref.astype(int)).mean() < tol, name


def _with_file_size_limit(code: str, limit: int, cwd) -> subprocess.CompletedProcess:
    """Python `code` in a process whose files cannot grow past `limit` bytes (RLIMIT_FSIZE), a disk that fills
    up: a write past it fails (EFBIG, Python ignoring SIGXFSZ), and ffmpeg started from it is killed by SIGXFSZ."""
    import resource

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))


NOISE = "np.random.default_rng(0).random((8, 64, 64, 3), dtype=np.float32)"  # far over 4 KB as H.264 or PNG


@pytest.mark.parametrize("name", ["clip.mp4", "still.png"])
def test_a_full_disk_is_an_error_naming_the_file_and_leaves_the_old_one_whole(tmp_path, name):
    """A disk that fills up during the write (a file size limit here): ffmpeg's (or Pillow's) failure is a
    MediaError/FileError naming the file, the file there before is left whole, and no temporary is left beside it."""
    out = tmp_path / name
    write_media(out, gradient(4, 16, 16) if name.endswith(".mp4") else gradient(1, 16, 16)[0], fps=4)
    before = out.read_bytes()
    frames = NOISE if name.endswith(".mp4") else NOISE + "[0]"
    code = ("import numpy as np\nfrom chunkflow.media import write_media\nfrom chunkflow_planner.errors import "
            f"ChunkflowError\ntry:\n    write_media({name!r}, {frames}, fps=4)\nexcept ChunkflowError as e:\n"
            "    print('refused:', e)\nelse:\n    print('written')\n")
    p = _with_file_size_limit(code, 4096, tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("refused:"), (p.stdout, p.stderr)
    assert f"{name!r}" in p.stdout and "left as it was" in p.stdout, p.stdout
    assert out.read_bytes() == before and no_temp_files(tmp_path)
    (tmp_path / name).unlink()
    p = _with_file_size_limit(code, 4096, tmp_path)  # no earlier file: none is left at the name
    assert p.stdout.startswith("refused:") and not out.exists() and no_temp_files(tmp_path), p.stdout


def test_a_device_fifo_or_socket_at_the_output_name_is_refused_before_writing(tmp_path):
    """An output is a regular file or a new name: a character device (a link to /dev/full), a FIFO or a socket
    there is refused before anything is encoded, and left as it is."""
    import socket

    (tmp_path / "dev.mp4").symlink_to("/dev/full")
    os.mkfifo(tmp_path / "fifo.png")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.mp4"))
    try:
        for name, kind in (("dev.mp4", "character device"), ("fifo.png", "FIFO"), ("sock.mp4", "socket")):
            with pytest.raises(ChunkflowError, match=f"{name}.*is a {kind}.*new file name"):
                check_media_path(str(tmp_path / name))
            with pytest.raises(ChunkflowError, match=f"is a {kind}"):
                write_media(tmp_path / name, gradient(1, 16, 16)[0], fps=4)
        assert (tmp_path / "dev.mp4").is_symlink() and os.readlink(tmp_path / "dev.mp4") == "/dev/full"
        assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo.png").st_mode)
        assert stat.S_ISSOCK(os.lstat(tmp_path / "sock.mp4").st_mode)
        assert no_temp_files(tmp_path)
    finally:
        sock.close()


def test_png_round_trip_is_exact_and_matches_diffusers(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.uniform(-0.2, 1.2, size=(33, 47, 3)).astype(np.float32)  # out-of-range values are clipped
    for name, value in {"a.png": image, "b.PNG": image[None]}.items():
        out = write_media(tmp_path / name, value)
        np.testing.assert_array_equal(read_image(out), expected_uint8(image))
    assert no_temp_files(tmp_path)
    diffusers = pytest.importorskip("diffusers")
    pil = diffusers.image_processor.VaeImageProcessor.numpy_to_pil(np.clip(image, 0, 1)[None])[0]
    np.testing.assert_array_equal(read_image(tmp_path / "a.png"), np.asarray(pil))


def test_check_media_path_returns_the_kind(tmp_path):
    assert check_media_path(str(tmp_path / "a.mp4")) == "video"
    assert check_media_path(str(tmp_path / "a.Mp4")) == "video"
    assert check_media_path(str(tmp_path / "a.png")) == "image"


@pytest.mark.parametrize("name", ["a.gif", "a.avi", "a", "a.mp4.tmp", "a.jpg"])
def test_bad_suffix(tmp_path, name):
    with pytest.raises(MediaError, match=r"\.mp4.*\.png"):
        check_media_path(str(tmp_path / name))
    with pytest.raises(MediaError):
        write_media(tmp_path / name, gradient(1, 8, 8), fps=1)
    assert not list(tmp_path.iterdir())


def test_missing_directory_and_directory_as_out(tmp_path):
    with pytest.raises(ChunkflowError, match="does not exist"):
        check_media_path(str(tmp_path / "nope" / "a.mp4"))
    with pytest.raises(ChunkflowError, match="does not exist"):
        write_media(tmp_path / "nope" / "a.png", gradient(1, 8, 8))
    (tmp_path / "dir.mp4").mkdir()
    for d in (tmp_path, tmp_path / "dir.mp4"):
        with pytest.raises(ChunkflowError, match="is a directory"):
            check_media_path(str(d))
        with pytest.raises(ChunkflowError, match="is a directory"):
            write_media(d, gradient(2, 8, 8), fps=4)


@pytest.mark.parametrize("fps", [None, 0, -8, float("nan"), "16"])
def test_fps_missing_or_not_positive(tmp_path, fps):
    with pytest.raises(MediaError, match="fps"):
        write_media(tmp_path / "a.mp4", gradient(3, 8, 8), fps=fps)
    assert not list(tmp_path.iterdir())


def test_video_to_png_is_refused(tmp_path):
    with pytest.raises(MediaError, match=r"video of 3 frames.*\.mp4"):
        write_media(tmp_path / "a.png", gradient(3, 8, 8))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("frames,match", [
    (np.zeros((3, 3, 8, 8), np.float32), "channels first"),
    (np.zeros((2, 3, 8, 8, 3), np.float32), "batch of 2 videos"),
    (np.zeros((8, 8), np.float32), "expected"),
    (np.zeros((0, 8, 8, 3), np.float32), "nothing to write"),
    (np.full((2, 8, 8, 3), np.nan, np.float32), "NaN"),
    (np.zeros((2, 8, 8, 3), np.int64), "dtype"),
    ([], "empty"),
    ([np.zeros((8, 8, 3)), np.zeros((8, 9, 3))], "same size"),
])
def test_bad_frames(tmp_path, frames, match):
    with pytest.raises(MediaError, match=match):
        write_media(tmp_path / "a.mp4", frames, fps=4)
    assert not list(tmp_path.iterdir())


def test_uint8_frames_pass_through_and_floats_convert_like_diffusers():
    u8 = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    assert np.array_equal(to_uint8_frames(u8), u8)
    x = np.array([[[0.0, 0.5 / 255, 1.5 / 255], [0.998, 1.0, 2.0]]], np.float32)
    np.testing.assert_array_equal(to_uint8_frames(x)[0], (np.clip(x, 0, 1) * 255).round().astype("uint8"))


def test_missing_video_extra_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "cv2", None)  # nor OpenCV, the fallback
    with pytest.raises(MediaError, match=r"pip install 'chunkflow-dit\[video\]'"):
        check_media_path(str(tmp_path / "a.mp4"))
    assert check_media_path(str(tmp_path / "a.png")) == "image"  # images need no ffmpeg


def test_missing_ffmpeg_binary(tmp_path, monkeypatch):
    import imageio_ffmpeg

    def no_binary():
        raise RuntimeError("No ffmpeg exe could be found")

    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", no_binary)
    monkeypatch.setitem(sys.modules, "cv2", None)
    with pytest.raises(MediaError, match=r"no ffmpeg binary.*chunkflow-dit\[video\]"):
        check_media_path(str(tmp_path / "a.mp4"))


def test_reading_missing_or_broken_files(tmp_path):
    with pytest.raises(ChunkflowError, match="does not exist"):
        read_video(tmp_path / "none.mp4")
    with pytest.raises(ChunkflowError, match="does not exist"):
        read_image(tmp_path / "none.png")
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all")
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    with pytest.raises(MediaError, match="cannot be read"):
        read_video(tmp_path / "junk.mp4")
    with pytest.raises(MediaError, match="cannot be read"):
        read_image(tmp_path / "junk.png")


@pytest.mark.slow
def test_importing_media_does_not_import_torch():
    code = "import sys, chunkflow.media; assert 'torch' not in sys.modules, 'torch imported'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr


def test_opencv_writes_the_video_without_imageio_ffmpeg(tmp_path, monkeypatch):
    cv2 = pytest.importorskip("cv2")
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    frames = np.linspace(0, 1, 5 * 32 * 48 * 3, dtype=np.float32).reshape(5, 32, 48, 3)
    write_media(tmp_path / "v.mp4", frames, fps=16)
    cap = cv2.VideoCapture(str(tmp_path / "v.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == 5
    assert (int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))) == (48, 32)
