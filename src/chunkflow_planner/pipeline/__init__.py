"""The whole-pipeline extension of the planner: the text encoders, transformer and VAE of a generation, each
placed (on the GPU, moved per phase, streamed, on the CPU), priced per phase in time, GPU and host memory, and the
placement chosen under the budgets (ChunkFlow's paper plans the transformer alone: chunkflow_planner's core).

It builds on the core and the core never imports it (tests/test_architecture.py); planner.make_plan composes the
two. Its figures of a hardware profile are `HardwareSpec.pipeline` (catalog.PipelineProfile, flat in the file).

    placement  what it decides and estimates: Placements, Phase, PipelineEstimate
    text       the text encoders' operators and cost in each placement
    cpu        operators on the host CPU (a `cpu` placement)
    decode     the VAE's decode fit and the output's postprocessing
    phases     one placement's phases, start-ups and host memory (estimate)
    decide     the policy over placements (decide_pipeline) and its facts
    explain    the facts in words
    load       loading the pipeline from its checkpoint: time and host memory
    hostinfo   this machine's memory: the default --host-mem-budget
    assemble   the pipeline's sections of the Plan
"""

from chunkflow_planner.catalog import PipelineProfile
from chunkflow_planner.pipeline.decide import (
    PipelineDecision,
    PipelineFacts,
    decide_pipeline,
    generation_target,
    transformer_candidates,
)
from chunkflow_planner.pipeline.decode import (
    OUTPUT_HOST_COPIES,
    decode_calls,
    decode_cost,
    output_bytes,
    output_host_bytes,
    vae_fit,
)
from chunkflow_planner.pipeline.phases import estimate, startup_of
from chunkflow_planner.pipeline.placement import PHASES, Phase, PipelineError, PipelineEstimate, Placements
from chunkflow_planner.pipeline.text import text_costs, text_device_s, text_encoder_ops, text_forward_s, text_host_s

__all__ = ["PHASES", "OUTPUT_HOST_COPIES", "Phase", "PipelineDecision", "PipelineError", "PipelineEstimate",
           "PipelineFacts", "PipelineProfile", "Placements", "decide_pipeline", "decode_calls", "decode_cost",
           "estimate", "generation_target", "output_bytes", "output_host_bytes", "startup_of", "text_costs",
           "text_device_s", "text_encoder_ops", "text_forward_s", "text_host_s", "transformer_candidates", "vae_fit"]
