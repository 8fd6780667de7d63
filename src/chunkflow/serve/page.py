"""The page at `/`: a form with every field the loaded pipeline takes (defaults from the plan, the API's refusals
shown beside the fields they are about), the jobs (full id, state, progress within a running one, predicted start
and finish or "no prediction", the result at its size with a download link, the settings used, measured against
predicted time) and the plan (where each component runs, the memory it holds, predicted times), all polled from the
API. Its HTML, style and script are page.html, page.css and page.js of this package, put together into one
self-contained page (no external script, style or font: the machine may be offline); every string from a job is put
in the page as text (textContent), never as markup. It sends JSON to its own origin only. Where the server has a token the page takes it from its URL's
fragment (`/#token=...`, removed from the address bar at once), keeps it in the tab's sessionStorage and sends it as
`Authorization: Bearer`; results are then fetched with it and shown from blob: URLs. page_policy is its
Content-Security-Policy: its own inline script and style by hash, nothing from elsewhere, no framing."""

from __future__ import annotations

import base64
import hashlib
import html
import re
from functools import lru_cache
from importlib import resources

__all__ = ["render_page", "page_policy"]

_INPUTS = {
    "negative": '    <div class="field wide"><label for="negative_prompt">Negative prompt</label>\n'
                '      <textarea id="negative_prompt" name="negative_prompt" maxlength="4000" rows="2" '
                'placeholder="what to steer away from"></textarea>\n'
                '      <p class="field-error" id="error-negative_prompt"></p></div>\n',
    "frames": '    <div class="field"><label for="frames">Frames</label>\n'
              '      <input id="frames" name="frames" type="number" min="1"><p class="field-error" '
              'id="error-frames"></p></div>\n',
    "image": '    <div class="field wide"><label for="image">Image</label>\n'
             '      <input id="image" name="image" type="file" required accept="image/png,image/jpeg,image/webp">\n'
             '      <p class="field-error" id="error-image"></p></div>\n',
}


def _asset(name: str) -> str:
    return (resources.files("chunkflow.serve") / name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _template() -> str:
    """page.html with page.css and page.js inline (one self-contained page)."""
    return _asset("page.html").replace("__STYLE__", _asset("page.css")).replace("__SCRIPT__", _asset("page.js"))


def render_page(model: str | None, *, image: bool, video: bool, negative: bool = False) -> str:
    """The page for a server of `model` (its name escaped; None: the page asks /plan for it): a frames input for a
    video pipeline, an image input where the pipeline takes one, a negative prompt where it uses one. The form's
    defaults, the plan panel and the jobs come from the API."""
    name = html.escape(model) if model else ""
    return (_template().replace("__NEGATIVE_INPUT__", _INPUTS["negative"] if negative else "")
            .replace("__FRAMES_INPUT__", _INPUTS["frames"] if video else "")
            .replace("__IMAGE_INPUT__", _INPUTS["image"] if image else "")
            .replace("__VIDEO__", "true" if video else "false")
            .replace("__TITLE__", f": {name}" if name else "").replace("__MODEL__", name))


def _hashes(tag: str, text: str) -> str:
    return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
                    for body in re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S))


def page_policy(text: str) -> str:
    """The Content-Security-Policy for the rendered page `text`: its inline script and style only (by their
    hashes), requests to its own origin, results shown from it or from blob: URLs, no framing, no form target."""
    return (f"default-src 'none'; script-src {_hashes('script', text)}; style-src {_hashes('style', text)}; "
            "connect-src 'self'; img-src 'self' blob:; media-src 'self' blob:; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'")
