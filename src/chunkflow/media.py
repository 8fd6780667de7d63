"""Write what a generation produced: a video to .mp4 (H.264 through imageio-ffmpeg) or an image to .png, both
atomically, and read them back. `check_media_path` checks where the output goes before any work."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.files import FileError, atomic_path, check_output_file, existing_file, write_atomic

__all__ = ["MediaError", "check_media_path", "image_names", "load_input_image", "load_input_image_bytes", "read_image",
           "read_video", "to_uint8_frames", "write_media"]

KINDS = {".mp4": "video", ".png": "image"}
CRF = 18  # libx264 constant rate factor: visually lossless for ordinary viewing, files stay small
_VIDEO_INSTALL = "pip install 'chunkflow-dit[video]'"
# RGB <-> YUV with exact rounding and chroma interpolated (not replicated) when converting back to RGB
_SWS = "bicubic+accurate_rnd+full_chroma_int"
# RGB -> BT.709 limited-range YUV, and the file says so (stream and frame tags), so that players convert back
# with the matrix it was written with
_TO_YUV = (f"scale=out_color_matrix=bt709:out_range=tv:flags={_SWS},"
           "setparams=range=tv:colorspace=bt709:color_primaries=bt709:color_trc=bt709")
_BT709_TAGS = ("-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709")


class MediaError(ChunkflowError):
    """An output path, or frames, that cannot be written as a video or an image."""


def _kind(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in KINDS:
        got = f"suffix {suffix!r}" if suffix else "no suffix"
        raise MediaError(f"--out {str(path)!r} has {got}; give a .mp4 file (video) or a .png file (image)")
    return KINDS[suffix]


def _imageio_ffmpeg() -> Any:
    """imageio_ffmpeg, checked to be installed with a working ffmpeg binary."""
    try:
        import imageio  # noqa: F401  (the [video] extra installs both; imageio_ffmpeg does the work)
        import imageio_ffmpeg
    except ImportError as exc:
        raise MediaError(f"writing .mp4 needs imageio and imageio-ffmpeg ({exc.name} is missing): "
                         f"{_VIDEO_INSTALL}") from None
    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except (RuntimeError, OSError) as exc:  # RuntimeError when neither the bundled binary nor IMAGEIO_FFMPEG_EXE is found
        raise MediaError(f"imageio-ffmpeg finds no ffmpeg binary ({exc}); reinstall it: {_VIDEO_INSTALL}, "
                         "or set IMAGEIO_FFMPEG_EXE to an ffmpeg with libx264") from None
    return imageio_ffmpeg


def check_media_path(path: str) -> str:
    """Check where a generation's output goes, before any work: a .mp4 or .png suffix (any case), a writable
    directory, not a directory itself, and for .mp4 a working imageio-ffmpeg. Returns "video" or "image"."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise FileError(f"--out {str(p)!r} is a directory; give a file name in it, e.g. {str(p / 'out.mp4')!r}")
    kind = _kind(path)
    check_output_file(p, "--out")
    if kind == "video":
        _video_backend()
    return kind


def image_names(path: str, count: int) -> list[str]:
    """Where `count` images of one generation go for `--out path`: the path itself for one, else `stem-0.png`,
    `stem-1.png`, ... beside it."""
    if count <= 1:
        return [path]
    stem, suffix = os.path.splitext(path)
    return [f"{stem}-{i}{suffix}" for i in range(count)]


def _video_backend() -> str:
    """"ffmpeg" (imageio-ffmpeg: H.264), else "cv2" where only OpenCV is installed (MPEG-4 part 2, what OpenCV's
    own writer has), else the error that says what to install."""
    try:
        _imageio_ffmpeg()
        return "ffmpeg"
    except MediaError as missing:
        try:
            import cv2  # noqa: F401
        except ImportError:
            raise missing from None
        return "cv2"


def to_uint8_frames(frames: Any) -> np.ndarray:
    """`frames` as a uint8 array (F, H, W, 3); an image (H, W, 3) becomes one frame.

    Accepts what diffusers returns with output_type="np" (floats in [0, 1]), a torch tensor of that layout, a
    uint8 array, or a list of PIL images or of (H, W, 3) arrays. A batch of one video (1, F, H, W, 3), as
    `pipe(...).frames` holds, is taken as that video. Floats are clipped to [0, 1] and converted exactly as
    diffusers' `numpy_to_pil` does: (x * 255).round().astype("uint8").
    """
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise MediaError("no frames to write (an empty list)")
        arrays = []
        for i, f in enumerate(frames):
            a = np.asarray(f.convert("RGB")) if _is_pil(f) else _as_numpy(f)
            if a.ndim != 3 or a.shape[-1] != 3:
                raise MediaError(f"frame {i} has shape {tuple(a.shape)}; each frame must be (H, W, 3)")
            arrays.append(_to_uint8(a))
        shapes = sorted({a.shape for a in arrays})
        if len(shapes) > 1:
            raise MediaError(f"frames differ in size ({shapes}); every frame must have the same size")
        return np.stack(arrays)
    array = _as_numpy(frames)
    if array.ndim == 5 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4 or array.shape[-1] != 3:
        hint = ""
        if array.ndim == 5:
            hint = f" (a batch of {array.shape[0]} videos: write one at a time, e.g. frames[0])"
        elif array.ndim in (3, 4) and array.shape[-3] == 3:
            hint = " (channels first? pass output_type='np' to the pipeline, or move channels last)"
        raise MediaError(f"frames have shape {tuple(array.shape)}; expected (F, H, W, 3) for a video or "
                         f"(H, W, 3) for an image{hint}")
    if 0 in array.shape:
        raise MediaError(f"frames have shape {tuple(array.shape)}: nothing to write")
    return _to_uint8(array)


