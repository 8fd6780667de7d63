"""What `chunkflow calibrate` measures of the host side of a generation (chunkflow_planner/pipeline/text.py): per
text-encoder architecture, the host time of one layer of an eager forward on the GPU path (`text_layer_host_us`),
and the host CPU's bf16 GEMM efficiency by shape and memory bandwidth (`cpu_gemm_eta`, `cpu_mem_gbps`;
calibrate_ops' own measurements run on the CPU), the rates a text encoder placed on the CPU is priced by.

The host time is measured on the catalog's text encoders themselves, called as their pipelines call them (the
attention mask, TextEncoderSpec.mask), with this machine's transformers: each architecture's class at a small width
(its device work becomes negligible, what it dispatches does not change) and all its layers, one forward timed and
divided by its layers. A generation's forwards run slower than these quiet ones (the host CPU's speed varies up to
2x within a process): `calibrate --from-report` measures by how much (PipelineProfile.host_margin).
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any, Callable

from chunkflow_planner.errors import ChunkflowError


class CalibrationError(ChunkflowError):
    """Calibration cannot run or its input is unusable; the message says why."""


CPU_GEMM_M = (16, 128, 1024)
CPU_GEMM_NK = (768, 4096)
SMALL_HEADS = 2


def small_config(arch: str, config: dict, layers: int) -> dict:
    """`config` at a small width with `layers` layers: two heads of the model's own head dim (rotary sections
    keep their sizes), a small MLP and vocabulary; what decides the operators it dispatches (flags, activations,
    biases, attention kind) is kept."""
    c = dict(config)
    if arch in ("t5_encoder", "umt5_encoder"):
        c.update(d_model=SMALL_HEADS * c["d_kv"], d_ff=128, num_heads=SMALL_HEADS, vocab_size=1000, num_layers=layers)
        return c
    t = dict(c.get("text_config") or c)
    heads = t["num_attention_heads"]
    hd = t.get("head_dim") or t["hidden_size"] // heads
    kv = t.get("num_key_value_heads") or heads
    t.update(hidden_size=SMALL_HEADS * hd, intermediate_size=128, num_attention_heads=SMALL_HEADS, vocab_size=1000,
             num_hidden_layers=layers)
    if "num_key_value_heads" in t:
        t["num_key_value_heads"] = 1 if kv < heads else SMALL_HEADS  # grouped-query attention stays grouped
    if "head_dim" in t:
        t["head_dim"] = hd
    if "text_config" not in c:
        return t
    c["text_config"] = t
    if "vision_config" in c:  # a VL encoder's vision tower does not run for a text prompt: as small as it goes
        c["vision_config"] = dict(c["vision_config"], depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                  out_hidden_size=t["hidden_size"], fullatt_block_indexes=[0])
    return c


def small_text_encoder(te, layers: int, device, dtype=None):
    """The text encoder's transformers class at a small width (small_config), random weights, on `device`."""
    import torch
    import transformers

    cls = getattr(transformers, te.cls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = cls(cls.config_class(**small_config(te.arch, te.config, layers)))
    return module.to(device=device, dtype=dtype or torch.bfloat16).eval()


PROMPT_TOKENS = 16  # a short prompt's tokens, the rest padding, where the pipeline pads (TextEncoderSpec.mask)


def _forward(module, te, device) -> Callable[[], Any]:
    """One forward as a pipeline calls its text encoder: token ids padded to its length, and the attention mask its
    pipeline passes (te.mask: a short prompt then padding, every token, or none)."""
    import torch

    ids = torch.randint(0, min(1000, module.get_input_embeddings().num_embeddings), (1, te.tokens), device=device)
    kw: dict[str, Any] = {}
    if te.mask != "none":
        mask = torch.ones(1, te.tokens, dtype=torch.long, device=device)
        if te.mask == "padded":
            mask[:, min(PROMPT_TOKENS, te.tokens - 1):] = 0
        kw["attention_mask"] = mask

    def run():
        with torch.no_grad():
            return module(input_ids=ids, **kw)

    return run


def _small_run(te, layers: int, device) -> Callable[[], Any]:
    """One forward of the text encoder at a small width with `layers` layers, run once already (first-call work,
    lazy initialisation, is not the steady forward)."""
    run = _forward(small_text_encoder(te, layers, device), te, device)
    run()
    return run


ROUNDS = 3  # each architecture timed in rounds spread over the whole measurement: a slow spell of the host (they
# come in bursts: docs/data/h200-umt5-dispatch) lands in one round of each, not in all of one architecture's forwards


def text_encoder_archs() -> dict[str, Any]:
    """One catalog text encoder per architecture (the first model using it), the tiny pipelines' left out."""
    from chunkflow_planner.catalog import load_models

    out: dict[str, Any] = {}
    for spec in load_models().values():
        if spec.pipeline is None or spec.name.startswith("tiny"):
            continue
        for te in spec.pipeline.text_encoders:
            out.setdefault(te.arch, te)
    return out


def measure_text_host(device, samples: dict[str, list[float]] | None = None) -> dict[str, float | str]:
    """Per catalog text-encoder architecture, the host microseconds of one layer of its eager forward on `device`
    (all its layers at a small width, run twice already; the median over ROUNDS rounds of three forwards, over its
    layers); an architecture this transformers cannot build at a small width is left out (its entry says why).
    `samples`: filled with each architecture's every timed forward, per layer (us)."""
    from chunkflow.timing import time_on

    on_gpu = device.type != "cpu"
    out: dict[str, float | str] = {}
    built: dict[str, tuple[Callable[[], Any], int]] = {}  # arch -> (one forward at full depth, its layers)
    for arch, te in text_encoder_archs().items():
        try:
            layers = te.shape()["layers"]
            run = _small_run(te, layers, device)
            run()
            built[arch] = (run, layers)
        except Exception as exc:  # noqa: BLE001 - one architecture's failure must not lose the calibration
            out[arch] = f"not measured: {type(exc).__name__}: {exc}"[:300]
    times: dict[str, list[float]] = {arch: [] for arch in built}
    for _ in range(ROUNDS):
        for arch, (run, _) in built.items():
            times[arch].extend(time_on(on_gpu, run)[1] for _ in range(3))
    for arch, (_, layers) in built.items():
        out[arch] = statistics.median(times[arch]) / layers * 1e6
        if samples is not None:
            samples[arch] = [t / layers * 1e6 for t in times[arch]]
    if not any(isinstance(v, float) for v in out.values()):
        raise CalibrationError("no text encoder could be built at a small width to time its host cost ("
                               + "; ".join(map(str, out.values())) + "); check that transformers is installed and "
                               "up to date")
    return out


def measure_cpu_gemm_grid(cpu_tflops: float, ms=CPU_GEMM_M, nks=CPU_GEMM_NK, residuals: list[list[float]] | None = None
                          ) -> tuple[float, list[tuple[float, float, float, float]]]:
    """(peak TFLOP/s, [M, N, K, eta] rows) of bf16 matmuls on the host CPU (text encoders on the CPU: few tokens);
    the peak is the best of `cpu_tflops` (the square matmul) and the grid, eta is against it. Each shape's repeats
    about their median go into `residuals`, a list a shape."""
    import torch

    from chunkflow.commands.calibrate.ops import gemm_rates

    rates = gemm_rates(torch.device("cpu"), ms, nks, warmup=1, repeats=3, residuals=residuals)
    peak = max([cpu_tflops] + [r[3] for r in rates])
    return peak, [(m, n, k, rate / peak) for m, n, k, rate in rates]


def measure_host(device, cpu_tflops: float, cpu_smoke: bool = False, cpu_residuals: list[list[float]] | None = None
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Profile fields of the host side (module docstring) and the raw measurements (with every text-encoder
    forward timed, per layer: `text_layer_samples_us`); the CPU matmuls' repeats about their medians go into
    `cpu_residuals`, a list a shape."""
    import torch

    from chunkflow.commands.calibrate.ops import measure_hbm

    samples: dict[str, list[float]] = {}
    text = measure_text_host(device, samples)
    small = dict(ms=(16, 64), nks=(64, 128)) if cpu_smoke else {}
    peak, grid = measure_cpu_gemm_grid(cpu_tflops, residuals=cpu_residuals, **small)
    mem = measure_hbm(torch.device("cpu"), 2**22 if cpu_smoke else 2**28)  # the host's memory, as the GPU's
    measured = {arch: v for arch, v in text.items() if isinstance(v, float)}
    update: dict[str, Any] = dict(text_layer_host_us=measured, cpu_tflops=peak, cpu_gemm_eta=grid, cpu_mem_gbps=mem)
    raw = dict(text_layer_host_us=text, text_layer_samples_us=samples, cpu_square_tflops=cpu_tflops, cpu_tflops=peak,
               cpu_gemm_eta=grid, cpu_mem_gbps=mem)
    return update, raw