def _to_uint8(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if not np.issubdtype(array.dtype, np.floating):
        raise MediaError(f"frames have dtype {array.dtype}; give floats in [0, 1] (output_type='np') or uint8")
    if not np.isfinite(array).all():
        bad = int((~np.isfinite(array)).sum())
        raise MediaError(f"frames hold {bad} NaN or infinite values: the generation failed numerically (NaN or inf in "
                         "the weights, or an overflow in the model's dtype)")
    return (np.clip(array, 0.0, 1.0) * 255).round().astype("uint8")


def _is_pil(x: Any) -> bool:
    return type(x).__module__.startswith("PIL.") and hasattr(x, "convert")


def _as_numpy(x: Any) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().to("cpu")
            if x.dtype in (torch.bfloat16, torch.float16):
                x = x.float()
            return x.numpy()
    return np.asarray(x)


def write_media(path: str | Path, frames: Any, fps: int | None = None) -> Path:
    """Write `frames` (see `to_uint8_frames`) to `path`, whole or not at all (a temporary file beside it, then a
    rename), and return the path.

    .mp4: every frame at `fps` frames per second (required, > 0; 16 for Wan, 24 for HunyuanVideo), an image being
    a one-frame video. H.264 (libx264, CRF 18: visually lossless) in yuv420p, tagged BT.709, the index at the
    front (+faststart): the format every ordinary player, browser and editor plays. yuv420p stores colour at
    half resolution, so libx264 refuses odd widths and heights; rather than rescale the frames (which resamples
    every pixel, as imageio's default macro_block_size=16 does) or use yuv444p (which many players cannot play),
    an odd height or width is padded by one row at the bottom or one column at the right, a copy of the edge:
    a 33x47 video is stored, and read back, as 34x48, every original pixel in place.
    .png: exactly one image, lossless; several frames are refused (write a video to .mp4).
    """
    kind = check_media_path(str(path))
    p = Path(path).expanduser()
    if kind == "video":
        if fps is None or isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating)):
            raise MediaError(f"writing video {str(p)!r} needs the frame rate: pass fps= (e.g. 16 for Wan, "
                             "24 for HunyuanVideo)")
        if not fps > 0 or not np.isfinite(fps):
            raise MediaError(f"fps must be a positive number of frames per second, got {fps!r}")
        _write_mp4(p, to_uint8_frames(frames), fps)
        return p
    array = to_uint8_frames(frames)
    if array.shape[0] != 1:
        raise MediaError(f"--out {str(p)!r} is an image (.png) but the frames are a video of {array.shape[0]} "
                         f"frames; write it to a .mp4 file (or pick one frame)")
    try:
        from PIL import Image
    except ImportError:
        raise MediaError("writing .png needs Pillow: pip install pillow") from None
    buf = io.BytesIO()
    Image.fromarray(array[0]).save(buf, format="PNG")
    write_atomic(p, buf.getvalue())
    return p


def _write_mp4_cv2(p: Path, array: np.ndarray, fps: float) -> None:
    """The fallback without imageio-ffmpeg: OpenCV's MPEG-4 part 2 writer, to a temporary file, then renamed. OpenCV
    says nothing of a failed write (a full disk), so the file is read back: every frame must be there."""
    import cv2

    _, h, w, _ = array.shape
    with atomic_path(p, ".tmp.mp4") as tmp:
        writer = cv2.VideoWriter(tmp, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (w, h))
        if not writer.isOpened():
            raise MediaError(f"OpenCV cannot write {str(p)!r}; install the video extra: {_VIDEO_INSTALL}")
        for frame in array:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        cap = cv2.VideoCapture(tmp)
        frames = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) if cap.isOpened() else 0
        cap.release()
        if frames != len(array):
            raise MediaError(f"OpenCV could not write {str(p)!r} whole ({frames} of {len(array)} frames in the file); "
                             "it is left as it was: is there space on the disk?")


def _mp4_command(exe: str, tmp: str, w: int, h: int, fps: float) -> list[str]:
    """ffmpeg reading raw RGB frames of w x h on stdin and writing H.264 to `tmp` (write_media's docstring)."""
    from fractions import Fraction

    rate = str(Fraction(fps).limit_denominator())  # 24000/1001 stays exact
    return [exe, "-y", "-nostdin", "-v", "error", "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{w}x{h}",
            "-pix_fmt", "rgb24", "-r", rate, "-i", "pipe:0", "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p",
            "-crf", str(CRF), "-vf", _TO_YUV, *_BT709_TAGS, "-movflags", "+faststart", "-f", "mp4", tmp]


def _write_mp4(p: Path, array: np.ndarray, fps: float) -> None:
    """H.264 through imageio-ffmpeg's binary, run here so that its exit status and messages are checked: a failed
    encode (a full disk, a file size limit, a missing encoder) is a MediaError naming `p`, and nothing is left
    there (atomic_path)."""
    if _video_backend() == "cv2":
        _write_mp4_cv2(p, array, fps)
        return
    exe = _imageio_ffmpeg().get_ffmpeg_exe()
    _, h, w, _ = array.shape
    pad_h, pad_w = h % 2, w % 2
    if pad_h or pad_w:
        array = np.pad(array, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    with atomic_path(p, ".tmp.mp4") as tmp:
        code, said = _encode(_mp4_command(exe, tmp, w + pad_w, h + pad_h, fps), array)
        if code != 0 or os.path.getsize(tmp) == 0:
            why = said or (f"killed by signal {-code}" if code < 0 else f"exit status {code}")
            raise MediaError(f"ffmpeg could not write {str(p)!r} ({why}); it is left as it was: is there space on "
                             "the disk, and does IMAGEIO_FFMPEG_EXE (if set) have libx264?")


def _encode(cmd: list[str], array: np.ndarray) -> tuple[int, str]:
    """Run ffmpeg `cmd`, feed it the frames, wait for it: (its exit status, the last line it printed). Its output is
    kept, not printed (it echoes file names); it runs in a session of its own, so a terminal's Ctrl-C reaches this
    process, which then stops it."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
                                start_new_session=True)
        try:
            try:
                for frame in array:
                    proc.stdin.write(frame.tobytes())
                proc.stdin.close()
            except BrokenPipeError:  # ffmpeg stopped reading: its status and message say why
                pass
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        log.seek(0)
        lines = [ln.strip() for ln in log.read()[-4096:].decode(errors="replace").splitlines() if ln.strip()]
    return code, lines[-1] if lines else ""


def read_video(path: str | Path) -> np.ndarray:
    """Every frame of the video at `path`, as uint8 RGB (F, H, W, 3) (an odd-sized video written by
    `write_media` comes back padded to even size)."""
    p = existing_file(path, "video")
    exe = _imageio_ffmpeg().get_ffmpeg_exe()
    # each frame as a binary PPM ("P6\n<w> <h>\n255\n" + RGB bytes), the size coming with every frame
    cmd = [exe, "-nostdin", "-v", "error", "-i", str(p), "-map", "0:v:0", "-sws_flags", _SWS,
           "-f", "image2pipe", "-c:v", "ppm", "-pix_fmt", "rgb24", "-"]
    run = subprocess.run(cmd, capture_output=True, check=False)
    lines = [ln for ln in run.stderr.decode(errors="replace").splitlines() if ln.strip()]
    if run.returncode != 0 or not run.stdout:
        why = lines[-1] if lines else "no frames"
        raise MediaError(f"video {str(p)!r} cannot be read ({why}); is it a complete video file?")
    frames, data, pos = [], run.stdout, 0
    while pos < len(data):
        header = re.match(rb"P6\s+(\d+)\s+(\d+)\s+255\s", data[pos:pos + 64])
        if header is None:
            raise MediaError(f"video {str(p)!r}: ffmpeg returned a frame that is not RGB24 PPM")
        w, h = int(header.group(1)), int(header.group(2))
        start = pos + header.end()
        frames.append(np.frombuffer(data, np.uint8, count=h * w * 3, offset=start).reshape(h, w, 3))
        pos = start + h * w * 3
    return np.stack(frames)


def read_image(path: str | Path) -> np.ndarray:
    """The image at `path` as uint8 RGB (H, W, 3)."""
    p = existing_file(path, "image")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(p) as im:
            return np.asarray(im.convert("RGB")).copy()
    except (UnidentifiedImageError, OSError) as exc:
        raise MediaError(f"image {str(p)!r} cannot be read ({exc})") from None


# an input image (`run --image`): what a pipeline is given to animate or edit. The largest real inputs are photos of
# a few tens of megapixels; pipelines resize them to the workload's size anyway. Larger ones are refused before
# they are decoded (a small PNG can declare 100,000 x 100,000 pixels: 30 GB once decoded).
MAX_IMAGE_FILE_BYTES = 256 * 2**20
MAX_IMAGE_SIDE = 16384
MAX_IMAGE_PIXELS = 64 * 2**20
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF")


def load_input_image(path: str | Path):
    """The image at `path` as an RGB PIL image, checked before the pipeline is built: a regular, readable, non-empty
    file of at most MAX_IMAGE_FILE_BYTES, a format PIL decodes (IMAGE_FORMATS), at most MAX_IMAGE_SIDE pixels a side
    and MAX_IMAGE_PIXELS in all (read from its header, before any pixel is decoded). MediaError says what to fix."""
    import stat

    from chunkflow_planner.files import file_kind

    fix = "give a PNG, JPEG or WebP image"
    try:
        p = existing_file(path, "--image")
        st = p.stat()
    except FileError as exc:
        raise MediaError(str(exc)) from None
    except OSError as exc:
        raise MediaError(f"--image {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise MediaError(f"--image {str(p)!r} is {file_kind(st.st_mode)}, not a file; {fix}")
    if st.st_size == 0:
        raise MediaError(f"--image {str(p)!r} is empty (0 bytes); {fix}")
    if st.st_size > MAX_IMAGE_FILE_BYTES:
        raise MediaError(f"--image {str(p)!r} holds {st.st_size:,} bytes, over the {MAX_IMAGE_FILE_BYTES:,} an input "
                         f"image may; {fix} of at most {MAX_IMAGE_SIDE} pixels a side")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_IMAGE_FILE_BYTES + 1)
    except OSError as exc:
        raise MediaError(f"--image {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    return _decode_input_image(data, f"--image {str(p)!r}")


def load_input_image_bytes(data: bytes, what: str = "the uploaded image"):
    """An input image given as bytes (an upload to `chunkflow serve`), decoded in memory and checked as
    load_input_image checks a file: non-empty, at most MAX_IMAGE_FILE_BYTES, a format PIL decodes, its size read
    from its header before any pixel is decoded. `what` names it in the message; MediaError says what to fix."""
    check_input_image_bytes(data, what)
    return _decode_input_image(bytes(data), what)


def check_input_image_bytes(data: bytes, what: str = "the uploaded image") -> tuple[str, int, int]:
    """What load_input_image_bytes checks before it decodes (the byte count, the format and the pixel size from the
    header), with no pixel decoded: (format, width, height), or MediaError. The server checks an upload with it and
    keeps the compressed bytes until the job runs."""
    fix = "give a PNG, JPEG or WebP image"
    if not data:
        raise MediaError(f"{what} is empty (0 bytes); {fix}")
    if len(data) > MAX_IMAGE_FILE_BYTES:
        raise MediaError(f"{what} holds {len(data):,} bytes, over the {MAX_IMAGE_FILE_BYTES:,} an input image may; "
                         f"{fix} of at most {MAX_IMAGE_SIDE} pixels a side")
    return _decode_input_image(bytes(data), what, decode=False)


def _decode_input_image(data: bytes, what: str, decode: bool = True):
    """The checks load_input_image and load_input_image_bytes share: the format, the size from the header (before
    any pixel is decoded), then the decode; an RGB PIL image, or MediaError naming `what`. decode=False: (format,
    width, height) once the header passed, nothing decoded."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    fix = "give a PNG, JPEG or WebP image"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            fmt, (w, h) = im.format, im.size
            if fmt not in IMAGE_FORMATS:
                raise MediaError(f"{what} is a {fmt} image, not one of {', '.join(IMAGE_FORMATS)}; {fix}")
            if w < 1 or h < 1 or max(w, h) > MAX_IMAGE_SIDE or w * h > MAX_IMAGE_PIXELS:
                raise MediaError(f"{what} is {w} x {h} pixels, beyond what an input image may be (at most "
                                 f"{MAX_IMAGE_SIDE} a side, {MAX_IMAGE_PIXELS // 2**20} megapixels); the pipeline "
                                 "resizes it to the plan's size anyway: give it smaller")
            if not decode:
                return fmt, w, h
            im.load()
            return im.convert("RGB")
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # its header, before any pixel
        found = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"declares {int(found.group(1)):,} pixels" if found else "declares too many pixels"
        raise MediaError(f"{what} {size}, beyond what an input image may be (at most {MAX_IMAGE_SIDE} "
                         f"a side, {MAX_IMAGE_PIXELS // 2**20} megapixels); the pipeline resizes it to the plan's "
                         "size anyway: give it smaller") from None
    except UnidentifiedImageError:
        raise MediaError(f"{what} is not an image PIL can read; {fix}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated or damaged image data
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise MediaError(f"{what} cannot be decoded ({why}); {fix}") from None
